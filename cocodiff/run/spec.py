"""`GenerateSpec`: what one `generate` or `verify` run asks for, checked and filled in with its
preset's defaults (`resolve_spec`, from the command line), and the tolerance `verify` holds a dtype to."""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..config.flags import SEED_LIMIT, STEPS_LIMIT
from ..config.lossy_budget import lossy_budget
from ..config.parallel import DEFAULT_PROMPT, DTYPE_NAMES, ParallelConfig, stage_sharers
from ..config.plan import Plan, default_plan
from ..errors import UsageError
from ..engine.attention.backends import check_backend, splits_stock_processors
from ..engine.families.pipelines import (
    ANIMATE_PIPELINES,
    NEEDS_REFERENCE,
    SIZED_BY_IMAGE,
    animates_one_image,
    bucket_target,
    needs_last_frame,
    needs_reference,
    no_bucket,
)
from ..models.catalog import clip_rule
from ..models.counts import ModelCounts
from ..models.lora import Adapter, check_loader, parse_adapters
from ..models.quantize import check_quantize
from ..models.presets import PRESETS, check_model, last_frame_of, last_frame_refusal, makes_video, pipeline_class, refusal
from ..models.source import resolve_model
from .inputs import ImageInput, read_image_input
from .launch import under_launcher

__all__ = ["GenerateSpec", "check_run", "image_source", "needs", "resolve_spec", "run_world", "tolerance_for"]


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
    lora: tuple[Adapter, ...] = ()
    """LoRA adapters fused into the weights on every rank (`--lora`, models/lora.py)."""
    lora_applied: dict | None = None
    """What fusing `lora` did once the pipeline loaded (`apply_adapters`' record)."""
    quantize: str | None = None
    """LOSSY: the transformer's linear weights quantized with this torchao mode (`--quantize`,
    models/quantize.py); None: as loaded."""
    quantize_text_encoders: bool = False
    """The text encoders' weights quantized too, in the same mode (`--quantize-text-encoders`)."""
    quantized: dict | None = None
    """What quantizing did once the pipeline loaded (`apply_quantize`' record)."""
    stage_load: dict | None = None
    """What this rank read of a checkpoint's transformer for its pipeline stage (models/stage_load.py
    record); None: it loaded whole (a preset, no stages, or a checkpoint not read by name)."""

    def __post_init__(self) -> None:
        self.parallel = self.parallel or ParallelConfig()
        check_model(self.model)
        preset = PRESETS.get(self.model)
        video = makes_video(self.model)
        if self.frames is not None and not video:
            raise UsageError(f"--frames {self.frames}: {self.model} makes images, not videos")
        if self.frames is not None and self.frames < 1:
            raise UsageError(f"--frames {self.frames} must be at least 1")
        if video and self.source is not None and not self.source.animates:
            raise UsageError(f"--image: {self.model} is a text-to-video model here; image input is for image models")
        if self.frames is None and preset is not None:
            self.frames = preset.frames
        if self.frames is not None and preset is not None and preset.frame_chunk is not None:
            rule = clip_rule(self.frames, preset.frame_chunk, preset.frame_limits)
            if rule is not None:
                raise UsageError(f"--frames {self.frames}: {self.model} makes clips of {rule} (its VAE encodes "
                                 f"{preset.frame_chunk[0]} frames at a time)")
        elif self.frames is not None and preset is not None and (self.frames - 1) % preset.frame_step:
            step = preset.frame_step
            raise UsageError(f"--frames {self.frames}: {self.model} makes clips of {step}k+1 frames "
                             f"(1, {step + 1}, {2 * step + 1}, ...; its VAE's temporal factor is {step})")
        if self.source is not None and self.source.edit:  # the first reference's size, unless given
            self.height = self.height if self.height is not None else self.source.height
            self.width = self.width if self.width is not None else self.source.width
        elif self.source is not None:  # the output has the image's size
            for name, given, own in (("height", self.height, self.source.height), ("width", self.width, self.source.width)):
                if given is not None and given != own:
                    raise UsageError(f"--{name} {given} differs from the {name} of --image {self.source.image_path} "
                                     f"({own}); leave it out to use the image's")
            self.height, self.width = self.source.height, self.source.width
        self.steps = self.steps if self.steps is not None else preset.default_steps if preset else 4
        self.height = self.height if self.height is not None else preset.default_size if preset else 256
        self.width = self.width if self.width is not None else preset.default_size if preset else 256
        if not 0 <= self.seed < SEED_LIMIT:
            raise UsageError(f"--seed {self.seed} must be from 0 to 2**63 - 1 (a seed torch takes)")
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch} must be at least 1")
        if not 1 <= self.steps <= STEPS_LIMIT:
            raise UsageError(f"--steps {self.steps} must be from 1 to {STEPS_LIMIT} (the schedulers' training timesteps)")
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
        if pipeline_class(self.model) in SIZED_BY_IMAGE and bucket_target(self.height, self.width, multiple) is None:
            raise UsageError(f"--height {self.height} --width {self.width}: "
                             f"{no_bucket(self.model, self.height, self.width, multiple)}")
        patches = self.parallel.pipe_patches if self.parallel is not None else None
        rows = self.height // multiple * (self.frames or 1)  # a patch is a run of whole rows of tokens
        if isinstance(patches, int) and patches > rows:
            raise UsageError(f"--pipe-patches {patches} is more than the {rows} rows of tokens of a "
                             f"{self.height}-pixel-high {'video' if self.frames else 'image'}: at most {rows}")


def tolerance_for(dtype: str) -> float:
    """Largest relative difference (to the reference's largest magnitude) that still counts as equal.

    fp32: sharded matmuls and attention over reordered keys round differently from one process
    (~1e-7 per operation), compounded over layers and steps; 1e-4 leaves room for that while any
    real mistake (a wrong token, head or position) gives errors of order 1e-1 or more.
    bf16/fp16 round at ~4e-3/5e-4 per operation, so the same argument gives 3e-2.
    """
    return 1e-4 if dtype == "float32" else 3e-2


def resolve_spec(args: argparse.Namespace) -> GenerateSpec:
    """The one place where `generate`, `verify` and `serve` turn their flags into a checked spec:
    the ranks (the launcher's world, or `--nproc`), `--ranks-per-node` and `--levels` against them,
    the plan against the preset's heads, then `GenerateSpec`'s own checks and defaults."""
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc} must be at least 1")
    world = run_world(args.nproc)
    preset = PRESETS.get(args.model)
    resolve_model(args.model)
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or world % args.ranks_per_node):
        raise UsageError(f"--ranks-per-node {args.ranks_per_node} must be at least 1 and divide the {world} ranks")
    warmup, text = getattr(args, "pipe_warmup", None), getattr(args, "pipe_text", None)
    if getattr(args, "pipe_patches", None) is None and (warmup is not None or text is not None):
        given = " and ".join(flag for flag, value in (("--pipe-warmup", warmup), ("--pipe-text", text)) if value is not None)
        raise UsageError(f"{given} set displaced patches' schedule: give --pipe-patches too")
    parallel = ParallelConfig(
        comm=args.comm, ranks_per_node=args.ranks_per_node, levels=args.levels, v_first=args.v_first, fuse_qk=args.fuse_qk,
        v_major=args.v_major, v_major_tensors=args.v_major_tensors, v_major_max_memory=args.v_major_max_memory,
        plan=args.plan, compile=args.compile, cache=args.cache, wire=args.wire, parallel_vae=args.parallel_vae,
        lossy_budget=lossy_budget(args.model, args.lossy_budget), shard_weights=args.shard_weights,
        offload_text_encoders=args.offload_text_encoders, pipe_patches=getattr(args, "pipe_patches", None),
        pipe_warmup=1 if warmup is None else warmup, pipe_text="whole" if text is None else text,
        attention_backend=getattr(args, "attention_backend", None),
    )
    check_backend(parallel.attention_backend)
    if parallel.levels is not None and math.prod(size for _, size in parallel.levels) != world:
        raise UsageError(f"--levels {args.levels} must multiply to the {world} ranks")
    if parallel.wire is not None and parallel.levels is None and parallel.ranks_per_node is None:
        parallel.wire.check(["node", "rank"])  # the levels a run has when none are named
    _check_shard_ranks(args, parallel, world)
    spec = GenerateSpec(
        model=args.model, prompt=args.prompt, steps=args.steps, height=args.height, width=args.width,
        seed=args.seed, batch=args.batch, dtype=args.dtype, parallel=parallel, source=image_source(args),
        frames=args.frames, quantize=getattr(args, "quantize", None),
        quantize_text_encoders=getattr(args, "quantize_text_encoders", False),
    )
    adapters = getattr(args, "lora", None)
    check_run(spec, world, {"lora"} if adapters else set())
    spec.lora = parse_adapters(adapters)
    if spec.lora and preset is None:
        check_loader(args.model)
    return spec


def run_world(nproc: int) -> int:
    """The ranks a run will have: the launcher's world under one, else `--nproc` local ranks."""
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else nproc


def check_run(spec: GenerateSpec, world: int, more_needs: set[str] = frozenset()) -> None:
    """What can be refused of a run on `world` ranks before any rank starts: its quantize mode (and
    with sharded weights), its attention backend on split stock processors, the plan against the
    ranks and the preset's heads, a stage plan that leaves sharded weights no one to share with, the
    preset's refusals of what the run needs (and `more_needs`), and the preset's configs against
    the size, the cache and one rank's memory (`generate`'s flags, or one `bench e2e` variant)."""
    preset = PRESETS.get(spec.model)
    parallel = spec.parallel
    check_quantize(spec.quantize, text_encoders=spec.quantize_text_encoders)
    if spec.quantize is not None and parallel.shard_weights is True:
        raise UsageError(f"--quantize {spec.quantize} does not combine with --shard-weights on (quantized weights "
                         f"are not sharded); use --shard-weights off")
    _check_split_kernel(spec.model, parallel.attention_backend, world)
    if preset is not None and isinstance(parallel.plan, Plan):  # checked again against the model once loaded
        parallel.plan.check(world, preset.heads)
    if (parallel.shard_weights is True and isinstance(parallel.plan, Plan)
            and stage_sharers(parallel.ranks_per_node or world, world, parallel.plan.pipe) < 2):
        raise UsageError(f"--shard-weights on shares a pipeline stage's weights among its ranks on a node; --plan "
                         f"{parallel.plan.short} leaves none to share with (use --shard-weights off, or fewer stages)")
    # a preset's: before any rank loads it (with no plan given, the default puts a ring past its heads)
    rings = preset is not None and parallel.plan is None and default_plan(world, preset.heads).ring > 1
    reason = refusal(spec.model, needs(spec) | more_needs | ({"ring"} if rings else set()))
    if reason is not None:
        raise UsageError(reason)
    if preset is not None:
        _check_preset(spec, world)


def _check_shard_ranks(args: argparse.Namespace, parallel: ParallelConfig, world: int) -> None:
    """`--shard-weights on` shares the weights among a node's ranks: refused where the command line
    already says a node has one rank (the launcher's nodes are known only once the ranks meet)."""
    if parallel.shard_weights is not True:
        return
    if world == 1:
        flag = f"--nproc {args.nproc}" if not under_launcher() else "a launcher's single rank"
    elif parallel.levels is not None and math.prod(size for _, size in parallel.levels[1:]) == 1:
        flag = f"--levels {args.levels}"
    elif parallel.ranks_per_node == 1:
        flag = "--ranks-per-node 1"
    else:  # one node's ranks per stage: check_run
        return
    raise UsageError(f"--shard-weights on shares the weights among a node's ranks; {flag} leaves none to share with "
                     f"(use --shard-weights off or auto, or more ranks per node)")


def _check_preset(spec: GenerateSpec, world: int) -> None:
    """What a preset's configs decide before any rank loads it: its transformer's blocks against
    `--cache`, its position tables against the size and frames, and one rank's memory."""
    from ..config.plan import default_plan
    from ..footprint.cli import Setting, check_fits
    from ..models.counts import count_model
    from ..models.presets import DTYPES, resolve_dtype

    with _library_logs_quiet():  # building the tiny parts looks up classes that log their fallbacks
        if spec.parallel.cache is not None:
            spec.parallel.cache.block_split(_preset_blocks(spec.model))
        counts = count_model(spec.model)
    _check_positions(spec, counts)
    plan = spec.parallel.plan if isinstance(spec.parallel.plan, Plan) else default_plan(world, counts.heads)
    dtype = resolve_dtype(spec.dtype, spec.model, _device())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_launcher() else world
    node = (math.prod(size for _, size in spec.parallel.levels[1:]) if spec.parallel.levels is not None
            else spec.parallel.ranks_per_node or local)
    check_fits(counts, Setting(
        height=spec.height, width=spec.width, frames=spec.frames or 1, batch=spec.batch, nproc=world, plan=plan,
        dtype=dtype, item_bytes=DTYPES[dtype].itemsize, shard=spec.parallel.shard_weights is True,
        offload=spec.parallel.offload_text_encoders is True, parallel_vae=spec.parallel.parallel_vae,
    ), local_ranks=local, shard_ranks=node)


@contextmanager
def _library_logs_quiet() -> Iterator[None]:
    """transformers' and diffusers' loggers at ERROR, as the ranks have them (`cli.main` sets their
    VERBOSITY variables, which these libraries read when imported: before that, in this process)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    levels = [(library, library.get_verbosity()) for library in (diffusers_logging, transformers_logging)]
    for library, _ in levels:
        library.set_verbosity(library.ERROR)
    try:
        yield
    finally:
        for library, level in levels:
            library.set_verbosity(level)


def _device():
    from ..distributed.topology import bound_device

    return bound_device()


@functools.lru_cache(maxsize=None)
def _preset_blocks(model: str) -> int:
    """The blocks of preset `model`'s transformer that a step cache splits (its tiny weights built once)."""
    import torch

    from ..engine.cache.steps import cache_blocks
    from ..models.presets import load_pipeline

    with torch.random.fork_rng():  # built as the ranks build it; this process's generator stays as it was
        return len(cache_blocks(load_pipeline(model)[0].transformer))


def _check_positions(spec: GenerateSpec, counts: ModelCounts) -> None:
    """The positions a transformer's tables cover: Wan's rotary table (`rope_max_seq_len` per axis:
    latent frames, then patch rows and columns) and SD3's cropped position embedding
    (`pos_embed_max_size` patches per side). A run past them fails inside the model on every rank."""
    config = counts.transformer_config
    step = PRESETS[spec.model].frame_step  # latent frames: 1 + (frames - 1) / the VAE's temporal factor
    patch = config.get("patch_size") or 1
    patch_t, patch_hw = (patch[0], patch[-1]) if isinstance(patch, (list, tuple)) else (1, patch)
    vae = counts.pixel_multiple // patch_hw  # pixels per latent row
    for key, axes in (("rope_max_seq_len", ("frames", "height", "width")), ("pos_embed_max_size", ("height", "width"))):
        limit = config.get(key)
        if not isinstance(limit, int):
            continue
        for axis in axes:
            if axis == "frames":
                if spec.frames is None:
                    continue
                positions = ((spec.frames - 1) // step + 1 + patch_t - 1) // patch_t
                most = (limit * patch_t - 1) * step + 1
                unit = "latent frames"
            else:
                positions = getattr(spec, axis) // (vae * patch_hw)
                most, unit = limit * vae * patch_hw, "patches"
            if positions > limit:
                raise UsageError(f"--{axis} {getattr(spec, axis)} is {positions} {unit}, more than the {limit} "
                                 f"positions of {spec.model}'s transformer ({key} {limit}): at most {most}")


def _check_split_kernel(model: str, backend: str | None, world: int) -> None:
    """A backend with no context-parallel path on a preset whose stock processors need one
    (`split_kernel`), refused in one line on more than one rank."""
    if world > 1 and not splits_stock_processors(backend):
        reason = refusal(model, {"split_kernel"})
        if reason is not None:
            raise UsageError(f"--attention-backend {backend}: {reason}")


def needs(spec: GenerateSpec) -> set[str]:
    """What of a model `spec` needs that a preset may refuse (`models.presets.refusal`)."""
    plan = spec.parallel.plan
    return {need for need, used in (
        ("data_groups", isinstance(plan, Plan) and plan.cfg * plan.batch > 1),
        ("cfg", isinstance(plan, Plan) and plan.cfg > 1),
        ("ring", isinstance(plan, Plan) and plan.ring > 1),
        ("batch", spec.batch > 1),
        ("stages", isinstance(plan, Plan) and plan.pipe > 1 or spec.parallel.pipe_patches is not None),  # patches run stages' code
        ("patches", spec.parallel.pipe_patches is not None),
        ("step_cache", spec.parallel.cache is not None),
        ("plan_trials", spec.parallel.plan == "auto"),
        ("v_major", not spec.parallel.schedule.off),
        ("image_input", spec.source is not None and not spec.source.edit),
        ("mask", spec.source is not None and spec.source.mask is not None),
        ("references", spec.source is not None and len(spec.source.images) > 1),
        ("last_frame", spec.source is not None and spec.source.last is not None),
        ("parallel_vae", spec.parallel.parallel_vae == "on"),
        ("lora", bool(spec.lora)),
    ) if used}


def image_source(args: argparse.Namespace) -> ImageInput | None:
    """`--image` (and `--mask`, `--strength` where the command has them), read and checked before
    any rank starts; None without `--image`."""
    mask, strength = getattr(args, "mask", None), getattr(args, "strength", None)
    last = getattr(args, "last_frame", None)
    pipeline = pipeline_class(args.model)
    if last is not None and (reason := last_frame_refusal(args.model)):
        raise UsageError(f"--last-frame: {reason}")
    if last is None and getattr(args, "command", None) != "serve" and last_frame_of(args.model) == "required":
        raise UsageError(needs_last_frame(args.model))  # serve: each request's last_frame
    if args.image is None and getattr(args, "command", None) != "serve" and pipeline in ANIMATE_PIPELINES:
        raise UsageError(animates_one_image(args.model))  # serve: each request's input_reference
    if args.image is None and getattr(args, "command", None) != "serve" and pipeline in NEEDS_REFERENCE:
        raise UsageError(needs_reference(args.model, pipeline))  # serve: each edit's images
    if args.image is None:
        if mask is not None or strength is not None:
            raise UsageError(f"--{'mask' if mask is not None else 'strength'} needs --image")
        return None
    if makes_video(args.model) and pipeline not in ANIMATE_PIPELINES:
        raise UsageError(f"--image: {args.model} is a text-to-video model here; image input is for image models "
                         f"and image-to-video ones ({', '.join(ANIMATE_PIPELINES)})")
    return read_image_input(args.image, mask, strength, pipeline=pipeline, model=args.model, last=last)
