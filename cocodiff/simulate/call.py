"""One transformer call in the cost model: per attention layer its compute and the exposed time of
its exchanges, ring steps and the output's gather, on one placement (the formulas: model.py's
docstring). model.py sums calls into steps; stages.py runs one per pipeline stage and micro-batch.
"""

from __future__ import annotations

import math

import numpy as np

from ..config.plan import Plan
from ..config.variants import Variant
from ..config.wire import Wire, parse_wire
from ..errors import UsageError
from .network import PhaseLoad, phase_load, routing
from .placement import Placement
from .system import LinkParams, System
from .wire import WireCost, level_names, wire_cost
from .workload import LayerKind, Workload, split_sizes

__all__ = ["KEYS", "add_exposed", "cost_of", "layer_compute_s", "load", "nominal_compute_s", "one_call", "wire_of"]

INDEX_BYTES = 4


def _mean_kept(tokens: list[int], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: mean tokens sent per V-Major piece over the steps, and the mean index bytes."""
    kept, index = [], []
    for m in tokens:
        ks = [m] + [m - math.floor(i / steps * m) for i in range(1, steps)]
        kept.append(sum(ks) / steps)
        index.append(INDEX_BYTES * sum(ks[1:]) / steps)
    return np.array(kept), np.array(index)


def load(route, values: np.ndarray, cost: WireCost | None, extra: np.ndarray | float = 0.0) -> PhaseLoad:
    """One phase of `values` bytes (packed by `cost`, where a wire format applies) plus `extra`
    bytes sent as they are (V-Major's indices)."""
    if cost is None:
        return phase_load(route, values + extra)
    packed, codec_s = cost.apply(values)
    return phase_load(route, packed + extra, codec_s)


def _exchange(system: System, placement: Placement, variant: Variant, gathers: list[list[int]],
              scatters: list[list[int]], unit: float, selective: bool, steps: int,
              cost: WireCost | None = None) -> list[PhaseLoad]:
    """The phases of one exchange inside every Ulysses group (group g: gathers[g], scatters[g]);
    `cost`: the wire formats of its values."""
    route = routing(system)
    if variant.comm == "flat":
        return [load(route, T, cost) for T in placement.flat(gathers, scatters, unit)]
    kept = index = None
    if selective:
        kept, index = (list(x) for x in zip(*(_mean_kept(g, steps) for g in gathers)))
    if cost is None or index is None:
        phases = [load(route, T, cost) for T in placement.tapa(gathers, scatters, unit, kept, index)]
    else:  # the values packed, the indices as they are (unit 0: the indices alone)
        values, indices = placement.tapa(gathers, scatters, unit, kept), placement.tapa(gathers, scatters, 0.0, kept, index)
        phases = [load(route, T, cost, I) for T, I in zip(values, indices)]
    return [p for p in phases if not p.empty] or phases[:1]  # one group, or one rank per group: one phase


def layer_compute_s(workload: Workload, system: System, plan: Plan, compute_scale: float) -> list[float]:
    """Seconds of one layer of each kind of `workload.model.layers` on the slowest rank, at the
    measured profile's scale (what `+shard` hides a block's weight gathers behind)."""
    return [compute_scale * sum(nominal_compute_s(workload, kind, system, plan.ring, plan.sp)[x] for x in ("v", "qk", "rest"))
            for kind in workload.model.layers]


def nominal_compute_s(workload: Workload, kind: LayerKind, system: System, ring: int = 1,
                      ranks: int | None = None) -> dict[str, float]:
    """Seconds of one layer per call on the slowest rank of `ranks` sharing the sequence (default:
    all): v, qk, rest, overlap and attention (both part of rest)."""
    f = workload.flops(kind, ranks or system.ranks, ring)
    flops, memory = system.device.flops, system.device.memory_GBps * 1e9
    return {
        "v": f["v"] / flops,
        "qk": f["qk"] / flops + f["qk_bytes"] / memory,
        "rest": (f["attention"] + f["rest"]) / flops,
        "overlap": f["overlap"] / flops,
        "attention": f["attention"] / flops,
    }


def _times(phases: list[PhaseLoad], params: LinkParams) -> list[tuple[float, str]]:
    return [p.time(params) for p in phases]


def _ring_steps(workload: Workload, kind: LayerKind, placement: Placement, system: System,
                wire: Wire | None = None) -> list[PhaseLoad]:
    """Ring attention's R - 1 steps of one layer: K and V of a chunk's tokens for a rank's heads."""
    R, U = placement.ring, placement.ulysses
    chunks = workload.chunk_tokens(kind, placement.plan.sp, R, keys=True)
    heads = workload.head_split(U)
    unit = workload.call_batch * 2 * workload.model.head_dim * workload.item_bytes  # K and V, one token, one head
    blocks = np.outer(np.asarray(chunks, dtype=np.float64), np.asarray(heads, dtype=np.float64)) * unit  # (R, U)
    route = routing(system)
    cost = cost_of(wire, system, workload, workload.model.head_dim, {"k": 0.5, "v": 0.5})
    return [load(route, placement.ring_step(j, blocks), cost) for j in range(R - 1)]


def cost_of(wire: Wire | None, system: System, workload: Workload, block: int, tensors: dict[str, float]) -> WireCost | None:
    return None if wire is None else wire_cost(wire, system, routing(system), workload.item_bytes, block, tensors)


def wire_of(variant: Variant, system: System) -> Wire | None:
    """The variant's wire formats (`+fp8`, `--wire`), checked against the system's level names
    (simulate/wire.py: `node`, then the system's own); None: every message exact."""
    if variant.wire is None:
        return None
    wire = parse_wire(variant.wire)
    if wire is not None:
        try:
            wire.check(level_names(system))
        except UsageError as error:
            raise UsageError(f"variant {variant.name!r} on {system.name}: {error}") from None
    return wire


def _gathers(workload: Workload, placement: Placement, system: System) -> list[PhaseLoad]:
    """The output's all-gather at the transformer's exit, shards padded to the largest: over every
    rank of a data group, or inside each Ulysses group and then around the ring."""
    SP, R, U = placement.plan.sp, placement.ring, placement.ulysses
    row = workload.call_batch * workload.model.out_channels * workload.item_bytes  # one image token
    sizes = split_sizes(workload.image_tokens, SP)
    route = routing(system)
    if R == 1:
        return [phase_load(route, placement.ulysses_gather([row * max(sizes)]))] if SP > 1 else []
    chunks = [sizes[g * U : (g + 1) * U] for g in range(R)]
    return [phase_load(route, placement.ulysses_gather([row * max(c) for c in chunks])),
            phase_load(route, placement.ring_gather(row * max(sum(c) for c in chunks)))]


KEYS = ("compute", "exposed", "intra", "inter", "comm", "inter_bytes", "intra_bytes", "ring_exposed", "ring_hidden",
         "data_exposed", "shard_exposed", "shard_comm", "shard_bytes")


def one_call(workload: Workload, system: System, params: LinkParams, variant: Variant, placement: Placement,
              compute_scale: float, gathered: Workload | None = None, wire: Wire | None = None,
              gather: bool = True) -> dict[str, float]:
    """One transformer call of one data group (all groups at once), slowest rank. The output's
    sequence gather carries `gathered`'s batch (the whole batch, when the data groups' shards were
    gathered first), else the call's; `gather` False: none (a pipeline stage before the last)."""
    plan = placement.plan
    SP, R, U = plan.sp, plan.ring, plan.ulysses
    B, D, item = workload.call_batch, workload.model.head_dim, workload.item_bytes
    unit = B * D * item
    heads_split = workload.head_split(U)
    per_call = dict.fromkeys(KEYS, 0.0)
    for kind in workload.model.layers:
        c = {k: v * compute_scale for k, v in nominal_compute_s(workload, kind, system, R, SP).items()}
        per_call["compute"] += kind.count * (c["v"] + c["qk"] + c["rest"])
        if kind.cross == "local":  # every rank's own queries against the whole text: nothing sent
            continue
        split, keys = workload.token_split(kind, SP), workload.key_split(kind, SP)
        tokens = [split[g * U : (g + 1) * U] for g in range(R)]  # per Ulysses group, in member order
        heads = [heads_split] * R
        if kind.cross:  # V: the text; Q and K: the video's queries and the text's keys, one message
            kv = [keys[g * U : (g + 1) * U] for g in range(R)]
            qk_tokens, qk_unit = [[q + k for q, k in zip(qs, ks)] for qs, ks in zip(tokens, kv)], unit
        else:
            kv, qk_tokens, qk_unit = tokens, tokens, 2 * unit
        q_share = 0.5 if not kind.cross else sum(map(sum, tokens)) / max(1, sum(map(sum, qk_tokens)))
        costs = [cost_of(wire, system, workload, D, t) for t in ({"v": 1.0}, {"q": q_share, "k": 1 - q_share}, {"o": 1.0})]
        v_loads = _exchange(system, placement, variant, kv, heads, unit, variant.lossy, workload.steps, costs[0])
        qk_loads = _exchange(system, placement, variant, qk_tokens, heads, qk_unit, variant.v_major_tensors == "vqk",
                             workload.steps, costs[1])
        o_loads = _exchange(system, placement, variant, heads, tokens, unit, False, workload.steps, costs[2])
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
        per_call["exposed"] += kind.count * exposed
        per_call["intra"] += kind.count * (exposed * intra / comm if comm > 0 else 0.0)
        per_call["inter"] += kind.count * (exposed * (1 - intra / comm) if comm > 0 else 0.0)
        per_call["comm"] += kind.count * comm
        per_call["inter_bytes"] += kind.count * sum(p.inter_node_bytes for p in v_loads + qk_loads + o_loads)
        per_call["intra_bytes"] += kind.count * sum(p.intra_node_bytes for p in v_loads + qk_loads + o_loads)
        if R > 1:  # each step's hop flies while the current block's attention runs
            block = c["attention"] / R
            for step in _ring_steps(workload, kind, placement, system, wire):
                t, where = step.time(params)
                shown = max(0.0, t - block)
                per_call["exposed"] += kind.count * shown
                per_call[where] += kind.count * shown
                per_call["ring_exposed"] += kind.count * shown
                per_call["ring_hidden"] += kind.count * (t - shown)
                per_call["comm"] += kind.count * t
                per_call["inter_bytes"] += kind.count * step.inter_node_bytes
                per_call["intra_bytes"] += kind.count * step.intra_node_bytes
    for phase in _gathers(gathered or workload, placement, system) if gather else ():  # exposed: nothing runs beside it
        add_exposed(per_call, phase, params)
    return per_call


def add_exposed(per_call: dict[str, float], phase: PhaseLoad, params: LinkParams, key: str | None = None) -> None:
    t, where = phase.time(params)
    for k in ("exposed", "comm", where) + ((key,) if key else ()):
        per_call[k] += t
    per_call["inter_bytes"] += phase.inter_node_bytes
    per_call["intra_bytes"] += phase.intra_node_bytes
