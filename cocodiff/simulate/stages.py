"""Pipeline stages (`p`) and displaced patches (`+patches=M`) in the cost model.

    ranks = pipe x (ring x ulysses): each stage's ranks run the rest of the plan over its blocks

The cut (engine/stages.py): the transformer's blocks, in the order they run, are cut into `pipe`
contiguous ranges by `config.plan.stage_ranges` over each block's cost per image token (the
engine's cut, `engine.stages.token_params`: the weights its image tokens' matmuls read, through
`models.counts.stage_blocks`, torch imported here, only for these plans), or what-if over each
block's nominal compute (`compute`). A block holds the spec's layer kinds as `shard.block_compute`
maps them (FLUX.1: 19 double-stream, then 38 single-stream blocks; Wan: one self- and one
cross-attention layer per block). FLUX's double-stream blocks carry two streams' weights and their
modulations (36 d^2 parameters against the single-stream's 15 d^2), but their image tokens read
12 d^2 of them, as a single-stream block's do: the engine's cut is a compute cut, p2 is 28 against
29 blocks. A model whose blocks are not known offline takes the compute cut only (its blocks from
the spec's layers).

A stage: the model of model.py (`one_call`) on the stage's blocks, over its ranks only (placement
of stage s; the last stage also gathers the output inside its sequence-parallel group). t_s: one
micro-batch on stage s, compute + exposed exchanges.

The boundary: every rank sends its own sequence shard of the next block's inputs (image + text
tokens x hidden x dtype bytes; a cross-attention's text whole where every rank holds it) to the
rank at its place in the next stage, h_s one traffic matrix per boundary; the last stage's ranks
each send the whole output (image tokens x out channels) to the rank at their place in every
earlier stage, o one traffic matrix. Sends fly while the sender computes the next micro-batch.

Exact (engine/stages.py): a call's items (images; a batched CFG's branches) are B micro-batches,
at most two per stage (`config.parallel.micro_batches`; a larger batch: micro-batches of several).
The stages and the links between them are a flow shop of identical jobs,

    call = sum_k p_k + (B - 1) x max_k p_k        p = (t_0, h_0, t_1, ..., t_{S-1}, o)

so one image (B = 1) runs the stages in turn with no overlap, and B images on equal stages take
(B + S - 1) / B of B stage times. Along the slowest stage b: compute = B x its compute, exposed =
B x its exposed exchanges + the boundary's share (every hop and output once, and B - 1 times what
a link's time per job exceeds t_b), bubble = the other stages' t_s (fill and drain). Busy share
of stage s: B t_s / call.

Displaced patches (engine/patches.py, LOSSY): the first `warmup` steps run whole (one micro-batch
of the call's items, the stages in turn); every later step runs M patches (workload.Patch: the
patch's queries against the whole sequence's keys) as M jobs of the flow shop, the output sent
back once per call after the last. Per step the boundary carries about one hidden state plus
(M - 1) x the text (`whole` text). Without `p` the patches run on one stage, one after another (the
engine's reference). A step's figures are the steps' mean.

Shared cores (`System.host_cores`, an emulation): a stage computing while the others wait runs
faster (each rank's share of the cores grows, up to S times), and no faster than the pool of
cores allows: call = max(the flow shop with stages at that speed, B x sum_s c_s / S + exposed),
c_s a stage's compute at the all-ranks rate, exposed as above.

Wire formats (`+fp8`, `--wire`) pack the boundary's tensors per link as the exchanges' (blocks of
the hidden size, of the output's channels). Not modelled: the embedders every stage computes and
the output layers (left out of the workload, as without stages); boundary messages sharing links
with a stage's exchanges; CFG or batch groups with stages (refused, model.check_modelled).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..config.parallel import micro_batches
from ..config.plan import Plan, stage_ranges
from ..config.sizes import split_sizes
from ..config.variants import Variant
from ..config.wire import Wire
from ..errors import UsageError
from .call import cost_of, layer_compute_s, load, nominal_compute_s, one_call
from .network import PhaseLoad, routing
from .placement import Placement, Unplaceable, place, stage_ranks
from .shard import Gathers, Units, block_compute, sharers, stage_costs_of, units_of, weight_gathers
from .system import LinkParams, System
from .workload import PATCH_TEXT, LayerKind, Patch, Workload

__all__ = ["CUTS", "StageOptions", "Stages", "flow_shop", "predict_stages", "stage_layers"]

CUTS = ("engine", "compute")
"""How the blocks are cut into stages: by parameter count (the engine's), or by nominal compute (a what-if)."""


@dataclass(frozen=True, slots=True)
class StageOptions:
    """What a run chooses besides the variant: the cut, and the displaced schedule's options."""

    cut: str = "engine"
    warmup: int = 1
    """Displaced patches: steps run whole first (`--pipe-warmup`)."""
    text: str = "whole"
    """Displaced patches: the whole text with every patch, or its piece (`--pipe-text`)."""

    def __post_init__(self) -> None:
        if self.cut not in CUTS:
            raise UsageError(f"--stage-cut {self.cut!r} is not one of {', '.join(CUTS)}")
        if self.warmup < 0:
            raise UsageError(f"--pipe-warmup {self.warmup} must be at least 0")
        if self.text not in PATCH_TEXT:
            raise UsageError(f"--pipe-text {self.text!r} is not one of {', '.join(PATCH_TEXT)}")


@dataclass(frozen=True, slots=True)
class Stages:
    """A prediction's stages: the cut, the schedule, the boundary. Seconds and bytes per step,
    unless said per micro-batch."""

    ranges: tuple[tuple[int, int], ...]
    """[start, end) of each stage's blocks."""
    cut: str
    micro_batches: int
    """Jobs per call: the call's items (exact), or the patches."""
    patches: int | None
    stage_s: tuple[float, ...]
    """One micro-batch on each stage: compute + exposed exchanges (displaced: a patch)."""
    hop_s: tuple[float, ...]
    """One micro-batch's hidden state across each boundary."""
    output_s: float
    """The output back to the earlier stages (one micro-batch's; displaced: the call's)."""
    busy: tuple[float, ...]
    """Share of the step each stage computes or exchanges."""
    bubble_s: float
    """The slowest stage's wait for the others (fill and drain)."""
    boundary_exposed_s: float
    """The boundary's transfers on the step's path (part of `Prediction.exposed_s`)."""
    boundary_comm_s: float
    """Every boundary transfer's time, none hidden (part of `Prediction.comm_s`)."""
    boundary_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes across the boundaries per link class: `node` between nodes, else the system's level."""
    warmup: int = 0
    """Displaced: steps run whole."""
    text: str = "whole"


def flow_shop(jobs: int, times: list[float], last: float = 0.0) -> float:
    """Identical jobs through resources in order, each one job at a time: sum + (jobs - 1) x max;
    `last`: a resource only the last job uses (the output of a displaced call)."""
    return sum(times) + (jobs - 1) * max(times) + last


def _block_layers(workload: Workload, blocks: int) -> list[np.ndarray]:
    """Per block, its layers of each kind (shard.block_compute's rules)."""
    counts = np.array([k.count for k in workload.model.layers], dtype=np.float64)
    if counts.sum() == blocks:
        kinds = np.repeat(np.arange(len(counts)), counts.astype(int))
        return [np.eye(len(counts))[k] for k in kinds]
    if (counts == blocks).all():
        return [np.ones(len(counts))] * blocks
    return [counts / blocks] * blocks


def stage_layers(workload: Workload, system: System, stages: int, cut: str = "engine"
                 ) -> tuple[list[tuple[int, int]], list[tuple[LayerKind, ...]]]:
    """(each stage's [start, end) of blocks, each stage's layer kinds with their counts)."""
    try:
        blocks: tuple[int, ...] | None = stage_costs_of(workload.model.name)
    except UsageError:
        blocks = None
    if blocks is None and cut == "engine":
        raise UsageError(f"pipeline stages on {workload.model.name}: its blocks, by which the engine cuts the stages, "
                         f"are not known offline; --stage-cut compute cuts by the spec's layers")
    counts = [k.count for k in workload.model.layers]
    per_block = _block_layers(workload, len(blocks) if blocks is not None else
                              counts[0] if len(set(counts)) == 1 and any(k.cross for k in workload.model.layers) else sum(counts))
    if cut == "engine":
        costs = list(blocks)
    else:
        kind_s = [sum(nominal_compute_s(workload, k, system, 1, 1)[x] for x in ("v", "qk", "rest")) for k in workload.model.layers]
        costs = [float(layers @ kind_s) for layers in per_block]
    try:
        ranges = stage_ranges(costs, stages)
    except UsageError as error:
        raise UsageError(f"{workload.model.name}: {error}") from None
    layers = []
    for start, end in ranges:
        counts = sum(per_block[start:end])
        layers.append(tuple(replace(k, count=float(n)) for k, n in zip(workload.model.layers, counts) if n > 0))
    return ranges, layers


def _alone(system: System, stages: int) -> float:
    """How much faster a stage computes while the others wait: 1 with a device per rank; on a
    host's shared cores, a rank's share with only its stage computing over its share with all."""
    cores, P = system.host_cores, system.ranks
    if cores is None or P <= cores:
        return 1.0
    return min(P / cores, float(stages))


def _on(workload: Workload, layers: tuple[LayerKind, ...]) -> Workload:
    return replace(workload, model=replace(workload.model, layers=layers))


def _hidden_rows(workload: Workload, sp: int) -> np.ndarray:
    """(sp,) tokens of the next block's inputs each sequence-parallel rank holds."""
    rows = np.array(split_sizes(workload.image_tokens, sp)) + np.array(split_sizes(workload.text_tokens, sp))
    crosses = {k.cross for k in workload.model.layers}
    if "local" in crosses:  # every rank holds the whole text
        rows += workload.model.cross_tokens
    elif "exchanged" in crosses:
        rows += np.array(split_sizes(workload.model.cross_tokens, sp))
    return rows


def _boundary(workload: Workload, whole: Workload, plan: Plan, system: System, wire: Wire | None
              ) -> tuple[list[PhaseLoad], PhaseLoad | None, list[np.ndarray]]:
    """(one phase per boundary, the output's phase (None: one stage), their traffic matrices as
    sent: packed where a wire format applies) for a micro-batch `workload`; the output is `whole`'s."""
    ranks = stage_ranks(plan, system)
    S, P, d = plan.pipe, system.ranks, workload.model.hidden
    route = routing(system)
    shard = _hidden_rows(workload, plan.sp) * workload.call_batch * d * workload.item_bytes
    hidden = cost_of(wire, system, workload, d, {"o": 1.0})
    hops, matrices = [], []
    for s in range(S - 1):
        T = np.zeros((P, P))
        T[ranks[s], ranks[s + 1]] = shard
        hops.append(load(route, T, hidden))
        matrices.append(T if hidden is None else hidden.apply(T)[0])
    if S == 1:
        return hops, None, matrices
    out = whole.call_batch * whole.image_tokens * whole.model.out_channels * whole.item_bytes
    T = np.zeros((P, P))
    for s in range(S - 1):
        T[ranks[-1], ranks[s]] = out
    cost = cost_of(wire, system, whole, whole.model.out_channels, {"o": 1.0})
    return hops, load(route, T, cost), matrices + [T if cost is None else cost.apply(T)[0]]


def _bytes_by_class(matrices: list[np.ndarray], weights: list[float], system: System) -> dict[str, float]:
    route = routing(system)
    names = ["node" if c == "network" else c for c in route.lat_classes]
    out: dict[str, float] = {}
    for T, w in zip(matrices, weights):
        for c, name in enumerate(names):
            total = float(T[route.msg_class == c].sum()) * w
            if total > 0:
                out[name] = out.get(name, 0.0) + total
    return out


_SUMS = ("compute", "exposed", "intra", "inter", "comm", "inter_bytes", "intra_bytes", "ring_exposed", "ring_hidden",
         "bubble", "boundary_exposed", "boundary_comm", "shard_exposed", "shard_comm", "shard_bytes")


def _weight_gathers(micro: Workload, system: System, params: LinkParams, plan: Plan, ranges: list[tuple[int, int]],
                    compute_scale: float) -> list[Gathers]:
    """`+shard`: one pass's weight gathers on each stage, its root and blocks over its ranks on a node."""
    units = units_of(micro.model.name)
    if len(units.blocks) != ranges[-1][1]:
        raise UsageError(f"{micro.model.name}: {len(units.blocks)} sharded blocks, but the stages cut {ranges[-1][1]}")
    block_s = block_compute(layer_compute_s(micro, system, plan, compute_scale), [kind.count for kind in micro.model.layers],
                            len(units.blocks))
    ranks = stage_ranks(plan, system)
    fewest = min(int(sharers(system, list(row)).sum(axis=1).max()) for row in ranks)
    if fewest < 2:
        raise Unplaceable(f"+shard with {plan.short}: a stage's weights are shared among its ranks on a node, "
                          f"and some stage has {fewest} on a node")
    return [weight_gathers(Units(units.root, units.blocks[a:b]), block_s[a:b], micro, system, params, list(ranks[s]))
            for s, (a, b) in enumerate(ranges)]


def _call(micro: Workload, whole: Workload, jobs: int, once: bool, system: System, params: LinkParams,
          variant: Variant, plan: Plan, placements: list[Placement], layers: list[tuple[LayerKind, ...]],
          compute_scale: float, wire: Wire | None, ranges: list[tuple[int, int]]) -> tuple[dict[str, float], dict]:
    """One call: `jobs` micro-batches `micro` through the stages; the output (`whole`'s) sent back
    after each job, or `once` after the last. Returns the sums (as model.py's) and the details."""
    S = plan.pipe
    per_stage = [one_call(_on(micro, layers[s]), system, params, variant, placements[s], compute_scale, wire=wire,
                           gather=s == S - 1) for s in range(S)]
    gathers = _weight_gathers(micro, system, params, plan, ranges, compute_scale) if variant.shard else None
    for c, g in zip(per_stage, gathers or ()):  # each pass gathers its stage's weights again (engine/shard.py)
        for key, value in (("exposed", g.exposed_s), (g.where, g.exposed_s), ("comm", g.comm_s)):
            c[key] += value
    speed = _alone(system, S)
    t = [c["compute"] / speed + c["exposed"] for c in per_stage]
    hops, out, matrices = _boundary(micro, whole, plan, system, wire)
    hop = [h.time(params) for h in hops]
    output = out.time(params) if out is not None else (0.0, "intra")
    resources = [x for s in range(S) for x in ([(t[s], "stage")] + ([hop[s]] if s < S - 1 else []))]
    if not once:
        resources.append(output)
    call = flow_shop(jobs, [r for r, _ in resources], output[0] if once else 0.0)
    b = int(np.argmax(t))
    slowest = max(resources, key=lambda r: r[0])
    sums = {k: jobs * per_stage[b][k] for k in ("compute", "exposed", "intra", "inter", "ring_exposed", "ring_hidden")}
    sums["shard_exposed"] = jobs * gathers[b].exposed_s if gathers else 0.0
    sums["shard_comm"] = jobs * sum(g.comm_s for g in gathers) if gathers else 0.0
    sums["shard_bytes"] = jobs * max(g.received_bytes for g in gathers) if gathers else 0.0
    sums["compute"] /= speed
    links = [r for r in resources if r[1] != "stage"] + ([output] if once else [])
    excess = (jobs - 1) * (slowest[0] - t[b])
    for r, kind in links:
        sums[kind] += r
    if excess > 0:
        sums[slowest[1]] += excess
    boundary = sum(r for r, _ in links) + max(0.0, excess)
    sums["exposed"] += boundary
    sums["boundary_exposed"] = boundary
    pool = jobs * sum(c["compute"] for c in per_stage) / S  # every rank's compute on the host's cores
    if system.host_cores is not None and pool + sums["exposed"] > call:
        sums["compute"], call = pool, pool + sums["exposed"]
    sums["bubble"] = max(0.0, call - sums["compute"] - sums["exposed"])  # the flow shop's: the other stages' t_s
    sums["boundary_comm"] = jobs * sum(r for r, _ in hop) + (1 if once else jobs) * output[0]
    sums["comm"] = jobs * sum(c["comm"] for c in per_stage) + sums["boundary_comm"]
    sends = [jobs] * len(hops) + ([1 if once else jobs] if out is not None else [])
    for key, attr in (("inter_bytes", "inter_node_bytes"), ("intra_bytes", "intra_node_bytes")):
        sums[key] = jobs * sum(c[key] for c in per_stage) + sum(n * getattr(p, attr) for n, p in
                                                                   zip(sends, hops + ([out] if out is not None else [])))
    details = {"stage_s": tuple(t), "hop_s": tuple(r for r, _ in hop), "output_s": output[0], "call_s": call,
               "busy": tuple(jobs * x / call for x in t) if call > 0 else (0.0,) * S,
               "bytes": _bytes_by_class(matrices, sends, system)}
    return sums, details


def predict_stages(workload: Workload, system: System, params: LinkParams, variant: Variant, plan: Plan,
                   compute_scale: float = 1.0, wire: Wire | None = None, options: StageOptions | None = None
                   ) -> tuple[dict[str, float], Stages]:
    """A step's sums (call.KEYS, as model.predict adds them up) of a plan with pipeline stages or of
    displaced patches (the module's docstring), and its stages; raises placement.Unplaceable where
    the engine cannot lay the plan over the nodes."""
    options = options or StageOptions()
    assert plan.cfg * plan.batch == 1, "stages with data groups are refused by model.check_modelled"
    placements = [place(plan, system, s) for s in range(plan.pipe)]
    ranges, layers = stage_layers(workload, system, plan.pipe, options.cut)
    items = replace(workload, batch=workload.call_batch, cfg=False)  # one call's items, one pass
    run = dict(system=system, params=params, variant=variant, plan=plan, placements=placements, layers=layers,
               compute_scale=compute_scale, wire=wire, ranges=ranges)
    if variant.displaced:
        M = variant.patches
        warm = min(options.warmup, workload.steps)
        shares = [((workload.steps - warm) / workload.steps, _call(Patch.of(items, M, options.text), items, M, True, **run)),
                  (warm / workload.steps, _call(items, items, 1, True, **run))]
        shares = [(w, c) for w, c in shares if w > 0]
    else:  # jobs of the most images a micro-batch holds (split_sizes: the first ones)
        jobs = micro_batches(workload.call_batch, plan.pipe)
        one = replace(workload, batch=split_sizes(workload.call_batch, jobs)[0], cfg=False)
        shares = [(1.0, _call(one, one, jobs, False, **run))]
    calls = workload.calls_per_step
    total = dict.fromkeys(_SUMS, 0.0)
    boundary: dict[str, float] = {}
    for weight, (sums, details) in shares:
        for k in _SUMS:
            total[k] += weight * calls * sums[k]
        for name, n in details["bytes"].items():
            boundary[name] = boundary.get(name, 0.0) + weight * calls * n
    main = shares[0][1][1]
    stages = Stages(
        ranges=tuple(ranges), cut=options.cut, micro_batches=variant.patches or micro_batches(workload.call_batch, plan.pipe),
        patches=variant.patches, stage_s=main["stage_s"], hop_s=main["hop_s"], output_s=main["output_s"], busy=main["busy"],
        bubble_s=total["bubble"], boundary_exposed_s=total["boundary_exposed"], boundary_comm_s=total["boundary_comm"],
        boundary_bytes=boundary, warmup=min(options.warmup, workload.steps) if variant.displaced else 0, text=options.text,
    )
    return total, stages
