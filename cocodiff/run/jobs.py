"""What each rank runs for `generate` and `verify`.

`generate_job` and `verify_job` run on every rank (spawned locally or under torchrun) and return
a plain dict on rank 0 (None elsewhere). They build the same pipeline on every rank from the
same seed, apply `parallelize` when there is more than one rank, and time each denoising step.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config.quality import lossy_floor
from ..distributed.memory import peak_bytes, reset_peak, runtime_bytes
from ..distributed.topology import bound_device, destroy_groups, peer_timeout_s
from ..engine.cache.steps import apply_cache
from ..engine.offload import place_text_encoders
from ..engine.parallelize import parallelize
from ..engine.parallelized import Parallelized
from ..models.quantize import MODES as QUANTIZE_MODES
from .load import load, load_spec_pipeline
from .pipeline import is_rank0, run_pipeline
from .spec import GenerateSpec, tolerance_for
from .summary import memory_figures, result_record

__all__ = ["compare", "generate_job", "generate_run", "verify_job", "whole_pipeline"]



def generate_run(spec: GenerateSpec) -> tuple[dict[str, Any], Parallelized | None, Any, Any]:
    """Load, parallelize (more than one rank) and run `spec` on this rank -> (its record, the
    `Parallelized` to undo, the pipeline, the text encoder)."""
    pipe, encoder = load(spec)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # One rank runs as one process, but for displaced patches: their schedule on one stage (its reference).
    alone = world == 1 and spec.parallel.pipe_patches is None
    parallel = parallelize(pipe, spec.parallel, images=spec.batch) if not alone else None
    cache = parallel.cache if parallel else apply_cache(pipe.transformer, spec.parallel.cache, scheduler=pipe.scheduler) if spec.parallel.cache else None
    runtime = runtime_bytes(pipe, encoder=encoder)
    reset_peak(pipe.transformer.device)  # the run's peak: the weights held and what it allocates, not the load's
    run = run_pipeline(spec, pipe, encoder, parallel, decode=is_rank0())  # only rank 0's pictures are read
    if cache is not None:
        cache.finish()  # the run's end: a curve MagCache calibrated is stored (one rank, no collective)
    memory = memory_figures(spec, pipe, encoder, peak_bytes(pipe.transformer.device), runtime)
    if parallel is None and cache is not None:
        cache.undo()  # one process: this run is cached, verify's reference is not
    result = result_record(spec, parallel, pipe, run, memory, cache, world)
    return result, parallel, pipe, encoder


def generate_job(spec: GenerateSpec) -> dict[str, Any] | None:
    result, *_ = generate_run(spec)
    return result if is_rank0() else None


def _difference(parallel: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    diff = (parallel.double() - reference.double()).abs().max().item()
    scale = reference.double().abs().max().item()
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale if scale > 0 else diff, "scale": scale}


def _psnr(image: np.ndarray, reference: np.ndarray) -> float | None:
    """PSNR in dB of an image against the reference, both in [0, 1] (None when equal: infinite)."""
    mse = float(np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return None if mse == 0 else 10 * math.log10(1 / mse)


def _reference_wait_group(parallel_s: float) -> dist.ProcessGroup | None:
    """A gloo group for the wait on rank 0's one-process reference run: its timeout is the peer
    timeout plus the parallel run's time for each rank's share (the reference does it all)."""
    if not dist.is_initialized():
        return None
    allowance = peer_timeout_s() + 2 * dist.get_world_size() * parallel_s
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=allowance))


def compare(spec: GenerateSpec, result: dict[str, Any], reference: dict[str, Any],
            same_weights: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run against the one-process reference: its differences, PSNR and verdict. An exact run is
    ok within `tolerance_for` its dtype; a LOSSY one when its image's PSNR is at or above the floor
    of its lossy modes (`config.quality`), or equal. With quantized weights `reference` ran on the
    weights as they come and `same_weights` on the same quantized weights as the run: against it
    the run must also hold as it would unquantized (exact, or within its other lossy modes' floor;
    a mode that rounds the activations as well, within the floor of quantized weights)."""
    verdict = _against(spec, result, reference, lossy_floor(spec.parallel, spec.quantize))
    held = None
    if same_weights is not None:
        dynamic = spec.quantize is not None and QUANTIZE_MODES[spec.quantize].dynamic
        held = _against(spec, result, same_weights, lossy_floor(spec.parallel, spec.quantize if dynamic else None))
        held = {key: held[key] for key in ("ok", "max_rel_diff", "psnr", "psnr_floor")}
        verdict["ok"] = verdict["ok"] and held["ok"]
    # Quantized weights: the run against one process on the same quantized weights (ok, its largest
    # relative difference, and PSNR and floor where other lossy modes run); None: none quantized.
    verdict["same_weights"] = held
    return verdict


def _against(spec: GenerateSpec, result: dict[str, Any], reference: dict[str, Any], floor: float | None) -> dict[str, Any]:
    latent = _difference(torch.as_tensor(result["latents"]), reference["latents"])
    pictures = "videos" if reference["videos"] else "images"  # every frame of a video
    image = _difference(torch.from_numpy(np.stack(result[pictures])), torch.from_numpy(np.stack(reference[pictures])))
    tolerance = tolerance_for(spec.dtype)
    worst_rel = max(latent["max_rel_diff"], image["max_rel_diff"])
    audio = None
    if reference.get("audios"):  # a soundtrack (LTX-2): every sample held as the frames are
        audio = _difference(torch.from_numpy(np.stack(result["audios"])), torch.from_numpy(np.stack(reference["audios"])))
        worst_rel = max(worst_rel, audio["max_rel_diff"])
    psnr = _psnr(np.stack(result[pictures]), np.stack(reference[pictures]))  # dB; None: equal
    return {
        "ok": worst_rel <= tolerance if floor is None else psnr is None or psnr >= floor,
        "max_abs_diff": max(latent["max_abs_diff"], image["max_abs_diff"]),
        "max_rel_diff": worst_rel,
        "tolerance": tolerance,
        "latent": latent,
        "image": image,
        "audio": audio,  # the soundtrack's difference; None: no sound
        "psnr": psnr,  # dB against the exact one-process pictures (every frame); None: equal
        "psnr_floor": floor,  # dB a LOSSY run must reach; None: an exact run
    }


def whole_pipeline(spec: GenerateSpec, quantize: bool = True) -> tuple[Any, Any]:
    """`spec`'s pipeline loaded whole on this rank's device for a one-process run, its text encoders
    placed to encode here, no progress bar; `quantize`: with `spec`'s quantized weights."""
    pipe, encoder = load_spec_pipeline(spec, quantize=quantize)
    place_text_encoders(pipe, encoder, bound_device(), offload=spec.parallel.offload_text_encoders is True, encodes=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe, encoder


def verify_job(spec: GenerateSpec) -> dict[str, Any] | None:
    """Sequence-parallel generation on every rank, then rank 0 repeats it in one process and compares."""
    started = time.perf_counter()
    result, parallel, pipe, encoder = generate_run(spec)
    # Rank 0 repeats the run alone; the others wait for it on a gloo group of their own, whose
    # timeout allows for that (an NCCL barrier would be aborted by the watchdog at --timeout).
    waiting = _reference_wait_group(time.perf_counter() - started)
    if not is_rank0():
        dist.barrier(group=waiting)
        destroy_groups([waiting])
        return None
    if parallel is not None and not parallel.partial_weights:
        parallel.undo()  # the stock pipeline again: no hooks, diffusers' own processors
    elif parallel is not None:  # sharded or cut in stages: the same pipeline loaded whole
        pipe, encoder = whole_pipeline(spec)
    pipe.set_progress_bar_config(disable=True)
    reference = run_pipeline(spec, pipe, encoder, None)
    same_weights = None
    if spec.quantize is not None:  # held to the weights as they come; the same quantized weights: exact
        same_weights, reference = reference, None
        del pipe, encoder
        reference = run_pipeline(spec, *whole_pipeline(spec, quantize=False), None)
    if dist.is_initialized():
        dist.barrier(group=waiting)
        destroy_groups([waiting])
    return {
        **compare(spec, result, reference, same_weights),
        **{k: result[k] for k in ("model", "nproc", "ranks_per_node", "nodes", "comm", "plan", "plan_description", "inferred_plan", "bytes_by_axis", "levels", "bytes_by_level", "exchange", "v_major", "lossy", "cache", "wire", "lossy_budget", "auto_choice", "plan_trials", "steps", "image_input", "reference_tokens", "conditioned_frames", "height", "width", "frames", "seed", "dtype", "compile", "lora", "quantize", "attention_backend", "parallel_vae", "parallel_vae_encodes", "shard_weights", "offload_text_encoders", "transformer_param_bytes", "stage_load", "patch_buffer_bytes", "clock", "peak_bytes", "estimated_bytes")},
    }

