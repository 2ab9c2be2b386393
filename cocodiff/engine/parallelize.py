"""`parallelize(pipe_or_transformer, config)`: Ulysses sequence parallelism applied from outside.

Each supported transformer class has a plan, written as data in the manner of diffusers'
`_cp_plan`: which module inputs or outputs are split along the sequence at the transformer's
entry, and where the output is gathered at its exit. Forward hooks carry out the plan and the
family's processor replaces every attention processor through `set_processor`. The model code
and the diffusers pipeline are not touched: a stock pipeline runs as before, every rank computes
1/P of the tokens, and every rank ends with the same full output.

Sequence dims are negative so a plan holds with or without a batch dim.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from .attention import UlyssesContext
from .attention.dispatch import DispatchedAttention
from .cache.steps import StepCache, apply_cache
from ..distributed.clock import Clock
from ..distributed.comm import AutoExchange, CommStats, Exchange, StepTrials, make_exchange
from ..distributed.comm.group import PeerGroup
from ..distributed.comm.ulysses import all_reduce
from .compile import CompiledBlocks
from ..config.parallel import ParallelConfig
from . import data_parallel
from .data_parallel import DataParallelForward
from ..errors import UsageError
from .families import (
    FAMILIES,
    class_name,
    Gather,
    ModulePlan,
    Split,
    batch_args,
    family_of,
    module_plans,
)
from ..config.plan import AUTO, Plan, auto_plan, default_plan
from .plan_trials import PlanCandidate, PlanTrials, build_plan_trials
from .families.pipelines import uses_cfg
from .shard import ShardedWeights, shard_weights
from ..distributed.topology import PlanGroups, Topology
from .vmajor import VMajor, VMajorCodec
from ..config.wire import EXACT, Wire


__all__ = ["attention_heads", "all_ranks_sum", "FAMILIES", "Parallelized", "parallelize", "resolve_plan"]


@dataclass
class Parallelized:
    """What `parallelize` did: the shared context (topology, stats) and a way to undo it."""

    ctx: UlyssesContext
    transformer: torch.nn.Module
    hooks: list[RemovableHandle]
    original_processors: dict[str, Any]
    overridden: list[torch.nn.Module] = field(default_factory=list)
    plan_trials: PlanTrials | None = None
    """`--plan auto`'s trials of candidate plans on the first steps, when they run."""
    compiled: CompiledBlocks | None = None
    """The compiled blocks under `config.compile`."""
    cache: StepCache | None = None
    """The step cache under `config.cache` (LOSSY; its decisions agreed by every rank)."""
    dispatched: DispatchedAttention | None = None
    """The stock processors' route to the exchange (families with no hand-written processor)."""
    experts: list[Parallelized] = field(default_factory=list)
    """The pipeline's other experts (Wan 2.2 A14B's `transformer_2`), parallelized alike."""
    sharded: ShardedWeights | None = None
    """The transformer's weights sharded over each node's ranks (`config.shard_weights`; shard.py)."""

    @property
    def topology(self) -> Topology:
        return self.ctx.topology

    @property
    def weights_sharded(self) -> bool:
        """The transformer's (or an expert's) weights are sharded: the pipeline runs on all ranks only."""
        return self.sharded is not None or any(e.weights_sharded for e in self.experts)

    @property
    def stats(self) -> CommStats:
        return self.ctx.stats

    @property
    def plan(self) -> Plan:
        """The plan run: written, or chosen (its `reason` says why); during `--plan auto`'s trials, the plan of the step."""
        return self.plan_trials.plan if self.plan_trials is not None else self.ctx.groups.plan

    @property
    def lossy(self) -> bool:
        """True when V-Major reuses cached projections, a step cache skips blocks or a wire format
        rounds messages (the output is no longer exact)."""
        return (self.cache is not None or (self.ctx.vmajor is not None and self.ctx.vmajor.schedule.lossy)
                or self.ctx.exchange.wire is not None)

    def auto_choice(self) -> dict[str, Any] | None:
        """What `--comm auto`'s trials measured and chose: the exchange's own trials, or those of
        `--plan auto`, which choose the exchange with the plan; None when the exchange is fixed."""
        if self.plan_trials is not None and any(c.named_with_comm for c in self.plan_trials.options):
            return self.plan_trials.report()
        return self.ctx.exchange.report() if isinstance(self.ctx.exchange, AutoExchange) else None

    def undo(self) -> None:
        """Remove the hooks and restore the original attention processors. Sharded weights stay
        sharded (FSDP2 has no undo): the pipeline runs on all ranks of the mesh, not on one alone."""
        for other in self.experts:
            other.undo()
        if self.cache is not None:
            self.cache.undo()  # first: it wraps the compiled and V-First's forwards
        if self.compiled is not None:
            self.compiled.undo()  # eager blocks again (V-First's forwards, removed below)
        for hook in self.hooks:
            hook.remove()
        for module in self.overridden:
            del module.forward  # back to the class's own forward
        if self.dispatched is not None:
            self.dispatched.undo()
        else:
            self.transformer.set_attn_processor(self.original_processors)


def parallelize(
    pipe_or_transformer: Any,
    config: ParallelConfig | None = None,
    topology: Topology | None = None,
    exchange: Exchange | None = None,
    groups: PlanGroups | None = None,
    images: int = 1,
    plan_trials: PlanTrials | None = None,
    time_plans: bool = True,
    expert: str = "transformer",
    stats: CommStats | None = None,
) -> Parallelized:
    """Split a diffusers pipeline's (or a bare transformer's) attention over all ranks, by
    `config.plan` (Ulysses, or Ulysses x ring past the head count; see plan.py).

    Needs an initialized default process group (see `cocodiff.run.launch`). Every rank must call it
    with the same model; afterwards every rank runs the same pipeline call and gets the same output.
    `exchange` reuses an exchange built earlier (e.g. a calibrated `auto`) instead of `config.comm`:
    it is left as it is, and a copy of it counts this parallelization's traffic (and carries its
    V-Major codec). `groups` reuses a plan's groups built earlier (`topology.split(plan)`), so
    that repeated runs of one plan do not build new process groups each time. `images` (per
    prompt) informs `--plan auto`, which times its candidate plans on the first steps
    (plan_trials.py; `plan_trials` reuses trials built earlier, so that a choice holds across
    runs) unless `time_plans` is False (then `plan.auto_plan`'s rule decides).
    """
    config = config or ParallelConfig()
    topology = topology or Topology.from_env(config.ranks_per_node, levels=config.levels)
    transformer = getattr(pipe_or_transformer, expert, pipe_or_transformer)
    family = family_of(transformer)
    plans = module_plans(family, transformer)
    if config.wire is not None:  # a level not in the run (the launcher's levels are known only here)
        config.wire.check([level for level, _ in topology.levels])
    vmajor = _v_major(config, pipe_or_transformer)
    codec = VMajorCodec(vmajor, _node_format(config.wire, topology)) if vmajor is not None else None
    if groups is None and plan_trials is None and config.plan == AUTO and time_plans and vmajor is None:
        plan_trials = build_plan_trials(config, topology, attention_heads(transformer), uses_cfg(pipe_or_transformer), images)
    if plan_trials is not None:
        groups, exchange = plan_trials.current
    elif groups is None:
        groups = topology.split(resolve_plan(pipe_or_transformer, config, topology, images))
    else:
        groups.plan.check(topology.world_size, attention_heads(transformer))

    stats = stats or CommStats(clock=Clock(topology.device), timed=not config.compile)
    if exchange is None:
        exchange = make_exchange(config.comm, groups.ulysses, stats, codec, v_first=config.v_first,
                                 lossy_wire=config.lossy_budget.wire if config.lossy_budget is not None else None)
    elif exchange.topology != groups.ulysses:
        raise UsageError(f"the exchange given spans {exchange.topology.describe()}, not plan {groups.plan.short}'s Ulysses group")
    else:
        exchange = exchange.with_state(stats, codec)
    exchange.functional = config.compile
    # Every plan this parallelization may run: its groups and exchange (counting into `stats`).
    options = {c: (g, exchange if e is plan_trials.current[1] else e.with_state(stats, None)) for c, (g, e)
               in plan_trials.options.items()} if plan_trials is not None else {None: (groups, exchange)}
    for _, plan_exchange in options.values():  # LOSSY formats only where the user named them: never by auto
        plan_exchange.set_wire(config.wire)
    ctx = UlyssesContext(topology, exchange, stats, v_first=config.v_first is not False, fuse_qk=config.fuse_qk,
                         groups=groups)
    original = dict(transformer.attn_processors) if family.processor is not None else {}  # dispatched: undone by itself
    dispatched = None
    if family.processor is not None:  # hand-written: the model's attention bypasses the dispatcher, or a faster path
        transformer.set_attn_processor({path: family.processor(ctx, path.removesuffix(".processor")) for path in original})
    else:  # the stock processors, their dispatcher calls routed to the exchange
        dispatched = DispatchedAttention(ctx, transformer, family.local, family.square_masks)
    hooks = _install_hooks(transformer, plans, ctx)
    if vmajor is not None:
        ctx.vmajor = vmajor
        vmajor.agree = all_ranks_sum(topology)
        hooks.append(transformer.register_forward_pre_hook(_step_hook(pipe_or_transformer.scheduler, vmajor), with_kwargs=True))
    overridden = []
    bound = {c: (g, e, _data_group(g, topology, stats, config.wire)) for c, (g, e) in options.items()}
    data_forward = None
    if any(data is not None for _, _, data in bound.values()):  # CFG / batch groups share each call's batch (data_parallel.py)
        data = bound[plan_trials.trials.current if plan_trials is not None else None][2]
        data_forward = DataParallelForward(transformer, data, groups.plan.cfg, batch_args(family, transformer), ctx,
                                           gather_inside=family.processor is not None)
        transformer.forward = data_forward
        overridden.append(transformer)
    if plan_trials is not None:  # `--plan auto`: the first steps try each candidate plan (plan_trials.py)
        hook = _plan_trial_hook(plan_trials, bound, ctx, data_forward, topology)
        hooks.append(transformer.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    if isinstance(exchange, AutoExchange):  # `--comm auto`: the first steps try each candidate
        hooks.append(transformer.register_forward_pre_hook(_trial_hook(exchange.trials, ctx, topology), with_kwargs=True))
    if config.v_first is not False:
        for module in transformer.modules():
            forward = family.overlapped_forwards.get(class_name(module))
            if forward is not None:
                module.forward = MethodType(forward, module)
                overridden.append(module)
    compiled = None
    if config.compile:
        compiled = CompiledBlocks(transformer, family, stats)
        hooks += compiled.hooks
    cache = None
    if config.cache is not None:  # last: it wraps the blocks' forwards as V-First left them
        # A call that runs a CFG pair computes, on one CFG group, the other branch: a cache of its own.
        paired = (lambda: data_forward._pending is not None) if data_forward is not None else None
        cache = apply_cache(transformer, config.cache, all_ranks_sum(topology), paired,
                            _trials_timing(plan_trials, exchange), lambda: ctx.groups)
    # Last: FSDP2's hooks go around the plan's (its pre-forward first, its post-forward last).
    sharded = shard_weights(transformer, family, topology) if config.shard_weights is True else None
    if hasattr(pipe_or_transformer, "set_progress_bar_config") and topology.rank != 0:
        pipe_or_transformer.set_progress_bar_config(disable=True)
    parallel = Parallelized(ctx, transformer, hooks, original, overridden, plan_trials, compiled, cache, dispatched,
                            sharded=sharded)
    for name in family.experts if expert == "transformer" else ():
        if getattr(pipe_or_transformer, name, None) is not None:  # the same plan, its own hooks and CFG pairing
            fixed = plan_trials is None  # under --plan auto's trials: the expert takes auto's rule
            parallel.experts.append(parallelize(pipe_or_transformer, config, topology, exchange if fixed else None,
                                                groups if fixed else None, images, time_plans=False, expert=name,
                                                stats=stats))
    return parallel


def _node_format(wire: Wire | None, topology: Topology) -> tuple[Wire, str] | None:
    """What V-Major's codec packs its inter-node rows with: the wire and the node level's name
    (None: no wire format on the node level, its rows travel exactly)."""
    if wire is None:
        return None
    outermost = topology.link_levels[0][0]
    return (wire, outermost) if wire.format_for(outermost, outermost) != EXACT else None


def _v_major(config: ParallelConfig, pipe: Any) -> VMajor | None:
    if config.schedule.off:
        return None
    if not hasattr(pipe, "scheduler"):
        raise UsageError("V-Major follows the denoising steps: parallelize the pipeline, not the bare transformer")
    return VMajor(config.schedule, config.v_major_tensors, config.v_major_max_memory)


def all_ranks_sum(topology: Topology) -> Callable[[torch.Tensor], list[float]]:
    """values (a tensor) -> their sums over every rank (float64 all-reduce on the world group)."""

    def agree(values: torch.Tensor) -> list[float]:
        t = values.to(device=topology.device, dtype=torch.float64, copy=True)
        return all_reduce(t, topology.world_group, "agreement (all-reduce)").tolist()

    return agree


def _trials_timing(plan_trials: PlanTrials | None, exchange: Exchange) -> Callable[[], bool]:
    """Whether `--plan auto`'s or `--comm auto`'s trials still time steps. A step cache computes
    every block of such a step: a skipped step runs in a fraction of a computed one's time and
    sends nothing, so the candidate it fell to would win by the cache, not by its speed. Every
    rank holds the same answer (the trials' choice is taken on agreed times), so the cache's
    decisions stay agreed; its warm-up counts on through the trial steps."""
    trials = [t for t in (plan_trials.trials if plan_trials is not None else None,
                          exchange.trials if isinstance(exchange, AutoExchange) else None) if t is not None]
    return lambda: any(t.choice is None for t in trials)


def _timestep_of(args: tuple, kwargs: dict[str, Any]) -> float:
    """A transformer call's timestep (`data_parallel.timestep_value`); 0 when it has none."""
    value = data_parallel.timestep_value(kwargs.get("timestep", args[3] if len(args) > 3 else None))
    return 0.0 if value is None else value


def _slowest(topology: Topology, what: str) -> Callable[[float], float]:
    """seconds -> the maximum over every rank (an all-reduce: every rank calls it at the same point)."""

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=topology.device)
        return all_reduce(t, topology.world_group, f"{what} (all-reduce)", op=dist.ReduceOp.MAX).item()

    return slowest


def _trial_hook(trials: StepTrials, ctx: UlyssesContext, topology: Topology):
    """Before each transformer call: let `--comm auto`'s trials mark step boundaries (a collective
    on every rank at each trial step's end) and set the step's V-First order. (Under `--plan auto`
    the plan trials choose the exchange too: their candidates' exchanges are never `auto`.)"""
    slowest = _slowest(topology, "auto's trial step time")
    settled = [False]  # the choice is made and applied: no more reads of the timestep (a host sync per call)

    def hook(_module, args, kwargs):
        if settled[0]:
            return args, kwargs
        if trials.step_boundary(_timestep_of(args, kwargs), slowest):
            ctx.v_first = trials.current.v_first
            settled[0] = trials.choice is not None
        return args, kwargs

    return hook


def _plan_trial_hook(trials: PlanTrials, bound: dict[PlanCandidate, tuple[PlanGroups, Exchange, PeerGroup | None]],
                     ctx: UlyssesContext, data_forward: DataParallelForward | None, topology: Topology):
    """Before each transformer call (first of the hooks): let `--plan auto`'s trials mark step
    boundaries and, at a step's first call, switch to the plan of the step (plan_trials.py)."""
    slowest = _slowest(topology, "plan auto's trial step time")
    settled = [False]  # the chosen plan runs: no more reads of the timestep (a host sync per call)

    def hook(_module, args, kwargs):
        if settled[0]:
            return args, kwargs
        if trials.trials.step_boundary(_timestep_of(args, kwargs), slowest):
            groups, exchange, data = bound[trials.trials.current]
            if exchange is not ctx.exchange:
                ctx.use(groups, exchange)
                if data_forward is not None:
                    data_forward.use(data, groups.plan.cfg)
            settled[0] = trials.trials.choice is not None
            if settled[0]:
                trials.release_losers()
        return args, kwargs

    return hook


def _data_group(groups: PlanGroups, topology: Topology, stats: CommStats, wire: Wire | None) -> PeerGroup | None:
    """This rank's CFG / batch group under a plan (its gathers in `wire`'s formats), or None when the plan has none."""
    if groups.plan.cfg * groups.plan.batch == 1:
        return None
    return PeerGroup(topology, groups.data_group, groups.data_members, groups.data_index, stats, wire=wire)


def _step_hook(scheduler: Any, vmajor: VMajor):
    """Tell V-Major which denoising step each transformer call belongs to (the same on all ranks)."""

    def hook(_module, args, kwargs):
        value = _timestep_of(args, kwargs)
        steps = len(scheduler.timesteps) if getattr(scheduler, "timesteps", None) is not None else 1
        vmajor.begin_call(scheduler.step_index or 0, steps, value)
        return args, kwargs

    return hook


def resolve_plan(pipe_or_transformer: Any, config: ParallelConfig, topology: Topology, images: int = 1) -> Plan:
    """`config.plan`; with `auto`, the plan for this pipeline's guidance and `images` per call
    (`auto_plan`); else the default plan for this model on these ranks. Checked against both."""
    transformer = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    heads = attention_heads(transformer)
    if config.plan == AUTO:
        guided = uses_cfg(pipe_or_transformer)
        plan = auto_plan(topology.world_size, heads, topology.ranks_per_node, cfg=guided, images=images)
    else:
        plan = config.plan or default_plan(topology.world_size, heads, topology.ranks_per_node)
    plan.check(topology.world_size, heads)
    return plan


def attention_heads(transformer: torch.nn.Module) -> int:
    """The fewest attention heads of any attention module: the widest Ulysses degree."""
    heads = []
    for path, module in transformer.named_modules():
        if getattr(module, "fused_projections", False):
            raise UsageError(f"{path}: fused QKV projections are not supported; call unfuse_qkv_projections()")
        if hasattr(module, "set_processor") and getattr(module, "heads", None) is not None:
            heads.append(module.heads)
    if not heads:
        raise UsageError(f"{type(transformer).__name__} has no attention modules with a head count")
    return min(heads)


def _matching_modules(root: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    if pattern == "":
        return [root]
    depth = pattern.count(".")  # '*' stands for exactly one path component
    return [m for path, m in root.named_modules() if path.count(".") == depth and fnmatch.fnmatchcase(path, pattern)]


def _install_hooks(transformer: torch.nn.Module, plans: dict[str, ModulePlan], ctx: UlyssesContext) -> list[RemovableHandle]:
    hooks = []
    for pattern, module_plan in plans.items():
        modules = _matching_modules(transformer, pattern)
        if not modules:
            raise RuntimeError(f"{type(transformer).__name__} has no module {pattern!r}; is diffusers too new?")
        for module in modules:
            if module_plan.inputs:
                hooks.append(module.register_forward_pre_hook(_input_hook(module, module_plan.inputs, ctx), with_kwargs=True))
            if module_plan.output is not None:
                hooks.append(module.register_forward_hook(_output_hook(module_plan.output, ctx)))
    return hooks


def _input_hook(module: torch.nn.Module, inputs: dict[str, Split], ctx: UlyssesContext):
    positions = list(inspect.signature(module.forward).parameters)

    def hook(_module, args, kwargs):
        args = list(args)
        for name, split in inputs.items():
            if name in kwargs and _splits(kwargs[name], split):
                kwargs[name] = ctx.shard(kwargs[name], split.dim, split.stream)
            elif name in positions and positions.index(name) < len(args):
                i = positions.index(name)
                if _splits(args[i], split):
                    args[i] = ctx.shard(args[i], split.dim, split.stream)
        return tuple(args), kwargs

    return hook


def _output_hook(spec: Split | Gather | dict[int, Split], ctx: UlyssesContext):
    def apply(x: torch.Tensor, s: Split | Gather) -> torch.Tensor:
        if isinstance(s, Gather):
            return ctx.gather(x, s.dim, s.stream)
        return ctx.shard(x, s.dim, s.stream) if _splits(x, s) else x

    def hook(_module, _args, output):
        if isinstance(spec, dict):
            items = list(output)
            for index, s in spec.items():
                items[index] = apply(items[index], s)
            return type(output)(items)
        return apply(output, spec)

    return hook


def _splits(x: Any, split: Split) -> bool:
    """Whether `split` applies to `x`: a tensor, of the plan's number of dims when it names one."""
    return isinstance(x, torch.Tensor) and (split.dims is None or x.dim() == split.dims)
