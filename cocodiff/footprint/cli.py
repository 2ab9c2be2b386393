"""`cocodiff footprint`: what one rank will hold, part by part, before anything is loaded.

    cocodiff footprint --model flux1-dev --height 1024 --width 1024 --nproc 8 --json fp.json

Per rank, with P parameters and `item` bytes per value (`--dtype`), a plan of cfg x batch x ring x
Ulysses (sp = ring x Ulysses ranks share one image's S tokens), and b = the transformer's batch per
call on one data group:

    transformer         P x item; with --shard-weights on P / nproc (the ranks of one node share the
                        weights: engine/shard.py, FSDP2) plus two blocks whole (the one running and the
                        one being gathered); a pipeline's second expert (Wan 2.2 A14B) likewise,
                        both experts' shards held, one expert's blocks gathered at a time; with
                        pipeline stages (p), the heaviest stage's blocks and the parts outside the
                        blocks (engine/stages.py), and b = 1 (a stage runs one image at a time)
    text encoders       each one's parameters x item (every rank holds them); with
                        --offload-text-encoders on, on rank 0 (the only one that encodes, the
                        others free them) two of its largest leaf modules x item: the layer
                        running and the one arriving (engine/offload.py; its weights wait on the host)
    vae                 its parameters x item
    activations         footprint.estimate's transformer activations of one call, over sp, and the
                        text rows every rank holds whole; or, where larger, a family's whole-image
                        embedding at the entry less the two parts below (footprint.plan_activations)
    ring_blocks         ring > 1: the next K and V blocks (2 x b x S/sp x d x item) and the merged
                        output in fp32 (b x S/sp x d x 4)
    comm_buffers        Ulysses > 1: the all-to-all's send and receive of one projection
                        (2 x b x S/sp x d x item). FSDP's all-gathers land in the two whole
                        blocks counted under transformer; what they move, per rank and step,
                        is `shard_gather_bytes_per_step`: calls per step x P x item x (N - 1) / N
    patch_buffers       --pipe-patches (engine/patches.py): for each block of the longest stage, the K and V
                        of every token of each call of a step (b x S x d / Ulysses x item, twice)
    vae_decode          footprint.estimate's decoding (every rank decodes every image), and a video's
                        decoded frames; with --parallel-vae (on, or auto where each rank owns at
                        least twice the halo) rank r decodes a band of h / N own latent rows, each
                        convolution borrowing one row of each neighbouring band (the halo,
                        bands.HALO_ROWS, for the 2D VAEs and Wan's alike), so the decode scales
                        by min(h, ceil(h / N) + 2 halo) / h (the decoded frames a video's rank 0
                        gathers are not split). Measured for FLUX.1's VAE on 4 ranks (docs/usage.md):
                        0.26x at 1024 px where this gives 0.27x.

The parts add up to `per_rank_bytes`, an upper bound: decoding starts after the last transformer call.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.choices import CHOICES
from ..config.flags import add_parallel_vae_argument, ascii_int
from ..config.parallel import ParallelConfig, default_patches, micro_batches, stage_sharers
from ..config.plan import AUTO, Plan, auto_plan, default_plan, parse_plan, stage_ranges
from ..errors import UsageError
from ..models import catalog
from ..models.catalog import frame_form
from ..models.counts import CHECKPOINTS, ModelCounts, count_model, stage_blocks
from ..models.quantize import MODES, check_quantize
from ..output.tables import print_table, write_json
from .estimate import _size, estimate, plan_activations

__all__ = ["Setting", "add_parser", "check_fits", "main", "rank_parts"]

DEFAULT_DEVICE_GB = 80.0
"""Device memory assumed for a real checkpoint when no accelerator is bound (an H100 or A100 80 GB)."""
MAX_SUGGESTED_RANKS = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One run's shape, as the flags give it."""

    height: int
    width: int
    frames: int
    batch: int
    nproc: int
    plan: Plan
    dtype: str
    item_bytes: int
    shard: bool
    """Transformer weights sharded over the ranks (`--shard-weights on`: engine/shard.py)."""
    offload: bool = False
    """Text encoders off the device (`--offload-text-encoders on`: engine/offload.py)."""
    parallel_vae: str = "auto"
    """`--parallel-vae auto|on|off`."""
    patches: int | None = None
    """Displaced patches per step (`--pipe-patches`: engine/patches.py); None: none."""
    quantize: str | None = None
    """`--quantize MODE` (models/quantize.py): the transformer's linear weights in one byte each."""
    quantize_text_encoders: bool = False
    """`--quantize-text-encoders`: the text encoders' weights in `quantize`'s mode too."""


QUANTIZED_ROW_BYTES = {"int8": 5, "float8": 4}
"""Bytes beside each output row of a quantized linear weight, by the weight's type: torchao 0.18's
int8 keeps an fp32 scale and an int8 zero point per row, its float8 an fp32 scale (measured on the
tiny presets in fp32 and bf16: every mode's bytes equal the count below exactly)."""


def weight_bytes(counts: ModelCounts, s: Setting, params: int) -> int:
    """Bytes of `params` parameters of the transformer: in the run's dtype, or with `--quantize` the
    linear layers' share of them in one byte each plus their rows' scales (`float8storage`: the
    share diffusers' casting stores, one byte each; the share of a stage's part taken as the whole
    transformer's)."""
    if s.quantize is None:
        return params * s.item_bytes
    share = params / counts.transformer_params if counts.transformer_params else 0.0
    return _quantized_bytes(s, params, counts.linear_weights * share, counts.linear_rows * share,
                            counts.float8_stored * share)


def encoder_weight_bytes(counts: ModelCounts, s: Setting, name: str) -> int:
    """Bytes of text encoder `name`'s parameters: in the run's dtype, or with `--quantize-text-encoders`
    in `--quantize`'s mode as the transformer's are counted."""
    params = counts.text_encoders[name][1]
    if s.quantize is None or not s.quantize_text_encoders:
        return params * s.item_bytes
    return _quantized_bytes(s, params, *counts.encoder_quantizable[name])


def _quantized_bytes(s: Setting, params: float, linear: float, rows: float, stored: float) -> int:
    """Bytes of `params` parameters quantized in `s.quantize`'s mode: `linear` of them in linear
    weights of `rows` output rows at one byte each plus their rows' scales, the rest in the run's
    dtype (`float8storage`: the `stored` ones at one byte each, no scales)."""
    if MODES[s.quantize].layerwise:
        return math.ceil((params - stored) * s.item_bytes + stored)
    return math.ceil((params - linear) * s.item_bytes + linear + rows * _row_bytes(s.quantize))


def _row_bytes(mode: str) -> int:
    """`QUANTIZED_ROW_BYTES` of a `--quantize` mode."""
    return QUANTIZED_ROW_BYTES["float8" if mode.startswith("float8") else "int8"]


def splits_vae(counts: ModelCounts, s: Setting) -> bool:
    """Whether the run decodes in bands, as `engine.vae.use_parallel_vae` decides it (a one-line
    error for `on` where the VAE is not split)."""
    rows = s.height // _vae_factor(counts)
    if s.parallel_vae == "off" or s.nproc < 2:
        return False
    if counts.vae_halo is None:
        if s.parallel_vae == "on":
            raise UsageError(f"--parallel-vae on: the VAE of {counts.name} is not split (only 2D AutoencoderKL-style "
                             f"VAEs and the Wan, LTX-Video and HunyuanVideo 1.5 VAEs); use auto or off")
        return False
    if s.parallel_vae == "on":
        if rows < s.nproc:
            raise UsageError(f"--parallel-vae on: the image has {rows} latent rows, fewer than the {s.nproc} ranks")
        return True
    return rows // s.nproc >= 2 * counts.vae_halo


def _vae_factor(counts: ModelCounts) -> int:
    """Pixel rows per latent row: 2 ** (levels - 1) for the 2D VAEs (Wan's 8, HunyuanVideo 1.5's 16
    too); LTX-Video's, its patch times 2 per level that scales (32)."""
    config = counts.vae_config
    if "spatio_temporal_scaling" in config:  # AutoencoderKLLTXVideo
        return config["patch_size"] * 2 ** sum(config["spatio_temporal_scaling"])
    return 2 ** (len(config.get("block_out_channels") or [0] * 4) - 1)


def held_params(counts: ModelCounts, s: Setting) -> tuple[int, int]:
    """(parameters of one expert a rank's copy holds, ranks sharing that copy with `--shard-weights
    on`): the whole transformer over the --nproc ranks, or with pipeline stages the heaviest
    stage's part over the ranks of a stage."""
    if s.plan.pipe > 1:
        return stage_params(counts.name, s.plan.pipe), max(1, s.nproc // s.plan.pipe)
    return counts.transformer_params, s.nproc


def shard_gather_bytes(counts: ModelCounts, s: Setting) -> int:
    """Bytes one rank receives per denoising step from FSDP's all-gathers (0 unsharded): every
    pass through the transformer gathers the running expert's weights (its stage's, with pipeline
    stages), (N - 1) / N of them from the others. A pass: a call, each micro-batch of a call through
    the stages, or each displaced patch."""
    params, sharers = held_params(counts, s)
    if not s.shard or sharers < 2:
        return 0
    calls = 2 if counts.cfg == "calls" else 1
    images = s.batch * (2 if counts.cfg == "batch" else 1)
    passes = s.patches or micro_batches(images, s.plan.pipe)
    return calls * passes * params * s.item_bytes * (sharers - 1) // sharers


def stage_params(model: str, stages: int) -> int:
    """Parameters of the transformer a rank of the heaviest pipeline stage holds: the parts
    outside the blocks (every stage runs the embedders; the last, the output layers) and its
    blocks, cut as engine/stages.py cuts them (`stage_ranges` over each block's cost per token)."""
    root, params, costs = stage_blocks(model)
    return root + max(sum(params[start:end]) for start, end in stage_ranges(list(costs), stages))


def rank_parts(counts: ModelCounts, s: Setting) -> dict[str, int]:
    """Bytes one rank holds, per part (the module docstring says how each is counted)."""
    latent_frames = catalog.latent_frames(s.frames, counts.temporal_factor, counts.frame_chunk) if counts.video else 1
    call_batch = s.batch * (2 if counts.cfg == "batch" else 1)
    group_batch = math.ceil(call_batch / (s.plan.cfg * s.plan.batch))  # b: CFG and batch groups split the batch
    if s.plan.pipe > 1:  # stages run a call's images one at a time
        group_batch = 1
    footprint = estimate(
        counts.transformer_config, counts.vae_config, height=s.height, width=s.width, pixel_multiple=counts.pixel_multiple,
        batch=s.batch, item_bytes=s.item_bytes, text_tokens=counts.text_tokens, family=counts.family,
        call_batch=group_batch, frames=latent_frames, decode_frames=counts.temporal_factor,
    )
    if footprint is None:
        raise UsageError(f"--model {counts.name}: its transformer's config gives no heads, head size or layers to estimate from")
    params, sharers = held_params(counts, s)
    whole = counts.experts * weight_bytes(counts, s, params)
    sharded = (counts.experts * math.ceil(params / sharers) + 2 * counts.block_params) * s.item_bytes
    decoded = s.batch * s.frames * s.height * s.width * 3 * s.item_bytes if counts.video else 0  # (B, 3, F, H, W)
    decode = footprint.decode_bytes
    if splits_vae(counts, s):  # the largest band: own rows plus a halo on both sides
        rows = s.height // _vae_factor(counts)
        decode = math.ceil(decode * min(rows, math.ceil(rows / s.nproc) + 2 * (counts.vae_halo or 0)) / rows)
    return {
        "transformer": min(whole, sharded) if s.shard else whole,
        **{name: min(encoder_weight_bytes(counts, s, name), 2 * counts.encoder_layer_params.get(name, params) * s.item_bytes)
           if s.offload else encoder_weight_bytes(counts, s, name) for name, (_, params) in counts.text_encoders.items()},
        "vae": counts.vae_params * s.item_bytes,
        **plan_activations(footprint, counts.transformer_config, family=counts.family, call_batch=group_batch,
                           item_bytes=s.item_bytes, text_tokens=counts.text_tokens, ulysses=s.plan.ulysses, ring=s.plan.ring),
        "vae_decode": decode + decoded,
        **({"patch_buffers": patch_buffers(counts, s, footprint.tokens)} if s.patches else {}),
    }


def add_parser(commands: argparse._SubParsersAction) -> None:
    from ..config.parallel import DTYPE_NAMES
    from ..models.presets import PRESETS

    fp = commands.add_parser("footprint", help="memory one rank needs, part by part, without loading the model")
    fp.add_argument("--model", default="tiny-shapes",
                    help=f"a real checkpoint ({', '.join(CHECKPOINTS)}), a preset ({', '.join(PRESETS)}) or a local "
                         f"pipeline folder; configs are read offline")
    fp.add_argument("--height", type=ascii_int, default=None, help="pixels (default: the preset's; 1024, or 720 for video)")
    fp.add_argument("--width", type=ascii_int, default=None, help="pixels (default: the preset's; 1024, or 1280 for video)")
    fp.add_argument("--frames", type=ascii_int, default=None, help="video frames (video models only; default: the model's)")
    fp.add_argument("--batch", type=ascii_int, default=1, help="images per prompt")
    fp.add_argument("--nproc", type=ascii_int, default=4, help="ranks")
    fp.add_argument("--plan", default=None, metavar="PLAN",
                    help="as generate's --plan: u8, u4r2, c2u4, auto (default: the engine's for these ranks and heads)")
    fp.add_argument("--pipe-patches", default=None, metavar="M",
                    help="as generate's --pipe-patches: also count the displaced patches' K/V buffers")
    fp.add_argument("--shard-weights", default="auto", choices=list(CHOICES),
                    help="transformer weights 1/N per rank (sharded over the --nproc ranks of one node); auto: off unless they do not fit")
    fp.add_argument("--offload-text-encoders", default="auto", choices=list(CHOICES),
                    help="text encoders on the host, streamed to rank 0's device layer by layer, freed on the others; "
                         "auto: off unless the pipeline does not fit")
    add_parallel_vae_argument(fp)
    fp.add_argument("--quantize", default=None, choices=list(MODES), metavar="MODE",
                    help=f"as generate's --quantize ({', '.join(MODES)}): the transformer's linear weights in one "
                         f"byte each, with a scale per output row (LOSSY)")
    fp.add_argument("--quantize-text-encoders", action="store_true",
                    help="as generate's: with --quantize, the text encoders' weights in the same mode")
    fp.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                    help="auto: bfloat16 for a checkpoint (as on a GPU), float32 for the presets")
    fp.add_argument("--device-memory", type=float, default=None, metavar="GB",
                    help="memory of one rank's device in GB (default: the bound accelerator's; 80 for a checkpoint; "
                         "the machine's available memory over --nproc for a preset on the CPU)")
    fp.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")


def _plan(text: str | None, nproc: int, counts: ModelCounts, batch: int) -> Plan:
    if text is None:
        plan = default_plan(nproc, counts.heads)
    elif text.strip().lower() == "auto":
        plan = auto_plan(nproc, counts.heads, cfg=counts.cfg != "none", images=batch)
    else:
        plan = parse_plan(text)
    plan.check(nproc, counts.heads)
    return plan


def _capacity(device_gb: float | None, counts: ModelCounts, nproc: int) -> tuple[int, str]:
    """One rank's memory in bytes, and where the figure comes from."""
    from ..distributed.memory import available_bytes
    from ..distributed.topology import bound_device

    if device_gb is not None:
        if not 0 < device_gb < math.inf:  # nan compares false both ways
            raise UsageError(f"--device-memory {device_gb:g} must be a finite number of GB, more than 0")
        return int(device_gb * 1e9), "--device-memory"
    device = bound_device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"{props.name} (bound device)"
    if counts.checkpoint or device.type != "cpu":
        return int(DEFAULT_DEVICE_GB * 1e9), f"assumed {DEFAULT_DEVICE_GB:.0f} GB accelerator (--device-memory GB to change)"
    available = available_bytes(torch.device("cpu")) or int(DEFAULT_DEVICE_GB * 1e9)
    return available // nproc, f"this machine's available memory over {nproc} rank(s)"


def check_fits(counts: ModelCounts, s: Setting, local_ranks: int, shard_ranks: int) -> None:
    """Refuse (one line) a run whose rank, by `rank_parts`, needs more than its share of this
    machine's memory (`local_ranks` ranks share it on the CPU; an accelerator's own otherwise):
    what the ranks would refuse once loaded, said before any of them starts. The refusal suggests
    `--shard-weights on` only where sharding over `shard_ranks` ranks makes the run fit."""
    capacity, source = _capacity(None, counts, local_ranks)
    total = sum(rank_parts(counts, s).values())
    if total <= capacity:
        return
    sharded = Setting(**{**_fields(s), "shard": True})
    shard_fits = not s.shard and shard_ranks > 1 and sum(rank_parts(counts, sharded).values()) <= capacity
    size = f"--height {s.height} --width {s.width}" + (f" --frames {s.frames}" if counts.video else "")
    where = (f"({local_ranks} local rank(s)) available on this machine" if source.startswith("this machine")
             else f"({source})")
    fewer = capacity * local_ranks // total if source.startswith("this machine") else 0  # the local ranks it fits
    remedies = (["fewer local ranks (it fits on at most %d)" % fewer] if 1 <= fewer < local_ranks else []) + [
        "a smaller size"] + (["--shard-weights on (cocodiff footprint says what fits)"] if shard_fits else [])
    raise UsageError(
        f"{size} needs about {_size(total)} per rank, more than the {_size(capacity)} per rank {where}; "
        f"use {' or '.join(remedies)}"
    )


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 or nbytes == 0 else f"{nbytes / 1e6:.2f} MB"


def _count(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"


SUGGESTED = ((False, False), (False, True), (True, False), (True, True))
"""(shard, offload) in the order `_suggest` tries them on each number of ranks: cheapest first
(offloading costs a weight stream per prompt, sharding an all-gather per step)."""


def _flags(shard: bool, offload: bool) -> str:
    return " ".join(flag for flag, on in (("--shard-weights on", shard), ("--offload-text-encoders on", offload)) if on)


def _suggest(counts: ModelCounts, s: Setting, capacity: int) -> tuple[str, dict[str, Any] | None]:
    """The first that fits of: these ranks with more of sharding and offloading on, then more ranks
    (doubling), with each of them."""
    n = s.nproc
    while n <= MAX_SUGGESTED_RANKS:
        for shard, offload in SUGGESTED:
            if n == s.nproc and (shard < s.shard or offload < s.offload or (shard, offload) == (s.shard, s.offload)):
                continue
            if shard and s.quantize is not None:  # quantized weights are not sharded here
                continue
            plan = s.plan if n == s.nproc else default_plan(n, counts.heads)
            setting = Setting(**{**_fields(s), "nproc": n, "plan": plan, "shard": shard, "offload": offload})
            total = sum(rank_parts(counts, setting).values())
            if total <= capacity:
                how = f" with {_flags(shard, offload)}" if shard or offload else ""
                return f"on {n} ranks ({plan.short}){how}: {_gb(total)}", {
                    "nproc": n, "plan": plan.short, "shard_weights": shard, "offload_text_encoders": offload,
                    "per_rank_bytes": total}
        n *= 2
    return f"not even with {_flags(True, True)} on {MAX_SUGGESTED_RANKS} ranks", None


def _fields(s: Setting) -> dict[str, Any]:
    return {name: getattr(s, name) for name in Setting.__slots__}


def _setting(args: argparse.Namespace, counts: ModelCounts) -> Setting:
    from ..models.presets import DTYPES, resolve_dtype

    height = args.height if args.height is not None else counts.default_size[0]
    width = args.width if args.width is not None else counts.default_size[1]
    for name, value in (("height", height), ("width", width)):
        if value < counts.pixel_multiple or value % counts.pixel_multiple:
            raise UsageError(f"--{name} {value} must be a positive multiple of {counts.pixel_multiple} for {counts.name}")
    if args.frames is not None and not counts.video:
        raise UsageError(f"--frames {args.frames}: {counts.name} makes images, not videos")
    frames = args.frames if args.frames is not None else counts.default_frames
    form = frame_form(frames, counts.temporal_factor, counts.frame_chunk)
    if form is not None:
        raise UsageError(f"--frames {frames} must be {form} (..., {counts.default_frames}) for {counts.name}")
    if args.batch < 1 or args.nproc < 1:
        raise UsageError(f"--batch {args.batch} and --nproc {args.nproc} must be at least 1")
    dtype = resolve_dtype(args.dtype, args.model, torch.device("cuda"))  # as on a GPU
    plan = _plan(args.plan, args.nproc, counts, args.batch)
    check_quantize(args.quantize, text_encoders=args.quantize_text_encoders)  # as generate checks it
    if args.shard_weights == "on" and args.quantize is not None:  # as generate refuses it
        raise UsageError(f"--quantize {args.quantize} does not combine with --shard-weights on (quantized weights are "
                         f"not sharded here); use --shard-weights off or auto")
    if args.shard_weights == "on" and stage_sharers(args.nproc, args.nproc, plan.pipe) < 2:  # as generate refuses it
        if plan.pipe > 1:
            raise UsageError(f"--shard-weights on shares a pipeline stage's weights among its ranks on a node; --plan "
                             f"{plan.short} leaves none to share with (use --shard-weights off, or fewer stages)")
        raise UsageError(f"--shard-weights on shares the weights among a node's ranks; --nproc {args.nproc} leaves none "
                         f"to share with (use --shard-weights off or auto, or more ranks)")
    return Setting(height=height, width=width, frames=frames, batch=args.batch, nproc=args.nproc,
                   plan=plan, dtype=dtype, item_bytes=DTYPES[dtype].itemsize,
                   shard=args.shard_weights == "on", offload=args.offload_text_encoders == "on",
                   parallel_vae=args.parallel_vae, patches=_patches(args.pipe_patches, args.plan),
                   quantize=args.quantize, quantize_text_encoders=args.quantize_text_encoders)


def _patches(text: str | None, plan: str | None) -> int | None:
    """`--pipe-patches` as the engine resolves it (`ParallelConfig`), before any rank starts."""
    if text is None:
        return None
    config = ParallelConfig(plan=plan, pipe_patches=text)
    return default_patches(config.plan.pipe if isinstance(config.plan, Plan) else 1) if config.pipe_patches == AUTO \
        else config.pipe_patches


def patch_buffers(counts: ModelCounts, s: Setting, tokens: int) -> int:
    """Bytes of displaced patches' K/V buffers on a rank of the stage of the most blocks: for each
    block, the K and V of every token (image and text) of each call of a step, its Ulysses share of the heads."""
    _root, _params, costs = stage_blocks(counts.name)
    most = max(end - start for start, end in stage_ranges(list(costs), s.plan.pipe))
    config = counts.transformer_config
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    calls = 2 if counts.cfg == "calls" else 1
    batch = s.batch * (2 if counts.cfg == "batch" else 1)
    return most * 2 * calls * batch * tokens * math.ceil(hidden / s.plan.ulysses) * s.item_bytes


def _rows(counts: ModelCounts, s: Setting, parts: dict[str, int]) -> list[tuple[str, str, str]]:
    plain = item = f"x {s.item_bytes} bytes"
    if s.quantize is not None and MODES[s.quantize].layerwise:
        item += f", linear and convolution weights {s.quantize} (1 byte)"
    elif s.quantize is not None:
        item += f", linear weights {s.quantize} (1 byte + {_row_bytes(s.quantize)} per row)"
    encoded = item if s.quantize_text_encoders else plain
    experts = f"{counts.experts} experts x " if counts.experts > 1 else ""
    params, sharers = held_params(counts, s)
    stage = f" (the heaviest of {s.plan.pipe} stages)" if s.plan.pipe > 1 else ""
    weights = (f"1/{sharers} of {experts}{_count(params)} parameters{stage} + 2 blocks of "
               f"{_count(counts.block_params)} whole, {item}"
               if s.shard else f"{experts}{_count(stage_params(counts.name, s.plan.pipe))} parameters of "
               f"{_count(counts.transformer_params)}: the heaviest of {s.plan.pipe} stages, {item}"
               if s.plan.pipe > 1 else f"{experts}{_count(counts.transformer_params)} parameters {item}")
    rows = [("transformer weights", _gb(parts["transformer"]), weights)]
    for name, (cls, params) in counts.text_encoders.items():
        how = (f"offloaded: 2 leaf modules of up to {_count(counts.encoder_layer_params.get(name, params))} on rank 0, "
               f"{_count(params)} parameters on the host" if s.offload else f"{_count(params)} parameters {encoded}")
        rows.append((f"{name} ({cls})", _gb(parts[name]), how))
    rows.append(("VAE weights", _gb(parts["vae"]), f"{_count(counts.vae_params)} parameters {plain}"))
    rows.append(("activations", _gb(parts["activations"]), f"one transformer call over {s.plan.sp} sequence rank(s) ({s.plan.short})"))
    rows.append(("ring K/V blocks", _gb(parts["ring_blocks"]), f"ring {s.plan.ring}: next K/V blocks, fp32 merge"))
    gathered = shard_gather_bytes(counts, s)
    rows.append(("all-to-all buffers", _gb(parts["comm_buffers"]), f"Ulysses {s.plan.ulysses}: send + receive of one projection"
                 + (f"; FSDP gathers {_gb(gathered)} per step into the 2 blocks above" if gathered else "")))
    if splits_vae(counts, s):
        decode = (f"a band per rank: {s.height // _vae_factor(counts)} / {s.nproc} latent rows "
                  f"+ {counts.vae_halo} of each neighbour's")
    else:
        decode = "every rank decodes every image" + (" (and holds the frames)" if counts.video else "")
    rows.append(("VAE decode", _gb(parts["vae_decode"]), decode))
    if "patch_buffers" in parts:
        rows.append(("patch K/V buffers", _gb(parts["patch_buffers"]),
                     f"--pipe-patches {s.patches}: K and V of the whole sequence per block of the longest stage"))
    return rows


def main(args: argparse.Namespace) -> int:
    from ..output.files import check_file

    check_file("--json", args.json)
    counts = count_model(args.model)
    s = _setting(args, counts)
    capacity, capacity_source = _capacity(args.device_memory, counts, s.nproc)
    parts = rank_parts(counts, s)
    whole = sum(parts.values())
    encoders = sum(parts[name] for name in counts.text_encoders)
    # auto, as run/load.py decides: shard when the rest does not fit beside the whole weights (the
    # text encoders waiting on the host), then offload when the text encoders do not fit beside it.
    if args.shard_weights == "auto" and args.quantize is None and \
            whole - (encoders if args.offload_text_encoders != "off" else 0) > capacity:
        s = Setting(**{**_fields(s), "shard": True})
    if args.offload_text_encoders == "auto" and sum(rank_parts(counts, s).values()) > capacity:
        s = Setting(**{**_fields(s), "offload": True})
    parts = rank_parts(counts, s)
    shard_weights, offload = ("on" if s.shard else "off"), ("on" if s.offload else "off")
    total = sum(parts.values())
    fits = total <= capacity
    suggestion, alternative = (None, None) if fits else _suggest(counts, s, capacity)
    verdict = f"{_gb(capacity - total)} to spare" if fits else f"needs {_gb(total)} per rank; {suggestion}"
    if shard_weights == "on" and args.shard_weights == "auto":
        verdict += f" (--shard-weights auto: whole weights need {_gb(whole)}, so sharded)"
    if offload == "on" and args.offload_text_encoders == "auto":
        verdict += " (--offload-text-encoders auto: the text encoders did not fit beside the rest, so offloaded)"
    size = f"{s.height}x{s.width}" + (f" x {s.frames} frames" if counts.video else "")
    print_table(
        f"cocodiff footprint: {counts.name}, {size}, {s.nproc} rank(s) ({s.plan.short}), {s.dtype}"
        + (" (weights sharded)" if s.shard else "") + (" (text encoders offloaded)" if s.offload else ""),
        ["part", "per rank", "how"],
        [*_rows(counts, s, parts), ("total", _gb(total), "the parts added (an upper bound)"),
         ("device memory", _gb(capacity), capacity_source), ("fits", "yes" if fits else "no", verdict)],
    )
    write_json(args.json, {
        "model": counts.name, "height": s.height, "width": s.width, "frames": s.frames, "batch": s.batch,
        "nproc": s.nproc, "plan": s.plan.short, "dtype": s.dtype, "quantize": s.quantize,
        "quantize_text_encoders": s.quantize_text_encoders, "shard_weights": shard_weights,
        "offload_text_encoders": offload, "parallel_vae": splits_vae(counts, s),
        "shard_gather_bytes_per_step": shard_gather_bytes(counts, s), "per_rank_bytes": total, "parts": parts, "device_memory_bytes": capacity, "device_memory_source": capacity_source,
        "fits": fits, "suggestion": suggestion, "alternative": alternative,
        "parameters": {"transformer": counts.experts * counts.transformer_params, "block": counts.block_params, "vae": counts.vae_params,
                       **{name: params for name, (_, params) in counts.text_encoders.items()}},
    })
    return 0
