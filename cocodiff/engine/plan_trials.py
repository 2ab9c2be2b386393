"""`--plan auto`: the candidate plans timed on a run's own first steps, then the fastest.

`plan.auto_plan` places CFG and batch groups outermost by a rule: their one output gather per
call against sequence parallelism's exchanges in every layer. A rule cannot see what decides a
step on a given machine: how a share's compute scales, how slow the links are at these message
sizes, whether splitting an image pays at all. So, as `--comm auto` does for the exchange
(distributed/comm/auto.py `StepTrials`, whose schedule this reuses), the first steps are shared out among
`plan.trial_plans`: a warm-up step under the rule's plan, then whole steps of each candidate,
alternating, a step's time being the slowest rank's (an all-reduce, so every rank holds the same
numbers and commits to the same plan); close candidates are timed again once; the fastest runs
every later step, and every later run of the same `PlanTrials`.

Switching plans between steps: every candidate's groups are built up front (collectives, in the
same order on every rank) with its exchange. Once the trials choose (every rank at the same step),
the process groups only the other candidates used are destroyed: on NCCL each holds a
communicator and its buffers. The attention processors and the entry / exit hooks
read the plan from the shared `UlyssesContext`, so `UlyssesContext.use` switches them; the
transformer's forward is one `DataParallelForward` whose data group `use` switches (None for a
plan without CFG or batch groups). A switch happens before the first call of a step, when no true
CFG pair is pending. Every candidate computes the same images (to fp32 rounding), so the trial
steps are real steps of the image: nothing is thrown away. On several nodes a pipeline stage per
node is a candidate too (`stages_fit`): every rank holds the whole transformer while the trials
run, and the stage plan's steps run on its own block layout (engine/stage_trials.py).

With `--comm auto` a candidate is a plan and an exchange: flat for every plan, TAPA too for a
plan whose Ulysses groups span nodes with several ranks on each (comparing plans under flat alone
would hide what TAPA gains for Ulysses across nodes), V-First on unless `--v-first` says
otherwise; the trials then choose both, and no exchange trials follow. A step cache skips
nothing in a trial step (engine/parallelize.py `trials_timing`): a skipped step would make its candidate
win by the cache. The rule's plan runs
alone under V-Major (its caches are laid out per plan) and where a step's batch changes from step
to step (serving), so that step times do not compare.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config.parallel import ParallelConfig
from ..config.plan import AUTO, Plan, trial_plans
from ..distributed.comm import AutoExchange, Exchange, StepTrials, make_exchange
from ..distributed.comm.auto import trials_summary
from ..distributed.comm.group import PeerGroup
from ..distributed.comm.ulysses import all_reduce
from ..distributed.topology import PlanGroups, Topology, destroy_groups
from ..errors import UsageError
from .attention import UlyssesContext
from .cache.steps import cache_blocks
from .data_parallel import DataParallelForward
from .families import check_family

__all__ = ["PlanCandidate", "PlanTrials", "build_plan_trials"]


@dataclass(frozen=True)
class PlanCandidate:
    """A plan and the exchange its Ulysses groups run (`comm` as in `--comm`)."""

    plan: Plan
    comm: str
    named_with_comm: bool = False
    """Name it `plan:comm` (when the trials also choose the exchange) rather than by its plan."""

    @property
    def name(self) -> str:
        return f"{self.plan.short}:{self.comm}" if self.named_with_comm else self.plan.short


@dataclass(eq=False)
class PlanTrials:
    """The candidates, each with its groups and exchange, and the trials' schedule. Kept across
    runs (bench e2e's repeats) so that a choice holds."""

    options: dict[PlanCandidate, tuple[PlanGroups, Exchange]]
    trials: StepTrials
    released: int | None = None
    """Process groups destroyed once the trials chose (None before)."""

    @property
    def current(self) -> tuple[PlanGroups, Exchange]:
        """The groups and exchange of the step running now (the chosen ones once chosen)."""
        return self.options[self.trials.current]

    @property
    def chosen(self) -> PlanCandidate | None:
        """The candidate committed to; None while the trials run."""
        return self.trials.choice

    @property
    def plan(self) -> Plan:
        """The plan of the step running now, its reason saying how the trials stand."""
        report = self.report()
        tried = trials_summary(report) or "none timed"
        if self.trials.choice is not None:
            return replace(self.trials.choice.plan, reason=f"auto: the fastest of the plans timed on the first steps ({tried})")
        current = self.trials.current.plan
        return replace(current, reason=f"auto: undecided after {report['trial_steps']} trial step(s) ({tried}), "
                                       f"more steps decide; this step's plan: {current.reason}")

    def release_losers(self) -> None:
        """Once chosen, destroy the process groups that only the other candidates use (a collective
        moment: every rank commits to the same choice at the same step boundary). Idempotent."""
        if self.chosen is None or self.released is not None:
            return
        keep = {id(g) for g in process_groups(self.options[self.chosen][0])}
        losers = {id(g): g for c, (groups, _) in self.options.items() if c != self.chosen for g in process_groups(groups)}
        self.released = destroy_groups(g for key, g in losers.items() if key not in keep)

    def held_groups(self) -> list[dist.ProcessGroup]:
        """The process groups the candidates still hold: all of them, or the chosen one's once the
        others' are released."""
        chosen = [self.options[self.chosen]] if self.released is not None else list(self.options.values())
        return [g for groups, _ in chosen for g in process_groups(groups)]

    def report(self) -> dict[str, Any]:
        """`StepTrials.report()`: each plan's fastest step, the trial steps, the choice."""
        return {**self.trials.report(), "name": "plan auto"}


def build_plan_trials(config: ParallelConfig, topology: Topology, heads: int, guided: bool, images: int,
                      transformer: torch.nn.Module | None = None) -> PlanTrials | None:
    """The trials of `plan.trial_plans` on these ranks (a collective: every rank builds every
    candidate's groups), or None when only one candidate fits (e.g. a single rank). A pipeline
    stage per node is a candidate where `transformer` can be cut and the run takes stages
    (`stages_fit`)."""
    options: dict[PlanCandidate, tuple[PlanGroups, Exchange]] = {}
    both = config.comm == AUTO
    stages = transformer is not None and stages_fit(config, transformer, topology)
    for plan in trial_plans(topology.world_size, heads, topology.ranks_per_node, cfg=guided, images=images,
                            stages=stages):
        try:
            if transformer is not None:
                check_family(transformer, plan)  # e.g. batch groups, which Z-Image refuses
            groups = topology.split(plan)
        except UsageError:  # or its Ulysses groups do not fall into equal runs of ranks per node: not a candidate
            continue
        comms = (["flat", "tapa"] if groups.ulysses.hierarchical else ["flat"]) if both else [config.comm]
        for comm in comms:
            exchange = make_exchange(comm, groups.ulysses, None, v_first=config.v_first,
                                     lossy_wire=config.lossy_budget.wire if config.lossy_budget is not None else None)
            options[PlanCandidate(plan, comm, named_with_comm=both)] = (groups, exchange)
    if len(options) < 2:
        return None
    return PlanTrials(options, StepTrials(list(options), device=topology.device))


def stages_fit(config: ParallelConfig, transformer: torch.nn.Module, topology: Topology) -> bool:
    """Whether `--plan auto` may time a pipeline stage per node: the transformer's family takes
    stages, it has a block per node at least, and nothing in the run refuses stages (a step cache,
    sharded weights over a node's ranks, displaced patches; V-Major runs no trials at all)."""
    if config.cache is not None or config.shard_weights is True or config.pipe_patches is not None:
        return False
    nodes = topology.world_size // topology.ranks_per_node if topology.ranks_per_node else 1
    if nodes < 2:
        return False
    try:
        check_family(transformer, Plan(pipe=nodes))  # a family that refuses stages
        return len(cache_blocks(transformer)) >= nodes  # (none: no list of blocks to cut)
    except UsageError:
        return False


def process_groups(groups: PlanGroups) -> list[dist.ProcessGroup]:
    """Every process group a plan's split made for this rank: Ulysses and its levels (not those of
    the whole run, which a plan of every rank shares), ring, data, and a stage's, its output's and its hand-ons'."""
    ulysses = groups.ulysses
    own_levels = (ulysses.groups or {}).values() if ulysses.members is not None else ()
    found = [ulysses.group, *own_levels, groups.ring_group, groups.data_group, groups.stage_group, groups.output_group,
             *groups.boundary_groups]
    return [g for g in found if g is not None]


def trials_timing(plan_trials: PlanTrials | None, exchange: Exchange) -> Callable[[], bool]:
    """Whether `--plan auto`'s or `--comm auto`'s trials still time steps. A step cache computes
    every block of such a step: a skipped step runs in a fraction of a computed one's time and
    sends nothing, so the candidate it fell to would win by the cache, not by its speed. Every
    rank holds the same answer (the trials' choice is taken on agreed times), so the cache's
    decisions stay agreed; its warm-up counts on through the trial steps."""
    trials = [t for t in (plan_trials.trials if plan_trials is not None else None,
                          exchange.trials if isinstance(exchange, AutoExchange) else None) if t is not None]
    return lambda: any(t.choice is None for t in trials)


def _slowest(topology: Topology, what: str) -> Callable[[float], float]:
    """seconds -> the maximum over every rank (an all-reduce: every rank calls it at the same point)."""

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=topology.device)
        return all_reduce(t, topology.world_group, f"{what} (all-reduce)", op=dist.ReduceOp.MAX).item()

    return slowest


def comm_trial_hook(trials: StepTrials, ctx: UlyssesContext, topology: Topology, step: Callable[[], float]):
    """Before each transformer call: let `--comm auto`'s trials mark step boundaries (a collective
    on every rank at each trial step's end) and set the step's V-First order. (Under `--plan auto`
    the plan trials choose the exchange too: their candidates' exchanges are never `auto`.) The hook
    marks steps by `step` (`steps.StepClock.value`), the same on every rank."""
    slowest = _slowest(topology, "auto's trial step time")
    settled = [False]  # the choice is made and applied: nothing more to do

    def hook(_module, args, kwargs):
        if settled[0]:
            return args, kwargs
        if trials.step_boundary(step(), slowest):
            ctx.v_first = trials.current.v_first
            settled[0] = trials.choice is not None
        return args, kwargs

    return hook


def plan_trial_hook(trials: PlanTrials, bound: dict[PlanCandidate, tuple[PlanGroups, Exchange, PeerGroup | None]],
                     ctx: UlyssesContext, data_forward: DataParallelForward | None, topology: Topology,
                     layouts: Callable[[PlanCandidate, bool], None] | None = None,
                     step: Callable[[], float] | None = None):
    """Before each transformer call (first of the hooks): let `--plan auto`'s trials mark step
    boundaries and, at a step's first call, switch to the plan of the step (engine/plan_trials.py);
    `layouts(candidate, chosen)` puts its block layout in place (engine/stage_trials.py)."""
    slowest = _slowest(topology, "plan auto's trial step time")
    settled = [False]  # the chosen plan runs: nothing more to do

    def hook(_module, args, kwargs):
        if settled[0]:
            return args, kwargs
        if trials.trials.step_boundary(step(), slowest):
            groups, exchange, data = bound[trials.trials.current]
            if exchange is not ctx.exchange:
                ctx.use(groups, exchange)
                if data_forward is not None:
                    data_forward.use(data, groups.plan.cfg)
            settled[0] = trials.trials.choice is not None
            if layouts is not None:
                layouts(trials.trials.current, settled[0])
            if settled[0]:
                trials.release_losers()
        return args, kwargs

    return hook
