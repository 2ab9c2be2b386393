"""`parallelize(pipe_or_transformer, config)`: Ulysses sequence parallelism applied from outside.

Each supported transformer class has a plan, written as data in the manner of diffusers'
`_cp_plan`: which module inputs or outputs are split along the sequence at the transformer's
entry, and where the output is gathered at its exit. Forward hooks carry out the plan and the
family's processor replaces every attention processor through `set_processor`. The model code
and the diffusers pipeline are not touched: a stock pipeline runs as before, every rank computes
1/P of the tokens, and every rank ends with the same full output.

`parallelize` reads as the ordered steps it takes (in the manner of torchtitan's
`parallelize_llama`): the plan, the exchange, attention, the split hooks (hooks.py), V-Major,
pipeline stages, CFG/batch groups, the trials, V-First, compile, the step cache, sharded weights, then the
experts alike. Each `apply_*` step records its own undo in the `Parallelized` handle.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from types import MethodType
from typing import Any

import torch

from ..config.parallel import ParallelConfig, default_patches
from ..config.plan import AUTO, Plan, auto_plan, default_plan
from ..config.wire import EXACT, Wire
from ..distributed.clock import Clock
from ..distributed.comm import AutoExchange, CommStats, Exchange, make_exchange
from ..distributed.comm.group import PeerGroup
from ..distributed.comm.ulysses import all_ranks_sum
from ..distributed.topology import PlanGroups, Topology
from ..errors import UsageError
from .attention import UlyssesContext
from .attention.backends import resolve_backend
from .attention.dispatch import DispatchedAttention, check_backends, is_attention
from .cache.steps import apply_cache
from .compile import CompiledBlocks
from .data_parallel import DataParallelForward
from .families import (
    FAMILIES,
    Family,
    batch_args,
    check_family,
    check_run_needs,
    class_name,
    family_of,
    module_plans,
)
from .families.pipelines import uses_cfg
from .hooks import install_split_hooks, present_plans
from .parallelized import Parallelized
from .plan_inference import install_inferred_split, outside_block_lists
from .plan_trials import (
    PlanTrials,
    build_plan_trials,
    comm_trial_hook,
    plan_trial_hook,
    process_groups,
    trials_timing,
)
from .shard import shard_weights
from .patches import Patches
from .stage_trials import StageTrials
from .stages import StageCut, StageForward, cut_stages, whole_cut
from .steps import StepClock, vmajor_step_hook
from .vmajor import VMajor, VMajorCodec

__all__ = ["attention_heads", "all_ranks_sum", "FAMILIES", "Parallelized", "parallelize", "resolve_plan"]


def parallelize(pipe_or_transformer: Any, config: ParallelConfig | None = None, topology: Topology | None = None,
                exchange: Exchange | None = None, groups: PlanGroups | None = None, images: int = 1,
                plan_trials: PlanTrials | None = None, time_plans: bool = True, expert: str = "transformer",
                stats: CommStats | None = None, scheduler: Any = None) -> Parallelized:
    """Split a diffusers pipeline's (or a bare transformer's) attention over all ranks, by
    `config.plan` (Ulysses, or Ulysses x ring past the head count; see config/plan.py).

    Needs an initialized default process group (see `cocodiff.run.launch`). Every rank must call it
    with the same model; afterwards every rank runs the same pipeline call and gets the same output.
    `exchange` reuses an exchange built earlier (e.g. a calibrated `auto`) instead of `config.comm`:
    it is left as it is, and a copy of it counts this parallelization's traffic (and carries its
    V-Major codec). `groups` reuses a plan's groups built earlier (`topology.split(plan)`), so
    that repeated runs of one plan do not build new process groups each time. `images` (per
    prompt) informs `--plan auto`, which times its candidate plans on the first steps
    (engine/plan_trials.py; `plan_trials` reuses trials built earlier, so that a choice holds across
    runs) unless `time_plans` is False (then `plan.auto_plan`'s rule decides). A bare transformer's
    caller may pass the `scheduler` its loop steps, so that its steps are known (without one, each
    call is a step of its own: engine/steps.py). The steps run in this order; each says in its
    docstring why it comes where it does.
    """
    config = config or ParallelConfig()
    given = {"topology": topology, "groups": groups, "plan_trials": plan_trials}
    topology = topology or Topology.from_env(config.ranks_per_node, levels=config.levels)
    pipe, transformer = pipe_or_transformer, getattr(pipe_or_transformer, expert, pipe_or_transformer)
    family = family_of(transformer)
    plans = module_plans(family, transformer)  # None: inferred at the first call (engine/plan_inference.py)
    plans = present_plans(transformer, plans) if plans is not None else None  # refused before anything is installed
    if family.infer:  # attention outside the block lists (a text refiner inside an embedder) runs whole
        family = replace(family, local=outside_block_lists(transformer))
    if family.processor is None:  # stock processors: each must reach the exchange through the dispatcher
        check_backends(transformer, family.local)
    check_run_needs(transformer, {need for need, asked in (
        ("plan_trials", plan_trials is not None or (config.plan == AUTO and time_plans and groups is None)),
        ("v_major", not config.schedule.off), ("step_cache", config.cache is not None),
    ) if asked})
    if config.wire is not None:  # a level not in the run (the launcher's levels are known only here)
        config.wire.check([level for level, _ in topology.levels])
    vmajor = _v_major(config, getattr(pipe, "scheduler", None) if pipe is not transformer else scheduler)
    if groups is None and plan_trials is None and config.plan == AUTO and time_plans and vmajor is None:
        plan_trials = build_plan_trials(config, topology, attention_heads(transformer), uses_cfg(pipe), images,
                                        transformer if expert == "transformer" else None)
    groups, exchange = apply_plan(pipe, transformer, config, topology, images, groups, exchange, plan_trials)
    layouts = _stage_trials(transformer, plan_trials)  # every candidate's block layout while the trials run
    cut = _cut(transformer, groups, config) if layouts is None else None  # before anything goes on the blocks
    stats = stats or CommStats(clock=Clock(topology.device), timed=not config.compile)
    codec = VMajorCodec(vmajor, _node_format(config.wire, topology)) if vmajor is not None else None
    exchange, options = apply_exchange(config, groups, exchange, plan_trials, stats, codec)
    ctx = UlyssesContext(topology, exchange, stats, v_first=config.v_first is not False, fuse_qk=config.fuse_qk,
                         groups=groups, attention_backend=resolve_backend(config.attention_backend))
    parallel = Parallelized(ctx, transformer, plan_trials, stage_trials=layouts)
    apply_groups(parallel, given)
    apply_attention(parallel, family)
    apply_split(parallel, plans)
    apply_step_clock(parallel, pipe if pipe is not transformer else scheduler)
    apply_vmajor(parallel, vmajor)
    apply_stages(parallel, family, cut, config)
    bound = {c: (g, e, _data_group(g, topology, stats, config.wire)) for c, (g, e) in options.items()}
    data_forward = apply_data_parallel(parallel, family, bound)
    apply_trials(parallel, bound, data_forward)
    apply_v_first(parallel, family, config)
    apply_compile(parallel, family, config)
    apply_step_cache(parallel, config, data_forward)
    apply_shard(parallel, family, config)
    if layouts is not None:  # the layout of the trials' step now (the steps above installed on every block)
        layouts.use(plan_trials.trials.current)
    if hasattr(pipe, "set_progress_bar_config") and topology.rank != 0:
        pipe.set_progress_bar_config(disable=True)
    if expert == "transformer":
        apply_experts(parallel, pipe, family, config, images)
    return parallel


def apply_groups(parallel: Parallelized, given: dict[str, Any]) -> None:
    """Step 1b, the process groups this call made (not those it was `given`), for the run's owner to
    destroy once done with them (`Parallelized.release_groups`)."""
    ctx, trials = parallel.ctx, parallel.plan_trials

    def made() -> list[Any]:
        groups = [*((ctx.topology.groups or {}).values() if given["topology"] is None else ())]
        if given["plan_trials"] is None and trials is not None:
            groups += trials.held_groups()
        elif given["groups"] is None and trials is None:
            groups += process_groups(ctx.groups)
        if parallel.sharded is not None and parallel.sharded.made:  # the weights' mesh (step 11, later)
            groups.append(parallel.sharded.mesh.get_group())
        return groups

    parallel.groups_made = made


def apply_plan(pipe: Any, transformer: torch.nn.Module, config: ParallelConfig, topology: Topology, images: int,
               groups: PlanGroups | None, exchange: Exchange | None,
               plan_trials: PlanTrials | None) -> tuple[PlanGroups, Exchange | None]:
    """Step 1, the plan: the groups of the plan to run (`--plan auto`'s first candidate while its
    trials run, groups given, or the resolved plan's), and the exchange that goes with them."""
    if plan_trials is not None:
        return plan_trials.current
    if groups is None:
        return topology.split(resolve_plan(pipe, config, topology, images)), exchange
    groups.plan.check(topology.world_size, attention_heads(transformer))
    check_family(transformer, groups.plan, patches=config.pipe_patches is not None)
    return groups, exchange


def apply_exchange(config: ParallelConfig, groups: PlanGroups, exchange: Exchange | None,
                   plan_trials: PlanTrials | None, stats: CommStats,
                   codec: VMajorCodec | None) -> tuple[Exchange, dict[Any, tuple[PlanGroups, Exchange]]]:
    """Step 2, the exchange over the plan's Ulysses group (built, or a copy of the one given that
    counts into `stats`), and every plan this parallelization may run with its own exchange.
    Wire formats go on every one of them: LOSSY formats only where the user named them, never by auto."""
    if exchange is None:
        exchange = make_exchange(config.comm, groups.ulysses, stats, codec, v_first=config.v_first,
                                 lossy_wire=config.lossy_budget.wire if config.lossy_budget is not None else None)
    elif exchange.topology != groups.ulysses:
        raise UsageError(f"the exchange given spans {exchange.topology.describe()}, not plan {groups.plan.short}'s Ulysses group")
    else:
        exchange = exchange.with_state(stats, codec)
    exchange.functional = config.compile
    options = {c: (g, exchange if e is plan_trials.current[1] else e.with_state(stats, None)) for c, (g, e)
               in plan_trials.options.items()} if plan_trials is not None else {None: (groups, exchange)}
    for _, plan_exchange in options.values():
        plan_exchange.set_wire(config.wire)
    return exchange, options


def apply_attention(parallel: Parallelized, family: Family) -> None:
    """Step 3, attention over the exchange: the family's hand-written processor on every attention
    module, or the stock processors with their dispatcher calls routed to the exchange."""
    transformer, ctx = parallel.transformer, parallel.ctx
    if family.processor is not None:  # the model's attention bypasses the dispatcher, or a faster path
        original = dict(transformer.attn_processors)
        transformer.set_attn_processor({path: family.processor(ctx, path.removesuffix(".processor"), stock)
                                        for path, stock in original.items()})
        # Stock processors again on the layers still there (a pipeline stage holds only its blocks'; stock
        # processors keep no per-layer state, so a list shortened by a stage takes them by position).
        parallel.installed("attention", lambda: transformer.set_attn_processor(
            {path: original[path] for path in transformer.attn_processors}))
    else:
        parallel.dispatched = DispatchedAttention(ctx, transformer, family.local, family.square_masks)
        parallel.installed("attention", parallel.dispatched.undo)


def apply_split(parallel: Parallelized, plans: dict) -> None:
    """Step 4, the split hooks (hooks.py): on the transformer's blocks, or while `--plan auto`'s
    trials run with a stage candidate, on each candidate's block layout, acting while it runs
    (engine/stage_trials.py)."""
    transformer, ctx, layouts = parallel.transformer, parallel.ctx, parallel.stage_trials
    if plans is None:  # no plan written: inferred at the first call (its family takes no stages)
        parallel.hooked("split plan", install_inferred_split(transformer, ctx, parallel.inferred))
        return
    if layouts is None:
        parallel.hooked("split plan", install_split_hooks(transformer, plans, ctx))
        return
    hooks = []
    for key in list(layouts.layouts):
        layouts.use(key)
        hooks += install_split_hooks(transformer, plans, ctx, layouts.live(key))
    layouts.use(None)  # the whole transformer for the steps that follow: they install on every block
    parallel.hooked("split plan", hooks)


def apply_step_clock(parallel: Parallelized, pipe_or_scheduler: Any) -> None:
    """Step 4 too, ahead of every pre-hook but `--plan auto`'s: which denoising step each call is,
    from the pipeline's scheduler (`steps.StepClock`; a bare transformer's caller may pass its loop's
    scheduler), before a split hook cuts the call's tensors. Everything acting per step reads it:
    V-Major, CFG pairing, the trials, the step cache, displaced patches."""
    transformer = parallel.transformer
    scheduler = getattr(pipe_or_scheduler, "scheduler", pipe_or_scheduler)
    parallel.clock = StepClock(transformer, scheduler).install()
    parallel.installed("step clock", parallel.clock.remove)


def apply_vmajor(parallel: Parallelized, vmajor: VMajor | None) -> None:
    """Step 5, V-Major (after the split hooks: its step hook reads the call's timestep): the
    context's cached projections, the ranks' agreement on what to send, and which step each call is."""
    if vmajor is None:
        return
    parallel.ctx.vmajor = vmajor
    vmajor.agree = all_ranks_sum(parallel.topology)
    step_hook = vmajor_step_hook(parallel.clock.scheduler, vmajor, parallel.clock)
    hook = parallel.transformer.register_forward_pre_hook(step_hook, with_kwargs=True)
    parallel.hooked("V-Major", [hook])


def _cut(transformer: torch.nn.Module, groups: PlanGroups, config: ParallelConfig) -> StageCut | None:
    """This rank's stage's blocks (a plan with `p`), all blocks on one stage (displaced patches
    without `p`), or None. A stage's part goes to the device here (sharded weights, unit by unit
    as FSDP2 shards them)."""
    if groups.plan.pipe > 1:
        cut = cut_stages(transformer, groups)
        if groups.ulysses.device.type != "meta":  # a checkpoint read for this stage alone (models/stage_load.py)
            left = next((name for name, p in transformer.named_parameters() if p.is_meta), None)
            if left is not None:
                raise RuntimeError(f"stage {cut.stage} of {cut.stages}: {left} was not read from the checkpoint, "
                                   f"though this stage keeps it (the blocks were read for another cut)")
        if config.shard_weights is not True:  # loaded on the host (run/load.py): the stage's part to the device
            transformer.to(groups.ulysses.device)
        return cut
    return whole_cut(transformer) if config.pipe_patches is not None else None


def apply_stages(parallel: Parallelized, family: Family, cut: StageCut | None, config: ParallelConfig) -> None:
    """Step 5 too, pipeline stages (engine/stages.py; a plan with `p`): this rank keeps its stage's
    blocks, and the transformer's forward runs a call's images through the stages one by one. After
    the split hooks (they cut each image's sequence as without stages), before anything that wraps
    the blocks or the forward (the data axes, which hand each share to it; V-First; compile, refused
    with stages for now). The
    blocks were cut earlier (`cut_stages`, right after the plan): the split hooks and processors
    went on this stage's blocks only."""
    transformer, ctx = parallel.transformer, parallel.ctx
    if parallel.stage_trials is not None:  # `--plan auto` times a stage plan: its forward, run in its steps
        layouts = parallel.stage_trials
        for candidate, stage_cut in layouts.cuts.items():
            groups = parallel.plan_trials.options[candidate][0]
            layouts.add_forward(candidate, StageForward(transformer, stage_cut, groups, parallel.topology, ctx.stats,
                                                        batch_args(family, transformer), None,
                                                        parallel.clock.value, config.wire,
                                                        streams=family.block_streams, build_output=family.stage_output))
        _forward_as(transformer, layouts)
        parallel.installed("pipeline stages (--plan auto's trials)", layouts.undo)
        return
    if cut is None:
        return
    if config.pipe_patches is not None:  # displaced patches (LOSSY): engine/patches.py
        if parallel.clock.scheduler is None:
            raise UsageError("--pipe-patches needs the pipeline's scheduler to tell its runs apart (a stale run's "
                             "K/V would be reused): parallelize the pipeline, or pass the loop's `scheduler=`")
        count = default_patches(cut.stages) if config.pipe_patches == AUTO else config.pipe_patches
        ctx.patches = Patches(count, config.pipe_warmup, config.pipe_text)
    parallel.stages = StageForward(transformer, cut, ctx.groups, parallel.topology, ctx.stats,
                                   batch_args(family, transformer), ctx.patches, parallel.clock.value, config.wire,
                                   last_step=parallel.clock.last_step, streams=family.block_streams,
                                   build_output=family.stage_output)
    _forward_as(transformer, parallel.stages)
    parallel.installed("pipeline stages", parallel.stages.undo)


def _forward_as(transformer: torch.nn.Module, forward: Any) -> None:
    """`forward` (a callable object) as the transformer's forward, under its class's signature: a caller
    that passes only the arguments its forward names (MiniMax-H3's denoising loop) reads the same names."""
    forward.__signature__ = inspect.signature(type(transformer).forward.__get__(transformer))
    transformer.forward = forward


def apply_data_parallel(parallel: Parallelized, family: Family, bound: dict) -> DataParallelForward | None:
    """Step 6, CFG and batch groups (engine/data_parallel.py): the transformer's forward shares each call's
    batch over the plan's data groups; None when no plan this run may take has one."""
    if all(data is None for _, _, data in bound.values()):
        return None
    trials, transformer, ctx = parallel.plan_trials, parallel.transformer, parallel.ctx
    data = bound[trials.trials.current if trials is not None else None][2]
    # Under pipeline stages only the last stage reaches the output's sequence gather: the batch is
    # gathered at the exit, on every stage's ranks, from the output the stages hand back.
    forward = DataParallelForward(transformer, data, ctx.groups.plan.cfg, batch_args(family, transformer), ctx,
                                  gather_inside=family.processor is not None and parallel.stages is None,
                                  step=parallel.clock.value)
    if parallel.stages is not None:
        forward.forward = parallel.stages  # each share passes through the stages
    elif parallel.stage_trials is not None:  # the stage candidate (no data groups: each call whole) or the stock forward
        forward.forward = parallel.stage_trials
    _forward_as(transformer, forward)
    parallel.overrode("CFG/batch groups", [transformer])
    return forward


def apply_trials(parallel: Parallelized, bound: dict, data_forward: DataParallelForward | None) -> None:
    """Step 7, the trials on the first steps: `--plan auto`'s hook first of all the transformer's
    pre-hooks (it switches the plan a call runs), then `--comm auto`'s (it sets the step's V-First
    order). Both mark steps by the step clock."""
    transformer, ctx, topology = parallel.transformer, parallel.ctx, parallel.topology
    clock = parallel.clock.value
    if parallel.plan_trials is not None:
        hook = plan_trial_hook(parallel.plan_trials, bound, ctx, data_forward, topology,
                               _switch_layouts(parallel) if parallel.stage_trials is not None else None, clock)
        parallel.hooked("--plan auto", [transformer.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)])
        parallel.clock.install()  # in front again: the call's step is known before the step's plan is chosen
    if isinstance(ctx.exchange, AutoExchange):
        hook = comm_trial_hook(ctx.exchange.trials, ctx, topology, clock)
        parallel.hooked("--comm auto", [transformer.register_forward_pre_hook(hook, with_kwargs=True)])


def _switch_layouts(parallel: Parallelized):
    """What `--plan auto`'s hook calls at a step's first call: the step's block layout in place,
    and once the trials chose, the chosen one's for good (a stage's: `parallel.stages` from then)."""
    layouts = parallel.stage_trials

    def switch(candidate: Any, chosen: bool) -> None:
        layouts.use(candidate)
        if chosen:
            parallel.stages = layouts.commit(candidate)

    return switch


def _stage_trials(transformer: torch.nn.Module, plan_trials: PlanTrials | None) -> StageTrials | None:
    """The candidates' block layouts while `--plan auto`'s trials run with a stage candidate, else None."""
    if plan_trials is None or plan_trials.chosen is not None:
        return None
    staged = {c: groups for c, (groups, _) in plan_trials.options.items() if groups.plan.pipe > 1}
    return StageTrials(transformer, staged) if staged else None


def apply_v_first(parallel: Parallelized, family: Family, config: ParallelConfig) -> None:
    """Step 8, V-First's overlapped forwards on the family's blocks that have one (before compile
    and the step cache, which wrap the blocks' forwards as they find them)."""
    if config.v_first is False:
        return
    overridden = []
    for module in parallel.transformer.modules():
        forward = family.overlapped_forwards.get(class_name(module))
        if forward is not None:
            module.forward = MethodType(forward, module)
            overridden.append(module)
    parallel.overrode("V-First", overridden)


def apply_compile(parallel: Parallelized, family: Family, config: ParallelConfig) -> None:
    """Step 9, `--compile`: the repeated blocks compiled (as V-First left them) with the exchanges inside."""
    if not config.compile:
        return
    compiled = parallel.compiled = CompiledBlocks(parallel.transformer, family, parallel.stats)

    def undo() -> None:
        compiled.undo()  # eager blocks again (V-First's forwards, undone next)
        for hook in compiled.hooks:
            hook.remove()

    parallel.installed("compile", undo)


def apply_step_cache(parallel: Parallelized, config: ParallelConfig, data_forward: DataParallelForward | None) -> None:
    """Step 10, the step cache (LOSSY): last of the forward wrappers, it wraps the blocks' forwards
    as V-First and compile left them. A call that runs a CFG pair computes, on one CFG group, the
    other branch: a cache of its own."""
    if config.cache is None:
        return
    ctx = parallel.ctx
    paired = (lambda: data_forward._pending is not None) if data_forward is not None else None
    parallel.cache = apply_cache(parallel.transformer, config.cache, all_ranks_sum(parallel.topology), paired,
                                 trials_timing(parallel.plan_trials, ctx.exchange), lambda: ctx.groups,
                                 parallel.clock)
    parallel.installed("step cache", parallel.cache.undo)


def apply_shard(parallel: Parallelized, family: Family, config: ParallelConfig) -> None:
    """Step 11, `--shard-weights` (FSDP2): last, so that its hooks go around the plan's (its
    pre-forward first, its post-forward last). FSDP2 has no undo: the weights stay sharded."""
    if config.shard_weights is True:
        parallel.sharded = shard_weights(parallel.transformer, family, parallel.topology,
                                        parallel.ctx.groups.plan if parallel.ctx.groups is not None else None)


def apply_experts(parallel: Parallelized, pipe: Any, family: Family, config: ParallelConfig, images: int) -> None:
    """Step 12, the pipeline's other experts (Wan 2.2 A14B's `transformer_2`): the same plan, their
    own hooks and CFG pairing; under `--plan auto`'s trials an expert takes auto's rule."""
    fixed = parallel.plan_trials is None
    for name in family.experts:
        if getattr(pipe, name, None) is not None:
            ctx = parallel.ctx
            parallel.experts.append(parallelize(pipe, config, ctx.topology, ctx.exchange if fixed else None,
                                                ctx.groups if fixed else None, images, time_plans=False, expert=name,
                                                stats=ctx.stats))


def _node_format(wire: Wire | None, topology: Topology) -> tuple[Wire, str] | None:
    """What V-Major's codec packs its inter-node rows with: the wire and the node level's name
    (None: no wire format on the node level, its rows travel exactly)."""
    if wire is None:
        return None
    outermost = topology.link_levels[0][0]
    return (wire, outermost) if wire.format_for(outermost, outermost) != EXACT else None


def _v_major(config: ParallelConfig, scheduler: Any) -> VMajor | None:
    if config.schedule.off:
        return None
    if not hasattr(scheduler, "step_index"):
        raise UsageError("V-Major follows the denoising steps: parallelize the pipeline (or pass a bare "
                         "transformer's loop's `scheduler=`)")
    return VMajor(config.schedule, config.v_major_tensors, config.v_major_max_memory)


def _data_group(groups: PlanGroups, topology: Topology, stats: CommStats, wire: Wire | None) -> PeerGroup | None:
    """This rank's CFG / batch group under a plan (its gathers in `wire`'s formats), or None when the plan has none."""
    if groups.plan.cfg * groups.plan.batch == 1:
        return None
    return PeerGroup(topology, groups.data_group, groups.data_members, groups.data_index, stats, wire=wire)


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
    check_family(transformer, plan, patches=config.pipe_patches is not None)
    return plan


def attention_heads(transformer: torch.nn.Module) -> int:
    """The fewest attention heads of any attention module: the widest Ulysses degree."""
    heads = []
    for path, module in transformer.named_modules():
        if getattr(module, "fused_projections", False):
            raise UsageError(f"{path}: fused QKV projections are not supported; call unfuse_qkv_projections()")
        if not is_attention(module):
            continue
        count = next((c for n in ("heads", "num_heads", "num_attention_heads")  # Krea 2's, Ideogram 4's, Cosmos 3's
                      if isinstance(c := getattr(module, n, None), int)), None)
        if isinstance(count, int):
            heads.append(count)
    if not heads:
        raise UsageError(f"{type(transformer).__name__} has no attention modules with a head count")
    return min(heads)


