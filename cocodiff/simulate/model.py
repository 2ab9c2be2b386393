"""The cost model: per-step latency of a variant on a system, from its workload.

Per attention layer and transformer call (times of the slowest rank):

    compute      c_v (V projection) + c_qk (Q/K projection, RMSNorm, RoPE) + c_rest (attention,
                 output projection, MLP): FLOPs / effective FLOP/s, norm and RoPE bytes / HBM
                 bandwidth, or a measured profile (all scaled so the step's compute matches)
    exchanges    V, then Q and K as one message (the engine's default), then the output O; each
                 flat (one phase) or TAPA (phase 1 inside a group, phase 2 between groups)

Exposed communication of the input exchanges:

    no V-First          V + QK                          (sent once V, Q and K are all computed)
    V-First, flat       max(V, c_qk) + QK - c_qk        V flies while Q and K are computed
    V-First, TAPA       max(V1, c_qk) + max(V2, QK1) + QK2 - c_qk
                        V's first phase overlaps Q/K compute; V's second phase (between groups)
                        runs at the same time as Q/K's first phase (inside groups); Q/K's second
                        phase waits for V's, as the engine issues them in that order

Output exchange: O, or with V-First max(0, O - c_overlap) where a block has independent work
(FLUX's single-stream MLP branch) that the engine runs while O travels. The final all-gather of
the output is exposed. Step = calls per step x (sum over layers of compute + exposed + gather).

V-Major (lossy): on TAPA's second phase only, V (and with `vqk` Q and K) sends per piece of M
tokens k_i = M - floor(r_i M) tokens plus 4 index bytes each at step i, r_i = i / steps, the
first step in full without indices (V-Major's `linear` schedule); bytes are averaged over the
steps. Intra-group bytes and the output exchange are always sent in full. The cost of choosing
the tokens (a top-k per piece) and the cache's memory are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import UsageError
from ..variants import Variant, parse_variants
from .network import PhaseLoad, gather_matrix, phase_load, routing, swap_matrix, tapa_matrices
from .system import LinkParams, System
from .workload import LayerKind, Workload, split_sizes

__all__ = ["FLAT", "NotRunnable", "Prediction", "check_modelled", "modelled_variants", "nominal_compute_s", "predict",
           "table_rows"]

INDEX_BYTES = 4
FLAT = Variant("flat")
"""The baseline every speedup is over."""


def check_modelled(variant: Variant) -> Variant:
    """`variant` if this cost model covers it; else a UsageError saying why (the names are those of
    cocodiff/variants.py, the same as `bench e2e`'s)."""
    if variant.plan is not None:
        raise UsageError(f"variant {variant.name!r}: plans are not modelled by simulate yet")
    if variant.baseline:
        raise UsageError(f"variant {variant.name!r}: diffusers' own Ulysses is measured by bench e2e, not modelled here")
    if variant.comm == "auto":
        raise UsageError(f"variant {variant.name!r}: auto chooses flat or tapa by a run-time measurement; "
                         f"simulate flat and tapa instead")
    if variant.lossy and variant.comm != "tapa":
        raise UsageError(f"variant {variant.name!r}: V-Major is modelled on TAPA's second phase only; use tapa as the base")
    return variant


def modelled_variants(text: str) -> list[Variant]:
    """'flat,tapa+vfirst,cocodiff' -> variants, each one the cost model covers."""
    return [check_modelled(v) for v in parse_variants(text)]


class NotRunnable(Exception):
    """A setting the engine cannot run (the message says why)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """One variant at one node count. Times are seconds per denoising step, bytes per step."""

    variant: Variant
    nodes: int
    ranks: int
    step_s: float
    compute_s: float
    exposed_s: float
    exposed_intra_s: float
    exposed_inter_s: float
    comm_s: float
    """All exchanges' time if none were hidden."""
    inter_node_bytes: float
    intra_node_bytes: float


def _mean_kept(tokens: list[int], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: mean tokens sent per V-Major piece over the steps, and the mean index bytes."""
    kept, index = [], []
    for m in tokens:
        ks = [m] + [m - math.floor(i / steps * m) for i in range(1, steps)]
        kept.append(sum(ks) / steps)
        index.append(INDEX_BYTES * sum(ks[1:]) / steps)
    return np.array(kept), np.array(index)


def _exchange(system: System, variant: Variant, gather: list[int], scatter: list[int], unit: float,
              selective: bool, steps: int) -> list[PhaseLoad]:
    route = routing(system)
    if variant.comm == "flat":
        return [phase_load(route, swap_matrix(gather, scatter, unit))]
    kept = index = None
    if selective:
        kept, index = _mean_kept(gather, steps)
    phases = [phase_load(route, T) for T in tapa_matrices(gather, scatter, unit, system.tapa_group, kept, index)]
    return [p for p in phases if not p.empty] or phases[:1]  # one group, or one rank per group: one phase


def nominal_compute_s(workload: Workload, kind: LayerKind, system: System) -> dict[str, float]:
    """Seconds of one layer per call on the slowest rank: v, qk, rest, overlap (part of rest)."""
    f = workload.flops(kind, system.ranks)
    flops, memory = system.device.flops, system.device.memory_GBps * 1e9
    return {
        "v": f["v"] / flops,
        "qk": f["qk"] / flops + f["qk_bytes"] / memory,
        "rest": (f["attention"] + f["rest"]) / flops,
        "overlap": f["overlap"] / flops,
    }


def _times(phases: list[PhaseLoad], params: LinkParams) -> list[tuple[float, str]]:
    return [p.time(params) for p in phases]


def predict(workload: Workload, system: System, params: LinkParams, variant: Variant, compute_scale: float = 1.0) -> Prediction:
    """Per-step latency of `variant`; raises NotRunnable beyond the Ulysses head limit.

    compute_scale multiplies the nominal compute times (a measured profile sets it).
    """
    P, heads = system.ranks, workload.model.heads
    if P > heads:
        raise NotRunnable(f"{P} ranks > {heads} attention heads: Ulysses cannot split the heads further "
                          f"(the paper falls back to ring attention there; not modelled)")
    B, D, item = workload.call_batch, workload.model.head_dim, workload.item_bytes
    unit = B * D * item
    heads_split = workload.head_split(P)
    per_call = dict(compute=0.0, exposed=0.0, intra=0.0, inter=0.0, comm=0.0, inter_bytes=0.0, intra_bytes=0.0)
    for kind in workload.model.layers:
        tokens = workload.token_split(kind, P)
        c = {k: v * compute_scale for k, v in nominal_compute_s(workload, kind, system).items()}
        v_loads = _exchange(system, variant, tokens, heads_split, unit, variant.lossy, workload.steps)
        qk_loads = _exchange(system, variant, tokens, heads_split, 2 * unit, variant.v_major_tensors == "vqk", workload.steps)
        o_loads = _exchange(system, variant, heads_split, tokens, unit, False, workload.steps)
        # (seconds, 'intra' | 'inter') per phase of V's, Q/K's and the output's exchange
        V, QK, out = _times(v_loads, params), _times(qk_loads, params), _times(o_loads, params)
        v, qk, o = (sum(t for t, _ in x) for x in (V, QK, out))
        if not variant.v_first:
            exposed_in = v + qk
        elif len(V) == 1 or len(QK) == 1:
            exposed_in = max(v, c["qk"]) + qk - c["qk"]
        else:
            exposed_in = max(V[0][0], c["qk"]) + max(V[1][0], QK[0][0]) + QK[1][0] - c["qk"]
        exposed_out = max(0.0, o - c["overlap"]) if variant.v_first else o
        exposed = exposed_in + exposed_out
        comm = v + qk + o
        intra = sum(t for x in (V, QK, out) for t, where in x if where == "intra")
        per_call["compute"] += kind.count * (c["v"] + c["qk"] + c["rest"])
        per_call["exposed"] += kind.count * exposed
        per_call["intra"] += kind.count * (exposed * intra / comm if comm > 0 else 0.0)
        per_call["inter"] += kind.count * (exposed * (1 - intra / comm) if comm > 0 else 0.0)
        per_call["comm"] += kind.count * comm
        per_call["inter_bytes"] += kind.count * sum(p.inter_node_bytes for p in v_loads + qk_loads + o_loads)
        per_call["intra_bytes"] += kind.count * sum(p.intra_node_bytes for p in v_loads + qk_loads + o_loads)
    if P > 1:  # the output's all-gather at the transformer's exit (shards padded to the largest)
        shard = B * max(split_sizes(workload.image_tokens, P)) * workload.model.out_channels * item
        gather = phase_load(routing(system), gather_matrix(P, shard))
        t, where = gather.time(params)
        per_call["exposed"] += t
        per_call["comm"] += t
        per_call[where] += t
        per_call["inter_bytes"] += gather.inter_node_bytes
        per_call["intra_bytes"] += gather.intra_node_bytes
    calls = workload.calls_per_step
    return Prediction(
        variant=variant, nodes=system.nodes, ranks=P,
        step_s=calls * (per_call["compute"] + per_call["exposed"]), compute_s=calls * per_call["compute"],
        exposed_s=calls * per_call["exposed"], exposed_intra_s=calls * per_call["intra"],
        exposed_inter_s=calls * per_call["inter"], comm_s=calls * per_call["comm"],
        inter_node_bytes=calls * per_call["inter_bytes"], intra_node_bytes=calls * per_call["intra_bytes"],
    )


def table_rows(
    workload: Workload,
    system: System,
    nodes: list[int],
    variants: list[Variant],
    params_for: Callable[[System], LinkParams],
    compute_scale: float = 1.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, not_runnable): one row per node count and variant, with the speedup over flat at the
    same node count (flat is predicted as the baseline even when not asked for)."""
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
            p = base if variant == FLAT else predict(workload, at, params, variant, compute_scale)
            rows.append({
                "nodes": n, "ranks": p.ranks, "variant": variant.name, "lossy": variant.lossy,
                "step_ms": p.step_s * 1e3, "speedup_vs_flat": base.step_s / p.step_s,
                "compute_ms": p.compute_s * 1e3, "exposed_comm_ms": p.exposed_s * 1e3,
                "exposed_intra_ms": p.exposed_intra_s * 1e3, "exposed_inter_ms": p.exposed_inter_s * 1e3,
                "comm_share": p.exposed_s / p.step_s, "comm_ms_unhidden": p.comm_s * 1e3,
                "inter_node_bytes": p.inter_node_bytes, "intra_node_bytes": p.intra_node_bytes,
            })
    return rows, skipped
