"""The result's figures gathered over the ranks: traffic by link class, axis and level, the ring's
steps, and memory (peak, estimate, weights held)."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..config.levels import format_levels
from ..distributed.clock import clock_name
from ..distributed.comm.stats import add_axes
from ..distributed.comm.ulysses import all_reduce
from ..distributed.memory import max_over_ranks
from ..engine.offload import text_tokens
from ..engine.parallelized import Parallelized
from ..engine.shard import local_parameter_bytes
from ..footprint.estimate import estimated_rank_bytes
from ..models.presets import pixel_multiple
from .spec import GenerateSpec


def comm_summary(parallel: Parallelized | None, elapsed_s: float, steps: int) -> dict[str, Any]:
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


def ring_summary(parallel: Parallelized | None, steps: int) -> dict[str, Any] | None:
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


def axis_summary(parallel: Parallelized | None, steps: int) -> dict[str, dict[str, int]]:
    """Bytes per denoising step (all ranks) per plan axis and link class (`CommStats.by_axis`)."""
    if parallel is None:
        return {}
    everyone: list[Any] = [None] * parallel.topology.world_size
    dist.all_gather_object(everyone, parallel.stats.by_axis(), group=parallel.topology.world_group)
    return {axis: {link: n // steps for link, n in links.items()} for axis, links in add_axes(everyone).items()}


def level_summary(parallel: Parallelized | None, steps: int) -> dict[str, int]:
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


def result_record(spec: GenerateSpec, parallel: Parallelized | None, pipe: Any, run: dict[str, Any],
                  memory: dict[str, int], cache: Any, world: int) -> dict[str, Any]:
    """The result of one run, as `generate --json` writes it (its keys are a contract: DESIGN.md):
    what ran, what was asked, the step times, memory, traffic, then the pictures."""
    step_s = run["step_s"]
    steps_run = len(step_s) or spec.steps  # fewer than spec.steps when an image's strength is below 1
    return {
        **_plan_figures(spec, parallel, cache, world, steps_run),
        **_request_figures(spec, parallel, pipe, run),
        "step_ms": [s * 1e3 for s in step_s],
        "step_ms_median": statistics.median(step_s) * 1e3,
        **memory,
        **comm_summary(parallel, sum(step_s), steps_run),
        "bytes_by_axis": axis_summary(parallel, steps_run),
        "levels": format_levels(parallel.topology.levels) if parallel else "node=1,rank=1",
        "bytes_by_level": level_summary(parallel, steps_run),
        "exchange": parallel.ctx.exchange.report() if parallel else None,  # what ran, e.g. tapa's hops
        "auto_choice": parallel.auto_choice() if parallel else None,
        "plan_trials": parallel.plan_trials.report() if parallel and parallel.plan_trials else None,
        "image": run["image"],
        "images": run["images"],
        "videos": run["videos"],
        "audios": run.get("audios"),  # each clip's soundtrack (channels, samples); None: no sound
        "sample_rate": run.get("sample_rate"),
        "fps": run.get("fps"),  # the clips' frame rate where the pipeline keeps sound in pace with it
        "latents": run["latents"],
    }


def _plan_figures(spec: GenerateSpec, parallel: Parallelized | None, cache: Any, world: int,
                  steps_run: int) -> dict[str, Any]:
    """Where the run ran and what it did to be fast: ranks, plan, ring, and every LOSSY mechanism."""
    return {
        "model": spec.model,
        "nproc": world,
        "ranks_per_node": parallel.topology.ranks_per_node if parallel else 1,
        "nodes": parallel.topology.nodes if parallel else 1,
        "comm": spec.parallel.comm,
        "plan": parallel.plan.short if parallel else "u1",
        "plan_description": parallel.plan.describe() if parallel else "u1 (one process)",
        # A class with no plan written: where its plan inferred at the first call splits (module -> arguments)
        # and gathers (module -> 'output'), engine/plan_inference.py; None: a written plan, or one process.
        "inferred_plan": inferred_summary(parallel),
        "ring": ring_summary(parallel, steps_run),
        "v_major": str(spec.parallel.v_major),  # the schedule as written
        "lossy": spec.parallel.lossy or spec.quantize is not None,
        "cache_bytes": parallel.ctx.vmajor.cache_bytes() if parallel and parallel.ctx.vmajor else 0,
        "cache": cache.report() if cache else None,  # the step cache (LOSSY): its spec and steps computed / skipped
        "wire": str(spec.parallel.wire) if spec.parallel.wire is not None else None,  # wire formats per level (LOSSY)
        "lossy_budget": str(spec.parallel.lossy_budget) if spec.parallel.lossy_budget is not None else None,  # what auto may try
    }


def _request_figures(spec: GenerateSpec, parallel: Parallelized | None, pipe: Any, run: dict[str, Any]) -> dict[str, Any]:
    """What was asked (size, steps, seed, dtype, input) and how the weights, encoders and VAE were held."""
    return {
        "steps": spec.steps,
        "image_input": spec.source.report() if spec.source is not None else None,
        # Tokens of the transformer's sequence beyond the latents': an edit's reference images (0: none;
        # None: a model whose latents are not packed tokens).
        "reference_tokens": run["reference_tokens"],
        # Latent frames given beside the noise, read from the transformer's input (Wan's image-to-video:
        # [0] a first frame, [0, n - 1] and a last; None: a pipeline that lays none there).
        "conditioned_frames": run["conditioned_frames"],
        "height": spec.height,
        "width": spec.width,
        "frames": spec.frames,
        "seed": spec.seed,
        "dtype": spec.dtype,
        "compile": spec.parallel.compile,
        # LoRA adapters fused into the weights: each one's path and scale, the layers they changed, and the
        # largest ||dW|| / ||W|| of a layer (models/lora.py); None: no --lora.
        "lora": spec.lora_applied,
        # LOSSY quantized weights (models/quantize.py): the mode, the layers quantized (float8storage: stored in
        # float8), and the transformers' weight bytes before and after, with --quantize-text-encoders each text
        # encoder's under `text_encoders`; None: no --quantize.
        "quantize": spec.quantized,
        # The attention kernel asked for (--attention-backend; None: torch's SDPA as the processors call it) and
        # the functions rank 0's attention calls ran on ('ring': ring blocks; None: one process, not recorded).
        "attention_backend": {"name": spec.parallel.attention_backend,
                              "kernels": sorted(parallel.ctx.kernels) if parallel else None},
        "parallel_vae": run["parallel_vae"],  # whether the VAE decoded in bands (engine/vae)
        "parallel_vae_encodes": run["parallel_vae_encodes"],  # the image inputs' encodes run in bands (inpainting: 2)
        # The transformer's weights sharded over each node's ranks (FSDP2), and the bytes of its parameters one rank holds.
        "shard_weights": bool(parallel and parallel.weights_sharded),
        # The text encoders on the host (streamed to the device for encoding) or freed where nothing is encoded.
        "offload_text_encoders": spec.parallel.offload_text_encoders is True,
        "transformer_param_bytes": max_over_ranks(local_parameter_bytes(pipe.transformer), pipe.transformer.device),
        # What the rank that read most of a checkpoint's transformer for its pipeline stage read of its files, and
        # the transformer's bytes in them (models/stage_load.py); None: every rank loaded it whole.
        "stage_load": _stage_load(spec, pipe.transformer.device),
        # Displaced patches' K/V buffers (engine/patches.py) one rank held at the end, every expert's; None: no patches.
        "patch_buffer_bytes": _patch_buffer_bytes(parallel, pipe.transformer.device),
        "clock": clock_name(pipe.transformer.device),
    }


def _stage_load(spec: GenerateSpec, device: torch.device) -> dict[str, int] | None:
    """{read_bytes: the most any rank read, checkpoint_bytes} of a stage plan's checkpoint read by name."""
    read = max_over_ranks(spec.stage_load["read_bytes"] if spec.stage_load else 0, device)  # every rank calls it
    return {"read_bytes": read, "checkpoint_bytes": spec.stage_load["checkpoint_bytes"]} if spec.stage_load else None


def _patch_buffer_bytes(parallel: Parallelized | None, device: torch.device) -> int | None:
    """The most bytes of displaced patches' K/V buffers any rank held (None: no patches); freed
    after the run's last step."""
    handles = [parallel, *parallel.experts] if parallel is not None else []
    held = [h.ctx.patches.peak for h in handles if h.ctx.patches is not None]
    return max_over_ranks(sum(held), device) if held else None


def inferred_summary(parallel: Parallelized | None) -> dict[str, list[str]] | None:
    """The plan inferred from the model, by module: the arguments split there, or 'output'."""
    plan = parallel.inferred.get("plan") if parallel else None
    if not plan:
        return None
    return {path: sorted(spec.inputs) + (["output"] if spec.output is not None else []) for path, spec in plan.items()}
