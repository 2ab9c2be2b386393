"""The simulator's table: each variant's prediction at each node count, beside flat's."""

from __future__ import annotations

from typing import Any, Callable

from ..config.variants import Variant
from .model import FLAT, NotRunnable, Prediction, predict
from .system import LinkParams, System
from .workload import Workload

__all__ = ["table_rows"]


def table_rows(
    workload: Workload,
    system: System,
    nodes: list[int],
    variants: list[Variant],
    params_for: Callable[[System], LinkParams],
    compute_scale: float = 1.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, not_runnable): one row per node count and variant, with the speedup over flat (under
    the default plan, as bench e2e's baseline) at the same node count (flat is predicted as the
    baseline even when not asked for). Each row names its plan (`plan`, short form); rows with a
    ring add its exposed and hidden time (`ring_exposed_ms`, `ring_hidden_ms`), rows with data
    groups their output gathers (`data_gather_ms`), `+shard` rows their weight gathers
    (`shard_gather_bytes_per_step` received per rank, `shard_exposed_ms`, `shard_gather_ms`), and chosen or composite plans their
    description (`plan_description`)."""
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
                p = base if variant == FLAT else predict(workload, at, params, variant, compute_scale)
            except NotRunnable as error:
                skipped.append({"nodes": n, "ranks": at.ranks, "variant": variant.name, "reason": str(error)})
                continue
            rows.append(_row(p, base))
    return rows, skipped


def _row(p: Prediction, base: Prediction) -> dict[str, Any]:
    row = {
        "nodes": p.nodes, "ranks": p.ranks, "variant": p.variant.name, "lossy": p.variant.lossy or p.variant.packed,
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
    if p.plan.ring > 1 or p.plan.cfg * p.plan.batch > 1 or p.plan.reason:
        row.update(plan_description=p.plan.describe())
    return row
