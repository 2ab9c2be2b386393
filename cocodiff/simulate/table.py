"""The simulator's table: each variant's prediction at each node count, beside flat's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..config.variants import Variant
from .model import FLAT, NotRunnable, Prediction, predict
from .system import LinkParams, System
from .workload import Workload

if TYPE_CHECKING:
    from .stages import StageOptions

__all__ = ["table_rows"]


def table_rows(
    workload: Workload,
    system: System,
    nodes: list[int],
    variants: list[Variant],
    params_for: Callable[[System], LinkParams],
    compute_scale: float = 1.0,
    stage_options: StageOptions | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, not_runnable): one row per node count and variant, with the speedup over flat (under
    the default plan, as bench e2e's baseline) at the same node count (flat is predicted as the
    baseline even when not asked for). Each row names its plan (`plan`, short form); rows with a
    ring add its exposed and hidden time (`ring_exposed_ms`, `ring_hidden_ms`), rows with data
    groups their output gathers (`data_gather_ms`), `+shard` rows their weight gathers
    (`shard_gather_bytes_per_step` received per rank, `shard_exposed_ms`, `shard_gather_ms`), pipeline stages and displaced
    patches their cut and schedule (`stage_blocks`, `stage_ms`, `bubble_ms`, `boundary_bytes`, ...: `_stage_keys`), and chosen
    or composite plans their description (`plan_description`)."""
    rows, skipped = [], []
    for n in nodes:
        at = system.with_nodes(n)
        params = params_for(at)
        try:
            base = predict(workload, at, params, FLAT, compute_scale)
        except NotRunnable as error:
            skipped.append({"nodes": n, "ranks": at.ranks, "reason": str(error)})
            continue
        for variant in variants:
            try:
                p = base if variant == FLAT else predict(workload, at, params, variant, compute_scale, stage_options)
            except NotRunnable as error:
                skipped.append({"nodes": n, "ranks": at.ranks, "variant": variant.name, "reason": str(error)})
                continue
            rows.append(_row(p, base))
    return rows, skipped


def _row(p: Prediction, base: Prediction) -> dict[str, Any]:
    row = {
        "nodes": p.nodes, "ranks": p.ranks, "variant": p.variant.name,
        "lossy": p.variant.lossy or p.variant.packed or p.variant.displaced,
        "step_ms": p.step_s * 1e3, "speedup_vs_flat": base.step_s / p.step_s,
        "compute_ms": p.compute_s * 1e3, "exposed_comm_ms": p.exposed_s * 1e3,
        "exposed_intra_ms": p.exposed_intra_s * 1e3, "exposed_inter_ms": p.exposed_inter_s * 1e3,
        "comm_share": p.exposed_s / p.step_s, "comm_ms_unhidden": p.comm_s * 1e3,
        "inter_node_bytes": p.inter_node_bytes, "intra_node_bytes": p.intra_node_bytes,
        "plan": p.plan.short,
    }
    if p.variant.packed:
        row.update(wire=p.variant.wire)
    if p.plan.ring > 1:
        row.update(ring_exposed_ms=p.ring_exposed_s * 1e3, ring_hidden_ms=p.ring_hidden_s * 1e3)
    if p.plan.cfg * p.plan.batch > 1:
        row.update(data_gather_ms=p.data_exposed_s * 1e3)
    if p.variant.shard:
        row.update(shard_gather_bytes_per_step=p.shard_gather_bytes, shard_exposed_ms=p.shard_exposed_s * 1e3,
                   shard_gather_ms=p.shard_comm_s * 1e3)
    if p.stages is not None:
        row.update(_stage_keys(p))
    if p.plan.ring > 1 or p.plan.cfg * p.plan.batch > 1 or p.plan.pipe > 1 or p.plan.reason:
        row.update(plan_description=p.plan.describe())
    return row


def _stage_keys(p: Prediction) -> dict[str, Any]:
    """A pipeline's cut and schedule (stages.py): blocks per stage, one micro-batch's time on each
    stage and across each boundary, each stage's busy share, the bubble, the boundary's bytes per
    link class and step; displaced patches their count, warm-up steps and text."""
    s = p.stages
    keys = {
        "stages": len(s.ranges), "stage_blocks": [list(r) for r in s.ranges], "stage_cut": s.cut,
        "micro_batches": s.micro_batches, "stage_ms": [t * 1e3 for t in s.stage_s], "stage_busy": list(s.busy),
        "hop_ms": [t * 1e3 for t in s.hop_s], "output_ms": s.output_s * 1e3, "bubble_ms": s.bubble_s * 1e3,
        "boundary_exposed_ms": s.boundary_exposed_s * 1e3, "boundary_comm_ms": s.boundary_comm_s * 1e3,
        "boundary_bytes": dict(s.boundary_bytes),
    }
    if s.patches is not None:
        keys.update(patches=s.patches, pipe_warmup=s.warmup, pipe_text=s.text)
    return keys
