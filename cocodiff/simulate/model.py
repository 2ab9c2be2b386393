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

Plans (config/plan.py, placement.py): with more ranks than heads, or a variant written `PLAN:COMM`, the
ranks run cfg x batch x ring x Ulysses. CFG and batch axes cut the work into data groups
(`data_shares`: images or CFG branches per group, calls per step), each running the rest of the
plan below on its own ranks at the same time; one gather of the output per call joins them
(exposed: the pipeline needs it before the next call), on each rank's sequence shard before the
sequence gather, which then carries the whole batch (as the engine does, engine/data_parallel.py). `auto` is the engine's `--plan auto`
(plan.auto_plan). The exchanges above run inside each Ulysses group (all groups at once:
one traffic matrix per phase), the attention covers the group's chunk of queries, and between
the input and output exchanges ring attention takes R - 1 steps, each one traffic matrix (every
rank sends its K/V block to the next ring rank) overlapped with one block's attention (the
layer's attention / R):

    ring exposed    sum over steps of max(0, hop_j - c_attention / R)
    ring hidden     sum over steps of min(hop_j, c_attention / R)

TAPA's phases inside a Ulysses group, and V-Major on its second phase, are placement.py's; ring
blocks always travel in full. The output gather runs inside each Ulysses group, then around the
ring, as the engine does: two exposed phases, not one gather over all P (the same bytes in total,
not over the same links). No plan given: `default_plan(ranks, heads, ranks_per_node)`, the
engine's own choice (a written plan is checked as the engine checks it: a one-line error).

V-Major (lossy): on TAPA's second phase only, V (and with `vqk` Q and K) sends per piece of M
tokens k_i = M - floor(r_i M) tokens plus 4 index bytes each at step i, r_i = i / steps, the
first step in full without indices (V-Major's `linear` schedule); bytes are averaged over the
steps. Intra-group bytes and the output exchange are always sent in full. The cost of choosing
the tokens (a top-k per piece) and the cache's memory are not modelled.

Sharded weights (`+shard`): every call also all-gathers each block's weights inside each node, the
next block's behind the current block's compute (engine/shard.py's model); the exposed time adds to the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..errors import UsageError
from ..config.plan import Plan, auto_plan, default_plan, inter_node_shards, parse_plan
from ..config.variants import Variant, parse_variants
from ..config.wire import Wire, parse_wire
from .network import PhaseLoad, phase_load, routing
from .placement import Placement, Unplaceable, place
from .shard import add_weight_gathers
from .system import LinkParams, System
from .wire import WireCost, level_names, wire_cost
from .workload import LayerKind, Workload, split_sizes

__all__ = ["FLAT", "NotRunnable", "Prediction", "Share", "check_modelled", "data_shares", "modelled_variants",
           "nominal_compute_s", "predict", "resolve_plan", "wire_of"]

INDEX_BYTES = 4
FLAT = Variant("flat")
"""The baseline every speedup is over."""


def check_modelled(variant: Variant) -> Variant:
    """`variant` if this cost model covers it; else a UsageError saying why (the names are those of
    cocodiff/config/variants.py, the same as `bench e2e`'s)."""
    if variant.plan not in (None, "auto") and parse_plan(variant.plan).pipe > 1:
        raise UsageError(f"variant {variant.name!r}: pipeline stages are measured by bench e2e, not modelled here yet")
    if variant.baseline:
        raise UsageError(f"variant {variant.name!r}: diffusers' own Ulysses is measured by bench e2e, not modelled here")
    if variant.comm == "auto":
        raise UsageError(f"variant {variant.name!r}: auto chooses flat or tapa by a run-time measurement; "
                         f"simulate flat and tapa instead")
    if variant.comm == "tapa-full":
        raise UsageError(f"variant {variant.name!r}: the model's TAPA is two phases (inside a node's fast level, then "
                         f"across); full-depth TAPA is measured by bench, not modelled")
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
    plan: Plan | None = None
    """The plan it runs under (placement included)."""
    ring_exposed_s: float = 0.0
    """Ring attention's K/V transfers not hidden behind attention (part of `exposed_s`)."""
    ring_hidden_s: float = 0.0
    """Ring attention's K/V transfers hidden behind attention (not in `exposed_s`)."""
    data_exposed_s: float = 0.0
    """The data groups' output gathers (CFG, batch; part of `exposed_s`)."""
    shard_gather_bytes: float = 0.0
    """`+shard`: bytes one rank receives per step from the weights' all-gathers (not in `intra_node_bytes`)."""
    shard_exposed_s: float = 0.0
    """`+shard`: the weights' all-gathers not hidden behind compute (part of `exposed_s`)."""
    shard_comm_s: float = 0.0
    """`+shard`: the weights' all-gathers if none were hidden (part of `comm_s`)."""


def resolve_plan(workload: Workload, system: System, variant: Variant) -> Plan:
    """The variant's written plan, the engine's `--plan auto` (plan.auto_plan: from the guidance,
    the images, the heads and the ranks per node), or with no plan the engine's default for these
    ranks and heads; checked against both (a one-line UsageError naming the variant and the ranks)."""
    P, heads = system.ranks, workload.model.heads
    check_modelled(variant)
    if variant.plan == "auto":
        guided = workload.cfg and workload.model.cfg != "none"
        plan = auto_plan(P, heads, system.ranks_per_node, cfg=guided, images=workload.batch)
    elif variant.plan is None:
        plan = default_plan(P, heads, system.ranks_per_node)
    else:
        plan = parse_plan(variant.plan)
    try:
        plan.check(P, heads)
        if workload.model.even_heads:
            plan = _even_heads(plan, workload.model.name, heads, system, written=variant.plan not in (None, "auto"))
    except UsageError as error:
        raise UsageError(f"variant {variant.name!r} on {system.nodes} node(s) x {system.ranks_per_node}: {error}") from None
    return plan


def _even_heads(plan: Plan, model: str, heads: int, system: System, written: bool) -> Plan:
    """For a model whose attention splits the heads evenly (`ModelSpec.even_heads`): `plan` if its
    Ulysses degree divides the heads; else a written plan is a one-line UsageError naming the degrees
    that do, and a chosen one becomes the widest such Ulysses degree of its sequence ranks, ring for
    the rest, the ring inside the nodes or across them: of the placements the nodes allow, the one
    that sends fewer bytes between nodes (plan.inter_node_shards; the data axes stay outermost)."""
    if heads % plan.ulysses == 0:
        return plan
    sp = plan.sp
    dividing = [d for d in range(1, heads + 1) if heads % d == 0]
    if written:
        raise UsageError(f"--plan {plan.short}: Ulysses degree {plan.ulysses} does not divide the {heads} attention heads "
                         f"of {model} (its layer splits heads evenly); Ulysses degrees {', '.join(map(str, dividing))}, "
                         f"ring for the rest")
    ulysses = max(d for d in dividing if sp % d == 0)
    data = {"cfg": plan.cfg, "batch": plan.batch}
    inside, across = (Plan(**data, ring=sp // ulysses, ulysses=ulysses, order=("cfg", "batch") + o)
                      for o in (("ring", "ulysses"), ("ulysses", "ring")))
    costs = [inter_node_shards(p, system.ranks_per_node) for p in (inside, across)]
    ranked = [across, inside] if costs[1] < costs[0] else [inside, across]
    chosen = next((p for p in ranked if _placeable(p, system)), ranked[0])
    why = (f"{heads} heads split evenly: Ulysses {ulysses} (the widest degree dividing {sp} sequence ranks and the heads), "
           f"ring {sp // ulysses}; estimated inter-node traffic per rank and layer {costs[0]:.2f} shards ({inside.short}) "
           f"vs {costs[1]:.2f} ({across.short})")
    return replace(chosen, reason=why)


def _placeable(plan: Plan, system: System) -> bool:
    try:
        place(plan, system)
    except Unplaceable:
        return False
    return True


def _mean_kept(tokens: list[int], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: mean tokens sent per V-Major piece over the steps, and the mean index bytes."""
    kept, index = [], []
    for m in tokens:
        ks = [m] + [m - math.floor(i / steps * m) for i in range(1, steps)]
        kept.append(sum(ks) / steps)
        index.append(INDEX_BYTES * sum(ks[1:]) / steps)
    return np.array(kept), np.array(index)


def _load(route, values: np.ndarray, cost: WireCost | None, extra: np.ndarray | float = 0.0) -> PhaseLoad:
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
        return [_load(route, T, cost) for T in placement.flat(gathers, scatters, unit)]
    kept = index = None
    if selective:
        kept, index = (list(x) for x in zip(*(_mean_kept(g, steps) for g in gathers)))
    if cost is None or index is None:
        phases = [_load(route, T, cost) for T in placement.tapa(gathers, scatters, unit, kept, index)]
    else:  # the values packed, the indices as they are (unit 0: the indices alone)
        values, indices = placement.tapa(gathers, scatters, unit, kept), placement.tapa(gathers, scatters, 0.0, kept, index)
        phases = [_load(route, T, cost, I) for T, I in zip(values, indices)]
    return [p for p in phases if not p.empty] or phases[:1]  # one group, or one rank per group: one phase


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
    cost = _cost(wire, system, workload, workload.model.head_dim, {"k": 0.5, "v": 0.5})
    return [_load(route, placement.ring_step(j, blocks), cost) for j in range(R - 1)]


def _cost(wire: Wire | None, system: System, workload: Workload, block: int, tensors: dict[str, float]) -> WireCost | None:
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


@dataclass(frozen=True, slots=True)
class Share:
    """What one data group runs in a share of the steps (engine/data_parallel.py's rules)."""

    items: int
    """Items per transformer call on one group (the largest share: the slowest group)."""
    calls: int
    """Transformer calls per step."""
    exchange: bool
    """The data groups trade outputs once per call (False: each runs the whole batch)."""
    weight: float
    """Fraction of the steps."""


def data_shares(workload: Workload, plan: Plan) -> list[Share]:
    """How a plan's N = cfg x batch data groups share a step. A call's batch (SD3's CFG pair
    included) is cut into N shares, or runs whole on every group when it has fewer items than N.
    True CFG (two calls per step) with cfg=2 pairs the calls across the CFG groups, each batch
    shared over the batch groups, from the second step on; the first step is unpaired."""
    N = plan.cfg * plan.batch
    guided = workload.cfg and workload.model.cfg != "none"

    def split(items: int, groups: int) -> tuple[int, bool]:
        return (-(-items // groups), True) if groups > 1 and items >= groups else (items, False)

    if workload.model.cfg == "calls" and guided and plan.cfg == 2:
        paired = split(workload.batch, plan.batch)[0]
        first, exchange = split(workload.batch, N)
        later = (workload.steps - 1) / workload.steps
        return [Share(paired, 1, True, later)] * (workload.steps > 1) + [Share(first, 2, exchange, 1 / workload.steps)]
    items, exchange = split(workload.call_batch, N)
    return [Share(items, workload.calls_per_step, exchange, 1.0)]


_KEYS = ("compute", "exposed", "intra", "inter", "comm", "inter_bytes", "intra_bytes", "ring_exposed", "ring_hidden",
         "data_exposed", "shard_exposed", "shard_comm", "shard_bytes")


def _one_call(workload: Workload, system: System, params: LinkParams, variant: Variant, placement: Placement,
              compute_scale: float, gathered: Workload | None = None, wire: Wire | None = None) -> dict[str, float]:
    """One transformer call of one data group (all groups at once), slowest rank. The output's
    sequence gather carries `gathered`'s batch (the whole batch, when the data groups' shards were
    gathered first), else the call's."""
    plan = placement.plan
    SP, R, U = plan.sp, plan.ring, plan.ulysses
    B, D, item = workload.call_batch, workload.model.head_dim, workload.item_bytes
    unit = B * D * item
    heads_split = workload.head_split(U)
    per_call = dict.fromkeys(_KEYS, 0.0)
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
        costs = [_cost(wire, system, workload, D, t) for t in ({"v": 1.0}, {"q": q_share, "k": 1 - q_share}, {"o": 1.0})]
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
    for gather in _gathers(gathered or workload, placement, system):  # exposed: nothing runs beside it
        _add_exposed(per_call, gather, params)
    return per_call


def _add_exposed(per_call: dict[str, float], phase: PhaseLoad, params: LinkParams, key: str | None = None) -> None:
    t, where = phase.time(params)
    for k in ("exposed", "comm", where) + ((key,) if key else ()):
        per_call[k] += t
    per_call["inter_bytes"] += phase.inter_node_bytes
    per_call["intra_bytes"] += phase.intra_node_bytes


def predict(workload: Workload, system: System, params: LinkParams, variant: Variant, compute_scale: float = 1.0) -> Prediction:
    """Per-step latency of `variant` under its plan (`resolve_plan`); raises NotRunnable where the
    engine cannot lay the plan over the system's nodes.

    compute_scale multiplies the nominal compute times (a measured profile sets it). With data
    groups (cfg, batch) every group runs its share at once (`data_shares`), and one gather of the
    output per call joins them (exposed); a step is averaged over the shares' steps.
    """
    plan = resolve_plan(workload, system, variant)
    wire = wire_of(variant, system)
    if variant.shard and system.ranks_per_node < 2:
        raise NotRunnable(f"{variant.name}: the weights are shared among a node's ranks; "
                          f"1 rank per node leaves none to share with")
    try:
        placement = place(plan, system)
    except Unplaceable as error:
        raise NotRunnable(str(error)) from None
    total = dict.fromkeys(_KEYS, 0.0)
    for share in data_shares(workload, plan):
        group = replace(workload, batch=share.items, cfg=False)
        whole = replace(group, batch=share.items * plan.cfg * plan.batch) if share.exchange else None
        per_call = _one_call(group, system, params, variant, placement, compute_scale, gathered=whole, wire=wire)
        if share.exchange:  # shards first (engine/data_parallel.py): each rank's sequence shard of its share's output
            shard = max(split_sizes(group.image_tokens, plan.sp))
            row = group.call_batch * group.model.out_channels * group.item_bytes * shard
            cost = _cost(wire, system, group, group.model.out_channels, {"o": 1.0})  # one scale per output row
            _add_exposed(per_call, _load(routing(system), placement.data_gather(row), cost), params, "data_exposed")
        if variant.shard:  # the weights' all-gathers inside each node, behind the blocks' compute (engine/shard.py)
            nominal = [nominal_compute_s(group, kind, system, plan.ring, plan.sp) for kind in group.model.layers]
            layer_s = [compute_scale * (c["v"] + c["qk"] + c["rest"]) for c in nominal]
            add_weight_gathers(per_call, group, system, params, layer_s)
        for k in _KEYS:
            total[k] += share.weight * share.calls * per_call[k]
    return Prediction(
        variant=variant, nodes=system.nodes, ranks=system.ranks,
        step_s=total["compute"] + total["exposed"], compute_s=total["compute"],
        exposed_s=total["exposed"], exposed_intra_s=total["intra"], exposed_inter_s=total["inter"], comm_s=total["comm"],
        inter_node_bytes=total["inter_bytes"], intra_node_bytes=total["intra_bytes"],
        plan=plan, ring_exposed_s=total["ring_exposed"], ring_hidden_s=total["ring_hidden"],
        data_exposed_s=total["data_exposed"], shard_gather_bytes=total["shard_bytes"],
        shard_exposed_s=total["shard_exposed"], shard_comm_s=total["shard_comm"],
    )


