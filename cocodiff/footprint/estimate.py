"""What a generation will need, estimated from the model's config before anything is allocated.

A size far beyond the machine (`--height 100000 --width 100000`) should end in one line naming the
size and the limit, not in an allocator's traceback, and a size that fits but will run for hours
should say so before it starts. Both come from the transformer's and the VAE's configs and the
requested size, to an order of magnitude (the factors below are deliberately generous):

    tokens          S = image tokens (height / pixel multiple x width / pixel multiple) + text tokens
                    (the preset's, or TEXT_TOKENS for a checkpoint)
    transformer     B x S x d x bytes x the family's activation factor per call, d = heads x head_dim; Ulysses
                    splits it over the ranks (each holds S/P tokens, or all S tokens of H/P heads)
    decoding        every rank decodes every image: pixels x VAE channels at full size x bytes
                    x DECODE_FACTOR
    FLOPs per call  layers x (24 d^2 B S + 4 B S^2 d): projections and MLP, then attention

B counts classifier-free guidance as a batch of 2 (an upper bound: guidance-distilled models
need half; `cocodiff footprint` passes each checkpoint's own batch). A video's tokens are its latent
frames' (`frames`), and its decoder holds `decode_frames` full-size frames at once.

After a run, `peak_bytes` is what one rank held at its peak: the accelerator's peak allocation
(`max_memory_allocated`), or on the CPU the process's peak resident set (`VmHWM`: the Python
runtime and torch's libraries included). `estimated_bytes` is this module's figure for the same:
the weights as loaded plus the pre-run check's activations and decoding. Attention needs O(S) memory here: SDPA's fused kernels (flash attention on CPU and
GPU) never hold the (S, S) scores, and the engine's masks are key-padding masks (B, 1, 1, S).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config.parallel import stage_sharers
from ..errors import UsageError
from ..distributed.memory import agreed, available_bytes, tensor_bytes, weight_bytes
from ..models.catalog import TEXT_TOKENS

if TYPE_CHECKING:
    from ..engine.families import Family

__all__ = ["Footprint", "check_footprint", "estimate", "estimated_rank_bytes", "plan_activations", "sharding_frees",
           "wants_offload", "wants_sharding"]

ACTIVATION_FACTOR = 24
"""Values per token and hidden channel alive at the peak of one block (input, norm, Q/K/V, attention
output, the 4x MLP hidden and its activation, concatenations, residual: about 20, rounded up), for
a family with no figure of its own."""
# A family's own figures are in its record (engine/families/<family>.py), each measured:
# - `activation_factor`: peak activations of one forward of the real checkpoints' configs (FLUX.1-dev,
#   SD3.5 Large, Qwen-Image) in bf16 at 1024 pixels square, one process, under FakeTensorMode with
#   torch's MemTracker (nothing allocated): 17.3 (17.2 at 2048), 12.4 and 14.2 values per token and
#   channel (tests/test_footprint_fake.py).
# - `entry_factor`: for families that embed the image whole before the sequence is split (SD3's patch
#   embedding with its cropped position table), values of the image tokens' (b, S_image, d) rows alive
#   at the entry, the peak of a rank once sp is large (measured 5.0 with SD3.5 Large's config at 1024
#   and 2048).
# - `plan_values`: values of a rank's rows a family's blocks hold beyond the rest under any plan, and
#   more under a ring (Qwen-Image's config: 4.3-5.8 and 5.2 measured at 1024 and 2048, u8 and u4r2;
#   its masked attention's, not isolated further).
DECODE_FACTOR = 10
"""Full-size feature maps alive at once in the VAE decoder's last block (input, norm, activation,
conv, upsampling): measured 9.5 with FLUX's VAE in bf16 on an H200, peak 2.38 / 9.5 / 38.0 GiB at
1024 / 2048 / 4096 pixels square (docs/results/gpu-nvidia-h200.json)."""
EXCHANGE_VALUES = 2
"""Ulysses: the all-to-all's send and receive buffers of one projection alive at the peak, in values
of a rank's (b, S/sp, d) rows (measured 1.6 with FLUX.1-dev's config at u2/u8/u24)."""
RING_FP32_VALUES = 1
"""Ring: besides the next K and V blocks (two values of the rows in the dtype), the merged output in
fp32 (measured 4.1-4.7 bf16 values in all with FLUX.1-dev's config at u4r2, u1r8)."""
REPLICATED_TEXT_VALUES = 1.5
"""Values of the text tokens' (b, text, d) rows that every rank of a plan holds whole (the entry's
text embeddings before the split; measured 9 MiB with FLUX.1-dev's config at 1024, b = 2)."""
FLOPS_PER_S = {"cpu": 50e9, "cuda": 400e12, "xpu": 150e12}
"""Assumed sustained rate in bf16: per CPU core (the local ranks share the cores), or per
accelerator; fp32 on an accelerator runs at `FP32_SLOWDOWN` times less."""
FP32_SLOWDOWN = 8
HOURS_WARNING_S = 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Footprint:
    """One generation's needs on one rank, and its work over all ranks."""

    image_tokens: int
    """Tokens of the image: (height / pixel multiple) x (width / pixel multiple)."""
    tokens: int
    """S of one transformer call: image + text tokens."""
    rank_bytes: int
    """Activation memory of one rank: its share of the transformer's, plus decoding the image."""
    transformer_bytes: int
    """Activations of one transformer call in one process (all of its tokens and batch)."""
    decode_bytes: int
    """Decoding the images (or a video's `decode_frames` frames at once) at full size."""
    flops: float
    """Work of the whole generation, all steps and ranks."""


def _family(name: str) -> Family:
    """The family record of the transformer class `name` (the generic one where it has none).
    Imported here: the families import diffusers, which a command refused on its flags never needs
    (`cocodiff.cli` imports this module)."""
    from ..engine.families import FAMILIES, Family

    return FAMILIES.get(name, Family())


def estimate(
    transformer: Any, vae: Any, *, height: int, width: int, pixel_multiple: int, batch: int = 1, steps: int = 1,
    item_bytes: int = 4, ranks: int = 1, text_tokens: int = TEXT_TOKENS, family: str | None = None,
    call_batch: int | None = None, frames: int = 1, decode_frames: int = 1,
) -> Footprint | None:
    """The footprint from the configs (`pipe.transformer.config`, `pipe.vae.config`), or None if
    they do not say; `family` is the transformer's class name (its family's `activation_factor`).

    `call_batch`: the transformer's batch per call (default 2 x batch, CFG as a batch); `frames`:
    latent frames of a video (its tokens are frames x those of one frame)."""
    heads, head_dim = transformer.get("num_attention_heads"), transformer.get("attention_head_dim")
    layers = transformer.get("num_layers", 0) + transformer.get("num_single_layers", 0)
    if not heads or not head_dim or not layers:
        return None
    hidden = heads * head_dim
    channels = (vae.get("block_out_channels") or [vae.get("base_dim") or 128])[0]
    image_tokens = frames * (height // pixel_multiple) * (width // pixel_multiple)
    tokens = image_tokens + text_tokens
    calls_batch = call_batch or 2 * batch  # classifier-free guidance: a batch of 2 (or two calls: then an upper bound)
    factor = _family(family or transformer.get("_class_name", "")).activation_factor or ACTIVATION_FACTOR
    transformer_bytes = int(calls_batch * tokens * hidden * item_bytes * factor)
    decode_bytes = batch * decode_frames * height * width * channels * item_bytes * DECODE_FACTOR
    call_flops = layers * calls_batch * (24.0 * hidden**2 * tokens + 4.0 * tokens**2 * hidden)
    return Footprint(
        image_tokens=image_tokens, tokens=tokens, rank_bytes=transformer_bytes // ranks + decode_bytes,
        transformer_bytes=transformer_bytes, decode_bytes=decode_bytes, flops=steps * call_flops,
    )


def plan_activations(footprint: Footprint, transformer: Any, *, family: str | None, call_batch: int, item_bytes: int,
                     text_tokens: int, ulysses: int = 1, ring: int = 1) -> dict[str, int]:
    """One rank's activations under a plan of `ulysses` x `ring` sequence ranks (b = `call_batch`
    items per call): {activations, ring_blocks, comm_buffers}, adding up to its peak, the larger of
    the blocks' and the entry's (`Family.entry_factor`).

    The blocks: `footprint`'s activations over sp (for a batch of `call_batch`), the text rows every
    rank holds whole, the all-to-all's buffers (Ulysses > 1) and the ring's next K/V blocks and fp32
    output (ring > 1), and a family's own extras (`Family.plan_values`)."""
    sp = ulysses * ring
    hidden = transformer["num_attention_heads"] * transformer["attention_head_dim"]
    rows = call_batch * math.ceil(footprint.tokens / sp)  # token rows of one rank: (b, S / sp)
    share = math.ceil(footprint.transformer_bytes / sp)
    text = int(REPLICATED_TEXT_VALUES * call_batch * text_tokens * hidden * item_bytes) if sp > 1 else 0
    ring_bytes = rows * hidden * (2 * item_bytes + 4 * RING_FP32_VALUES) if ring > 1 else 0
    comm = EXCHANGE_VALUES * rows * hidden * item_bytes if ulysses > 1 else 0
    record = _family(family or transformer.get("_class_name", ""))
    any_plan, ring_more = record.plan_values
    share += (any_plan if sp > 1 else 0) * rows * hidden * item_bytes
    ring_bytes += (ring_more if ring > 1 else 0) * rows * hidden * item_bytes
    entry = int(record.entry_factor * call_batch * footprint.image_tokens * hidden * item_bytes)
    return {"activations": max(share + text, entry - ring_bytes - comm), "ring_blocks": ring_bytes, "comm_buffers": comm}


def _pipeline_estimate(pipe: Any, *, height: int, width: int, pixel_multiple: int, batch: int, steps: int,
                       text_tokens: int | None, ranks: int) -> Footprint | None:
    from ..engine.families import class_name

    return estimate(
        pipe.transformer.config, pipe.vae.config, height=height, width=width, pixel_multiple=pixel_multiple,
        batch=batch, steps=steps, item_bytes=pipe.transformer.dtype.itemsize, ranks=ranks,
        text_tokens=text_tokens or TEXT_TOKENS, family=class_name(pipe.transformer),
    )


def estimated_rank_bytes(pipe: Any, encoder: Any, *, height: int, width: int, pixel_multiple: int, batch: int,
                         text_tokens: int | None) -> int:
    """What one rank should hold at its peak: the pipeline's weights as held (every component,
    the preset's text encoder included; a sharded transformer's shard, plus the two blocks
    gathered whole at a time) plus the pre-run check's activations and decoding."""
    from ..engine.families import family_of
    from ..engine.shard import is_sharded, repeated_blocks

    world = dist.get_world_size() if dist.is_initialized() else 1
    components = getattr(pipe, "components", {}) or {}
    weights = weight_bytes(encoder, *components.values(), on=pipe.transformer.device)
    for part in components.values():
        if isinstance(part, torch.nn.Module) and is_sharded(part):  # the running block and the one arriving, whole
            blocks = repeated_blocks(part, family_of(part))
            weights += 2 * max((_whole_bytes(b) for b in blocks), default=0)
    footprint = _pipeline_estimate(pipe, height=height, width=width, pixel_multiple=pixel_multiple, batch=batch,
                                   steps=1, text_tokens=text_tokens, ranks=world)
    return weights + (footprint.rank_bytes if footprint else 0)


def _whole_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters gathered whole (a sharded parameter at its global size)."""
    return sum(tensor_bytes(p) for p in module.parameters())


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e6:.2f} MB"


def sharding_frees(pipe: Any, ranks: int, device: torch.device | None = None, stages: int = 1) -> int:
    """Bytes one rank's `device` gives back when the transformer's weights (and its experts') take
    their place for the run, sharded over `ranks` ranks (1: whole): what it holds of them now (all,
    or none where they wait on the host: run.load), less what it will hold, 1/ranks of them and
    the two blocks whole (running, arriving), or all of them. With pipeline stages (`stages` > 1,
    engine/stages.py) "them" is the heaviest stage's part. Negative for weights still on the host:
    the run brings them."""
    from ..engine.families import family_of
    from ..engine.shard import repeated_blocks
    from ..engine.stages import stage_parameters

    freed = 0
    for name in ("transformer", "transformer_2"):
        transformer = getattr(pipe, name, None)
        if not isinstance(transformer, torch.nn.Module):
            continue
        held = whole = weight_bytes(transformer)
        if stages > 1:  # its buffers, and the parameters of the heaviest stage
            size = [sum(tensor_bytes(p) for p in part)
                    for part in [list(transformer.parameters()), *stage_parameters(transformer, stages)]]
            held = whole = whole - size[0] + max(size[1:])
        if ranks > 1:
            largest = max((weight_bytes(b) for b in repeated_blocks(transformer, family_of(transformer))), default=0)
            held = min(whole, whole // ranks + 2 * largest)
        freed += weight_bytes(transformer, on=device) - held
    return freed


def _memory_needs(pipe: Any, *, height: int, width: int, pixel_multiple: int, batch: int, steps: int,
                  device: torch.device, text_tokens: int | None) -> tuple[Footprint, int, float, int] | None:
    """(footprint, activation bytes needed on this machine or device, its free bytes (agreed by
    every rank; -1: unknown), ranks sharing it); None when the configs do not say."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    footprint = _pipeline_estimate(pipe, height=height, width=width, pixel_multiple=pixel_multiple, batch=batch,
                                   steps=steps, text_tokens=text_tokens, ranks=world)
    if footprint is None:
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if device.type == "cpu" else 1  # CPU ranks share the machine
    free = agreed(available_bytes(device) or -1, device, dist.ReduceOp.MIN)  # -1 on any rank: unknown, no check
    return footprint, footprint.rank_bytes * local_ranks, free, local_ranks


def wants_sharding(pipe: Any, *, height: int, width: int, pixel_multiple: int, batch: int, steps: int,
                   device: torch.device, shard_ranks: int, text_tokens: int | None = None, stages: int = 1) -> bool:
    """`--shard-weights auto`: whether the activations do not fit beside the whole weights but do
    beside the transformer's weights sharded over `shard_ranks` ranks (the same on every rank).

    The weights may be on the device already or still on the host (run.load loads them there,
    so that weights too large for the device never arrive whole): the room either way is the
    free memory less what they will take (`sharding_frees`)."""
    needs = _memory_needs(pipe, height=height, width=width, pixel_multiple=pixel_multiple, batch=batch, steps=steps,
                          device=device, text_tokens=text_tokens)
    if needs is None or shard_ranks < 2:
        return False
    _, needed, free, local_ranks = needs
    whole, sharded = (free + sharding_frees(pipe, ranks, device, stages) * local_ranks for ranks in (1, shard_ranks))
    return 0 < free and whole < needed <= sharded


def wants_offload(pipe: Any, *, height: int, width: int, pixel_multiple: int, batch: int, steps: int,
                  device: torch.device, shard_ranks: int, encoder_bytes: int, text_tokens: int | None = None,
                  stages: int = 1) -> bool:
    """`--offload-text-encoders auto`: whether the activations do not fit beside the text encoders
    (`encoder_bytes`, still on the host on an accelerator; already in the machine's memory on the
    CPU), the transformer's weights sharded over `shard_ranks` ranks (1: whole). The same on every rank."""
    needs = _memory_needs(pipe, height=height, width=width, pixel_multiple=pixel_multiple, batch=batch, steps=steps,
                          device=device, text_tokens=text_tokens)
    if needs is None or encoder_bytes == 0:
        return False
    _, needed, free, local_ranks = needs
    room = free + sharding_frees(pipe, shard_ranks, device, stages) * local_ranks
    return 0 < free and room < needed + (0 if device.type == "cpu" else encoder_bytes)


def check_footprint(pipe: Any, *, height: int, width: int, pixel_multiple: int, batch: int, steps: int,
                    device: torch.device, text_tokens: int | None = None, shard_ranks: int = 1,
                    offloaded: bool = False, stages: int = 1) -> str | None:
    """Refuse a size that cannot fit (UsageError, the same on every rank); a warning line if it will take hours.

    Called on every rank after the pipeline is loaded (the weights on the device are then already
    counted out of the free memory) and before the pipeline call allocates anything for the image.
    The transformer's weights count as they will be held, sharded over `shard_ranks` ranks or whole
    (`sharding_frees`: what sharding gives back counts as free, weights still on the host as arriving),
    of the heaviest of `stages` pipeline stages. A refusal names the memory flags not yet on (`offloaded`: the text encoders are); `--shard-weights on` only where sharding over a node's ranks would make room.
    """
    needs = _memory_needs(pipe, height=height, width=width, pixel_multiple=pixel_multiple, batch=batch, steps=steps,
                          device=device, text_tokens=text_tokens)
    if needs is None:
        return None
    footprint, needed, free, local_ranks = needs
    on_cpu = device.type == "cpu"
    world = dist.get_world_size() if dist.is_initialized() else 1
    room = free + sharding_frees(pipe, shard_ranks, device, stages) * local_ranks
    if 0 < free and room < needed:  # room <= 0: weights still on the host that do not fit at all
        where = "available on this machine" if on_cpu else f"free on {device.type} {device.index}"
        sharded = (" with the transformer's weights sharded" if shard_ranks > 1
                   else " beside the transformer's whole weights" if room < free else "")  # weights to arrive from the host
        node_ranks = stage_sharers(int(os.environ.get("LOCAL_WORLD_SIZE", world)), world, stages)  # who would share the weights
        shard_helps = (shard_ranks == 1 and node_ranks > 1
                       and needed <= free + sharding_frees(pipe, node_ranks, device, stages) * local_ranks)
        flags = [flag for flag, on in (("--shard-weights on", shard_helps), ("--offload-text-encoders on", not offloaded))
                 if on]
        raise UsageError(
            f"--height {height} --width {width} needs about {_size(needed)} of activations ({footprint.image_tokens} image tokens), "
            f"more than the {_size(max(room, 0))} {where}{sharded}; use a smaller size"
            + (f" or {' and '.join(flags)} (cocodiff footprint says what fits)" if flags else "")
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rate = FLOPS_PER_S["cpu"] * cores if on_cpu else FLOPS_PER_S.get(device.type, FLOPS_PER_S["cuda"]) * world
    if not on_cpu and pipe.transformer.dtype == torch.float32:
        rate /= FP32_SLOWDOWN
    seconds = footprint.flops / rate
    if seconds < HOURS_WARNING_S:
        return None
    return (
        f"{height}x{width}, {steps} steps ({footprint.image_tokens} image tokens) will take about {seconds / 3600:.0f} hours here "
        f"({footprint.flops:.1e} FLOPs at an assumed {rate / 1e9:.0f} GFLOP/s); a smaller size is faster"
    )
