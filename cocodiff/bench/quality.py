"""`cocodiff bench quality`: what V-Major's schedules cost in fidelity and save in bytes.

One launch: the exact run (flat all-to-all), then each schedule (TAPA + V-Major) with the same
seed. Per schedule: PSNR, SSIM and MSE of the final image against the exact one (scikit-image),
relative L2 error of the final latents, relative error per step of the V rows that receivers
reused, the share of the exact run's inter-node projection bytes (V, Q, K) saved, and the cache
memory (largest rank). `off` is TAPA without V-Major and must match exactly; every other schedule
is labelled lossy.

Step caches (`--cache SPEC`, LOSSY, cocodiff/engine/cache/) run the same way, each as one more entry named
`cache=SPEC`: TAPA without V-Major, the cache on the transformer's blocks. Besides the image metrics
they report the transformer calls whose middle blocks ran (`computed_steps`) or were skipped
(`skipped_steps`, counted by the cache: true CFG's two calls of a step count as two) and
`skipped_share` = skipped / (computed + skipped). Their `inter_node_bytes_saved` is measured from the
exchange statistics, as V-Major's is: a skipped middle block sends no projections at all, so it is
the skipped share times the middle's share of the blocks' inter-node bytes. Their `cache_bytes` is
the step cache's memory (the residuals it keeps, largest rank).

Wire formats (`--wire SPEC[;SPEC...]`, LOSSY, config/wire.py) run the same way, each as the entry
`wire=SPEC`: TAPA with the messages over the named levels packed (`node=fp8`, `node=int8`,
`node=fp8,rank=bf16`; a bare format, `fp8`, is the slowest level's, as the variant suffix `+fp8`),
optionally stacked on a V-Major schedule written before a `+` (`linear+fp8`, `linear+node=int8`:
TAPA + V-Major + the wire). Their `inter_node_projection_bytes` are the packed bytes.

Displaced patch pipelining (`--patches SPEC[;SPEC...]`, LOSSY, engine/patches.py) runs the same way,
each as the entry `patches=M,warmup=K,text=T`: two pipeline stages outermost, Ulysses over each
stage's ranks (`patch_plan`: `p2u2` on 4 ranks, `p2u1` on 2), on a copy of the pipeline cut for
its stage. Its numbers depend on M, K and the text mode only, not on the ranks. Its plan sends
other messages than TAPA's (the stages hand on hidden states), so it reports no bytes saved
(None); its `cache_bytes` are the per-layer K/V buffers the patches attend to (largest rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from skimage.metrics import mean_squared_error, peak_signal_noise_ratio, structural_similarity

from ..engine.cache import CacheSpec, parse_cache
from ..engine.cache.steps import StepCache
from ..config.parallel import PATCH_TEXT, ParallelConfig
from ..errors import UsageError
from ..output.files import save_figure
from ..engine.parallelize import parallelize
from ..run.pipeline import run_pipeline
from ..run.load import load
from ..run.spec import GenerateSpec
from ..distributed.topology import Topology
from ..engine.vmajor import Schedule, parse_schedule
from ..config.wire import FORMATS, SLOWEST, Wire, parse_wire
from .a2a import run_header

__all__ = [
    "PatchEntry", "QualitySpec", "ScheduleRun", "WireEntry", "bytes_saved", "cache_figures", "grid", "grid_rows",
    "image_metrics", "parse_caches", "parse_patches", "parse_schedules", "parse_wires", "patch_plan", "quality_job",
    "quality_topology", "run_schedules",
]


def parse_schedules(text: str) -> list[Schedule]:
    """'off,linear,warmup:1,linear' -> the schedules off, linear, warmup:1,linear (each checked)."""
    names: list[str] = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        if token == "linear" and names and names[-1].startswith("warmup:") and not names[-1].endswith(",linear"):
            names[-1] += ",linear"
        else:
            names.append(token)
    if not names:
        raise UsageError("--schedules is empty")
    return [parse_schedule(name) for name in names]


def parse_caches(texts: list[str]) -> list[CacheSpec]:
    """Repeated `--cache` values, each maybe several specs separated by ';' -> the specs (each checked).

    ';' because a spec's own ':' and ',' separate its settings (`dbcache:F1B0W2,0.1`)."""
    specs = [parse_cache(t) for text in texts for t in text.split(";") if t.strip()]
    if texts and not specs:
        raise UsageError(f"--cache {';'.join(texts)!r} names no step cache")
    return specs


@dataclass(frozen=True)
class WireEntry:
    """One `--wire` entry: wire formats (LOSSY), on TAPA alone or stacked on a V-Major schedule."""

    text: str
    """As written: the entry's name is `wire=TEXT`."""
    wire: Wire
    schedule: Schedule | None = None

    @property
    def name(self) -> str:
        return f"wire={self.text}"


def parse_wires(texts: list[str]) -> list[WireEntry]:
    """Repeated `--wire` values, each maybe several entries separated by ';' -> the entries (each
    checked): `node=fp8`, `fp8` (the slowest level, as `+fp8`), `linear+fp8` (on a V-Major schedule)."""
    entries = []
    for text in (t.strip() for value in texts for t in value.split(";") if t.strip()):
        schedule, plus, wire = text.rpartition("+")
        wire = f"{SLOWEST}={wire}" if wire.strip() in FORMATS else wire
        parsed = parse_wire(wire)
        if parsed is None:
            raise UsageError(f"--wire {text!r} names no wire format (one of {', '.join(FORMATS)} on a level)")
        entries.append(WireEntry(text, parsed, parse_schedule(schedule.strip()) if plus else None))
    if texts and not entries:
        raise UsageError(f"--wire {';'.join(texts)!r} names no wire format")
    return entries


@dataclass(frozen=True)
class PatchEntry:
    """One `--patches` entry: displaced patch pipelining (LOSSY) on two pipeline stages."""

    count: int
    """M: patches per step (`--pipe-patches`)."""
    warmup: int
    """Steps run whole first (`--pipe-warmup`)."""
    text: str
    """The text stream whole with each patch, or cut into them (`--pipe-text`)."""

    @property
    def name(self) -> str:
        return f"patches={self.count},warmup={self.warmup},text={self.text}"


def _digits(text: str) -> int | None:
    """ASCII digits -> their number (`int()` takes other scripts' digits too), else None."""
    return int(text) if text.isascii() and text.isdigit() else None


def _patch_entry(text: str) -> PatchEntry:
    """`M[,warmup=K][,text=whole|patched]` -> the entry (settings left out: generate's defaults), or a
    one-line UsageError naming `text`."""
    count, *settings = (part.strip() for part in text.split(","))
    defaults = ParallelConfig()
    values = {"warmup": str(defaults.pipe_warmup), "text": defaults.pipe_text}
    for setting in settings:
        key, equals, value = (part.strip() for part in setting.partition("="))
        if not equals or key not in values:
            raise UsageError(f"--patches {text!r}: {setting!r} is not warmup=K or text={'|'.join(PATCH_TEXT)}")
        values[key] = value
    patches, warmup = _digits(count), _digits(values["warmup"])
    if patches is None or patches < 2:
        raise UsageError(f"--patches {text!r}: the patch count {count!r} is not a number of at least 2")
    if warmup is None:
        raise UsageError(f"--patches {text!r}: warmup={values['warmup']} is not a number of steps (0 or more)")
    if values["text"] not in PATCH_TEXT:
        raise UsageError(f"--patches {text!r}: text={values['text']} is not one of {', '.join(PATCH_TEXT)}")
    return PatchEntry(patches, warmup, values["text"])


def parse_patches(texts: list[str]) -> list[PatchEntry]:
    """Repeated `--patches` values, each maybe several specs separated by ';' -> the entries (each
    checked): `2`, `4,warmup=2,text=patched`."""
    entries = [_patch_entry(t.strip()) for value in texts for t in value.split(";") if t.strip()]
    if texts and not entries:
        raise UsageError(f"--patches {';'.join(texts)!r} names no patch count")
    names = [entry.name for entry in entries]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise UsageError(f"--patches {';'.join(texts)!r} names the entry {twice} twice")
    return entries


def patch_plan(ranks: int) -> str | None:
    """The plan of the `--patches` entries: two stages outermost, Ulysses inside (`p2u2` on 4
    ranks); on an odd count of ranks the default plan, the schedule on one stage (the same numbers)."""
    return f"p2u{ranks // 2}" if ranks % 2 == 0 else None


@dataclass(kw_only=True)
class QualitySpec:
    generate: GenerateSpec
    schedules: list[Schedule]
    tensors: str = "v"
    caches: list[CacheSpec] = field(default_factory=list)
    """Step caches (LOSSY), each one more entry `cache=SPEC`."""
    wires: list[WireEntry] = field(default_factory=list)
    """Wire formats (LOSSY), each one more entry `wire=SPEC`."""
    patches: list[PatchEntry] = field(default_factory=list)
    """Displaced patch settings (LOSSY), each one more entry `patches=M,warmup=K,text=T`."""


def _all_ranks_sum(value: float, topology: Topology, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=topology.device)
    dist.all_reduce(t, op=op, group=topology.world_group)
    return t.item()


def quality_topology(spec: Any) -> Topology:
    """This rank's topology for `spec` (a QualitySpec or an InpaintSpec). V-Major needs TAPA's
    inter-node phase, and step caches and wire formats count its bytes: 2+ nodes of 2+ ranks; the
    exact `off` and displaced patches alone run on any ranks."""
    topology = Topology.from_env(spec.generate.parallel.ranks_per_node)
    counts_bytes = any(s.lossy for s in spec.schedules) or spec.caches or spec.wires
    if counts_bytes and (topology.nodes < 2 or topology.ranks_per_node < 2):
        raise UsageError(
            f"V-Major acts on TAPA's inter-node phase: needs at least 2 nodes of at least 2 ranks, "
            f"not {topology.nodes} x {topology.ranks_per_node} (--nproc, --ranks-per-node)"
        )
    return topology


@dataclass
class ScheduleRun:
    """One schedule's run: its output and what it sent and kept (summed or maxed over the ranks)."""

    lossy: bool
    result: dict[str, Any]
    """`run_pipeline`'s result: image, latents, step times."""
    projection_bytes: int | None
    """Inter-node projection bytes (V, Q, K all-to-all in), all ranks; None: displaced patches (another plan's)."""
    cache_bytes: int
    """V-Major cache memory (a step cache's residuals, displaced patches' K/V buffers) of the largest rank."""
    step_rel_error: list[float]
    step_ratio: list[float]
    computed_steps: int | None = None
    """A step cache's transformer calls whose middle blocks ran (None: a V-Major schedule)."""
    skipped_steps: int | None = None
    """A step cache's transformer calls whose middle blocks were skipped."""


def cache_figures(computed: int, skipped: int) -> dict[str, float | int]:
    """A step cache's counts and the share of the transformer calls it skipped (0 with no call)."""
    calls = computed + skipped
    return {"computed_steps": computed, "skipped_steps": skipped, "skipped_share": skipped / calls if calls else 0.0}


def bytes_saved(projection_bytes: float | None, baseline_bytes: float) -> float | None:
    """The share of the exact TAPA run's inter-node projection bytes an entry did not send (0 when
    that run sends none: one node); None for displaced patches, whose plan sends other projections."""
    if projection_bytes is None:
        return None
    return 1.0 - projection_bytes / baseline_bytes if baseline_bytes else 0.0


def _step_cache_bytes(cache: StepCache) -> int:
    """What a step cache keeps after its run (`StepCache.kept_bytes`)."""
    return cache.kept_bytes()


def staged_pipe(gen: GenerateSpec, pipe: Any, spec: Any, topology: Topology) -> Any:
    """The pipeline `spec`'s patch entries run on: where their plan has stages, a copy of `pipe`
    (loaded as `gen` says), since a stage cuts the blocks it does not run for good."""
    return load(gen)[0] if spec.patches and patch_plan(topology.world_size) else pipe


def run_schedules(gen: GenerateSpec, pipe: Any, encoder: Any, topology: Topology, schedules: list[Schedule],
                  tensors: str, baseline_bytes: float | None = None, *,
                  caches: Sequence[CacheSpec] = (), wires: Sequence[WireEntry] = (),
                  patches: Sequence[PatchEntry] = (), staged: Any = None
                  ) -> tuple[dict[str, Any], dict[str, ScheduleRun], float]:
    """The exact run (flat), then each schedule (TAPA + V-Major), then each step cache (TAPA + the
    cache), then each wire entry (TAPA [+ V-Major] + the wire formats), then each patch entry (on
    `patch_plan`, run by `staged`: a copy of `pipe` its stages may cut for good) with the same seed
    and input.

    Returns the exact run's result, each schedule's run (by the name as written; a cache's is
    `cache=SPEC`) and the exact TAPA run's inter-node projection bytes, against which bytes saved are counted: the `off`
    schedule's, else `baseline_bytes` if given (an earlier measure of the same shapes), else one
    more run without V-Major.
    """

    def run(config: ParallelConfig, own: Any = pipe) -> tuple[dict[str, Any], Any]:
        parallel = parallelize(own, config, topology)
        result = run_pipeline(replace(gen), own, encoder, parallel)
        parallel.undo()
        return result, parallel

    rpn = topology.ranks_per_node
    exact, _ = run(ParallelConfig(comm="flat", ranks_per_node=rpn, v_first=gen.parallel.v_first))
    runs: dict[str, ScheduleRun] = {}
    entries = [(str(schedule), schedule, None) for schedule in schedules]  # the name as written
    entries += [(entry.name, entry.schedule or "off", entry.wire) for entry in wires]
    for name, schedule, wire in entries:
        config = ParallelConfig(comm="tapa", ranks_per_node=rpn, v_first=gen.parallel.v_first, v_major=schedule,
                                v_major_tensors=tensors, wire=wire)
        result, parallel = run(config)
        proj_bytes = _all_ranks_sum(parallel.stats.other_node_bytes["a2a_in"], topology)
        if config.schedule.off and wire is None:
            baseline_bytes = proj_bytes  # measured here, for these shapes
        vm = parallel.ctx.vmajor
        cache = _all_ranks_sum(vm.cache_bytes() if vm else 0, topology, dist.ReduceOp.MAX)
        runs[name] = ScheduleRun(
            lossy=config.lossy, result=result, projection_bytes=int(proj_bytes), cache_bytes=int(cache),
            step_rel_error=vm.step_errors() if vm else [], step_ratio=list(vm.ratios) if vm else [],
        )
    for cache_spec in caches:
        config = ParallelConfig(comm="tapa", ranks_per_node=rpn, v_first=gen.parallel.v_first, cache=cache_spec)
        result, parallel = run(config)
        cache = parallel.cache
        runs[f"cache={cache_spec}"] = ScheduleRun(
            lossy=config.lossy, result=result,
            projection_bytes=int(_all_ranks_sum(parallel.stats.other_node_bytes["a2a_in"], topology)),
            cache_bytes=int(_all_ranks_sum(_step_cache_bytes(cache), topology, dist.ReduceOp.MAX)),
            step_rel_error=[], step_ratio=[],
            computed_steps=cache.computed_steps, skipped_steps=cache.skipped_steps,  # agreed: the same on every rank
        )
    for entry in patches:
        config = ParallelConfig(ranks_per_node=rpn, v_first=gen.parallel.v_first, plan=patch_plan(topology.world_size),
                                pipe_patches=entry.count, pipe_warmup=entry.warmup, pipe_text=entry.text)
        result, parallel = run(config, pipe if staged is None else staged)
        buffers = _all_ranks_sum(parallel.ctx.patches.peak, topology, dist.ReduceOp.MAX)
        runs[entry.name] = ScheduleRun(lossy=config.lossy, result=result, projection_bytes=None,
                                       cache_bytes=int(buffers), step_rel_error=[], step_ratio=[])
    if baseline_bytes is None:  # no `off` run: measure the exact TAPA bytes for the ratio
        _, parallel = run(ParallelConfig(comm="tapa", ranks_per_node=rpn, v_first=gen.parallel.v_first))
        baseline_bytes = _all_ranks_sum(parallel.stats.other_node_bytes["a2a_in"], topology)
    return exact, runs, baseline_bytes


def image_metrics(reference: np.ndarray, image: np.ndarray) -> dict[str, float]:
    """PSNR (inf when equal), SSIM and MSE of `image` against `reference`, (H, W, 3) floats in [0, 1]."""
    return {
        "psnr": float(peak_signal_noise_ratio(reference, image, data_range=1.0)) if not np.array_equal(reference, image) else float("inf"),
        "ssim": float(structural_similarity(reference, image, data_range=1.0, channel_axis=2)),
        "mse": float(mean_squared_error(reference, image)),
    }


def quality_job(spec: QualitySpec) -> dict[str, Any] | None:
    gen = spec.generate
    pipe, encoder = load(gen)
    topology = quality_topology(spec)
    exact, runs, baseline_bytes = run_schedules(gen, pipe, encoder, topology, spec.schedules, spec.tensors,
                                                caches=spec.caches, wires=spec.wires, patches=spec.patches,
                                                staged=staged_pipe(gen, pipe, spec, topology))
    schedules: dict[str, dict[str, Any]] = {}
    images = {"exact (flat)": exact["image"]}
    for name, run in runs.items():
        image, reference = run.result["image"], exact["image"]
        latents, ref_latents = run.result["latents"].double(), exact["latents"].double()
        schedules[name] = {
            "lossy": run.lossy,
            **image_metrics(reference, image),
            "latent_rel_error": float((latents - ref_latents).norm() / ref_latents.norm()),
            "step_rel_error": run.step_rel_error,
            "step_ratio": run.step_ratio,
            "inter_node_projection_bytes": run.projection_bytes,
            "cache_bytes": run.cache_bytes,
            "inter_node_bytes_saved": bytes_saved(run.projection_bytes, baseline_bytes),
        }
        if run.computed_steps is not None:  # a step cache
            schedules[name].update(cache_figures(run.computed_steps, run.skipped_steps))
        images[f"{name}{' (lossy)' if run.lossy else ''}"] = image
    if topology.rank != 0:
        return None
    return {
        **run_header(gen, topology),
        "seed": gen.seed,
        "tensors": spec.tensors,
        "reference": "flat (exact)",
        **({"patch_plan": patch_plan(topology.world_size)} if spec.patches else {}),
        "schedules": schedules,
        "images": images,
    }


def grid(images: dict[str, np.ndarray], path: Path, title: str) -> None:
    """The images side by side in one row, each under its name."""
    grid_rows([images], path, title)


def grid_rows(rows: list[dict[str, np.ndarray]], path: Path, title: str) -> None:
    """One row of named images per entry of `rows` (the same names in every row), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), columns, figsize=(2.6 * columns, 0.4 + 2.6 * len(rows)), squeeze=False)
    for ax_row, images in zip(axes, rows):
        for ax, (name, image) in zip(ax_row, images.items()):
            ax.imshow(np.clip(image, 0, 1))
            ax.set_title(name, fontsize=8)
        for ax in ax_row:
            ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
