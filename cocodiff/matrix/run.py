"""Running the matrix: every cell's expected outcome, its refusal or its ranks, and its verdict.

A refusal is checked where a user meets it: `verify`'s own command line, parsed and resolved
(`run.spec.resolve_spec`) before any rank starts. The cells that run are grouped by world size,
one launch each (`matrix.job`), every model's cells in a row; a launch that fails names its cell
and the rest of its cells run in a new launch. The one-process references are computed once per
request and shared by the launches.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.env import CACHE_DIR_ENV, COMPILE_BACKEND_ENV
from ..config.plan import AUTO, default_plan, parse_plan
from ..errors import RunFailed, UsageError
from ..models.lora import make_adapter
from ..engine.families.pipelines import AUDIO_PIPELINES, NEEDS_REFERENCE
from ..models.presets import PRESETS, load_pipeline, makes_video, pipeline_class, refusal
from ..run.launch import RankError, run_ranks
from ..run.spec import GenerateSpec, resolve_spec
from .cells import (
    EXACT,
    LOSSY,
    LOSSY_MOVED,
    Feature,
    animates,
    cell_args,
    cell_size,
    missing_evidence,
    node_bytes,
)
from .job import matrix_job

__all__ = ["Cell", "run_matrix"]

REFUSED = "refused"
NA = "n/a"
"""A cell whose column means nothing for its model (`Feature.applies`): nothing runs."""


@dataclass
class Cell:
    model: str
    feature: Feature
    args: list[str]
    expected: str
    """'exact', 'lossy', 'refused' or 'n/a'."""
    reason: str | None = None
    """What the declared refusal says (a part of its line); n/a: why the column means nothing here."""
    outcome: str | None = None
    """What happened: 'exact', 'lossy', 'refused', 'n/a' (nothing ran), or 'failed'."""
    record: dict[str, Any] = field(default_factory=dict)
    message: str | None = None
    """The refusal's line, or why the cell failed."""

    @property
    def passed(self) -> bool:
        return self.outcome == self.expected and not (self.expected == REFUSED and self.reason not in (self.message or ""))

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "feature": self.feature.name, "expected": self.expected, "outcome": self.outcome,
                "passed": self.passed, "message": self.message, "args": self.args, **self.record}


def _expected(model: str, feature: Feature) -> tuple[str, str | None]:
    """The declared outcome of a cell, and a refusal's reason: the feature's (by the model's kind) or
    the family's or preset's (`models.presets.refusal`, for what the feature needs)."""
    if feature.applies is not None and (why := feature.applies(model)):
        return NA, why
    kind = "i2v" if animates(model) else "video" if makes_video(model) else "image"
    batch = "--batch" in feature.args and int(feature.args[feature.args.index("--batch") + 1]) > 1
    more = {*(("batch",) if batch else ()), *(("ring",) if _rings(model, feature) else ())}
    reason = feature.refused.get(kind) or refusal(model, {*feature.needs, *more})
    return (REFUSED, reason) if reason else (feature.kind, None)


def _rings(model: str, feature: Feature) -> bool:
    """Whether the cell's plan has a ring: its `--plan` says so, or with none its ranks are more than
    the model's heads (the default plan puts a ring past them)."""
    if "--plan" in feature.args:
        text = feature.args[feature.args.index("--plan") + 1]
        return text != AUTO and parse_plan(text).ring > 1
    return default_plan(feature.nproc, PRESETS[model].heads).ring > 1


def _pictures(folder: Path, height: int, width: int) -> dict[str, str]:
    """An image (shapes on a background), a second one (an edit's second reference) and an
    inpainting mask (a white square) of this size."""
    from PIL import Image, ImageDraw

    image, mask = Image.new("RGB", (width, height), (40, 90, 160)), Image.new("L", (width, height), 0)
    ImageDraw.Draw(image).ellipse((width // 8, height // 8, width // 2, height // 2), fill=(220, 40, 30))
    image2 = Image.new("RGB", (width, height), (230, 220, 200))
    ImageDraw.Draw(image2).rectangle((width // 3, height // 4, width - 4, height - 4), fill=(30, 150, 60))
    ImageDraw.Draw(mask).rectangle((width // 2, height // 2, width - 1, height - 1), fill=255)
    paths = {"image": folder / f"image-{height}x{width}.png", "image2": folder / f"image2-{height}x{width}.png",
             "mask": folder / f"mask-{height}x{width}.png"}
    image.save(paths["image"])
    image2.save(paths["image2"])
    mask.save(paths["mask"])
    return {k: str(v) for k, v in paths.items()}


def _adapter(folder: Path, model: str) -> str:
    """A LoRA of `model`'s transformer (models/lora.py), where its pipeline loads one (else a name
    its refusal comes before)."""
    path = folder / f"lora-{model}"
    if refusal(model, {"lora"}) is None and not path.is_dir():
        pipe, _ = load_pipeline(model)
        make_adapter(pipe, path)
    return str(path)


def plan_cells(models: list[str], features: list[Feature], folder: Path) -> list[Cell]:
    """Every (model, feature) cell with its command line and declared outcome; the input pictures
    of img2img and inpainting written to `folder`."""
    cells = []
    for model in models:
        preset = PRESETS[model]
        size = cell_size(preset.pixel_multiple, makes_video(model), animates(model), (preset.frame_limits or (None,))[0])
        files = _pictures(folder, size[0], size[1])
        if any("{lora}" in arg for feature in features for arg in feature.args):
            files["lora"] = _adapter(folder, model)
        for feature in features:
            expected, reason = _expected(model, feature)
            cells.append(Cell(model, feature, cell_args(model, feature, size, files), expected, reason))
    return cells


def _resolve(cell: Cell, parse: Callable[[list[str]], Any]) -> GenerateSpec | None:
    """The cell's spec, or None with the cell refused (one line) as `verify` would refuse it."""
    try:
        return resolve_spec(parse(["verify", *cell.args]))
    except UsageError as error:
        cell.outcome, cell.message = REFUSED, str(error)
        if "\n" in cell.message:
            cell.outcome = "failed"
            cell.message = f"a refusal of more than one line: {cell.message!r}"
        return None


def _verdict(cell: Cell, record: dict[str, Any], cells: list[Cell]) -> None:
    """What a cell that ran shows: exact within tolerance, lossy within its floor having saved
    something, either with the evidence of its feature in effect (`cells.missing_evidence`), or
    failed (and why)."""
    cell.record = record
    if not record["ok"]:
        cell.outcome = "failed"
        cell.message = (f"max relative difference {record['max_rel_diff']:.2e} over the tolerance {record['tolerance']:.0e}"
                        if record["psnr_floor"] is None else f"PSNR {record['psnr']:.1f} dB under the floor {record['psnr_floor']:g} dB")
        return
    cell.outcome = EXACT if record["psnr_floor"] is None else LOSSY
    saved = _saved(cell, record, cells)
    record["saved"] = saved
    if cell.outcome == LOSSY and cell.feature.saves and not saved and _measured(cell, cells):
        cell.outcome, cell.message = "failed", "LOSSY but saved nothing"
        return
    others = {c.feature.name: c.record for c in cells if c.model == cell.model and c.record and c is not cell}
    unmoved = PRESETS[cell.model].unmoved if cell.model in PRESETS else ""
    missing = missing_evidence(cell.feature, record, others, unmoved=bool(unmoved))
    if missing is None and cell.outcome == LOSSY and unmoved and record["latent_rel_diff"] < LOSSY_MOVED:
        cell.message = f"{cell.model}: latents unmoved: {unmoved}"  # a note beside the figures
    if missing is None and animates(cell.model) and (record.get("image_input") or {}).get("task") != "i2v":
        missing = "the clip was not animated from the image"
    elif missing is None and pipeline_class(cell.model) in NEEDS_REFERENCE and not record.get("reference_tokens"):
        missing = "no reference tokens joined the sequence"
    if missing is None and pipeline_class(cell.model) in AUDIO_PIPELINES and not (record.get("audio") or {}).get("scale"):
        missing = "the soundtrack was not compared"
    if missing is not None:
        cell.outcome, cell.message = "failed", f"{cell.outcome}, but not in effect: {missing}"


def _saved(cell: Cell, record: dict[str, Any], cells: list[Cell]) -> float | None:
    """The share of steps skipped, or of inter-node bytes saved against the baseline column."""
    if cell.feature.saves == "steps" and record.get("cache"):
        computed, skipped = record["cache"]["computed_steps"], record["cache"]["skipped_steps"]
        return skipped / (computed + skipped) if skipped else None
    if cell.feature.saves == "bytes":
        base = next((c for c in cells if c.model == cell.model and c.feature.name == cell.feature.baseline and c.record), None)
        if base is None:
            return None
        sent, before = node_bytes(record), node_bytes(base.record)
        return 1 - sent / before if before and sent < before else None
    return None


def _measured(cell: Cell, cells: list[Cell]) -> bool:
    """Whether what a LOSSY cell saved can be told: steps always, bytes against its baseline
    column when that ran (`--features` may leave it out)."""
    if cell.feature.saves != "bytes":
        return True
    return any(c.model == cell.model and c.feature.name == cell.feature.baseline and c.record for c in cells)


def _launch(group: list[tuple[Cell, GenerateSpec]], timeout_s: float, out_dir: Path, references: Path) -> None:
    """Run the cells of one world size; a failed launch fails its cell and the rest go on."""
    while group:
        named = [(f"{i:03d}", spec, cell.feature.runs) for i, (cell, spec) in enumerate(group)]
        for path in out_dir.glob("*.json"):
            path.unlink()
        try:
            run_ranks(matrix_job, group[0][0].feature.nproc, named, out_dir, references, timeout_s=timeout_s)
            failure = None
        except (RankError, RunFailed, UsageError) as error:
            lines = [line for line in str(error).strip().splitlines() if line.strip()]
            failure = lines[-1] if lines else type(error).__name__
        done = 0
        for (cell, _spec), (name, *_rest) in zip(group, named):
            path = out_dir / f"{name}.json"
            if not path.is_file():
                break
            cell.record = json.loads(path.read_text())
            done += 1
        if failure is None and done == len(group):
            return
        failed = group[min(done, len(group) - 1)][0]  # the cell that ran when the launch failed
        failed.outcome, failed.message = "failed", failure or "no record"
        group = group[done + 1:]


@contextmanager
def _environment(folder: Path, compile_backend: str | None) -> Iterator[None]:
    """What the ranks inherit: a cache folder of the run's own (magcache
    calibrates in its first run of a cell), and `--compile`'s backend (None: torch's inductor)."""
    values = {CACHE_DIR_ENV: str(folder / "cache"), COMPILE_BACKEND_ENV: compile_backend}
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is not None:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_matrix(cells: list[Cell], parse: Callable[[list[str]], Any], timeout_s: float = 120.0,
               compile_backend: str | None = None, report: Callable[[str], None] = print) -> float:
    """Run every cell (refusals first, then the launches) with `parse` the CLI's parser; return the
    wall time in seconds."""
    started = time.perf_counter()
    for cell in cells:
        if cell.expected == NA:
            cell.outcome, cell.message = NA, cell.reason
    runnable = [(cell, spec) for cell in cells if cell.outcome is None and (spec := _resolve(cell, parse)) is not None]
    groups: dict[int, list[tuple[Cell, GenerateSpec]]] = {}
    for cell, spec in runnable:
        groups.setdefault(cell.feature.nproc, []).append((cell, spec))
    with tempfile.TemporaryDirectory(prefix="cocodiff-matrix-") as tmp, _environment(Path(tmp), compile_backend):
        references = Path(tmp) / "references"
        references.mkdir()
        for nproc, group in sorted(groups.items()):
            began = time.perf_counter()
            _launch(group, timeout_s, Path(tmp), references)
            report(f"{nproc} ranks: {len(group)} cells of {len({c.model for c, _ in group})} models "
                   f"in {time.perf_counter() - began:.0f} s")
    for cell in cells:
        if cell.record and cell.outcome is None:
            _verdict(cell, cell.record, cells)
    return time.perf_counter() - started
