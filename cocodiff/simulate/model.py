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

Pipeline stages (`p`, outermost unless written elsewhere; stages.py): the blocks cut into S
contiguous ranges as the engine cuts them (by parameter count), each stage this model over its
blocks on its own ranks (`place(plan, system, stage)`), one micro-batch at a time: an image (a
batched CFG's branch) exact, or with `+patches=M` (LOSSY) a displaced patch, its queries against
the whole sequence's keys. Stages and the boundary's transfers (each rank's shard of the hidden
state to its place in the next stage; the output back) form a flow shop of B identical jobs:

    call = sum of the per-job times + (B - 1) x the largest        step = compute + exposed + bubble

with compute and exposed along the slowest stage, the boundary's transfers on the path in exposed,
and the other stages' fill and drain the bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UsageError
from ..config.plan import Plan, auto_plan, default_plan, inter_node_shards, parse_plan
from ..config.variants import Variant, parse_variants
from .call import KEYS, _gathers, add_exposed, cost_of, layer_compute_s, load, nominal_compute_s, one_call, wire_of  # noqa: F401 (_gathers: re-exported)
from .network import routing
from .placement import Unplaceable, place
from .shard import add_weight_gathers
from .stages import StageOptions, Stages, predict_stages
from .system import LinkParams, System
from .workload import Workload, split_sizes

__all__ = ["FLAT", "NotRunnable", "Prediction", "Share", "check_modelled", "data_shares", "modelled_variants",
           "nominal_compute_s", "predict", "resolve_plan", "wire_of"]

FLAT = Variant("flat")
"""The baseline every speedup is over."""


def check_modelled(variant: Variant) -> Variant:
    """`variant` if this cost model covers it; else a UsageError saying why (the names are those of
    cocodiff/config/variants.py, the same as `bench e2e`'s)."""
    plan = parse_plan(variant.plan) if variant.plan not in (None, "auto") else None
    if plan is not None and plan.pipe > 1 or variant.displaced:
        _check_stages(variant, plan)
    if variant.baseline:
        raise UsageError(f"variant {variant.name!r}: a peer's own Ulysses is measured by bench e2e, not modelled here")
    if variant.comm == "auto":
        raise UsageError(f"variant {variant.name!r}: auto chooses flat or tapa by a run-time measurement; "
                         f"simulate flat and tapa instead")
    if variant.comm == "tapa-full":
        raise UsageError(f"variant {variant.name!r}: the model's TAPA is two phases (inside a node's fast level, then "
                         f"across); full-depth TAPA is measured by bench, not modelled")
    if variant.lossy and variant.comm != "tapa":
        raise UsageError(f"variant {variant.name!r}: V-Major is modelled on TAPA's second phase only; use tapa as the base")
    return variant


def _check_stages(variant: Variant, plan: Plan | None) -> None:
    """What the engine's pipeline stages and displaced patches do not run (config/parallel.py), or
    this model does not cover yet, in one line."""
    what = "displaced patches (+patches)" if variant.displaced else "pipeline stages"
    clashes = [*(["V-Major"] if variant.lossy else []), *(["a step cache"] if variant.cached else [])]
    if clashes:
        raise UsageError(f"variant {variant.name!r}: {what} do not combine with {', '.join(clashes)}")
    if variant.compile:
        raise UsageError(f"variant {variant.name!r}: {what} with +compile are measured by bench e2e, not modelled here yet")
    if variant.displaced and variant.plan == "auto":
        raise UsageError(f"variant {variant.name!r}: displaced patches need a written plan (p, u), not auto")
    if variant.displaced and plan is not None and plan.ring > 1:
        raise UsageError(f"variant {variant.name!r}: displaced patches do not combine with a ring; write a plan of p and u only")
    if plan is not None and plan.cfg * plan.batch > 1:
        raise UsageError(f"variant {variant.name!r}: {what} with CFG or batch groups are measured by bench e2e, "
                         f"not modelled here yet; write a plan of p, r and u")


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
    stages: Stages | None = None
    """Pipeline stages or displaced patches (stages.py): the cut, the schedule, the boundary; then
    `step_s` = compute + exposed + `stages.bubble_s`."""


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


def predict(workload: Workload, system: System, params: LinkParams, variant: Variant, compute_scale: float = 1.0,
            stage_options: StageOptions | None = None) -> Prediction:
    """Per-step latency of `variant` under its plan (`resolve_plan`); raises NotRunnable where the
    engine cannot lay the plan over the system's nodes.

    compute_scale multiplies the nominal compute times (a measured profile sets it). With data
    groups (cfg, batch) every group runs its share at once (`data_shares`), and one gather of the
    output per call joins them (exposed); a step is averaged over the shares' steps. Pipeline
    stages and displaced patches: stages.py (`stage_options`: the cut and the patches' schedule;
    None: the engine's defaults).
    """
    plan = resolve_plan(workload, system, variant)
    wire = wire_of(variant, system)
    if plan.pipe > 1 or variant.displaced:
        try:
            total, stages = predict_stages(workload, system, params, variant, plan, compute_scale, wire, stage_options)
        except Unplaceable as error:
            raise NotRunnable(str(error)) from None
        return _prediction(variant, system, plan, total, stages)
    if variant.shard and system.ranks_per_node < 2:
        raise NotRunnable(f"{variant.name}: the weights are shared among a node's ranks; "
                          f"1 rank per node leaves none to share with")
    try:
        placement = place(plan, system)
    except Unplaceable as error:
        raise NotRunnable(str(error)) from None
    total = dict.fromkeys(KEYS, 0.0)
    for share in data_shares(workload, plan):
        group = replace(workload, batch=share.items, cfg=False)
        whole = replace(group, batch=share.items * plan.cfg * plan.batch) if share.exchange else None
        per_call = one_call(group, system, params, variant, placement, compute_scale, gathered=whole, wire=wire)
        if share.exchange:  # shards first (engine/data_parallel.py): each rank's sequence shard of its share's output
            shard = max(split_sizes(group.image_tokens, plan.sp))
            row = group.call_batch * group.model.out_channels * group.item_bytes * shard
            cost = cost_of(wire, system, group, group.model.out_channels, {"o": 1.0})  # one scale per output row
            add_exposed(per_call, load(routing(system), placement.data_gather(row), cost), params, "data_exposed")
        if variant.shard:  # the weights' all-gathers inside each node, behind the blocks' compute (engine/shard.py)
            add_weight_gathers(per_call, group, system, params, layer_compute_s(group, system, plan, compute_scale))
        for k in KEYS:
            total[k] += share.weight * share.calls * per_call[k]
    return _prediction(variant, system, plan, total)


def _prediction(variant: Variant, system: System, plan: Plan, total: dict[str, float], stages: Stages | None = None) -> Prediction:
    """A step's sums (`call.KEYS`) as a Prediction; with stages their bubble adds to the step."""
    total = {k: total.get(k, 0.0) for k in KEYS}
    return Prediction(
        variant=variant, nodes=system.nodes, ranks=system.ranks,
        step_s=total["compute"] + total["exposed"] + (stages.bubble_s if stages is not None else 0.0),
        compute_s=total["compute"],
        exposed_s=total["exposed"], exposed_intra_s=total["intra"], exposed_inter_s=total["inter"], comm_s=total["comm"],
        inter_node_bytes=total["inter_bytes"], intra_node_bytes=total["intra_bytes"],
        plan=plan, ring_exposed_s=total["ring_exposed"], ring_hidden_s=total["ring_hidden"],
        data_exposed_s=total["data_exposed"], shard_gather_bytes=total["shard_bytes"],
        shard_exposed_s=total["shard_exposed"], shard_comm_s=total["shard_comm"], stages=stages,
    )


