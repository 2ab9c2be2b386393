"""Step caches (LOSSY): skip the middle blocks of a denoising step when the first ones barely changed.

    --cache fbcache[:THRESH]                                  first-block cache (diffusers' FBCache)
    --cache dbcache[:F<n>B<n>[W<n>][MC<n>][,THRESH]]          dual-block cache (cache-dit's DBCache)

The transformer's repeated blocks (its ModuleLists of blocks that take and return
`hidden_states` and `encoder_hidden_states`, in order: FLUX's double- then single-stream blocks,
SD3's and Qwen-Image's joint blocks) are cut in three: the first Fn always run, the last Bn always
run, the middle ones run or are replaced by the residual they added the last time they ran. After
the Fn-th block, the residual it and the blocks before it added to the image tokens is compared
with the same residual of the last step computed (relative L1, `sum|r - r_prev| / sum|r_prev|`):
below the threshold the middle is skipped. The first W steps (warm-up) always compute, and at most
MC steps in a row are skipped. Defaults: `fbcache` = F1B0, threshold 0.05, no warm-up (diffusers'
`FirstBlockCacheConfig`); `dbcache` = F8B0, threshold 0.08, W8, no limit in a row (cache-dit's
`BasicCacheConfig`), its F capped to leave one middle block on a smaller model when F is not written.

One decision for the whole world per transformer call. Under sequence parallelism each rank holds a
shard of the tokens, so a decision taken on a rank's own residual differs between ranks: one rank
would skip the middle blocks (and their all-to-alls) while another runs them, a crash on gloo and a
hang on NCCL. The numerator and denominator are therefore summed over every rank (one float64
all-reduce on the world group, with a count of ranks that must compute: warm-up, no previous
residual, a changed shape), and every rank decides on the same sums. The world group rather than
the sequence-parallel group: it is matched under every plan (every rank runs the same transformer
calls, each running the blocks once), including `--plan auto`, whose trials switch groups between
steps; under CFG or batch groups it makes one decision for both branches, which keeps the groups'
steps aligned. The cost is one 24-byte all-reduce per call.

A new denoising step is a new timestep at the transformer's entry (`data_parallel.StepCounter`,
which the CFG pairing counts with too; a larger one starts a new run and clears the cache). With
true CFG (two calls per step) each call of a step has its own cache; a call that runs a CFG pair
(data_parallel.py) has its own too, since on one of the CFG groups it computes the other branch
than the unpaired call of that index.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from ..data_parallel import StepCounter, timestep_value
from ..errors import UsageError
from .spec import CacheSpec, should_skip

__all__ = ["StepCache", "apply_cache", "cache_blocks", "local_sums"]


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
    forward takes `hidden_states` and `encoder_hidden_states` (and returns them, text first)."""
    blocks = []
    for child in transformer.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) and all(_is_block(b) for b in child):
            blocks += list(child)
    if not blocks:
        raise UsageError(f"--cache: {type(transformer).__name__} has no list of transformer blocks to cache")
    return blocks


def _is_block(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return "hidden_states" in parameters and "encoder_hidden_states" in parameters


@dataclass
class _CallState:
    """The cache of one call of a step (true CFG's positive and negative calls each have one)."""

    previous: torch.Tensor | None = None
    """The Fn residual of the last step computed."""
    middle: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """What the middle blocks added the last time they ran: (image, text; None: the text left the blocks)."""
    calls: int = 0
    in_a_row: int = 0


@dataclass
class StepCache:
    """A step cache installed on a transformer's blocks (`apply_cache`); `undo` removes it."""

    spec: CacheSpec
    transformer: torch.nn.Module
    agree: Callable[[torch.Tensor], list[float]]
    """values -> their sums over every rank (one process: the values)."""
    paired: Callable[[], bool] = lambda: False
    """Whether the call starting now runs a CFG pair (data_parallel.py)."""
    computed_steps: int = 0
    skipped_steps: int = 0
    """Steps of the last run whose middle blocks ran / were skipped, per call that runs the blocks:
    true CFG's two calls of a step count as two steps (one per branch), a CFG pair as one."""
    _states: dict[tuple[int, bool], _CallState] = field(default_factory=dict)
    _state: _CallState = field(default_factory=_CallState)
    _restore: list[tuple[torch.nn.Module, Any]] = field(default_factory=list)
    _hook: RemovableHandle | None = None
    _timestep_at: int | None = None
    """Where `timestep` comes among the transformer's positional arguments."""
    _steps: StepCounter = field(default_factory=StepCounter)
    _input: torch.Tensor | None = None
    _head: tuple[torch.Tensor, torch.Tensor | None] | None = None
    _skip: bool = False
    first: int = field(init=False, default=1)
    """Fn: the blocks before the decision (set by `install` from the model's block count)."""
    end: int = field(init=False, default=1)
    """Where the middle blocks end (the last Bn blocks start)."""

    def install(self) -> StepCache:
        blocks = cache_blocks(self.transformer)
        self.first, self.end = self.spec.block_split(len(blocks))
        for index, block in enumerate(blocks):
            self._restore.append((block, block.__dict__.get("forward")))
            block.forward = self._wrapped(index, block.forward)
        parameters = list(inspect.signature(type(self.transformer).forward).parameters)[1:]  # less self
        self._timestep_at = parameters.index("timestep") if "timestep" in parameters else None
        self._hook = self.transformer.register_forward_pre_hook(self._new_call, with_kwargs=True)
        return self

    def undo(self) -> None:
        """Every block's own forward again (or the override it had, e.g. V-First's)."""
        for block, own in self._restore:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._restore.clear()
        if self._hook is not None:
            self._hook.remove()

    def report(self) -> dict[str, Any]:
        return {"spec": str(self.spec), "computed_steps": self.computed_steps, "skipped_steps": self.skipped_steps}

    def _new_call(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        """At the transformer's entry: which step and which call of it this is."""
        at = self._timestep_at
        t = timestep_value(kwargs["timestep"] if "timestep" in kwargs else args[at] if at is not None and at < len(args) else None)
        new_run, _ = self._steps.count(t)
        if new_run:
            self._states.clear()
            self.computed_steps = self.skipped_steps = 0
        self._state = self._states.setdefault((self._steps.calls - 1, self.paired()), _CallState())
        self._skip, self._input, self._head = False, None, None
        return args, kwargs

    def _wrapped(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def cached_forward(*args: Any, **kwargs: Any) -> Any:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1]
            if index == 0:
                self._input = hidden
            if self._skip and self.first <= index < self.end:
                if index < self.end - 1:
                    return text, hidden  # the middle's residual is added at its last block
                residual, text_residual = self._state.middle
                return (text + text_residual if text_residual is not None else None), hidden + residual
            text_out, hidden_out = forward(*args, **kwargs)
            if index == self.first - 1:
                self._decide(hidden_out, text_out)
            elif index == self.end - 1 and self._head is not None:
                hidden_start, text_start = self._head
                text_residual = text_out - text_start if text_out is not None and text_start is not None else None
                self._state.middle = (hidden_out - hidden_start, text_residual)
            return text_out, hidden_out

        return cached_forward

    def _decide(self, hidden: torch.Tensor, text: torch.Tensor | None) -> None:
        """After the Fn-th block: agree with every rank whether this call skips its middle blocks."""
        state, spec = self._state, self.spec
        residual = hidden - self._input
        must = (not _fits(state.middle, hidden, text) or state.calls < spec.warmup
                or (spec.max_in_a_row is not None and state.in_a_row >= spec.max_in_a_row))
        skip = should_skip(self.agree(local_sums(residual, state.previous, must)), spec.threshold)
        state.calls += 1
        self._skip = skip
        if skip:
            state.in_a_row += 1
            self.skipped_steps += 1
            return
        self.computed_steps += 1
        state.in_a_row, state.previous, self._head = 0, residual, (hidden, text)


def _fits(middle: tuple[torch.Tensor, torch.Tensor | None] | None, hidden: torch.Tensor, text: torch.Tensor | None) -> bool:
    """Whether a cached middle residual can be added to this call's tokens (a plan switched by
    `--plan auto` may shard them differently)."""
    if middle is None or middle[0].shape != hidden.shape:
        return False
    return middle[1] is None or (text is not None and middle[1].shape == text.shape)


def apply_cache(transformer: torch.nn.Module, spec: CacheSpec,
                agree: Callable[[torch.Tensor], list[float]] | None = None,
                paired: Callable[[], bool] | None = None) -> StepCache:
    """Install `spec` on `transformer`'s blocks. `agree` sums the decision's values over every rank
    (required with more than one; None: one process); `paired` says whether a call runs a CFG pair."""
    local = lambda values: values.tolist()  # noqa: E731 - one process: its sums are everyone's
    return StepCache(spec, transformer, agree or local, paired or (lambda: False)).install()
