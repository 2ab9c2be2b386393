"""Parallel plans: how the ranks share one generation, as one object.

    ranks = pipe x cfg x batch x ring x ulysses        sequence parallel degree = ring x ulysses

- `ulysses`: inside a group, all-to-alls swap a sequence shard of all heads for the whole
  group's sequence of a share of the heads (the exchange: flat, TAPA, auto; V-First; V-Major).
  Its degree cannot exceed the attention heads.
- `ring`: the sequence is cut into `ring` chunks, one per Ulysses group; attention passes K/V
  blocks around the ring and merges partial outputs by their log-sum-exp (engine/attention/ring.py).
  This is how a run gets past the head count (Ulysses x ring = USP).
- `cfg`, `batch`: classifier-free guidance's two branches and a batch's items on separate rank
  groups, each running the sequence-parallel plan on its share (engine/data_parallel.py); one gather
  of the transformer's output per call joins them, each rank trading only its sequence shard.

- `pipe`: pipeline stages. The transformer's blocks are cut into `pipe` contiguous ranges, one per
  stage, each stage's ranks holding only their blocks and running the sequence-parallel plan on
  them; a call's images pass from stage to stage as micro-batches (engine/stages.py), exact. One
  hidden state per image crosses a stage boundary, where sequence parallelism exchanges four
  shards in every attention layer: the axis for the slowest links.

Written plans (a contract, see DESIGN.md): the long form `cfg=2,batch=1,ring=2,ulysses=2` or the
short form of letters each followed by its degree (`c2u2`, `u4r2`, `r2u4`, `u1r8`); omitted axes
are 1 and the degrees multiply to the number of ranks.

**The written order is the placement**: axes are listed from the outermost to the innermost.
Ranks are numbered node-major, so the innermost axis joins neighbouring ranks (inside a node) and
the outermost spans nodes. `r2u4` on 2 nodes x 4 ranks keeps each Ulysses group inside a node
and sends ring's K/V blocks between nodes; `u4r2` puts Ulysses across nodes and ring inside.
A plan that is not written (no `--plan`, or more ranks than heads) is chosen by `default_plan`,
which places the axes by an estimate of the bytes each placement sends between nodes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..errors import UsageError
from .sizes import digits

__all__ = ["AUTO", "AXES", "HEAD_IMBALANCE", "Plan", "auto_plan", "default_plan", "equal_runs", "even_heads_plan", "head_imbalance", "inter_node_shards", "parse_plan", "stage_ranges", "trial_plans"]

AUTO = "auto"
"""`--plan auto`: `auto_plan` chooses, from the model's guidance and the number of images."""
AXES = ("pipe", "cfg", "batch", "ring", "ulysses")
"""Every axis, in the default placement order (outermost first)."""
_LETTERS = {"p": "pipe", "c": "cfg", "b": "batch", "r": "ring", "u": "ulysses"}
_SHORT = re.compile(r"([pcbru])(\d+)")


@dataclass(frozen=True, slots=True)
class Plan:
    """Degrees of each axis and their placement (outermost first)."""

    cfg: int = 1
    batch: int = 1
    ring: int = 1
    ulysses: int = 1
    order: tuple[str, ...] = AXES
    """All five axes, outermost (spans nodes) first, innermost (inside a node) last; an order
    without `pipe` has it outermost."""
    pipe: int = 1
    """Pipeline stages, each a contiguous range of the transformer's blocks."""
    reason: str = ""
    """Why this plan, when the engine chose it (empty when it was written)."""

    def __post_init__(self) -> None:
        if "pipe" not in self.order:
            object.__setattr__(self, "order", ("pipe", *self.order))
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise UsageError(f"plan axis {axis}={getattr(self, axis)} must be at least 1")
        if sorted(self.order) != sorted(AXES):
            raise UsageError(f"plan order {self.order} must name each of {', '.join(AXES)} once")

    @property
    def ranks(self) -> int:
        return self.pipe * self.cfg * self.batch * self.ring * self.ulysses

    @property
    def sp(self) -> int:
        """Sequence-parallel degree: ranks that share one image."""
        return self.ring * self.ulysses

    @property
    def short(self) -> str:
        """The short form, placement included: axes of degree > 1 (and always Ulysses), outermost first."""
        axes = [a for a in self.order if getattr(self, a) > 1 or a == "ulysses"]
        return "".join(f"{a[0]}{getattr(self, a)}" for a in axes)

    @property
    def mesh_dims(self) -> list[tuple[str, int]]:
        """(axis, degree) outermost first, for a device mesh over node-major ranks."""
        return [(a, getattr(self, a)) for a in self.order]

    def place(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each axis, as `Topology.split` lays the axes over the node-major
        ranks (outermost first): e.g. its pipeline stage, `place(rank)["pipe"]`."""
        place = {}
        for axis, degree in reversed(self.mesh_dims):
            rank, place[axis] = divmod(rank, degree)
        return place

    def rank_name(self, rank: int) -> str:
        """'rank 5', and its pipeline stage where the plan has stages, counted from 0 as the stages
        name themselves ('rank 5 (stage 1 of 2)')."""
        return f"rank {rank}" + (f" (stage {self.place(rank)['pipe']} of {self.pipe})" if self.pipe > 1 else "")

    def describe(self) -> str:
        text = f"{self.short} (" + " x ".join(f"{a} {d}" for a, d in self.mesh_dims if d > 1 or a == "ulysses") + ", outermost first)"
        return f"{text}: {self.reason}" if self.reason else text

    def check(self, ranks: int, heads: int | None = None) -> None:
        """One-line errors for a plan that does not fit the ranks or the heads."""
        if self.ranks != ranks:
            raise UsageError(f"--plan {self.short}: its degrees multiply to {self.ranks}, not to the {ranks} ranks")
        if self.cfg > 2:
            raise UsageError(f"--plan {self.short}: cfg={self.cfg}, but classifier-free guidance has 2 branches; use cfg=2")
        if heads is not None and self.ulysses > heads:
            raise UsageError(
                f"--plan {self.short}: Ulysses degree {self.ulysses} is larger than the {heads} attention heads; "
                f"use ring for the rest (e.g. --plan {default_plan(ranks, heads).short})"
            )


def parse_plan(text: str) -> Plan:
    """`cfg=2,ulysses=2` or `c2u2` -> Plan (written order = placement). Raises UsageError."""
    text = text.strip().lower()
    degrees: dict[str, int] = {}
    if "=" in text:
        for item in text.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in AXES or not digits(value.strip()):
                raise UsageError(f"--plan {text!r}: {item!r} is not AXIS=DEGREE with AXIS one of {', '.join(AXES)}")
            if name in degrees:
                raise UsageError(f"--plan {text!r}: {name} is given twice")
            degrees[name] = int(value)
    else:
        matches = _SHORT.findall(text)
        if not matches or "".join(letter + count for letter, count in matches) != text:
            raise UsageError(
                f"--plan {text!r} is not a plan: write letters c, b, r, u (or p) each followed by its degree "
                "(e.g. u4r2) or cfg=2,batch=1,ring=2,ulysses=2, or auto; p for pipeline stages"
            )
        for letter, count in matches:
            name = _LETTERS[letter]
            if name in degrees:
                raise UsageError(f"--plan {text!r}: {name} is given twice")
            degrees[name] = int(count)
    order = tuple(degrees) + tuple(a for a in AXES if a not in degrees and a != "pipe")  # unwritten stages: outermost
    return Plan(**degrees, order=order)


def equal_runs(keys: list[int]) -> int | None:
    """Length of the equal, consecutive runs of `keys` (each key one run), or None: how many
    members of a group share each node, when they come in the runs TAPA's two phases assume."""
    run = keys.count(keys[0])
    runs = [keys[i : i + run] for i in range(0, len(keys), run)]
    if any(len(r) != run or len(set(r)) != 1 for r in runs) or len({r[0] for r in runs}) != len(runs):
        return None
    return run


def inter_node_shards(plan: Plan, ranks_per_node: int) -> float:
    """What one rank sends between nodes per attention layer under `plan`, in shards (a shard:
    one rank's tokens x all heads x head size, seq / sp x H x D elements). An estimate.

    Ulysses: four all-to-alls (Q, K, V in, the output back) of one shard each, of which the
    share for group members on other nodes crosses. Ring: K and V blocks of a chunk's tokens
    (ulysses shards) for heads / ulysses heads - one shard each - passed ring - 1 times; counted
    whole when any hop of the ring crosses nodes (each ring step waits for its slowest hop). Placement decides which members sit on
    other nodes: an axis's members are `stride` ranks apart, stride = the product of the
    degrees inside it.
    """

    def remote_share(axis: str) -> float:
        """Fraction of an axis group's other members that live on another node."""
        degree = getattr(plan, axis)
        if degree == 1:
            return 0.0
        inner = plan.order[plan.order.index(axis) + 1 :]
        stride = math.prod(getattr(plan, a) for a in inner)
        local = min(degree, ranks_per_node // stride) if stride < ranks_per_node else 1
        return (degree - local) / (degree - 1)

    ulysses = 4 * (plan.ulysses - 1) / plan.ulysses * remote_share("ulysses")
    ring = 2 * (plan.ring - 1) if remote_share("ring") > 0 else 0.0
    return ulysses + ring


HEAD_IMBALANCE = 1.15
"""Most heads on one rank over the mean past which `--plan auto` also times a narrower Ulysses
degree that divides the heads, ring for the rest (`even_heads_plan`): FLUX's 24 heads on 16
ranks leave 2 heads on some ranks, 1.5 on average, so attention waits 1.33x for the slowest
(u8r2 splits them evenly); SD3.5 Large's 38 heads on 8 ranks (1.05x) need no such plan."""


def head_imbalance(heads: int, ulysses: int) -> float:
    """The most heads a rank gets over the mean, when `heads` split over `ulysses` ranks."""
    return math.ceil(heads / ulysses) * ulysses / heads


def even_heads_plan(ranks: int, heads: int, ranks_per_node: int | None = None) -> Plan | None:
    """Where the default plan's Ulysses degree splits the heads unevenly (past `HEAD_IMBALANCE`):
    the widest Ulysses degree of at least 2 that divides both the ranks and the heads, ring for
    the rest, placed as `default_plan` places a ring; None where the default's heads are even
    enough or no such degree exists.

    Not the default: a ring's K/V hops against a Ulysses group's uneven attention is a trade
    that only a multi-GPU measurement can settle; `--plan auto` times both."""
    widest = default_plan(ranks, heads, ranks_per_node).ulysses
    even = [d for d in range(2, widest + 1) if ranks % d == 0 and heads % d == 0]
    if head_imbalance(heads, widest) <= HEAD_IMBALANCE or not even:
        return None
    ulysses = max(even)
    why = (f"{heads} heads over Ulysses {widest} would be uneven ({head_imbalance(heads, widest):.2f}x the mean on "
           f"some ranks): Ulysses {ulysses} ({heads // ulysses} heads each), ring {ranks // ulysses}")
    return _with_ring(ranks, ulysses, ranks_per_node, why)


def default_plan(ranks: int, heads: int, ranks_per_node: int | None = None) -> Plan:
    """Ulysses over every rank when the heads allow it; else Ulysses as wide as the heads allow
    (a divisor of the ranks) and ring for the rest, placed where it sends fewer bytes between
    nodes (`inter_node_shards`). On a tie the ring spans the nodes: its blocks travel while
    attention runs, where the all-to-alls' bytes are waited for."""
    if ranks <= heads:
        return Plan(ulysses=ranks)
    ulysses = max(d for d in range(1, heads + 1) if ranks % d == 0)
    return _with_ring(ranks, ulysses, ranks_per_node, f"{ranks} ranks > {heads} heads: Ulysses {ulysses}, ring {ranks // ulysses}")


def _with_ring(ranks: int, ulysses: int, ranks_per_node: int | None, why: str) -> Plan:
    """Ulysses `ulysses` x ring for the rest of the ranks, the ring inside the nodes or across them,
    whichever sends fewer bytes between nodes."""
    ring = ranks // ulysses
    inside = Plan(ring=ring, ulysses=ulysses, order=("cfg", "batch", "ring", "ulysses"))
    across = Plan(ring=ring, ulysses=ulysses, order=("cfg", "batch", "ulysses", "ring"))
    if ranks_per_node is None or ranks_per_node in (1, ranks):
        return Plan(ring=ring, ulysses=ulysses, order=inside.order, reason=f"{why}; one node level")
    costs = [inter_node_shards(p, ranks_per_node) for p in (inside, across)]
    chosen = across if costs[1] < costs[0] else inside
    note = (
        f"{why}; estimated inter-node traffic per rank and layer {costs[0]:.2f} shards ({inside.short}) "
        f"vs {costs[1]:.2f} ({across.short}), ring's overlap with attention not counted"
    )
    return Plan(ring=ring, ulysses=ulysses, order=chosen.order, reason=note)


def auto_plan(ranks: int, heads: int, ranks_per_node: int | None = None, cfg: bool = False, images: int = 1) -> Plan:
    """`--plan auto`: CFG's two branches (when the pipeline guides) and then the images on
    separate groups, outermost, so that they span nodes; sequence parallelism (`default_plan`)
    on each group's ranks, innermost.

    The estimate behind it: a CFG or batch group trades one gather of the transformer's output
    per call with the others, where sequence parallelism exchanges four shards (Ulysses) or two
    (a ring hop) in every attention layer, and both split the compute evenly. So the data axes
    take as many ranks as they can use (2 for CFG, a divisor of the ranks up to the images for
    the batch), and the sequence is split only over what is left.
    """
    c = 2 if cfg and ranks % 2 == 0 else 1
    rest = ranks // c
    b = max(d for d in range(1, min(images, rest) + 1) if rest % d == 0)
    sp = rest // b
    plan = _data_over_sequence(c, b, sp, heads, ranks_per_node)
    guidance = "CFG 2 (guided)" if c > 1 else "no CFG groups (guided, odd ranks)" if cfg else "no CFG groups (unguided)"
    axes = [guidance, f"batch {b} of {images} image(s)"]
    why = f"auto: {', '.join(axes)}, each group one output gather per call; sequence parallel over {sp}"
    if plan.reason:
        why += f" ({plan.reason})"
    return replace(plan, reason=why)


def _data_over_sequence(cfg: int, batch: int, sp: int, heads: int, ranks_per_node: int | None) -> Plan:
    """CFG and batch groups outermost, the default sequence-parallel plan over `sp` ranks inside
    (its reason kept)."""
    sequence = default_plan(sp, heads, math.gcd(sp, ranks_per_node) if ranks_per_node else None)
    order = ("cfg", "batch", *(a for a in sequence.order if a not in ("cfg", "batch")))
    return Plan(cfg=cfg, batch=batch, ring=sequence.ring, ulysses=sequence.ulysses, order=order, reason=sequence.reason)


def trial_plans(ranks: int, heads: int, ranks_per_node: int | None = None, cfg: bool = False, images: int = 1,
                stages: bool = False) -> list[Plan]:
    """The plans `--plan auto` times on a run's first steps (engine/plan_trials.py): `auto_plan`'s first,
    then the same CFG groups with each other sequence-parallel degree (a divisor of the ranks
    left), widest first, the rest of the ranks going to the batch axis, and last sequence
    parallelism over every rank without CFG groups (the default plan), and where that splits the
    heads unevenly, Ulysses over a degree that divides them with a ring (`even_heads_plan`). The candidates
    narrower than the rule's use fewer ranks per image, for where splitting an image does not
    pay; a call with fewer items than the CFG x batch groups runs whole on every group, with no
    exchange at all (engine/data_parallel.py). With `stages` (the model can be cut and nothing
    in the run refuses stages) and several nodes, last a pipeline stage per node with the
    default plan inside it: one hidden state per image crosses the nodes, where the others
    exchange in every layer (engine/stage_trials.py)."""
    chosen = auto_plan(ranks, heads, ranks_per_node, cfg=cfg, images=images)
    rest = ranks // chosen.cfg
    plans = [chosen]
    for sp in sorted((d for d in range(1, rest + 1) if rest % d == 0), reverse=True):
        plan = _data_over_sequence(chosen.cfg, rest // sp, sp, heads, ranks_per_node)
        per = " per CFG branch" if chosen.cfg > 1 else ""  # without CFG groups the ranks are all one branch's
        plans.append(replace(plan, reason=f"auto trial: sequence parallel over {sp} of {rest} ranks{per}"))
    plans.append(default_plan(ranks, heads, ranks_per_node))
    even = even_heads_plan(ranks, heads, ranks_per_node)
    if even is not None:
        plans.append(replace(even, reason=f"auto trial: {even.reason}"))
    if stages and ranks_per_node is not None and 1 < ranks_per_node < ranks and ranks % ranks_per_node == 0:
        inside = default_plan(ranks_per_node, heads, ranks_per_node)
        nodes = ranks // ranks_per_node
        why = f"auto trial: a pipeline stage per node ({nodes}), sequence parallel over its {ranks_per_node} ranks"
        plans.append(Plan(pipe=nodes, ring=inside.ring, ulysses=inside.ulysses, order=inside.order, reason=why))
    unique: dict[str, Plan] = {}
    for plan in plans:
        unique.setdefault(plan.short, plan)
    return list(unique.values())


def stage_ranges(costs: list[int], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of `costs` (one per block, in order), one per stage, each
    with at least one block, whose largest sum is the least possible (ties: the earlier cut)."""
    n = len(costs)
    if stages > n:
        raise UsageError(f"--plan: {stages} pipeline stages but the transformer has {n} blocks; use at most {n}")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: the least largest sum of blocks [0, i) in k stages; cut[k][i]: where its last stage starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ends, i = [], n
    for k in range(stages, 0, -1):
        ends.append(i)
        i = cut[k][i]
    ends.reverse()
    return list(zip([0, *ends[:-1]], ends))
