"""The paper's settings on Aurora, predicted, beside what the paper reports.

Settings (PAPER.md, "Evaluation in the paper"): FLUX.1-dev, SD3.5 Large, Qwen-Image and
FLUX.2-dev at 768^2, 1536^2 and 2304^2 on 1, 2, 4 and 8 Aurora nodes (12 tiles each), batch 1,
each model's default step count, against the flat baseline. Settings with more ranks than
attention heads run Ulysses x ring under the engine's default plan (the paper falls back to ring
attention there too); each row names its plan. A setting the engine cannot lay over the nodes
would be listed as not runnable and left out of the averages.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from .model import modelled_variants, table_rows
from .system import LinkParams, System
from .workload import MODELS, Workload

__all__ = ["PAPER_MODELS", "PAPER_NODES", "PAPER_REPORTED", "PAPER_RESOLUTIONS", "PAPER_VARIANTS", "paper_figures",
           "paper_table"]

PAPER_MODELS = ("flux1-dev", "sd35-large", "qwen-image", "flux2-dev")
PAPER_RESOLUTIONS = (768, 1536, 2304)
PAPER_NODES = (1, 2, 4, 8)
PAPER_VARIANTS = "flat,tapa,tapa+vfirst,cocodiff"

PAPER_REPORTED: dict[str, str] = {
    "average": "3.6x average end-to-end speedup",
    "peak": "8.4x peak (SD3.5, 2304^2, 4 nodes)",
    "tapa": "TAPA alone 2.2x (SD3.5 1536^2 ablation, unverified)",
    "ablation": "SD3.5 1536^2 (unverified): TAPA 2.2x, V-First 1.3x more, V-Major 2.9x more at scale",
    "single_node": "Single node: TAPA ~2.3x, all ~2.5x (unverified)",
    "multi_node": "multi-node: TAPA ~2.2x, all ~5.1x (unverified)",
    "comm_share": "all-to-alls take 64-96% of inference time for Qwen-Image 20B on Aurora (unverified)",
}
"""Quoted from PAPER.md (the paper as restated there)."""


def paper_table(system: System, params_for: Callable[[System], LinkParams], compute_scale: float = 1.0) -> dict[str, Any]:
    """Rows (with model and resolution), the settings not runnable, and a summary to set beside
    PAPER_REPORTED."""
    variants = modelled_variants(PAPER_VARIANTS)
    rows, skipped = [], []
    for name in PAPER_MODELS:
        model = MODELS[name]
        for res in PAPER_RESOLUTIONS:
            workload = Workload(model=model, height=res, width=res, steps=model.default_steps, dtype=model.default_dtype)
            got, missing = table_rows(workload, system, list(PAPER_NODES), variants, params_for, compute_scale)
            rows += [{"model": name, "resolution": res, **r} for r in got]
            skipped += [{"model": name, "resolution": res, **s} for s in missing]
    return {"rows": rows, "not_runnable": skipped, "summary": summarize(rows)}


def _speedups(rows: list[dict[str, Any]], variant: str, keep: Callable[[dict[str, Any]], bool] = lambda r: True) -> list[float]:
    return [r["speedup_vs_flat"] for r in rows if r["variant"] == variant and keep(r)]


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted counterparts of each reported figure (None where no setting is runnable)."""
    full = [r for r in rows if r["variant"] == "cocodiff"]
    peak = max(full, key=lambda r: r["speedup_vs_flat"], default=None)
    single, multi = (lambda r: r["nodes"] == 1), (lambda r: r["nodes"] > 1)
    ablation = {v: {r["nodes"]: r["speedup_vs_flat"] for r in rows
                    if r["model"] == "sd35-large" and r["resolution"] == 1536 and r["variant"] == v}
                for v in ("tapa", "tapa+vfirst", "cocodiff")}
    scale = max(ablation["cocodiff"], default=None)
    qwen_flat = [r["comm_share"] for r in rows if r["model"] == "qwen-image" and r["variant"] == "flat"]
    return {
        "average": _mean(_speedups(rows, "cocodiff")),
        "peak": peak["speedup_vs_flat"] if peak else None,
        "peak_at": f"{peak['model']} {peak['resolution']}^2, {peak['nodes']} node(s)" if peak else None,
        "tapa_average": _mean(_speedups(rows, "tapa")),
        "single_node": {"tapa": _mean(_speedups(rows, "tapa", single)), "all": _mean(_speedups(rows, "cocodiff", single))},
        "multi_node": {"tapa": _mean(_speedups(rows, "tapa", multi)), "all": _mean(_speedups(rows, "cocodiff", multi))},
        "ablation_sd35_1536": None if scale is None else {
            "nodes": scale,
            "tapa": ablation["tapa"][scale],
            "vfirst_more": ablation["tapa+vfirst"][scale] / ablation["tapa"][scale],
            "vmajor_more": ablation["cocodiff"][scale] / ablation["tapa+vfirst"][scale],
        },
        "qwen_flat_comm_share": [min(qwen_flat), max(qwen_flat)] if qwen_flat else None,
    }


def paper_figures(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's reported figures (PAPER.md) beside their predicted counterparts, one row each:
    {"figure", "predicted", "reported", "reason"}. `reason` says why a figure has no prediction;
    why a prediction differs from the paper is what the cost model does not yet explain (None)."""
    ablation = summary.get("ablation_sd35_1536") or {}
    pairs = [
        ("average speedup, all mechanisms", summary.get("average"), 3.6),
        ("peak speedup (SD3.5 2304^2, 4 nodes in the paper)", summary.get("peak"), 8.4),
        ("TAPA alone (SD3.5 1536^2 ablation)", ablation.get("tapa"), 2.2),
        ("V-First on top of TAPA (SD3.5 1536^2)", ablation.get("vfirst_more"), 1.3),
        ("V-Major on top of V-First at scale (SD3.5 1536^2)", ablation.get("vmajor_more"), 2.9),
        ("single node: TAPA", summary["single_node"]["tapa"], 2.3),
        ("single node: all mechanisms", summary["single_node"]["all"], 2.5),
        ("multi-node: TAPA", summary["multi_node"]["tapa"], 2.2),
        ("multi-node: all mechanisms", summary["multi_node"]["all"], 5.1),
    ]
    return [
        {"figure": figure, "predicted": predicted, "reported": reported,
         "reason": None if predicted is not None else "no runnable setting"}
        for figure, predicted, reported in pairs
    ]
