"""Step caches for a batch whose rows belong to different runs: serving's step-level batching.

`cocodiff serve` advances every image in flight by one denoising step per transformer call
(serve/stepper.py): the rows of a call belong to different requests, each at its own step of its
own run, each with its own cache or none. A `StepCache` (steps.py) keeps one state per call of a
step; here each run (a request's images of one CFG branch) keeps its own `RowRun`: its previous
residuals, Taylor table, counters and accumulation, which follow the request from step to step
while the batch around it changes. The decision rule, the agreement and the reuse are steps.py's:

- Decisions per run. Each run decides at its own block (after Fn for fbcache / dbcache, at the
  middle's entry for the others) on the sums of its own rows, summed over every rank: all runs
  deciding at one block share one float64 all-reduce of 3 values per run, in the order of the
  call's runs, which every rank knows (rank 0 broadcasts the joins), so every rank calls it at the
  same blocks and takes the same decisions. A rank that holds none of a run's rows (a plan with
  batch groups shares the batch) adds zeros.
- A mixed batch (some runs skip a block, some compute it): the block runs on the computing rows
  only (its batch arguments `hidden_states`, `encoder_hidden_states`, `temb` taken by row), the
  skipping rows pass through, and at their middle's last block they gain their run's cached (or
  extrapolated) residual. Every rank of a sequence-parallel group holds the same rows and takes
  the same decisions, so its collectives stay matched; a block no local row computes is not run.
  Each row thus gets what its run alone would get, up to the rounding of a matmul over fewer rows.
- A run's residuals live on the ranks that held its rows. Under batch or CFG groups the rows of a
  run may move to another data group when requests join or leave; a rank that did not hold the
  run's rows (the same ones) at its previous step drops its tensors for it, and its `must compute`
  makes the run compute that step on every rank (counters and accumulations are agreed, so they stay).

MagCache reads the model's stored curve once, with its first run (every rank together); without
one its runs skip nothing (`generate --cache magcache` calibrates it).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from cocodiff.config.cache import CacheSpec

from .magcache import MagCurve, agreed_curve, curve_path
from .steps import CallState, agreed_skip, cache_blocks, fits, local_sums
from .taylor import Residual, TaylorResidual
from .teacache import modulated_input, rescaler

__all__ = ["BATCH_ARGUMENTS", "RowCaches", "RowRun"]

BATCH_ARGUMENTS = ("hidden_states", "encoder_hidden_states", "temb")
"""A block's arguments taken by row when only some rows compute it (the others, e.g. the rotary
embedding, are the same for every row)."""


@dataclass
class RowRun:
    """One run's step cache inside a shared batch: a request's images of one CFG branch."""

    spec: CacheSpec
    first: int
    """Fn: the blocks before its decision."""
    end: int
    """Where its middle ends (its last Bn blocks start)."""
    warmup: int
    state: CallState
    computed_steps: int = 0
    skipped_steps: int = 0
    calibrating: bool = False
    """magcache without a stored curve: it skips nothing."""
    rescale: str | None = None
    """teacache: the name of its polynomial (teacache.py)."""
    timestep: float | None = None
    previous_timestep: float | None = None
    seen: int = -1
    """The step at which this rank last held its rows (its tensors are stale otherwise)."""
    held: tuple[int, int] = (0, 0)
    """Which of its rows this rank held then: (first, count) within the run's rows."""
    rows: slice | None = None
    """Its rows in this rank's batch during a call (None: none here)."""
    skip: bool = False
    input: torch.Tensor | None = None
    modulated: torch.Tensor | None = None
    head: tuple[torch.Tensor, torch.Tensor | None] | None = None
    step: int = 0
    predicted: Residual | None = None

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"spec": str(self.spec), "computed_steps": self.computed_steps,
                                  "skipped_steps": self.skipped_steps}
        if self.rescale is not None:
            report["rescale"] = self.rescale
        return report | ({"calibrating": True} if self.calibrating else {})


@dataclass
class RowCaches:
    """Step caches per run on one transformer's blocks (`runs` enter the calls through `call`)."""

    transformer: torch.nn.Module
    agree: Callable[[torch.Tensor], list[float]] = lambda values: values.tolist()
    """values -> their sums over every rank (one process: the values)."""
    share: Callable[[], tuple[int, int] | None] = lambda: None
    """(first row, rows) of the call's batch this rank runs (batch / CFG groups); None: every row."""
    _blocks: int = 0
    _runs: list[RowRun] = field(default_factory=list)
    _placed: list[tuple[RowRun, int, int, float | None]] | None = None
    """The runs of the call in progress until its first block places their rows (`_place`)."""
    _restore: list[tuple[torch.nn.Module, Any]] = field(default_factory=list)
    _curve: MagCurve | None = None
    _curve_read: bool = False
    _rescale: tuple[str, Callable[[float], float]] = ("identity", lambda x: x)

    def __post_init__(self) -> None:
        blocks = cache_blocks(self.transformer)
        self._blocks = len(blocks)
        for index, block in enumerate(blocks):
            self._restore.append((block, block.__dict__.get("forward")))
            block.forward = self._wrapped(index, block.forward)
        self._rescale = rescaler(self.transformer)

    @property
    def blocks(self) -> int:
        return self._blocks

    def undo(self) -> None:
        for block, own in self._restore:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._restore.clear()

    def run(self, spec: CacheSpec) -> RowRun:
        """A new run under `spec` (every rank at once: a magcache run reads the curve with the others)."""
        first, end = spec.block_split(self._blocks)
        if spec.kind == "magcache" and not self._curve_read:
            self._read_curve()
        warmup = spec.warmup if spec.warmup is not None else (
            int(0.2 * self._curve.steps + 0.5) if self._curve is not None else 0)
        return RowRun(spec, first, end, warmup, CallState(TaylorResidual(spec.order)),
                      calibrating=spec.kind == "magcache" and self._curve is None,
                      rescale=self._rescale[0] if spec.kind == "teacache" else None)

    @contextmanager
    def call(self, runs: Sequence[tuple[RowRun, int, int, float | None]]) -> Iterator[None]:
        """Inside: the next transformer call's batch holds each run's rows, (run, first row, rows,
        its timestep) in the whole batch; the other rows are not cached."""
        for run, _first, _rows, timestep in runs:
            run.previous_timestep, run.timestep = run.timestep, timestep
            run.skip, run.input, run.modulated, run.head, run.predicted = False, None, None, None, None
        self._runs, self._placed = [run for run, *_ in runs], list(runs)
        try:
            yield
        finally:
            for run in self._runs:
                run.rows, run.input, run.modulated, run.head, run.predicted = None, None, None, None, None
            self._runs, self._placed = [], None

    def _place(self) -> None:
        """At the call's first block, where the share of a batch / CFG group is known: each run's
        rows in this rank's batch; a run whose rows were elsewhere at its last step forgets its tensors."""
        share = self.share()
        start, count = share if share is not None else (0, math.inf)
        for run, first, rows, _timestep in self._placed:
            low, high = max(first, start), min(first + rows, start + count)
            run.rows = slice(int(low - start), int(high - start)) if low < high else None
            if run.rows is not None:
                held = (int(low - first), int(high - low))  # which of its rows: a shifted split may hand others
                if run.state.calls > 0 and (run.seen != run.state.calls - 1 or run.held != held):  # stale here
                    run.state.previous, run.state.middle = None, TaylorResidual(run.spec.order)
                run.seen, run.held = run.state.calls, held
        self._placed = None

    def _wrapped(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        parameters = inspect.signature(forward).parameters

        @functools.wraps(forward)  # its signature stays readable (`cache_blocks`)
        def cached_forward(*args: Any, **kwargs: Any) -> Any:
            if not self._runs:
                return forward(*args, **kwargs)
            if self._placed is not None:
                self._place()
            named = {**dict(zip(parameters, args)), **kwargs}
            hidden, text = named["hidden_states"], named.get("encoder_hidden_states")
            local = [run for run in self._runs if run.rows is not None]
            if index == 0:
                modulated = None
                if any(run.spec.kind == "teacache" for run in local):
                    block = self._restore[0][0]
                    modulated = modulated_input(block, forward, args, kwargs, hidden)
                for run in local:
                    run.input = hidden[run.rows]
                    run.modulated = modulated[run.rows] if modulated is not None else None
            entering = [run for run in self._runs if not run.spec.decides_after_first and run.first == index]
            if entering:
                self._decide(entering, hidden, text, after_first=False)
            skipping = [run for run in local if run.skip and run.first <= index < run.end]
            if skipping:
                text_out, hidden_out = self._partial(index, forward, named, hidden, text, skipping)
            else:
                text_out, hidden_out = forward(*args, **kwargs)
            deciding = [run for run in self._runs if run.spec.decides_after_first and run.first - 1 == index]
            if deciding:
                self._decide(deciding, hidden_out, text_out, after_first=True)
            for run in local:
                if index == run.end - 1 and run.head is not None:
                    hidden_start, text_start = run.head
                    text_end = text_out[run.rows] if text_out is not None else None
                    text_residual = text_end - text_start if text_end is not None and text_start is not None else None
                    run.state.middle.update(run.step, (hidden_out[run.rows] - hidden_start, text_residual))
            return text_out, hidden_out

        return cached_forward

    def _partial(self, index: int, forward: Callable[..., Any], named: dict[str, Any], hidden: torch.Tensor,
                 text: torch.Tensor | None, skipping: list[RowRun]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Block `index` on the rows that compute it; the skipping runs' rows pass through (at their
        middle's last block, with their residual added)."""
        batch = hidden.shape[0]
        computing = torch.ones(batch, dtype=torch.bool)
        for run in skipping:
            computing[run.rows] = False
        hidden_out, text_out = hidden.clone(), (text.clone() if text is not None else None)
        if computing.any():
            rows = computing.nonzero().flatten().to(hidden.device)  # (R,): the computing rows, in order
            part = {k: (v.index_select(0, rows) if k in BATCH_ARGUMENTS and isinstance(v, torch.Tensor)
                        and v.dim() > 0 and v.shape[0] == batch else v) for k, v in named.items()}
            text_part, hidden_part = forward(**part)
            hidden_out[rows] = hidden_part
            if text_out is not None and text_part is not None:
                text_out[rows] = text_part
        for run in skipping:
            if index == run.end - 1:
                residual, text_residual = run.predicted
                hidden_out[run.rows] += residual
                if text_out is not None and text_residual is not None:
                    text_out[run.rows] += text_residual
        return text_out, hidden_out

    def _decide(self, runs: list[RowRun], hidden: torch.Tensor, text: torch.Tensor | None, after_first: bool) -> None:
        """Agree with every rank whether each of `runs` skips its middle blocks at this call."""
        values = []
        for run in runs:
            state, spec = run.state, run.spec
            if run.rows is None:  # none of its rows here: nothing to add
                values.append(torch.zeros(3, dtype=torch.float64, device=hidden.device))
                continue
            mine, words = hidden[run.rows], text[run.rows] if text is not None else None
            must = (not fits(state.middle, mine, words) or state.calls < run.warmup
                    or (spec.max_in_a_row is not None and state.in_a_row >= spec.max_in_a_row))
            if after_first:
                values.append(local_sums(mine - run.input, state.previous, must))
            elif spec.kind == "teacache":
                values.append(local_sums(run.modulated, state.previous, must))
                state.previous = run.modulated  # TeaCache compares consecutive steps, skipped ones too
            else:
                values.append(torch.tensor([0.0, 0.0, float(must)], dtype=torch.float64, device=hidden.device))
        sums = self.agree(torch.cat(values))  # one all-reduce for every run deciding here
        for k, run in enumerate(runs):
            state, ratio = run.state, None
            if self._curve is not None and run.previous_timestep is not None and run.timestep is not None:
                ratio = self._curve.ratio(run.previous_timestep, run.timestep)
            skip = agreed_skip(run.spec, sums[3 * k : 3 * k + 3], state, self._rescale[1], ratio)
            step, state.calls = state.calls, state.calls + 1
            run.skip = skip
            if skip:
                state.in_a_row += 1
                run.skipped_steps += 1
                run.predicted = state.middle.predict(step) if run.rows is not None else None
                continue
            run.computed_steps += 1
            state.in_a_row, state.accumulated, state.ratio = 0, 0.0, 1.0
            run.step = step
            if run.rows is not None:
                run.head = (hidden[run.rows], text[run.rows] if text is not None else None)
                if after_first:
                    state.previous = hidden[run.rows] - run.input

    def _read_curve(self) -> None:
        """MagCache: the model's stored curve, used only when every rank read the same one."""
        self._curve_read = True
        device = next((p.device for p in self.transformer.parameters()), torch.device("cpu"))
        self._curve = agreed_curve(curve_path(self.transformer), self.agree, device)
