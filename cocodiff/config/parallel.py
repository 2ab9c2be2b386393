"""Typed, validated configuration for sequence-parallel inference.

Parsing a config never starts `torch.distributed`: `ParallelConfig` only checks that its fields
make sense together; the process groups are built later by `Topology`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError
from .cache import CacheSpec, parse_cache
from .choices import CHOICES, parse_choice
from .levels import Levels, format_levels, parse_levels
from .lossy_budget import LossyBudget
from .plan import AUTO, Plan, parse_plan
from .sizes import digits
from .vmajor import Schedule, parse_schedule
from .wire import Wire, parse_wire

__all__ = ["COMM_CHOICES", "DEFAULT_PROMPT", "DTYPE_NAMES", "MICRO_BATCHES_PER_STAGE", "PATCH_TEXT", "SHARD_CHOICES", "ParallelConfig", "stage_sharers",
           "default_patches", "micro_batches"]

COMM_CHOICES = ("flat", "tapa", "tapa-full", "auto")
PATCH_TEXT = ("patched", "whole")
"""`--pipe-text`: how the text stream crosses displaced patches (engine/patches.py)."""
SHARD_CHOICES = CHOICES  # the name the flags knew it by
DEFAULT_PROMPT = "a red circle above a blue square"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
"""Compute dtypes by name (models.presets.DTYPES maps them to torch's); `auto` is a checkpoint's own
(bfloat16) on CUDA/XPU and float32 for the presets and on the CPU (`models.presets.resolve_dtype`)."""


MICRO_BATCHES_PER_STAGE = 2
"""Pipeline stages pass a call's images (or CFG branches) as at most this many micro-batches per
stage (engine/stages.py): the fill and drain bubble stays at a third of a call or less
((S - 1) / (2 S + S - 1)), and a large batch of small images (serving's step-level batches) does
not pay a whole forward's fixed costs per image."""


def micro_batches(images: int, stages: int) -> int:
    """How many micro-batches a call of `images` passes the stages in."""
    return min(images, MICRO_BATCHES_PER_STAGE * stages)


def stage_sharers(node_ranks: int, world: int, stages: int) -> int:
    """The ranks that share one copy of the weights under `--shard-weights on`: a node's, and with
    pipeline stages of one stage's (stages are outermost: a stage fills whole nodes, or part of one)."""
    return min(node_ranks, world // stages) if stages > 1 else node_ranks


def default_patches(stages: int) -> int:
    """`--pipe-patches auto`: twice the stages, so that the fill and drain bubble, (S - 1) / (M + S - 1)
    of a step, stays at a third or less (PipeFusion's published runs take M of S to 2 S)."""
    return max(2, 2 * stages)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How a transformer is split over the ranks of the default process group."""

    comm: str = "flat"
    """All-to-all mechanism: `flat` (one all-to-all over all ranks, the Ulysses baseline) or
    `tapa` (two phases: inside each node, then between nodes among ranks of the same local index)
    or `tapa-full` (one phase per level of `levels`, innermost first) or `auto` (the run's first denoising steps timed under flat and TAPA, with and without
    V-First unless `v_first` fixes it; the fastest runs the rest: distributed/comm/auto.py `StepTrials`)."""

    v_first: bool | None = None
    """V-First: start V's all-to-all before Q and K are projected, normalized and rotated, and
    overlap the attention output's all-to-all with independent work (FLUX's single-stream MLP).
    Lossless: only the schedule changes. None: on, except under `comm="auto"`, which decides."""

    fuse_qk: bool = True
    """Send Q and K as one message (one collective instead of two)."""

    v_major: Schedule | str = "off"
    """V-Major (lossy): on inter-node links send only the tokens whose projections changed most
    since the receiver last got them; the cache ratio per step follows this schedule: `off`,
    `linear`, `constant:R`, `warmup:N,linear`, `adaptive:EPS`. Needs `comm="tapa"` or `"flat"`.
    Given as text, it is parsed once, here: after construction it is always a `Schedule`
    (`str()` of which is the text as written)."""

    v_major_tensors: str = "v"
    """`v`: V only; `vqk`: Q and K of the tokens V did not send are skipped too."""

    v_major_max_memory: int | None = None
    """Cache bytes per rank; layers past it send in full. None: no limit."""

    ranks_per_node: int | None = None
    """Ranks that share a node (fast links). None: taken from the launcher (`LOCAL_WORLD_SIZE`)."""

    levels: Levels | str | None = None
    """The hierarchy, outermost (the nodes) first: `node=2,card=2,tile=2` (config/levels.py; sizes
    multiply to the ranks). None: two levels from `ranks_per_node`. Text is parsed here."""

    plan: Plan | str | None = None
    """How the ranks share the work (config/plan.py): `u4r2`, `ring=2,ulysses=4`, ... (written order =
    placement, outermost first) or `auto` (CFG and batch groups where the pipeline guides or
    makes several images, sequence parallel inside: `auto_plan`). None: Ulysses over every rank
    when the heads allow it, else Ulysses as wide as they allow and ring for the rest, placed by
    an estimate. Text is parsed here; after construction it is a `Plan`, `"auto"` or None."""

    compile: bool = False
    """Compile the transformer's repeated blocks with `torch.compile` (regional compilation), the
    exchanges inside them as functional collectives so that a block compiles whole. Exact
    against eager within `verify`'s tolerance. With fixed exchanges and plans only: `auto`
    switches them between steps (each switch a recompilation), V-Major chooses tokens by data."""

    cache: CacheSpec | str | None = None
    """A step cache (LOSSY, cocodiff/engine/cache/): `fbcache`, `dbcache`, `taylorseer`, `teacache`,
    `magcache`, with settings (`dbcache:F1B0W2O1,0.2`; config/cache.py has the grammar); the middle
    blocks of a step are skipped when the last step did their work, decided by all ranks together. None: every block runs. Text is parsed here; after construction a `CacheSpec`."""

    wire: Wire | str | None = None
    """Wire formats per link level (LOSSY, config/wire.py): `node=fp8`, `node=fp8,card=bf16` (formats
    bf16, fp8, int8); the messages over a named level travel packed in its format, all others
    exactly; K stays at bf16 at least. None: every message exact. `--comm auto` and `--plan auto`
    never add one (only `--lossy-budget` lets `--comm auto` try one). Text is parsed here; after
    construction a `Wire` or None."""

    lossy_budget: LossyBudget | None = None
    """`--lossy-budget DB` (config/lossy_budget.py): `--comm auto` may also time its candidates with the
    wire format whose measured PSNR on the model meets the budget. None: auto is never lossy."""

    pipe_patches: int | str | None = None
    """Displaced patch pipelining (LOSSY, engine/patches.py): each step of a call cut into this many
    patches that follow each other through the pipeline stages, each attending to the last step's
    keys and values where this step's are not there yet; `auto`: twice the stages. None: off (the
    stages pass whole images, exact). Without `p` in the plan, the schedule runs on one stage (its
    reference)."""

    pipe_warmup: int = 1
    """With `pipe_patches`: the first steps run whole and exactly, filling the K/V buffers."""

    pipe_text: str = "whole"
    """With `pipe_patches`: the whole text carried and recomputed by every patch, its keys always
    fresh (`whole`), or the text stream cut into the patches like the image (`patched`: no token
    computed twice, but a text token sees the later patches' text one step old; several dB further
    from the exact run on the trained tiny-shapes, docs/usage.md)."""

    parallel_vae: str = "auto"
    """Patch-parallel VAE decode, and encode of an image input (engine/vae/kl2d.py, engine/vae/wan.py;
    exact): `on`, `off`, or
    `auto` (on for the 2D AutoencoderKL-style VAEs and the Wan video VAE where every rank's own
    rows are at least twice its halo)."""

    shard_weights: bool | str = False
    """Transformer weights sharded over each node's ranks (engine/shard.py, torch's FSDP2): every rank
    keeps 1/N of them and gathers a block's just before it runs, the next block's in flight.
    Exact. `on`/`off` as text are True/False; `auto`: on when the pipeline does not fit a device
    otherwise (run/load.py's memory check decides before `parallelize`; `parallelize` given `auto`
    alone leaves the weights whole). Not with `compile`."""

    attention_backend: str | None = None
    """The attention kernel: a backend of diffusers' attention dispatcher (`native`, `flash`,
    `_native_cudnn`, `sage`, ...; `auto`: `native`), engine/attention/backends.py. None: torch's SDPA
    as the processors call it. Exact within the kernels' rounding."""

    offload_text_encoders: bool | str = False
    """Text encoders off the device (engine/offload.py): the encoding rank keeps their weights on the host
    and streams each layer to the device as it runs; the other ranks free them. Exact. `on`/`off`
    as text are True/False; `auto`: on when the pipeline does not fit a device otherwise (the
    memory check of run/load.py decides after loading)."""

    @property
    def schedule(self) -> Schedule:
        """The V-Major schedule (`v_major`, typed as what it is after construction)."""
        assert isinstance(self.v_major, Schedule)
        return self.v_major

    @property
    def lossy(self) -> bool:
        """V-Major reuses projections, a step cache reuses blocks' residuals, or a wire format rounds values."""
        return (self.schedule.lossy or self.cache is not None or self.wire is not None or self.pipe_patches is not None
                or (self.lossy_budget is not None and self.lossy_budget.fmt is not None))

    def _check_stages(self, plan: Plan | None, what: str = "pipeline stages") -> None:
        """What pipeline stages (engine/stages.py) do not combine with yet, in one line each."""
        clashes = [
            *(["--cache"] if self.cache is not None else []),
            *(["--v-major"] if not self.v_major.off else []),
        ]
        if clashes:
            where = f"--plan {plan.short}: " if plan is not None else ""
            raise UsageError(f"{where}{what} do not combine with {', '.join(clashes)}; "
                             f"leave these options out")

    def _check_patches(self) -> None:
        """`--pipe-patches`, `--pipe-warmup` and `--pipe-text`, in one line each."""
        if self.pipe_text not in PATCH_TEXT:
            raise UsageError(f"--pipe-text {self.pipe_text!r} is not one of {', '.join(PATCH_TEXT)}")
        if self.pipe_warmup < 0:
            raise UsageError(f"--pipe-warmup {self.pipe_warmup} must be at least 0")
        if self.pipe_patches is None:
            return
        if isinstance(self.pipe_patches, str):
            text = self.pipe_patches.strip().lower()
            if text != AUTO and not digits(text):
                raise UsageError(f"--pipe-patches {self.pipe_patches!r} is neither a count nor auto")
            self.pipe_patches = AUTO if text == AUTO else int(text)
        if self.pipe_patches != AUTO and self.pipe_patches < 2:
            raise UsageError(f"--pipe-patches {self.pipe_patches} must be at least 2 (or auto); leave it out for whole images")
        plan = self.plan if isinstance(self.plan, Plan) else None
        others = [f"{axis} {getattr(plan, axis)}" for axis in ("cfg", "batch") if plan is not None and getattr(plan, axis) > 1]
        if others:
            raise UsageError(f"--plan {plan.short}: displaced patches (--pipe-patches) do not combine with the data "
                             f"axes ({', '.join(others)}); write a plan of p and u only")
        if self.plan == AUTO:
            raise UsageError("--pipe-patches needs a written plan (p, u); --plan auto does not time displaced patches")
        if plan is not None and plan.ring > 1:
            raise UsageError(f"--plan {plan.short}: displaced patches (--pipe-patches) do not combine with a ring; "
                             f"write a plan of p and u only")
        if plan is None or plan.pipe == 1:
            self._check_stages(plan, "displaced patches (--pipe-patches)")

    def __post_init__(self) -> None:
        if self.comm not in COMM_CHOICES:
            raise UsageError(f"--comm {self.comm!r} is not one of {', '.join(COMM_CHOICES)}")
        if isinstance(self.v_major, str):
            self.v_major = parse_schedule(self.v_major)
        if not isinstance(self.v_major, Schedule):
            raise UsageError(f"--v-major {self.v_major!r} is neither a schedule nor its text")
        if not self.v_major.off and self.comm not in ("flat", "tapa", "tapa-full"):
            raise UsageError(
                f"--v-major {self.v_major} needs an exchange whose inter-node part is known in advance: "
                f"use --comm tapa or flat, not {self.comm}"
            )
        if self.v_major_tensors not in ("v", "vqk"):
            raise UsageError(f"--v-major-tensors {self.v_major_tensors!r} is not one of v, vqk")
        if self.v_major_max_memory is not None and self.v_major_max_memory < 0:
            raise UsageError(f"--v-major-max-memory {self.v_major_max_memory} must be at least 0")
        if self.compile and (self.comm == "auto" or self.plan == AUTO or not self.v_major.off):
            what = "--comm auto" if self.comm == "auto" else "--plan auto" if self.plan == AUTO else f"--v-major {self.v_major}"
            raise UsageError(f"--compile runs fixed exchanges and plans; {what} switches them by timing or data between steps")
        if isinstance(self.cache, str):
            self.cache = parse_cache(self.cache)
        if self.cache is not None and not isinstance(self.cache, CacheSpec):
            raise UsageError(f"--cache {self.cache!r} is neither a cache spec nor its text")
        if self.lossy_budget is not None and self.comm != "auto":
            raise UsageError(f"--lossy-budget {self.lossy_budget.db:g}dB lets --comm auto try a wire format; "
                             f"with --comm {self.comm} name one with --wire")
        if isinstance(self.wire, str):
            self.wire = parse_wire(self.wire)
        if self.wire is not None and not isinstance(self.wire, Wire):
            raise UsageError(f"--wire {self.wire!r} is neither wire formats nor their text")
        if self.wire is not None and self.compile:
            raise UsageError(f"--wire {self.wire} does not combine with --compile (compiled blocks run exact exchanges)")
        if self.parallel_vae not in CHOICES:
            raise UsageError(f"--parallel-vae {self.parallel_vae!r} is not one of {', '.join(CHOICES)}")
        if isinstance(self.shard_weights, str):
            self.shard_weights = parse_choice("--shard-weights", self.shard_weights)
        if isinstance(self.offload_text_encoders, str):
            self.offload_text_encoders = parse_choice("--offload-text-encoders", self.offload_text_encoders)
        if self.shard_weights is True and self.compile:
            raise UsageError("--shard-weights on does not combine with --compile (compiled blocks would trace FSDP's gathers)")
        if self.v_first is None and self.comm != "auto":
            self.v_first = True
        if isinstance(self.plan, str):
            self.plan = AUTO if self.plan.strip().lower() == AUTO else parse_plan(self.plan)
        if self.plan not in (None, AUTO) and not isinstance(self.plan, Plan):
            raise UsageError(f"--plan {self.plan!r} is neither a plan nor its text")
        if isinstance(self.plan, Plan) and self.plan.pipe > 1:
            self._check_stages(self.plan)
        self._check_patches()
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UsageError(f"--ranks-per-node {self.ranks_per_node} must be at least 1")
        if isinstance(self.levels, str):
            self.levels = parse_levels(self.levels)
        inside = math.prod(size for _, size in self.levels[1:]) if self.levels is not None else None
        if inside is not None and self.ranks_per_node is not None and self.ranks_per_node != inside:
            raise UsageError(f"--ranks-per-node {self.ranks_per_node} disagrees with --levels {format_levels(self.levels)}")
        if self.wire is not None and (self.levels is not None or self.ranks_per_node is not None):
            self.wire.check([name for name, _ in self.levels] if self.levels is not None else ["node", "rank"])
