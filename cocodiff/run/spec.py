"""`GenerateSpec`: what one `generate` or `verify` run asks for, checked and filled in with its
preset's defaults (`resolve_spec`, from the command line), and the tolerance `verify` holds a dtype to."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from ..config.lossy_budget import lossy_budget
from ..config.parallel import DEFAULT_PROMPT, DTYPE_NAMES, ParallelConfig
from ..config.plan import Plan
from ..errors import UsageError
from ..models.presets import PRESETS, check_model, makes_video, refusal
from ..models.source import resolve_model
from .inputs import ImageInput, read_image_input
from .launch import under_launcher

__all__ = ["GenerateSpec", "image_source", "needs", "resolve_spec", "tolerance_for"]


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


def resolve_spec(args: argparse.Namespace) -> GenerateSpec:
    """The one place where `generate`, `verify` and `serve` turn their flags into a checked spec:
    the ranks (the launcher's world, or `--nproc`), `--ranks-per-node` and `--levels` against them,
    the plan against the preset's heads, then `GenerateSpec`'s own checks and defaults."""
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc} must be at least 1")
    world = int(os.environ["WORLD_SIZE"]) if under_launcher() else args.nproc
    preset = PRESETS.get(args.model)
    resolve_model(args.model)
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or world % args.ranks_per_node):
        raise UsageError(f"--ranks-per-node {args.ranks_per_node} must be at least 1 and divide the {world} ranks")
    parallel = ParallelConfig(
        comm=args.comm, ranks_per_node=args.ranks_per_node, levels=args.levels, v_first=args.v_first, fuse_qk=args.fuse_qk,
        v_major=args.v_major, v_major_tensors=args.v_major_tensors, v_major_max_memory=args.v_major_max_memory,
        plan=args.plan, compile=args.compile, cache=args.cache, wire=args.wire, parallel_vae=args.parallel_vae,
        lossy_budget=lossy_budget(args.model, args.lossy_budget), shard_weights=args.shard_weights,
        offload_text_encoders=args.offload_text_encoders,
    )
    if parallel.levels is not None and math.prod(size for _, size in parallel.levels) != world:
        raise UsageError(f"--levels {args.levels} must multiply to the {world} ranks")
    if preset is not None and isinstance(parallel.plan, Plan):  # checked again against the model once loaded
        parallel.plan.check(world, preset.heads)
    spec = GenerateSpec(
        model=args.model, prompt=args.prompt, steps=args.steps, height=args.height, width=args.width,
        seed=args.seed, batch=args.batch, dtype=args.dtype, parallel=parallel, source=image_source(args),
        frames=args.frames,
    )
    reason = refusal(args.model, needs(spec))  # a preset's: before any rank loads it
    if reason is not None:
        raise UsageError(reason)
    return spec


def needs(spec: GenerateSpec) -> set[str]:
    """What of a model `spec` needs that a preset may refuse (`models.presets.refusal`)."""
    plan = spec.parallel.plan
    return {need for need, used in (
        ("data_groups", isinstance(plan, Plan) and plan.cfg * plan.batch > 1),
        ("step_cache", spec.parallel.cache is not None),
        ("image_input", spec.source is not None),
        ("parallel_vae", spec.parallel.parallel_vae == "on"),
    ) if used}


def image_source(args: argparse.Namespace) -> ImageInput | None:
    """`--image` (and `--mask`, `--strength`), read and checked before any rank starts; None without `--image`."""
    if args.image is None:
        if args.mask is not None or args.strength is not None:
            raise UsageError(f"--{'mask' if args.mask is not None else 'strength'} needs --image")
        return None
    return read_image_input(args.image, args.mask, args.strength)
