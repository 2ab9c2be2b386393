"""The pipeline on this rank's device: loaded, its text encoders placed, and the `--shard-weights`
and `--offload-text-encoders` auto decisions taken with every rank agreeing."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..config.parallel import ParallelConfig, stage_sharers
from ..config.plan import AUTO, Plan
from ..distributed.topology import bound_device, ranks_per_node_of
from ..engine.attention.backends import check_backend, resolve_backend, set_backend
from ..engine.offload import encoder_bytes, place_text_encoders, text_encoders, text_tokens
from ..footprint.estimate import check_footprint, wants_offload, wants_sharding
from ..models.lora import apply_adapters
from ..models.presets import DTYPES, load_pipeline, pixel_multiple, resolve_dtype
from ..models.quantize import apply_quantize, check_quantize
from .pipeline import is_rank0
from .spec import GenerateSpec


def load_spec_pipeline(spec: GenerateSpec, host_transformers: bool = False, quantize: bool = True,
                       stage: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """The pipeline on this rank's device, `--lora` adapters fused, then `--quantize`d (unless not
    `quantize`: verify's reference); `host_transformers`: its transformers on the host (engine/shard.py);
    `stage` (stages, this rank's): a checkpoint's transformer read as far as that stage keeps it
    (models/stage_load.py; what was read in `spec.stage_load`)."""
    task = spec.source.task if spec.source is not None and not spec.source.edit else None  # an edit pipeline is its own
    read: dict[str, Any] = {}
    pipe, encoder = load_pipeline(spec.model, seed=spec.seed, dtype=DTYPES[spec.dtype], device=bound_device(), task=task,
                                  host_text_encoders=spec.parallel.offload_text_encoders is not False,
                                  host_transformers=host_transformers, stage=stage, read=read)
    spec.stage_load = read or None
    spec.lora_applied = apply_adapters(pipe, spec.lora)  # fused where the weights are: before any sharding or cut
    if quantize and spec.quantize is not None:
        check_quantize(spec.quantize, bound_device())
        encoders = text_encoders(pipe, encoder) if spec.quantize_text_encoders else None
        spec.quantized = apply_quantize(pipe, spec.quantize, encoders)  # the fused weights, before any cut
    check_backend(spec.parallel.attention_backend, bound_device())
    set_backend(pipe, resolve_backend(spec.parallel.attention_backend))  # the stock processors', one process's too
    return pipe, encoder


def _own_stage(spec: GenerateSpec, world: int) -> tuple[int, int] | None:
    """(stages, this rank's stage) where the plan names its stages and the weights are the
    checkpoint's as stored (adapters are fused and weights quantized whole, before the cut); None otherwise."""
    plan = spec.parallel.plan
    if not (isinstance(plan, Plan) and plan.pipe > 1 and plan.ranks == world) or spec.lora or spec.quantize is not None:
        return None
    return plan.pipe, plan.place(dist.get_rank())["pipe"]


def _stages(config: ParallelConfig) -> int:
    """The plan's pipeline stages (1: none, or a plan not written)."""
    return config.plan.pipe if isinstance(config.plan, Plan) else 1


def _shard_ranks(config: ParallelConfig) -> int:
    """The ranks that would share the weights: a node's (config, else the launcher's or host names'),
    of one pipeline stage's."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if config.levels is not None:
        node = math.prod(size for _, size in config.levels[1:])
    else:
        node = config.ranks_per_node or ranks_per_node_of(world)
    return stage_sharers(node, world, _stages(config))


def _place_transformers(pipe: Any, device: torch.device) -> None:
    """Move the transformer (and its experts) loaded on the host (`host_transformers`) to `device` whole."""
    for name, part in pipe.components.items():
        if name.startswith("transformer") and isinstance(part, torch.nn.Module):
            part.to(device)


def load(spec: GenerateSpec, every_rank_encodes: bool = False) -> tuple[Any, Any]:
    """The pipeline on this rank's device, its size checked against memory; `--shard-weights auto`
    resolved (on when the activations fit only beside sharded weights), then `--offload-text-encoders
    auto` (on when they do not fit beside the text encoders) and the encoders placed (engine/offload.py):
    rank 0 encodes (`encode_once`), or `every_rank_encodes` (serve).

    Wherever the weights could be sharded (`on`, or `auto` on more than one rank of a node) the
    transformer (and its experts) load on the host, never whole on the device: `parallelize`
    shards them there one block at a time (engine/shard.py). `auto` decides from their sizes there and
    the device's free memory beside the rest of the pipeline (agreed by every rank), and with
    the weights whole moves them to the device only after the pre-run check has let the size
    through. Under pipeline stages (a plan with `p`) they load on the host too, and `parallelize`
    moves a stage's part to the device once the other stages' blocks are gone (engine/stages.py).
    The host holds every weight anyway: checkpoints and presets load there first."""
    device = bound_device()
    spec.dtype = resolve_dtype(spec.dtype, spec.model, device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    shard_ranks = _shard_ranks(spec.parallel) if spec.parallel.shard_weights is not False else 1
    # --compile and quantized weights do not combine with sharding
    auto = spec.parallel.shard_weights == AUTO and not spec.parallel.compile and spec.quantize is None
    stages = _stages(spec.parallel) if world > 1 else 1
    on_host = world > 1 and ((spec.parallel.shard_weights is True or auto) and shard_ranks > 1 or stages > 1)
    pipe, encoder = load_spec_pipeline(spec, host_transformers=on_host, stage=_own_stage(spec, world))
    spec.check_size(pixel_multiple(spec.model, pipe))
    size = dict(pipe=pipe, height=spec.height, width=spec.width, pixel_multiple=pixel_multiple(spec.model, pipe),
                batch=spec.batch, steps=spec.steps, device=device, text_tokens=text_tokens(encoder), stages=stages)
    if spec.parallel.shard_weights == AUTO:
        wanted = auto and shard_ranks > 1 and wants_sharding(**size, shard_ranks=shard_ranks)
        spec.parallel = dataclasses.replace(spec.parallel, shard_weights=wanted)
    shard_ranks = shard_ranks if spec.parallel.shard_weights is True else 1
    if spec.parallel.offload_text_encoders == AUTO:
        wanted = wants_offload(**size, shard_ranks=shard_ranks, encoder_bytes=encoder_bytes(pipe, encoder))
        spec.parallel = dataclasses.replace(spec.parallel, offload_text_encoders=wanted)
    place_text_encoders(pipe, encoder, device, offload=spec.parallel.offload_text_encoders is True,
                        encodes=every_rank_encodes or is_rank0())
    warning = check_footprint(  # before anything the size of the image is allocated, or the weights arrive whole
        **size, shard_ranks=shard_ranks, offloaded=spec.parallel.offload_text_encoders is True,
    )
    if on_host and spec.parallel.shard_weights is not True and stages == 1:  # a stage's part: once cut (engine/stages.py)
        _place_transformers(pipe, device)
    if not is_rank0():
        pipe.set_progress_bar_config(disable=True)
    elif warning:
        print(f"cocodiff: warning: {warning}", file=sys.stderr, flush=True)
    return pipe, encoder
