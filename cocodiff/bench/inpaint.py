"""`cocodiff bench quality --task inpaint`: V-Major against ground truth, on held-out inpainting cases.

The paper measures quality on inpainting, against the ground-truth image. Here the cases are
tiny-shapes scenes that training never showed (`ShapesDataset(split="heldout")`: two objects in
an arrangement held out of training), drawn by the data module, so the ground truth is exact and
free. In each case one object is masked out (alternately the first and the second of the
caption): the mask is the object's bounding box, as the data's own renderer draws it, grown by
`MASK_MARGIN` pixels. The inpainting pipeline (`FluxInpaintPipeline` for tiny-shapes) then
redraws the masked region from the caption, from pure noise there (strength 1), keeping the rest.

Each case runs the exact run (flat) and every schedule (TAPA + V-Major) with the same seed (the
case's: `seed + index`), through `quality.run_schedules`. Per schedule, over the cases:

- against the exact run: PSNR, SSIM, MSE (as `bench quality` reports them);
- against the ground truth: PSNR, SSIM, MSE of the whole image (`psnr_gt`, `ssim_gt`, `mse_gt`)
  and of the masked box (`*_gt_masked`), and the same for the exact run itself, so a schedule's
  cost is `psnr_gt_delta` = its `psnr_gt` - the exact run's;
- whether the checker (cocodiff/models/shapes/check.py) finds the masked object's colour and shape in the
  regenerated image (`object_found_rate`), or its colour in any shape (`colour_found_rate`): the
  other object stays, and the two always differ in colour, so a find is the regenerated one;
- the inter-node projection bytes saved against the exact TAPA run, summed over the cases, and
  the largest cache;
- for a step cache (`--cache SPEC`, entry `cache=SPEC`): its computed and skipped transformer calls,
  summed over the cases, and the skipped share (see quality.py);
- for wire formats (`--wire SPEC`, entry `wire=SPEC`): the same figures, bytes as packed;
- for displaced patches (`--patches SPEC`, entry `patches=M,warmup=K,text=T`): the same figures but
  bytes saved (None: another plan, see quality.py), run on one copy of the pipeline cut for its stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..engine.cache import CacheSpec
from ..errors import UsageError
from ..run.inputs import ImageInput
from ..run.load import load
from ..run.spec import GenerateSpec
from ..models.shapes import check
from ..models.shapes.data import ShapesDataset, _coverage
from ..engine.vmajor import Schedule
from .a2a import run_header
from .quality import (
    PatchEntry,
    ScheduleRun,
    WireEntry,
    bytes_saved,
    cache_figures,
    image_metrics,
    patch_plan,
    quality_topology,
    run_schedules,
    staged_pipe,
)

__all__ = ["GRID_CASES", "InpaintCase", "InpaintSpec", "MASK_MARGIN", "STRENGTH", "heldout_cases", "inpaint_job"]

MODEL = "tiny-shapes"
"""The only model that knows the captions of the cases."""
MASK_MARGIN = 2
"""Pixels by which the mask's box extends past the masked object's (anti-aliased edges included)."""
STRENGTH = 1.0
"""The masked region is drawn from pure noise; outside it the pipeline keeps the image."""
GRID_CASES = 4
"""Cases shown in the grid PNG."""


@dataclass(frozen=True)
class InpaintCase:
    """One held-out scene with one object masked out."""

    index: int
    caption: str
    image: np.ndarray
    """(H, W, 3) uint8: the ground truth."""
    masked: int
    """Which object of the caption is masked out (0 or 1)."""
    box: tuple[int, int, int, int]
    """The mask: x0, y0, x1, y1 (x1, y1 exclusive)."""

    @property
    def mask(self) -> np.ndarray:
        """(H, W) uint8, 255 inside the box (repaint), 0 outside (keep)."""
        mask = np.zeros(self.image.shape[:2], dtype=np.uint8)
        x0, y0, x1, y1 = self.box
        mask[y0:y1, x0:x1] = 255
        return mask

    def crop(self, image: np.ndarray) -> np.ndarray:
        """The masked box of `image`."""
        x0, y0, x1, y1 = self.box
        return image[y0:y1, x0:x1]

    def source(self) -> ImageInput:
        return ImageInput(image=self.image, mask=self.mask, strength=STRENGTH, image_path=f"heldout case {self.index}",
                          mask_path=f"object {self.masked + 1} of {self.caption!r}")


def heldout_cases(count: int, seed: int = 0) -> list[InpaintCase]:
    """The first `count` held-out scenes of the data (seed `seed`), each with one object masked out."""
    data = ShapesDataset(seed, split="heldout")
    cases = []
    for index in range(count):
        scene, image = data.sample(index)
        masked = index % 2
        ys, xs = np.nonzero(_coverage(scene.objects[masked]) > 0)
        height, width = image.shape[:2]
        box = (max(int(xs.min()) - MASK_MARGIN, 0), max(int(ys.min()) - MASK_MARGIN, 0),
               min(int(xs.max()) + 1 + MASK_MARGIN, width), min(int(ys.max()) + 1 + MASK_MARGIN, height))
        cases.append(InpaintCase(index, scene.caption, image, masked, box))
    return cases


@dataclass(kw_only=True)
class InpaintSpec:
    generate: GenerateSpec
    """Model (tiny-shapes), steps, seed and the parallel flags (ranks per node, V-First)."""
    schedules: list[Schedule]
    tensors: str = "v"
    cases: int = 50
    grid_cases: int = GRID_CASES
    caches: list[CacheSpec] = field(default_factory=list)
    """Step caches (LOSSY), each one more entry `cache=SPEC`."""
    wires: list[WireEntry] = field(default_factory=list)
    """Wire formats (LOSSY), each one more entry `wire=SPEC` (quality.py)."""
    patches: list[PatchEntry] = field(default_factory=list)
    """Displaced patch settings (LOSSY), each one more entry `patches=M,warmup=K,text=T` (quality.py)."""

    def __post_init__(self) -> None:
        if self.generate.model != MODEL:
            raise UsageError(f"--task inpaint runs on {MODEL} (its held-out scenes are the cases), not {self.generate.model}")
        if self.cases < 1:
            raise UsageError(f"--cases {self.cases} must be at least 1")


def _against_truth(case: InpaintCase, image: np.ndarray) -> dict[str, float]:
    """Metrics of a regenerated image against the case's ground truth, whole and in the masked box."""
    truth = case.image.astype(np.float32) / 255.0
    whole = image_metrics(truth, image)
    box = image_metrics(case.crop(truth), case.crop(image))
    verdict = check.check(image, case.caption)
    return {
        **{f"{k}_gt": v for k, v in whole.items()},
        **{f"{k}_gt_masked": v for k, v in box.items()},
        "object_found": float(verdict.found[case.masked]),
        "colour_found": float(verdict.colour_found[case.masked]),
    }


def _mean_psnr(values: list[float]) -> tuple[float, int]:
    """(mean PSNR over the cases that differ, number of identical cases); inf when all are identical."""
    finite = [v for v in values if math.isfinite(v)]
    return (sum(finite) / len(finite) if finite else float("inf")), len(values) - len(finite)


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Means over the cases of each figure (PSNRs: see `_mean_psnr`); `*_found` become rates."""
    out: dict[str, float] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key.startswith("psnr"):
            out[key], identical = _mean_psnr(values)
            if key == "psnr":
                out["identical_cases"] = identical
        else:
            out[f"{key}_rate" if key.endswith("_found") else key] = float(np.mean(values))
    return out


def _case_rows(case: InpaintCase, exact: dict[str, Any], runs: dict[str, ScheduleRun]) -> dict[str, dict[str, float]]:
    """Per schedule ('' for the exact run): this case's figures."""
    rows = {"": _against_truth(case, exact["image"])}
    ref_latents = exact["latents"].double()
    for name, run in runs.items():
        latents = run.result["latents"].double()
        rows[name] = {
            **image_metrics(exact["image"], run.result["image"]),
            **_against_truth(case, run.result["image"]),
            "latent_rel_error": float((latents - ref_latents).norm() / ref_latents.norm()),
            "mean_step_ratio": float(np.mean(run.step_ratio)) if run.step_ratio else 0.0,
        }
    return rows


def _grid_row(case: InpaintCase, exact: dict[str, Any], runs: dict[str, ScheduleRun]) -> dict[str, np.ndarray]:
    truth = case.image.astype(np.float32) / 255.0
    masked = truth.copy()
    masked[case.mask > 0] = 0.5  # the region the pipeline redraws, in grey
    row = {f"ground truth {case.index}": truth, "mask": masked, "exact (flat)": exact["image"]}
    row.update({f"{name}{' (lossy)' if run.lossy else ''}": run.result["image"] for name, run in runs.items()})
    return row


def inpaint_job(spec: InpaintSpec) -> dict[str, Any] | None:
    """Every case, exact run and schedules, on every rank; rank 0 returns the figures (and grid rows)."""
    gen = spec.generate
    cases = heldout_cases(spec.cases)
    inpainting = replace(gen, source=cases[0].source())  # loads the inpainting pipeline
    pipe, encoder = load(inpainting)
    topology = quality_topology(spec)
    staged = staged_pipe(inpainting, pipe, spec, topology)
    rows: dict[str, list[dict[str, float]]] = {}
    totals: dict[str, list[float]] = {}  # per schedule: [projection bytes, exact TAPA bytes, largest cache, lossy]
    counts: dict[str, list[int]] = {}  # per step cache: [computed calls, skipped calls]
    grid: list[dict[str, np.ndarray]] = []
    baseline: float | None = None  # the exact TAPA run's bytes: the same shapes in every case
    for case in cases:
        case_gen = replace(gen, prompt=case.caption, seed=gen.seed + case.index, source=case.source())
        exact, runs, baseline = run_schedules(case_gen, pipe, encoder, topology, spec.schedules, spec.tensors, baseline,
                                              caches=spec.caches, wires=spec.wires, patches=spec.patches, staged=staged)
        for name, run in runs.items():
            total = totals.setdefault(name, [0.0, 0.0, 0.0, float(run.lossy)])
            total[0] = None if run.projection_bytes is None else total[0] + run.projection_bytes  # None: patches
            total[1] += baseline
            total[2] = max(total[2], run.cache_bytes)
            if run.computed_steps is not None:
                count = counts.setdefault(name, [0, 0])
                count[0] += run.computed_steps
                count[1] += run.skipped_steps
        if topology.rank != 0:
            continue
        for name, row in _case_rows(case, exact, runs).items():
            rows.setdefault(name, []).append(row)
        if len(grid) < spec.grid_cases:
            grid.append(_grid_row(case, exact, runs))
    if topology.rank != 0:
        return None
    exact_summary = _summary(rows.pop(""))
    schedules = {}
    for name, (proj, baseline, cache, lossy) in totals.items():
        figures = _summary(rows[name])
        schedules[name] = {
            "lossy": bool(lossy),
            **figures,
            "psnr_gt_delta": figures["psnr_gt"] - exact_summary["psnr_gt"],
            "inter_node_projection_bytes": None if proj is None else int(proj),
            "inter_node_bytes_saved": bytes_saved(proj, baseline),
            "cache_bytes": int(cache),
            **(cache_figures(*counts[name]) if name in counts else {}),
        }
    truth_found = [check.check(case.image, case.caption).found[case.masked] for case in cases]
    return {
        **run_header(gen, topology),
        "task": "inpaint",
        "seed": gen.seed,
        "tensors": spec.tensors,
        "strength": STRENGTH,
        "mask_margin": MASK_MARGIN,
        "cases": len(cases),
        "reference": "flat (exact); *_gt: the ground-truth image",
        "exact": exact_summary,
        **({"patch_plan": patch_plan(topology.world_size)} if spec.patches else {}),
        "ground_truth_object_found_rate": float(np.mean(truth_found)),
        "schedules": schedules,
        "case_list": [{"index": c.index, "caption": c.caption, "masked_object": c.masked, "box": list(c.box)} for c in cases],
        "grid": grid,
    }
