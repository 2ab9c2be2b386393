"""Step caches (LOSSY): skip the middle blocks of a denoising step when the step before did their work.

    --cache fbcache[:THRESH]                       first-block cache (diffusers' FBCache)
    --cache dbcache[:F<n>B<n>W<n>MC<n>O<n>][,THRESH] dual-block cache (cache-dit's DBCache)
    --cache taylorseer[:F<n>B<n>N<n>O<n>W<n>]      TaylorSeer at a fixed interval
    --cache teacache[:W<n>MC<n>O<n>][,THRESH]      TeaCache (modulated input of the first block)
    --cache magcache[:W<n>MC<n>O<n>][,THRESH]      MagCache (calibrated magnitude ratios)

The transformer's repeated blocks (its ModuleLists of blocks that take `hidden_states` and
`encoder_hidden_states`, in order: FLUX's double- then single-stream blocks, SD3's and Qwen-Image's
joint blocks, Wan's, LTX-Video's and HunyuanVideo 1.5's blocks) are cut in three: the first Fn always run, the last Bn always
run, the middle ones run or are replaced by the residual they added (image and text tokens). What
decides, per kind:

- fbcache / dbcache: after the Fn-th block, the residual it and the blocks before it added to the
  image tokens is compared with the same residual of the last step computed (relative L1,
  `sum|r - r_prev| / sum|r_prev|`): below the threshold the middle is skipped. Defaults: `fbcache` =
  F1B0, 0.05, no warm-up (diffusers' `FirstBlockCacheConfig`); `dbcache` = F8B0, 0.08, W8, no limit
  MC in a row (cache-dit's `BasicCacheConfig`), its F capped to leave one middle block on a smaller
  model when F is not written.
- taylorseer (F0B0 by default: every block is the middle): after W warm-up steps, one step in N
  computes and the N - 1 after it are skipped.
- teacache (F0B0): before the first block, the relative L1 change of its timestep-modulated input
  against the last step's (teacache.py), rescaled by a polynomial, is accumulated over the steps
  since the last computed one; the step is skipped while the sum is below the threshold.
- magcache (F0B0): the calibrated magnitude ratios of the steps since the last computed one
  (magcache.py) are multiplied, and `|1 - product|` accumulated; skipped while below the threshold.
  A run with no calibrated curve calibrates: it skips nothing, uses the curve from its next run on,
  and stores it when it ends (`StepCache.finish`: one rank, outside the forward).

A block returns the two streams in its family's order (`Family.block_outputs`: text first, or
HunyuanVideo 1.5's and LTX-2's image first; LTX-2's second stream is its audio, `Family.block_streams`
names a block's two arguments), or one tensor: the image stream (Wan, LTX-Video, whose text enters
by cross-attention), or FLUX.2's single-stream blocks' one sequence [text, image], which the model
joins between its two lists of blocks; a middle that starts before the join and ends after it
measures its residual on the joined sequence (`_aligned`). `BlockOutputs` reads and writes them.

A skipped step adds the middle's last residual, or with O<n> (TaylorSeer; the default of
`taylorseer`, O1) its Taylor extrapolation from the last computed steps (taylor.py).

One decision for the whole world per transformer call. Under sequence parallelism each rank holds a
shard of the tokens, so a decision taken on a rank's own residual differs between ranks: one rank
would skip the middle blocks (and their all-to-alls) while another runs them, a crash on gloo and a
hang on NCCL. The numerator and denominator are therefore summed over every rank (one float64
all-reduce on the world group, with a count of ranks that must compute: warm-up, no previous
residual, a changed shape), and every rank decides on the same sums (taylorseer and magcache,
which decide from the step, agree on the count alone; the sums make teacache's accumulation the
same float on every rank). MagCache's calibration sums its ratios the same way (every rank holds
the same curve: global rank 0 alone stores it, after the run), and a run uses a stored curve only
when every rank read the same one. The world group rather than the sequence-parallel group: it is
matched under every plan (every rank runs the same transformer calls, each running the blocks
once), including `--plan auto`, whose trials switch groups between steps; under CFG or batch
groups it makes one decision for both branches, which keeps the groups' steps aligned. While
`--plan auto`'s or `--comm auto`'s trials time a step (`timing`, the same on every rank), every
block computes: a skipped trial step would make its candidate win by the cache. A plan switch
(`layout`) drops the cached tensors: another plan may give a rank other tokens. The cost is one
24-byte all-reduce per call (one more per step while MagCache calibrates).

Denoising steps are the step clock's (engine/steps.py `StepClock`: the pipeline scheduler's step
counter; `data_parallel.StepCounter` counts a step's calls, as the CFG pairing does); a new run
clears the cache. Only MagCache reads a step's timestep (its curve is by timestep), once per step. With
true CFG (two calls per step) each call of a step has its own cache; a call that runs a CFG pair
(engine/data_parallel.py) has its own too, since on one of the CFG groups it computes the other branch
than the unpaired call of that index.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from cocodiff.config.cache import CacheSpec, should_skip
from cocodiff.errors import UsageError

from ..data_parallel import StepCounter
from ..steps import StepClock, clock_of
from ..families import FAMILIES, class_name
from ..families.base import Family
from .magcache import MagCurve, agreed_curve, curve_path, store_curve
from .taylor import Residual, TaylorResidual
from .teacache import modulated_input, rescaler

__all__ = ["CallState", "StepCache", "agreed_skip", "fits", "apply_cache", "cache_blocks", "local_sums"]


def local_sums(residual: torch.Tensor, previous: torch.Tensor | None, must_compute: bool) -> torch.Tensor:
    """This rank's part of the decision: (sum|r - r_prev|, sum|r_prev|, must compute (0 or 1)), float64.

    Sums, not means: summed over the ranks' shards they are the whole tensors' sums, and their
    ratio is the relative L1 of the whole residual (means of shards of unequal size would not add up)."""
    if must_compute or previous is None or previous.shape != residual.shape:
        return torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64, device=residual.device)
    numerator = torch.sum((residual - previous).abs(), dtype=torch.float64)
    denominator = torch.sum(previous.abs(), dtype=torch.float64)
    return torch.stack([numerator, denominator, torch.zeros_like(numerator)])


def cache_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks in the order they run: the items of the transformer's ModuleLists whose
    forward takes `hidden_states` and `encoder_hidden_states` (and returns them, text first), or of
    the list its family names (`Family.blocks`: MiniMax-H3's, whose blocks take one stream)."""
    family = FAMILIES.get(class_name(transformer))
    named = getattr(transformer, family.blocks, None) if family is not None and family.blocks else None
    blocks = []
    if named is not None:  # a stage's list with a hand-off in it is no list of blocks, as below
        stream = family.block_streams[0]
        blocks = list(named) if all(stream in inspect.signature(b.forward).parameters for b in named) else []
    for child in transformer.children() if named is None else ():
        if isinstance(child, torch.nn.ModuleList) and len(child) and all(_is_block(b) for b in child):
            blocks += list(child)
    if not blocks:
        raise UsageError(f"--cache: {type(transformer).__name__} has no list of transformer blocks to cache")
    return blocks


def _is_block(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return "hidden_states" in parameters and "encoder_hidden_states" in parameters


@dataclass
class BlockOutputs:
    """How a transformer's blocks return their streams, read as (text, hidden) and written back."""

    text_first: bool = True
    streams: tuple[str, ...] = ("hidden_states", "encoder_hidden_states")
    """The block arguments of the two streams, image first (`Family.block_streams`)."""
    single: dict[int, bool] = field(default_factory=dict)
    """Block index -> it returned one tensor, as first seen (a block always returns the same kind)."""

    @classmethod
    def of(cls, transformer: torch.nn.Module) -> BlockOutputs:
        """Its family's order; a class with no family record (a generic `_cp_plan` or a plan
        inferred): the order its blocks' own `forward` returns the two stream arguments in
        (`returned_order`), where it can be read, else the default's (text first)."""
        family = FAMILIES.get(class_name(transformer))
        if family is not None:
            return cls(text_first=family.block_outputs[0] == "txt", streams=family.block_streams)
        default = Family()
        orders = {returned_order(type(block), default.block_streams) for block in cache_blocks(transformer)} - {"one", None}
        if len(orders) > 1:
            raise UsageError(f"--cache: {type(transformer).__name__}'s block classes return their two streams in "
                             f"different orders ({default.block_streams[0]} first in some, last in others)")
        first = orders.pop() if orders else default.block_outputs[0]
        return cls(text_first=first == "txt", streams=default.block_streams)

    def read(self, index: int, out: Any) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A block's output as (text or None, hidden)."""
        self.single[index] = isinstance(out, torch.Tensor)
        if self.single[index]:
            return None, out
        first, second = out
        return (first, second) if self.text_first else (second, first)

    def write(self, index: int, text: torch.Tensor | None, hidden: torch.Tensor) -> Any:
        """(text, hidden) as block `index` returns them."""
        if self.single[index]:
            return hidden
        return (text, hidden) if self.text_first else (hidden, text)


@functools.cache
def returned_order(block: type, streams: tuple[str, str]) -> str | None:
    """Which of a block class's two streams its `forward` returns first, read from its source: 'img'
    where every `return` of two names returns `streams` image first, 'txt' text first, 'one' where it
    returns one value (the image stream); None where it cannot be told. The same on every rank
    (nothing of a call is read), as the cache's install needs it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(block.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0]
    returns = [node.value for node in ast.walk(function) if isinstance(node, ast.Return) and node.value is not None]
    pairs = {tuple(getattr(e, "id", None) for e in value.elts) for value in returns if isinstance(value, ast.Tuple)}
    if not pairs:
        return "one" if returns else None
    image, text = streams
    return {frozenset([(image, text)]): "img", frozenset([(text, image)]): "txt"}.get(frozenset(pairs))


def _aligned(start: torch.Tensor, start_text: torch.Tensor | None, now: torch.Tensor) -> torch.Tensor:
    """`start` laid out as `now` holds the tokens: where the model joined the streams between its
    block lists (FLUX.2's single-stream blocks take [text, image] as one sequence), the text's
    start joined in front of the image's."""
    if start_text is None or start.shape == now.shape:
        return start
    return torch.cat([start_text, start], dim=-2)


@dataclass
class CallState:
    """The cache of one call of a step (true CFG's positive and negative calls each have one)."""

    middle: TaylorResidual
    """What the middle blocks added over the last steps computed, and its extrapolation."""
    previous: torch.Tensor | None = None
    """fbcache / dbcache: the Fn residual of the last step computed; teacache: the last step's modulated input."""
    calls: int = 0
    """Decisions taken in this run: the step index of the next one."""
    in_a_row: int = 0
    accumulated: float = 0.0
    """teacache: the rescaled changes since the last computed step; magcache: the accumulated error."""
    ratio: float = 1.0
    """magcache: the product of the ratios since the last computed step."""


@dataclass
class StepCache:
    """A step cache installed on a transformer's blocks (`apply_cache`); `undo` removes it."""

    spec: CacheSpec
    transformer: torch.nn.Module
    agree: Callable[[torch.Tensor], list[float]]
    """values -> their sums over every rank (one process: the values)."""
    paired: Callable[[], bool] = lambda: False
    """Whether the call starting now runs a CFG pair (engine/data_parallel.py)."""
    timing: Callable[[], bool] = lambda: False
    """Whether `--plan auto`'s or `--comm auto`'s trials time this step: it computes every block
    (the same on every rank: the trials' choice is agreed)."""
    layout: Callable[[], Any] = lambda: None
    """What shards the tokens now (the plan's groups): when it changes, the cached tensors go."""
    clock: StepClock | None = None
    """Which step each call is (engine/steps.py), the same on every rank; when none is given or
    installed (`parallelize` installs one), `install` makes one on `scheduler`."""
    scheduler: Any = None
    """The scheduler of the loop that drives the transformer (None: each call a step of its own)."""
    stores_curve: bool = True
    """magcache: whether this rank stores the curve it calibrates (one rank of those that agree:
    they all hold the same curve)."""
    computed_steps: int = 0
    skipped_steps: int = 0
    """Steps of the last run whose middle blocks ran / were skipped, per call that runs the blocks:
    true CFG's two calls of a step count as two steps (one per branch), a CFG pair as one."""
    calibrating: bool = False
    """magcache: this run measures the curve (no curve stored, or the ranks read different ones)."""
    _states: dict[tuple[int, bool], CallState] = field(default_factory=dict)
    _state: CallState | None = None
    _restore: list[tuple[torch.nn.Module, Any]] = field(default_factory=list)
    _hook: RemovableHandle | None = None
    _layout: Any = None
    _own_clock: bool = False
    """The clock is this cache's own (a bare transformer): `undo` removes its hook."""
    _steps: StepCounter = field(default_factory=StepCounter)
    _timestep: float | None = None
    _previous_timestep: float | None = None
    """The timestep of this step and of the step before it in this run (None: the run's first)."""
    _input: torch.Tensor | None = None
    _input_text: torch.Tensor | None = None
    _outputs: BlockOutputs = field(default_factory=BlockOutputs)
    _modulated: torch.Tensor | None = None
    _head: tuple[torch.Tensor, torch.Tensor | None] | None = None
    _step: int = 0
    _predicted: Residual | None = None
    _skip: bool = False
    _rescale: tuple[str, Callable[[float], float]] = ("identity", lambda x: x)
    """teacache: the polynomial's name and the polynomial (teacache.py)."""
    _curve: MagCurve | None = None
    _curve_path: Path | None = None
    _calibration: list[tuple[float, float]] = field(default_factory=list)
    """magcache while calibrating: (timestep, ratio) of each step of this run."""
    _measured: MagCurve | None = None
    """magcache: the curve this cache calibrated (so far, while its run lasts), for `finish` to store."""
    _stored: MagCurve | None = None
    """The curve `finish` last stored (or failed to): each is stored once."""
    warmup: int = field(init=False, default=0)
    """Steps always computed at the start of a run (magcache's default: 20% of the calibrated steps)."""
    first: int = field(init=False, default=1)
    """Fn: the blocks before the decision (set by `install` from the model's block count)."""
    end: int = field(init=False, default=1)
    """Where the middle blocks end (the last Bn blocks start)."""

    def install(self) -> StepCache:
        blocks = cache_blocks(self.transformer)
        self._outputs = BlockOutputs.of(self.transformer)
        self.first, self.end = self.spec.block_split(len(blocks))
        for index, block in enumerate(blocks):
            self._restore.append((block, block.__dict__.get("forward")))
            block.forward = self._wrapped(index, block, block.forward)
        if self.clock is None:
            self.clock = clock_of(self.transformer)
        if self.clock is None:  # a bare transformer: its own clock, first of the pre-hooks
            self.clock = StepClock(self.transformer, self.scheduler).install()
            self._own_clock = True
        self._hook = self.transformer.register_forward_pre_hook(self._new_call, with_kwargs=True)
        if self.spec.kind == "teacache":
            self._rescale = rescaler(self.transformer)
        if self.spec.kind == "magcache":
            self._read_curve()
        self.warmup = self.spec.warmup if self.spec.warmup is not None else (
            int(0.2 * self._curve.steps + 0.5) if self._curve is not None else 0)
        return self

    def undo(self) -> None:
        """Every block's own forward again (or the override it had, e.g. V-First's); a curve
        calibrated and not yet stored is stored first (`finish`)."""
        self.finish()
        for block, own in self._restore:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._restore.clear()
        if self._hook is not None:
            self._hook.remove()
        if self._own_clock:
            self.clock.remove()

    def finish(self) -> None:
        """At the end of a run, outside the transformer's forward: store the curve this cache
        calibrated, once, on the rank that `stores_curve` (no collective here: any ranks may call
        it, in any order). A filesystem error is a warning, not an exception: the run is unaffected,
        and a later one that finds no curve calibrates again. Nothing to do for another kind, or
        after a run that read its curve."""
        curve = self._measured
        if curve is None or curve is self._stored:
            return
        self._stored = curve
        if not self.stores_curve:
            return
        try:
            store_curve(self._curve_path, curve)
        except OSError as error:
            warnings.warn(f"MagCache's calibrated curve was not stored at {self._curve_path}: {error} (this run "
                          "is unaffected; a later one that finds no curve calibrates again)",
                          RuntimeWarning, stacklevel=2)

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"spec": str(self.spec), "computed_steps": self.computed_steps,
                                  "skipped_steps": self.skipped_steps}
        if self.spec.kind == "teacache":
            report["rescale"] = self._rescale[0]
        if self.spec.kind == "magcache":
            report |= {"calibrating": self.calibrating, "curve": str(self._curve_path)}
        return report

    def kept_bytes(self) -> int:
        """What the cache keeps after its run: per call of a step, the decision's tensor and the
        middle's residuals (image and text; with TaylorSeer, their differences too)."""
        tensors = [t for state in self._states.values()
                   for t in (state.previous, *state.middle.tensors()) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _read_curve(self) -> None:
        """MagCache: this model's stored curve, used only when every rank read the same one."""
        self._curve_path = curve_path(self.transformer)
        device = next((p.device for p in self.transformer.parameters()), torch.device("cpu"))
        self._curve = agreed_curve(self._curve_path, self.agree, device)
        self.calibrating = self._curve is None

    def _new_call(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        """At the transformer's entry: which step and which call of it this is."""
        new_run, _ = self._steps.count(self.clock.value())
        if new_run:
            self._states.clear()
            self.computed_steps = self.skipped_steps = 0
            self._finish_calibration()
        if self._steps.calls == 1 and self.spec.kind == "magcache":  # a new step: its timestep, for the curve
            t = self.clock.timestep()
            self._previous_timestep = None if new_run or t is None else self._timestep
            self._timestep = t
        layout = self.layout()
        if layout is not self._layout:  # `--plan auto` switched plans: a shard's tokens may be others now
            self._layout = layout
            for state in self._states.values():
                state.previous, state.middle = None, TaylorResidual(self.spec.order)
        key = (self._steps.calls - 1, self.paired())
        if key not in self._states:
            self._states[key] = CallState(TaylorResidual(self.spec.order))
        self._state = self._states[key]
        self._skip, self._input, self._head, self._modulated, self._predicted = False, None, None, None, None
        self._input_text = None
        return args, kwargs

    def _wrapped(self, index: int, block: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        names = list(inspect.signature(forward).parameters)
        (image, at_image), *others = ((name, names.index(name)) for name in self._outputs.streams)
        second, at_second = others[0] if others else (None, None)  # MiniMax-H3's blocks: one stream

        @functools.wraps(forward)  # its signature: the split hooks find a block's arguments by their positions
        def cached_forward(*args: Any, **kwargs: Any) -> Any:
            # the two streams the blocks change: the image's, and the text's (LTX-2: the audio's)
            hidden = kwargs[image] if image in kwargs else args[at_image]
            text = None if second is None else kwargs[second] if second in kwargs else args[at_second]
            if index == 0:
                self._input, self._input_text = hidden, text
                if self.spec.kind == "teacache":
                    self._modulated = modulated_input(block, forward, args, kwargs, hidden)
            if index == self.first and not self.spec.decides_after_first:
                self._decide(hidden, text, None)  # at the middle's entry: from the step or the first block's input
            outputs = self._outputs
            if self._skip and self.first <= index < self.end:
                if index < self.end - 1:
                    return outputs.write(index, text, hidden)  # the middle's residual is added at its last block
                residual, text_residual = self._predicted
                text = text + text_residual if text_residual is not None else None
                return outputs.write(index, text, hidden + residual)
            text_out, hidden_out = outputs.read(index, forward(*args, **kwargs))
            if index == self.first - 1 and self.spec.decides_after_first:
                self._decide(hidden_out, text_out, hidden_out - _aligned(self._input, self._input_text, hidden_out))
            elif index == self.end - 1 and self._head is not None:
                hidden_start, text_start = self._head
                text_residual = text_out - text_start if text_out is not None and text_start is not None else None
                residual = hidden_out - _aligned(hidden_start, text_start, hidden_out)
                if self.calibrating:
                    self._calibrate(residual)
                self._state.middle.update(self._step, (residual, text_residual))
            return outputs.write(index, text_out, hidden_out)

        return cached_forward

    def _decide(self, hidden: torch.Tensor, text: torch.Tensor | None, residual: torch.Tensor | None) -> None:
        """Agree with every rank whether this call skips its middle blocks (`residual`: fbcache's
        and dbcache's Fn residual)."""
        state, spec = self._state, self.spec
        must = (self.timing() or not fits(state.middle, hidden, text) or state.calls < self.warmup
                or (spec.max_in_a_row is not None and state.in_a_row >= spec.max_in_a_row))
        if residual is not None:
            values = local_sums(residual, state.previous, must)
        elif spec.kind == "teacache":
            values = local_sums(self._modulated, state.previous, must)
            state.previous = self._modulated  # TeaCache compares consecutive steps, skipped ones too
        else:
            values = torch.tensor([0.0, 0.0, float(must)], dtype=torch.float64, device=hidden.device)
        skip = self._skips(self.agree(values), state)
        step, state.calls = state.calls, state.calls + 1
        self._skip = skip
        if skip:
            state.in_a_row += 1
            self.skipped_steps += 1
            self._predicted = state.middle.predict(step)
            return
        self.computed_steps += 1
        state.in_a_row, state.accumulated, state.ratio = 0, 0.0, 1.0
        self._head, self._step = (hidden, text), step
        if residual is not None:
            state.previous = residual

    def _skips(self, sums: list[float], state: CallState) -> bool:
        """The decision on the sums of every rank (the same on each: so is each kind's accumulation)."""
        ratio = None
        if self._curve is not None and self._previous_timestep is not None and self._timestep is not None:
            ratio = self._curve.ratio(self._previous_timestep, self._timestep)
        return agreed_skip(self.spec, sums, state, self._rescale[1], ratio)

    def _calibrate(self, residual: torch.Tensor) -> None:
        """MagCache calibration, at the first call of each computed step: the mean over every
        rank's image tokens of |r| / |r_prev| (per-token L2 norms), recorded (stored by `finish`)."""
        if self._steps.calls != 1:
            return
        previous = self._state.middle.last[0] if self._state.middle else None
        if previous is not None and previous.shape == residual.shape:
            norms = torch.linalg.vector_norm(residual.float(), dim=-1)  # (B, S): one per token
            ratios = norms / (torch.linalg.vector_norm(previous.float(), dim=-1) + 1e-8)
            total = ratios.sum(dtype=torch.float64)
            mine = torch.stack([total, torch.full_like(total, ratios.numel())])
        else:
            mine = torch.zeros(2, dtype=torch.float64, device=residual.device)
        total, tokens = self.agree(mine)
        timestep = self._timestep if self._timestep is not None else -float(len(self._calibration))
        self._calibration.append((timestep, total / tokens if tokens > 0 else 1.0))
        if len(self._calibration) >= 2:
            self._measured = MagCurve(*map(tuple, zip(*self._calibration)))  # the same on every rank: agreed ratios

    def _finish_calibration(self) -> None:
        """At a new run: a calibrated curve is used from now on (the same on every rank: agreed
        ratios); `finish` stores it, if it has not yet."""
        if self.calibrating and self._measured is not None:
            self._curve = self._measured
            self.calibrating = False
            if self.spec.warmup is None:
                self.warmup = int(0.2 * self._curve.steps + 0.5)
        self._calibration = []


def agreed_skip(spec: CacheSpec, sums: list[float], state: CallState, rescale: Callable[[float], float],
                ratio: float | None) -> bool:
    """Whether a call skips its middle, from the sums of every rank (`local_sums`, all-reduced) and
    the state of its run (teacache's and magcache's accumulation, updated here: the same float on
    every rank); `ratio`: magcache's calibrated ratio of this step (None: no curve, or no step before)."""
    if spec.decides_after_first:
        return should_skip(sums, spec.threshold)
    if sums[2] != 0:  # some rank must compute
        return False
    if spec.kind == "taylorseer":
        return True  # the interval (MC = N - 1) and the warm-up are in `must`
    if spec.kind == "teacache":
        if sums[1] <= 0:
            return False
        state.accumulated += rescale(sums[0] / sums[1])
    elif spec.kind == "magcache":
        if ratio is None:
            return False
        state.ratio *= ratio
        state.accumulated += abs(1.0 - state.ratio)
    return spec.threshold > 0 and state.accumulated < spec.threshold


def fits(middle: TaylorResidual, hidden: torch.Tensor, text: torch.Tensor | None) -> bool:
    """Whether a cached middle residual can be added to this call's tokens (a plan switched by
    `--plan auto` may shard them differently)."""
    if not middle:
        return False
    shape = middle.last[0].shape
    joined = text is not None and shape == hidden.shape[:-2] + (hidden.shape[-2] + text.shape[-2],) + hidden.shape[-1:]
    if shape != hidden.shape and not joined:  # a residual over FLUX.2's joined sequence fits its two streams
        return False
    return middle.last[1] is None or (text is not None and middle.last[1].shape == text.shape)


def apply_cache(transformer: torch.nn.Module, spec: CacheSpec,
                agree: Callable[[torch.Tensor], list[float]] | None = None,
                paired: Callable[[], bool] | None = None,
                timing: Callable[[], bool] | None = None,
                layout: Callable[[], Any] | None = None,
                clock: StepClock | None = None,
                scheduler: Any = None,
                stores_curve: bool | None = None) -> StepCache:
    """Install `spec` on `transformer`'s blocks. `agree` sums the decision's values over every rank
    (required with more than one; None: one process); `paired` says whether a call runs a CFG pair;
    `timing` whether trials time the step (nothing skipped); `layout` what shards the tokens; `clock`
    which step each call is (None: the one `parallelize` installed, else a clock on `scheduler`, the
    loop's; without one each call is a step of its own);
    `stores_curve` whether this rank stores a curve MagCache calibrates (None: one process, or
    global rank 0 of those that agree)."""
    local = lambda values: values.tolist()  # noqa: E731 - one process: its sums are everyone's
    if stores_curve is None:
        stores_curve = agree is None or not dist.is_initialized() or dist.get_rank() == 0
    return StepCache(spec, transformer, agree or local, paired or (lambda: False), timing or (lambda: False),
                     layout or (lambda: None), clock, scheduler, stores_curve).install()
