"""`Parallelized`: what `parallelize` installed, and its undo (one reversed loop over named steps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from ..config.plan import Plan
from ..distributed.comm import AutoExchange, CommStats
from ..distributed.topology import Topology, destroy_groups
from .attention import UlyssesContext
from .attention.dispatch import DispatchedAttention
from .cache.steps import StepCache
from .compile import CompiledBlocks
from .plan_trials import PlanTrials
from .shard import ShardedWeights
from .stage_trials import StageTrials
from .stages import StageForward
from .steps import StepClock


@dataclass
class Parallelized:
    """What `parallelize` did: the shared context (topology, stats), what each step installed, and
    a way to undo it all."""

    ctx: UlyssesContext
    transformer: torch.nn.Module
    plan_trials: PlanTrials | None = None
    """`--plan auto`'s trials of candidate plans on the first steps, when they run."""
    clock: StepClock | None = None
    """Which denoising step each call belongs to (from the pipeline's scheduler): what every part acting per step reads."""
    compiled: CompiledBlocks | None = None
    """The compiled blocks under `config.compile`."""
    cache: StepCache | None = None
    """The step cache under `config.cache` (LOSSY; its decisions agreed by every rank)."""
    dispatched: DispatchedAttention | None = None
    """The stock processors' route to the exchange (families with no hand-written processor)."""
    experts: list[Parallelized] = field(default_factory=list)
    """The pipeline's other experts (Wan 2.2 A14B's `transformer_2`), parallelized alike."""
    sharded: ShardedWeights | None = None
    """The transformer's weights sharded over each node's ranks (`config.shard_weights`; engine/shard.py)."""
    stages: StageForward | None = None
    """This rank's pipeline stage (a plan with `p`; engine/stages.py): it holds only its blocks."""
    stage_trials: StageTrials | None = None
    """Every candidate's block layout while `--plan auto`'s trials time a stage plan (engine/stage_trials.py)."""
    inferred: dict[str, Any] = field(default_factory=dict)
    """A class with no plan written: its plan inferred at the first call, under 'plan' (engine/plan_inference.py)."""
    undos: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    """(step, its undo) in the order the steps were applied; `undo` runs them in reverse."""
    groups_made: Callable[[], list[Any]] = lambda: []
    """The process groups `parallelize` made for this run (not those it was given), for `release_groups`."""

    def installed(self, step: str, undo: Callable[[], None]) -> None:
        """Record what undoes `step` (called by each step of `parallelize` that changed the model)."""
        self.undos.append((step, undo))

    def hooked(self, step: str, hooks: list[RemovableHandle]) -> None:
        """Record `step`'s forward hooks, removed by `undo`."""
        if hooks:
            self.installed(step, lambda: [hook.remove() for hook in hooks])

    def overrode(self, step: str, modules: list[torch.nn.Module]) -> None:
        """Record the modules whose `forward` `step` replaced, given back their class's own by `undo`."""
        if modules:
            self.installed(step, lambda: [delattr(module, "forward") for module in modules])

    @property
    def partial_weights(self) -> bool:
        """This rank holds part of the transformer's weights (sharded, or a pipeline stage's blocks):
        the pipeline runs on all ranks only, and a one-process run needs it loaded whole."""
        return self.weights_sharded or self.stages is not None or any(e.stages is not None for e in self.experts)

    @property
    def steps(self) -> list[str]:
        """The steps that changed the model, in the order they were applied."""
        return [step for step, _ in self.undos]

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

    def release_groups(self) -> int:
        """Destroy the process groups this run's `parallelize` made (its experts' too) -> how many;
        after `undo`, by the owner of a run that will not be repeated on them (the matrix: cell after
        cell in one process). Each gloo group holds threads and sockets, each NCCL group a
        communicator and its buffers. Not part of `undo`: a caller may run again on this run's
        groups, trials or exchange (`parallelize`'s `groups=`, `plan_trials=`, `exchange=`)."""
        released = sum(other.release_groups() for other in self.experts)
        made, self.groups_made = self.groups_made(), lambda: []
        return released + destroy_groups(made)

    def undo(self) -> None:
        """Undo every step, the last applied first (the experts before the transformer). Sharded
        weights stay sharded (FSDP2 has no undo): the pipeline runs on all ranks of the mesh, not on one alone."""
        for other in self.experts:
            other.undo()
        for _step, undo in reversed(self.undos):
            undo()
        self.undos.clear()
