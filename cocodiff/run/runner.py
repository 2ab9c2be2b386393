"""What each rank runs for `generate` and `verify`.

`generate_job` and `verify_job` run on every rank (spawned locally or under torchrun) and return
a plain dict on rank 0 (None elsewhere). They build the same pipeline on every rank from the
same seed, apply `parallelize` when there is more than one rank, and time each denoising step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..engine.cache.steps import apply_cache
from ..distributed.clock import clock_name, now
from ..distributed.comm.stats import add_axes
from ..distributed.comm.ulysses import all_reduce
from ..config.parallel import DEFAULT_PROMPT, DTYPE_NAMES, ParallelConfig
from ..engine.encode_once import encode_once
from ..errors import PeerTimeout, UsageError
from ..footprint.estimate import (
    check_footprint,
    estimated_rank_bytes,
    wants_offload,
    wants_sharding,
)
from ..distributed.memory import max_over_ranks, peak_bytes, reset_peak, runtime_bytes
from .inputs import ImageInput
from ..engine.offload import encoder_bytes, place_text_encoders, text_tokens
from ..config.levels import format_levels
from .lifetime import Progress
from ..engine.parallelize import parallelize
from ..engine.parallelized import Parallelized
from ..config.plan import AUTO
from ..models.presets import PRESETS, check_model, load_pipeline, makes_video, pixel_multiple
from ..engine.shard import local_parameter_bytes
from ..engine.steps import step_callback
from ..distributed.topology import bound_device, peer_timeout_s, ranks_per_node_of
from ..engine.vae.kl2d import (
    decode_split,
    encode_split,
    latent_rows,
    use_parallel_encode,
    use_parallel_vae,
)
from ..models.source import DTYPES, resolve_dtype

__all__ = ["GenerateSpec", "generate_job", "load", "memory_figures", "resolve_dtype", "run_pipeline", "tolerance_for", "verify_job"]



@dataclass(kw_only=True)
class GenerateSpec:
    """One generation, as the CLI describes it."""

    model: str = "tiny-shapes"
    prompt: str = DEFAULT_PROMPT
    steps: int | None = None
    """None: the preset's default (4 for a checkpoint)."""
    height: int | None = None
    """None: the preset's default size (256 for a checkpoint); likewise width."""
    width: int | None = None
    seed: int = 0
    batch: int = 1
    """Images per prompt (the transformer's batch; CFG pipelines double it)."""
    dtype: str = "auto"
    """A name of DTYPE_NAMES; `load` replaces `auto` by the dtype that runs (`resolve_dtype`)."""
    parallel: ParallelConfig = None  # type: ignore[assignment]
    source: ImageInput | None = None
    """An image (and mask) to start from: image-to-image or inpainting; None: text-to-image."""
    frames: int | None = None
    """Frames of a video model's clip; None: the preset's (the pipeline's for a checkpoint). Image models: None."""

    def __post_init__(self) -> None:
        self.parallel = self.parallel or ParallelConfig()
        check_model(self.model)
        preset = PRESETS.get(self.model)
        video = makes_video(self.model)
        if self.frames is not None and not video:
            raise UsageError(f"--frames {self.frames}: {self.model} makes images, not videos")
        if self.frames is not None and self.frames < 1:
            raise UsageError(f"--frames {self.frames} must be at least 1")
        if video and self.source is not None:
            raise UsageError(f"--image: {self.model} is a text-to-video model here; image input is for image models")
        if self.frames is None and preset is not None:
            self.frames = preset.frames
        if self.frames is not None and preset is not None and (self.frames - 1) % preset.frame_step:
            step = preset.frame_step
            raise UsageError(f"--frames {self.frames}: {self.model} makes clips of {step}k+1 frames "
                             f"(1, {step + 1}, {2 * step + 1}, ...; its VAE's temporal factor is {step})")
        if self.source is not None:  # the output has the image's size
            for name, given, own in (("height", self.height, self.source.height), ("width", self.width, self.source.width)):
                if given is not None and given != own:
                    raise UsageError(f"--{name} {given} differs from the {name} of --image {self.source.image_path} "
                                     f"({own}); leave it out to use the image's")
            self.height, self.width = self.source.height, self.source.width
        self.steps = self.steps if self.steps is not None else preset.default_steps if preset else 4
        self.height = self.height if self.height is not None else preset.default_size if preset else 256
        self.width = self.width if self.width is not None else preset.default_size if preset else 256
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch} must be at least 1")
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps} must be at least 1")
        if self.dtype not in DTYPE_NAMES:
            raise UsageError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        if self.model in PRESETS:
            self.check_size(PRESETS[self.model].pixel_multiple)

    def check_size(self, multiple: int) -> None:
        if self.source is not None:
            self.source.check_multiple(multiple, self.model)
        for name, value in (("height", self.height), ("width", self.width)):
            if value < multiple or value % multiple:
                raise UsageError(
                    f"--{name} {value} must be a positive multiple of {multiple} "
                    f"(VAE factor x patch size of {self.model})"
                )


def tolerance_for(dtype: str) -> float:
    """Largest relative difference (to the reference's largest magnitude) that still counts as equal.

    fp32: sharded matmuls and attention over reordered keys round differently from one process
    (~1e-7 per operation), compounded over layers and steps; 1e-4 leaves room for that while any
    real mistake (a wrong token, head or position) gives errors of order 1e-1 or more.
    bf16/fp16 round at ~4e-3/5e-4 per operation, so the same argument gives 3e-2.
    """
    return 1e-4 if dtype == "float32" else 3e-2


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _splits_vae(spec: GenerateSpec, pipe: Any, parallel: Parallelized) -> bool:
    """Whether this run decodes in bands (the same answer on every rank: it depends on the run only)."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not hasattr(vae, "config"):
        return False
    rows = latent_rows(vae, spec.height)
    return use_parallel_vae(spec.parallel.parallel_vae, vae, rows, parallel.topology.world_size)


def run_pipeline(spec: GenerateSpec, pipe: Any, encoder: Any, parallel: Parallelized | None,
                 decode: bool = True) -> dict[str, Any]:
    """One pipeline call: the first image, every image of the batch, the final latents and per-step timings on this rank.

    The pipeline encodes `spec.prompt` itself (a preset's with `encoder`, see `PromptEncoding`);
    with `parallel`, on rank 0 alone, the embeddings broadcast to the others (`encode_once`).
    A video model's run also gives its clips (`video`: the first, `videos`: every one, (F, H, W, 3)
    in [0, 1]); `image` is then the first clip's first frame. `decode` False skips the VAE (the
    latents only): the ranks whose pictures nobody reads. Under `--parallel-vae` every rank
    decodes (a band each, `vae_parallel`), `decode` False or not, and an image input is encoded
    in bands too (where the VAE's 2D encoder can be; `parallel_vae_encodes`: the encodes that were).
    """
    marks: list[float] = []
    final: dict[str, torch.Tensor] = {}
    device = pipe.transformer.device

    # A step's time is the device's: the clock is read once the device has run the step.
    def first_call(_module, _args):
        if not marks:
            marks.append(now(device))

    def on_step_end(_pipe, step, _timestep, tensors):
        marks.append(now(device))
        final["latents"] = tensors["latents"]  # copied to the host once, after the last step
        progress.step_ended(step)
        return tensors

    hook = pipe.transformer.register_forward_pre_hook(first_call)
    # Layers are followed by hooks on the attention modules: not inside compiled blocks, where
    # each module's own hook would be a guard (a recompilation per block); the step still is.
    follow_layers = parallel is not None and getattr(parallel, "compiled", None) is None
    progress = Progress(spec.steps, pipe.transformer if follow_layers else None)
    if parallel is not None:
        parallel.stats.reset()
    group = parallel.topology.world_group if parallel is not None else None
    split_vae = parallel is not None and _splits_vae(spec, pipe, parallel)
    decode = decode or split_vae
    split_encode = split_vae and spec.source is not None and use_parallel_encode(spec.parallel.parallel_vae, pipe.vae)
    encoded: list[tuple[int, ...]] = []
    split = spec.parallel.offload_text_encoders is not True  # every rank holds the encoders: many prompts split
    once = encode_once(pipe, group, parallel.topology.device, split=split) if parallel is not None else contextlib.nullcontext()
    try:
        with (once, decode_split(pipe.vae, group) if split_vae else contextlib.nullcontext(),
              encode_split(pipe.vae, group) if split_encode else contextlib.nullcontext(encoded) as encoded,
              step_callback(pipe, on_step_end) as callback):
            output = pipe(
                spec.prompt,
                height=spec.height,
                width=spec.width,
                num_inference_steps=spec.steps,
                num_images_per_prompt=spec.batch,
                generator=torch.Generator("cpu").manual_seed(spec.seed),
                output_type="np" if decode else "latent",
                **callback,
                **(spec.source.pipeline_kwargs() if spec.source is not None else {}),
                **({"num_frames": spec.frames} if spec.frames is not None else {}),
            )
    except PeerTimeout as error:
        progress.locate(error)  # the layer and step it happened at
        raise
    finally:
        hook.remove()
        progress.close()
    step_s = np.diff(marks).tolist()
    latents = final["latents"].detach().float().cpu().clone()
    run = {"latents": latents, "step_s": step_s, "parallel_vae": split_vae, "parallel_vae_encodes": len(encoded), "image": None, "images": [], "video": None, "videos": []}
    if not decode:
        return run
    if hasattr(output, "frames"):  # a video pipeline: (B, F, H, W, 3)
        run["videos"] = [np.asarray(clip, dtype=np.float32) for clip in output.frames]
        run["video"] = run["videos"][0]
        run["images"] = [clip[0] for clip in run["videos"]]
    else:
        run["images"] = [np.asarray(image, dtype=np.float32) for image in output.images]  # (H, W, 3) each, in [0, 1]
    run["image"] = run["images"][0]
    return run


def _load_pipeline(spec: GenerateSpec, host_transformers: bool = False) -> tuple[Any, Any]:
    """The pipeline on this rank's device; `host_transformers`: its transformers on the host (shard.py)."""
    task = spec.source.task if spec.source is not None else None
    return load_pipeline(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype], device=bound_device(), task=task,
                         host_text_encoders=spec.parallel.offload_text_encoders is not False,
                         host_transformers=host_transformers)


def _shard_ranks(config: ParallelConfig) -> int:
    """The ranks that would share the weights: a node's (config, else the launcher's or host names')."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if config.levels is not None:
        return math.prod(size for _, size in config.levels[1:])
    return config.ranks_per_node or ranks_per_node_of(world)


def _place_transformers(pipe: Any, device: torch.device) -> None:
    """Move the transformer (and its experts) loaded on the host (`host_transformers`) to `device` whole."""
    for name, part in pipe.components.items():
        if name.startswith("transformer") and isinstance(part, torch.nn.Module):
            part.to(device)


def load(spec: GenerateSpec, every_rank_encodes: bool = False) -> tuple[Any, Any]:
    """The pipeline on this rank's device, its size checked against memory; `--shard-weights auto`
    resolved (on when the activations fit only beside sharded weights), then `--offload-text-encoders
    auto` (on when they do not fit beside the text encoders) and the encoders placed (offload.py):
    rank 0 encodes (`encode_once`), or `every_rank_encodes` (serve).

    Wherever the weights could be sharded (`on`, or `auto` on more than one rank of a node) the
    transformer (and its experts) load on the host, never whole on the device: `parallelize`
    shards them there one block at a time (shard.py). `auto` decides from their sizes there and
    the device's free memory beside the rest of the pipeline (agreed by every rank), and with
    the weights whole moves them to the device only after the pre-run check has let the size
    through. The host holds every weight anyway: checkpoints and presets load there first."""
    device = bound_device()
    spec.dtype = resolve_dtype(spec.dtype, spec.model, device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    shard_ranks = _shard_ranks(spec.parallel) if spec.parallel.shard_weights is not False else 1
    auto = spec.parallel.shard_weights == AUTO and not spec.parallel.compile  # --compile does not combine with sharding
    on_host = (spec.parallel.shard_weights is True or auto) and world > 1 and shard_ranks > 1
    pipe, encoder = _load_pipeline(spec, host_transformers=on_host)
    spec.check_size(pixel_multiple(spec.model, pipe))
    size = dict(pipe=pipe, height=spec.height, width=spec.width, pixel_multiple=pixel_multiple(spec.model, pipe),
                batch=spec.batch, steps=spec.steps, device=device, text_tokens=text_tokens(encoder))
    if spec.parallel.shard_weights == AUTO:
        wanted = auto and shard_ranks > 1 and wants_sharding(**size, shard_ranks=shard_ranks)
        spec.parallel = dataclasses.replace(spec.parallel, shard_weights=wanted)
    shard_ranks = shard_ranks if spec.parallel.shard_weights is True else 1
    if spec.parallel.offload_text_encoders == AUTO:
        wanted = wants_offload(**size, shard_ranks=shard_ranks, encoder_bytes=encoder_bytes(pipe, encoder))
        spec.parallel = dataclasses.replace(spec.parallel, offload_text_encoders=wanted)
    place_text_encoders(pipe, encoder, device, offload=spec.parallel.offload_text_encoders is True,
                        encodes=every_rank_encodes or _is_rank0())
    warning = check_footprint(  # before anything the size of the image is allocated, or the weights arrive whole
        **size, shard_ranks=shard_ranks, offloaded=spec.parallel.offload_text_encoders is True,
    )
    if on_host and spec.parallel.shard_weights is not True:
        _place_transformers(pipe, device)
    if not _is_rank0():
        pipe.set_progress_bar_config(disable=True)
    elif warning:
        print(f"cocodiff: warning: {warning}", file=sys.stderr, flush=True)
    return pipe, encoder


def _comm_summary(parallel: Parallelized | None, elapsed_s: float, steps: int) -> dict[str, Any]:
    """Traffic per denoising step summed over all ranks, and the mean share of time spent waiting."""
    if parallel is None:
        return {"a2a_same_node_bytes": 0, "a2a_other_node_bytes": 0, "gather_bytes": 0, "comm_wait_share": 0.0}
    stats = parallel.stats
    stats.settle()
    a2a = ("a2a_in", "a2a_out")
    totals = torch.tensor(
        [
            sum(stats.same_node_bytes[k] for k in a2a),
            sum(stats.other_node_bytes[k] for k in a2a),
            stats.same_node_bytes["gather"] + stats.other_node_bytes["gather"],
            sum(stats.wait_s.values()),
            elapsed_s,
        ],
        dtype=torch.float64,
    )
    totals = totals.to(parallel.topology.device)  # NCCL and XCCL reduce device tensors only
    all_reduce(totals, parallel.topology.world_group, "statistics (all-reduce)")
    same, other, gathered, wait_s, elapsed = totals.cpu().tolist()
    return {
        "a2a_same_node_bytes": int(same / steps),
        "a2a_other_node_bytes": int(other / steps),
        "gather_bytes": int(gathered / steps),
        "comm_wait_share": wait_s / elapsed if elapsed > 0 else 0.0,
    }


def _ring_summary(parallel: Parallelized | None, steps: int) -> dict[str, Any] | None:
    """Ring's K/V traffic per denoising step (all ranks) and how much of it attention hid: the
    share of the time blocks were in flight that no rank spent waiting for them."""
    if parallel is None or parallel.ctx.ring is None:
        return None
    stats = parallel.stats
    stats.settle()
    totals = torch.tensor(
        [stats.same_node_bytes["ring"], stats.other_node_bytes["ring"], stats.wait_s["ring"], stats.in_flight_s["ring"]],
        dtype=torch.float64, device=parallel.topology.device,
    )
    all_reduce(totals, parallel.topology.world_group, "ring statistics (all-reduce)")
    same, other, exposed_s, in_flight_s = totals.cpu().tolist()
    return {
        "same_node_bytes": int(same / steps),
        "other_node_bytes": int(other / steps),
        "exposed_ms": exposed_s / parallel.topology.world_size / steps * 1e3,
        "in_flight_ms": in_flight_s / parallel.topology.world_size / steps * 1e3,
        "hidden_share": 1 - exposed_s / in_flight_s if in_flight_s > 0 else 1.0,
    }


def _axis_summary(parallel: Parallelized | None, steps: int) -> dict[str, dict[str, int]]:
    """Bytes per denoising step (all ranks) per plan axis and link class (`CommStats.by_axis`)."""
    if parallel is None:
        return {}
    everyone: list[Any] = [None] * parallel.topology.world_size
    dist.all_gather_object(everyone, parallel.stats.by_axis(), group=parallel.topology.world_group)
    return {axis: {link: n // steps for link, n in links.items()} for axis, links in add_axes(everyone).items()}


def _level_summary(parallel: Parallelized | None, steps: int) -> dict[str, int]:
    """Bytes per denoising step (all ranks) per topology level, outermost (between nodes) first:
    each message at the outermost level its ends differ in (`CommStats.by_level`)."""
    if parallel is None:
        return {}
    everyone: list[Any] = [None] * parallel.topology.world_size
    dist.all_gather_object(everyone, parallel.stats.by_level(), group=parallel.topology.world_group)
    return {name: sum(e.get(name, 0) for e in everyone) // steps for name, _ in parallel.topology.levels}


def memory_figures(spec: GenerateSpec, pipe: Any, encoder: Any, peak: int, runtime: int = 0) -> dict[str, int]:
    """`peak_bytes`: the largest of every rank's measured `peak` (footprint.peak_bytes: the
    accelerator's peak allocation, or the process's peak resident set on the CPU, since the run
    started); `estimated_bytes`: what footprint expects one rank to hold (the weights as loaded and
    the pre-run check's estimate), plus `runtime` (footprint.runtime_bytes: on the CPU, the
    process's own resident set besides the weights, measured as the run starts)."""
    estimated = estimated_rank_bytes(
        pipe, encoder, height=spec.height, width=spec.width, pixel_multiple=pixel_multiple(spec.model, pipe),
        batch=spec.batch, text_tokens=text_tokens(encoder),
    )
    return {"peak_bytes": max_over_ranks(peak, pipe.transformer.device), "estimated_bytes": estimated + runtime}


def _generate(spec: GenerateSpec) -> tuple[dict[str, Any], Parallelized | None, Any, Any]:
    pipe, encoder = load(spec)
    world = dist.get_world_size() if dist.is_initialized() else 1
    parallel = parallelize(pipe, spec.parallel, images=spec.batch) if world > 1 else None
    cache = parallel.cache if parallel else apply_cache(pipe.transformer, spec.parallel.cache) if spec.parallel.cache else None
    runtime = runtime_bytes(pipe, encoder=encoder)
    reset_peak(pipe.transformer.device)  # the run's peak: the weights held and what it allocates, not the load's
    run = run_pipeline(spec, pipe, encoder, parallel, decode=_is_rank0())  # only rank 0's pictures are read
    memory = memory_figures(spec, pipe, encoder, peak_bytes(pipe.transformer.device), runtime)
    if parallel is None and cache is not None:
        cache.undo()  # one process: this run is cached, verify's reference is not
    step_s = run["step_s"]
    steps_run = len(step_s) or spec.steps  # fewer than spec.steps when an image's strength is below 1
    result = {
        "model": spec.model,
        "nproc": world,
        "ranks_per_node": parallel.topology.ranks_per_node if parallel else 1,
        "nodes": parallel.topology.nodes if parallel else 1,
        "comm": spec.parallel.comm,
        "plan": parallel.plan.short if parallel else "u1",
        "plan_description": parallel.plan.describe() if parallel else "u1 (one process)",
        "ring": _ring_summary(parallel, steps_run),
        "v_major": str(spec.parallel.v_major),  # the schedule as written
        "lossy": spec.parallel.lossy,
        "cache_bytes": parallel.ctx.vmajor.cache_bytes() if parallel and parallel.ctx.vmajor else 0,
        "cache": cache.report() if cache else None,  # the step cache (LOSSY): its spec and steps computed / skipped
        "wire": str(spec.parallel.wire) if spec.parallel.wire is not None else None,  # wire formats per level (LOSSY)
        "lossy_budget": str(spec.parallel.lossy_budget) if spec.parallel.lossy_budget is not None else None,  # what auto may try
        "steps": spec.steps,
        "image_input": spec.source.report() if spec.source is not None else None,
        "height": spec.height,
        "width": spec.width,
        "frames": spec.frames,
        "seed": spec.seed,
        "dtype": spec.dtype,
        "compile": spec.parallel.compile,
        "parallel_vae": run["parallel_vae"],  # whether the VAE decoded in bands (vae_parallel.py)
        "parallel_vae_encodes": run["parallel_vae_encodes"],  # the image inputs' encodes run in bands (inpainting: 2)
        # The transformer's weights sharded over each node's ranks (FSDP2), and the bytes of its parameters one rank holds.
        "shard_weights": bool(parallel and parallel.weights_sharded),
        # The text encoders on the host (streamed to the device for encoding) or freed where nothing is encoded.
        "offload_text_encoders": spec.parallel.offload_text_encoders is True,
        "transformer_param_bytes": max_over_ranks(local_parameter_bytes(pipe.transformer), pipe.transformer.device),
        "clock": clock_name(pipe.transformer.device),
        "step_ms": [s * 1e3 for s in step_s],
        "step_ms_median": statistics.median(step_s) * 1e3,
        **memory,
        **_comm_summary(parallel, sum(step_s), steps_run),
        "bytes_by_axis": _axis_summary(parallel, steps_run),
        "levels": format_levels(parallel.topology.levels) if parallel else "node=1,rank=1",
        "bytes_by_level": _level_summary(parallel, steps_run),
        "exchange": parallel.ctx.exchange.report() if parallel else None,  # what ran, e.g. tapa's hops
        "auto_choice": parallel.auto_choice() if parallel else None,
        "plan_trials": parallel.plan_trials.report() if parallel and parallel.plan_trials else None,
        "image": run["image"],
        "images": run["images"],
        "videos": run["videos"],
        "latents": run["latents"],
    }
    return result, parallel, pipe, encoder


def generate_job(spec: GenerateSpec) -> dict[str, Any] | None:
    result, *_ = _generate(spec)
    return result if _is_rank0() else None


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


def verify_job(spec: GenerateSpec) -> dict[str, Any] | None:
    """Sequence-parallel generation on every rank, then rank 0 repeats it in one process and compares."""
    started = time.perf_counter()
    result, parallel, pipe, encoder = _generate(spec)
    # Rank 0 repeats the run alone; the others wait for it on a gloo group of their own, whose
    # timeout allows for that (an NCCL barrier would be aborted by the watchdog at --timeout).
    waiting = _reference_wait_group(time.perf_counter() - started)
    if not _is_rank0():
        dist.barrier(group=waiting)
        return None
    if parallel is not None:
        parallel.undo()  # the stock pipeline again: no hooks, diffusers' own processors
    if parallel is not None and parallel.weights_sharded:  # its weights stay sharded: the same pipeline loaded whole
        pipe, encoder = _load_pipeline(spec)
        place_text_encoders(pipe, encoder, bound_device(), offload=spec.parallel.offload_text_encoders is True, encodes=True)
    pipe.set_progress_bar_config(disable=True)
    reference = run_pipeline(spec, pipe, encoder, None)
    if dist.is_initialized():
        dist.barrier(group=waiting)
    latent = _difference(torch.as_tensor(result["latents"]), reference["latents"])
    pictures = "videos" if reference["videos"] else "images"  # every frame of a video
    image = _difference(torch.from_numpy(np.stack(result[pictures])), torch.from_numpy(np.stack(reference[pictures])))
    tolerance = tolerance_for(spec.dtype)
    worst_rel = max(latent["max_rel_diff"], image["max_rel_diff"])
    return {
        # A step cache's or a wire format's error is reported, not failed.
        "ok": worst_rel <= tolerance or spec.parallel.cache is not None or spec.parallel.wire is not None
              or spec.parallel.lossy,
        "max_abs_diff": max(latent["max_abs_diff"], image["max_abs_diff"]),
        "max_rel_diff": worst_rel,
        "tolerance": tolerance,
        "latent": latent,
        "image": image,
        "psnr": _psnr(result["image"], reference["image"]),  # dB against the exact one-process image; None: equal
        **{k: result[k] for k in ("model", "nproc", "ranks_per_node", "nodes", "comm", "plan", "plan_description", "bytes_by_axis", "levels", "bytes_by_level", "exchange", "v_major", "lossy", "cache", "wire", "lossy_budget", "auto_choice", "plan_trials", "steps", "image_input", "height", "width", "frames", "seed", "dtype", "compile", "parallel_vae", "parallel_vae_encodes", "shard_weights", "offload_text_encoders", "transformer_param_bytes", "clock", "peak_bytes", "estimated_bytes")},
    }

