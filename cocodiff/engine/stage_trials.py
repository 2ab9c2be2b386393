"""`--plan auto` with a pipeline-stage candidate: every candidate's block layout, kept until the
trials choose (engine/plan_trials.py).

A plan with `p` runs on a transformer cut for its stage (engine/stages.py `cut_stages`): the other
blocks leave it, for good. `--plan auto` switches plans between denoising steps, so while its
trials run each rank holds the whole transformer, as it was loaded, and a stage candidate's cut
is a second set of block lists (`stage_lists`), put in place for that candidate's steps:

    whole layout:  blocks = [b0, b1, b2, b3]          the split hooks of `blocks.0` on b0
    stage 1 of 2:  blocks = [b2, b3]                  ... on b2, its first block

Each layout has its own split hooks, installed on its own lists (a plan that splits the sequence
at `blocks.0` splits it at each stage's first block, as `cut_stages` has it), and each acts only
while its layout runs; the attention processors, V-First and the rest go on every block once.
`StageTrials` is the transformer's forward: the stage candidate's `StageForward` in its steps,
the stock forward in the others'. Once the trials choose a stage plan, its cut is kept as
`cut_stages` keeps one and the blocks it gave up leave the device (to `meta`); once they choose
another plan, the whole layout stays and the stage's hooks stay silent.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..distributed.topology import PlanGroups
from .stages import StageCut, StageForward, block_lists, keep_cut, stage_lists

__all__ = ["StageTrials"]


class StageTrials:
    """The block layouts of `--plan auto`'s candidates (keys: a stage candidate; None: the whole
    transformer, every other candidate's), the one in place now, and the forward that runs it."""

    def __init__(self, transformer: nn.Module, staged: dict[Any, PlanGroups]) -> None:
        self.transformer = transformer
        self.whole = dict(block_lists(transformer))
        self.layouts: dict[Any, tuple[StageCut | None, dict[str, nn.ModuleList]]] = {None: (None, self.whole)}
        for candidate, groups in staged.items():
            self.layouts[candidate] = stage_lists(transformer, groups)
        self.current: Any = None
        self.forwards: dict[Any, StageForward] = {}
        """Each stage candidate's forward (`add_forward`)."""
        self.stock = transformer.__dict__.get("forward") or type(transformer).forward.__get__(transformer)

    @property
    def cuts(self) -> dict[Any, StageCut]:
        return {key: cut for key, (cut, _) in self.layouts.items() if cut is not None}

    def layout_of(self, candidate: Any) -> Any:
        return candidate if candidate in self.layouts else None

    def use(self, candidate: Any) -> None:
        """Put `candidate`'s block layout in place (before a step's first call)."""
        self.current = self.layout_of(candidate)
        for name, blocks in self.layouts[self.current][1].items():
            setattr(self.transformer, name, blocks)

    def live(self, candidate: Any) -> Callable[[], bool]:
        """Whether `candidate`'s layout runs now (its hooks act only then)."""
        key = self.layout_of(candidate)
        return lambda: self.current is key

    def add_forward(self, candidate: Any, forward: StageForward) -> None:
        forward.live = self.live(candidate)
        self.forwards[candidate] = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.forwards[self.current] if self.current is not None else self.stock
        return forward(*args, **kwargs)

    def commit(self, candidate: Any) -> StageForward | None:
        """The trials chose `candidate`: its layout for good. A stage's cut is kept on the transformer
        and the blocks it gave up leave the device; returns the stage's forward (None: no stages)."""
        self.use(candidate)
        if self.current is None:
            return None
        cut, lists = self.layouts[self.current]
        keep_cut(self.transformer, cut, lists)
        kept = {id(block) for blocks in lists.values() for block in blocks}
        for block in (b for blocks in self.whole.values() for b in blocks if id(b) not in kept):
            block.to("meta")
        self.layouts = {self.current: (cut, lists)}
        return self.forwards[self.current]

    def undo(self) -> None:
        """The transformer's own forward again, on the whole layout unless a stage's cut was kept;
        the stage forwards' hooks go (a later parallelization of a kept cut installs its own)."""
        for forward in self.forwards.values():
            forward.undo()
        if None in self.layouts:
            self.use(None)
        if self.transformer.__dict__.get("forward") is self:
            del self.transformer.forward
