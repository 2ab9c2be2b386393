"""CFG and batch parallelism: each transformer call's batch shared by the data groups.

A plan with `cfg x batch = N > 1` gives every rank a data group: the N ranks at its place in the
sequence across the CFG branches and batch shares (CFG-major). The transformer's `forward` is
wrapped (an instance attribute, like V-First's overlapped blocks; `undo` removes it), so a stock
pipeline runs unchanged:

- One call per step whose batch holds both CFG branches (SD3's batched CFG: [negative, positive])
  or several images: the call's batch is cut into N shares in order (`split_sizes`, uneven
  allowed), each data index runs its share through the sequence-parallel transformer, and every
  rank ends with the whole output (below). With `cfg=2` the two halves are the two branches, so
  each branch runs on its own group.
- Two calls per step (true CFG: `FluxPipeline` / `QwenImagePipeline` with `true_cfg_scale`, the
  positive prompt then the negative, at the same timestep): the calls are paired. The first
  returns a buffer of the output's shape at once, without computing; the second runs, on CFG index
  0, the first call's inputs, and on CFG index 1 its own (each batch-shared as above); one gather
  brings both results to every rank, the first is written into the buffer returned earlier and
  the second is returned. The pipelines read the first result only after the second call
  (to combine them), so they see exactly what one group computing both would give. A run's
  first step is not paired: it shows how many calls a step makes (the same on every rank:
  every rank runs the same pipeline), and pairing starts with the second step.
- A call whose batch has fewer items than data groups (guidance off with `cfg=2` and one
  image) runs whole on every group: the same result, no exchange, no hang.

Shards first. The output leaves the transformer through the sequence gather at `proj_out`
(`UlyssesContext.gather`: inside the Ulysses group, then around the ring). The data groups span
nodes and the sequence-parallel ranks share one, so the batch is gathered first, on each rank's
sequence shard: while a share runs, the context's `batch_gather` gathers the shard along the
batch across the data group (distributed/comm/group.py, kind "data", axis cfg/batch), then the sequence
gather joins the whole batch's shards (kind "gather"):

    (B_i, S_r, C) --data gather--> (B, S_r, C) --sequence gather--> (B, S, C)

Each rank sends its 1/(ulysses x ring) of its share's output to each data peer instead of the
whole share's output; the sequence gather carries N times more, over the links the plan keeps
inside a node. The code after `proj_out` (SD3's unpatchify; FLUX and Qwen-Image return its
output) runs on the whole batch, shaped by its first dim. A call run whole sets no batch gather.

Which forward arguments carry the batch is data, per family (`families.batch_args`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..config.sizes import split_sizes
from ..distributed.comm.group import PeerGroup
from .steps import clock_of

if TYPE_CHECKING:
    from .attention.core import UlyssesContext

__all__ = ["DataParallelForward", "StepCounter", "unpaired"]


ROWS_PER_ITEM = ("encoder_hidden_states_image",)
"""Batch arguments that may hold several rows per item, item after item (Wan 2.1 FLF2V's image
features: the first frame's, then the last's); any other is split only where its leading dim is
the batch."""


def _take(value: Any, start: int, count: int, batch: int, name: str = "") -> Any:
    """Items [start, start + count) of batch argument `name` (a tensor or a per-item list)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.narrow(0, start, count)
    if name in ROWS_PER_ITEM and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] % batch == 0:
        rows = value.shape[0] // batch
        return value.narrow(0, start * rows, count * rows)
    if isinstance(value, list) and len(value) == batch:
        return value[start : start + count]
    return value  # a scalar or broadcast value: the same for every item


@dataclass
class StepCounter:
    """A transformer's calls by denoising step, from each call's step value (`steps.StepClock.value`):
    a new value starts a step, a larger one a new run (values fall within a run); no value, a step per call."""

    timestep: float | None = None
    """The step value of the current step."""
    calls: int = 0
    """Calls of the current step, the last one counted included."""

    def count(self, timestep: float | None) -> tuple[bool, int | None]:
        """Count a call at step value `timestep`: whether it starts a new run, and the calls of the step it
        ends (None when it continues a step or follows no timestep)."""
        if timestep is not None and timestep == self.timestep:
            self.calls += 1
            return False, None
        new_run = timestep is not None and self.timestep is not None and timestep > self.timestep
        ended = self.calls if self.timestep is not None else None
        self.timestep, self.calls = timestep, 1
        return new_run, ended


@dataclass
class DataParallelForward:
    """The wrapped `forward` of one transformer under a plan with CFG or batch groups."""

    transformer: torch.nn.Module
    data: PeerGroup | None
    """This rank's data group; None: no CFG or batch groups (a plan `--plan auto` may try), every call runs whole."""
    cfg: int
    batch_args: tuple[str, ...]
    context: UlyssesContext
    """The sequence-parallel context whose output gather takes the batch gather first."""
    forward: Callable[..., Any] = field(init=False)
    """The transformer's own forward (its class's), called on each share."""
    _parameters: list[str] = field(init=False)
    _steps: StepCounter = field(default_factory=StepCounter)
    _calls_per_step: int | None = None
    """Known after a run's first step; 2 with cfg=2 means the calls are paired."""
    _pending: tuple[dict[str, Any], torch.Tensor] | None = None
    """The first call of a pair: its arguments and the buffer it returned."""
    _templates: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """The last output computed whole for each call signature (`_signature`): its shape and type make
    the buffer of a pair whose calls have that signature."""
    pairs: int = 0
    """Pairs of calls run side by side so far (true CFG's two branches on two groups)."""
    pair_calls: bool = True
    """False inside `unpaired`: every call is one whole batch (a caller that batches the branches)."""
    share: tuple[int, int] | None = None
    """While a call's share runs: (its first row in the call's batch, its rows); None otherwise
    (per-request step caches read it: engine/cache/rows.py)."""
    gather_inside: bool = True
    """Gather the batch shard by shard inside the output's sequence gather (the plan's last step
    before the output is only reshaped); False: gather the whole output at the transformer's exit
    (a model that reshapes by its input's batch size after the sequence gather, e.g. Wan)."""
    step: Callable[[], float | None] | None = None
    """The call's step value (`steps.StepClock.value`, the same on every rank); None: every call a step of its own."""

    def __post_init__(self) -> None:
        self.forward = type(self.transformer).forward.__get__(self.transformer)
        self._parameters = list(inspect.signature(self.forward).parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = {**dict(zip(self._parameters, args)), **kwargs}
        if not self.pair_calls:
            return self._whole(kwargs)
        self._track_steps(self.step() if self.step is not None else None)
        if self._pending is not None:  # the second of a pair
            return self._second(kwargs)
        signature = _signature(kwargs)
        template = self._templates.get(signature)
        pairable = self.data is not None and self.cfg == 2 and self._calls_per_step == 2 and _single(template)
        if pairable and self._steps.calls == 1 and template is not None and _batch(kwargs) >= self.data.size // 2:
            # The first of a pair: a buffer now, filled by the second call.
            buffer = torch.empty_like(_sample(template))
            self._pending = (kwargs, buffer)
            return _with_sample(template, buffer)
        # Every whole call leaves its output as the template of the next pair's buffer, also under
        # a plan without data groups: `--plan auto` may switch to one between steps.
        self._templates[signature] = self._whole(kwargs)
        return self._templates[signature]

    def _second(self, kwargs: dict[str, Any]) -> Any:
        """The second call of a pair: CFG index 0 runs the first call's inputs, index 1 its own."""
        first, buffer = self._pending
        self._pending = None
        self.pairs += 1
        mine = first if self.data.index < self.data.size // 2 else kwargs
        both = self._shared(mine, calls=2)
        out_first, out_second = _sample(both).split(_batch(first), dim=0)
        buffer.copy_(out_first)
        return _with_sample(both, out_second)

    def _whole(self, kwargs: dict[str, Any]) -> Any:
        """One call's batch shared by the data groups; a batch smaller than the groups runs whole on every group."""
        if self.data is None or _batch(kwargs) < self.data.size:
            return self.forward(**kwargs)
        return self._shared(kwargs)

    def use(self, data: PeerGroup | None, cfg: int) -> None:
        """Share the next calls across another plan's data group (`--plan auto`'s trials switch
        plans between denoising steps, when no pair is pending: engine/plan_trials.py)."""
        self.data, self.cfg = data, cfg

    def _track_steps(self, value: float | None) -> None:
        """Count calls per denoising step (a new step value starts a step; a larger one, a run)."""
        new_run, ended = self._steps.count(value)
        if new_run:
            self._calls_per_step, self._pending = None, None  # learn its pattern again
            self._templates.clear()
        elif ended is not None and self._calls_per_step is None:
            self._calls_per_step = ended

    def _shared(self, kwargs: dict[str, Any], calls: int = 1) -> Any:
        """Run this data index's share of `kwargs`' batch and gather every share along the batch
        on every rank, shard by shard inside the output's sequence gather. With `calls=2` each
        half of the data group shares one call's batch (the two calls of a pair have the same
        batch size), first half first."""
        per_call = self.data.size // calls
        batch = _batch(kwargs)
        sizes = split_sizes(batch, per_call)
        index = self.data.index % per_call
        start = sum(sizes[:index])
        share = {k: _take(v, start, sizes[index], batch, k) if k in self.batch_args else v for k, v in kwargs.items()}
        gather = lambda part: self.data.gather(part.contiguous(), 0, sizes * calls, kind="data", packed=True)  # noqa: E731
        self.share = (start, sizes[index]) if calls == 1 else None
        try:
            return self._run_share(share, gather, batch * calls)
        finally:
            self.share = None

    def _run_share(self, share: dict[str, Any], gather: Callable[[torch.Tensor], torch.Tensor], batch: int) -> Any:
        if not self.gather_inside:  # every output (LTX-2's video and audio) gathered at the exit
            return _each_output(self.forward(**share), gather)
        # At proj_out, before the sequence gather: (B_i, S_r, C) shard -> (B, S_r, C) (every share, in order).
        self.context.batch_gather = gather
        try:
            out = self.forward(**share)
        finally:
            self.context.batch_gather = None
        if _sample(out).shape[0] != batch:
            raise RuntimeError(f"{type(self.transformer).__name__}'s output was not gathered along the batch")
        return out


@contextmanager
def unpaired(transformer: torch.nn.Module) -> Iterator[None]:
    """Inside: calls of `transformer` are never paired, each batch is shared as one call's, and each
    call is a step of its own (`StepClock.each_call`). For a caller that puts both CFG branches in
    one batch and steps its requests itself, each on its own scheduler (serving's step-level
    batching): the pipeline's scheduler does not move."""
    forward, clock = transformer.__dict__.get("forward"), clock_of(transformer)
    paired = isinstance(forward, DataParallelForward)
    if paired:
        forward.pair_calls = False
    if clock is not None:
        clock.each_call = True
    try:
        yield
    finally:
        if paired:
            forward.pair_calls = True
        if clock is not None:
            clock.each_call = False


def _signature(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What of a call's arguments may change the shape of its output while its tensors' shapes stay:
    its strings, flags and Nones (Qwen-Image 2.1's `kv_cache_mode`: the first step's 'extract' returns
    the text's rows too, the later steps' 'cached' the image's alone). A pair's buffer is shaped by a
    whole call of the same signature; a signature first seen runs whole, on every rank alike."""
    return tuple(sorted((k, v) for k, v in kwargs.items() if v is None or isinstance(v, (str, bool))))


def _batch(kwargs: dict[str, Any]) -> int:
    return kwargs["hidden_states"].shape[0]


def _sample(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def _each_output(out: Any, gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`out` (a tuple or a model output) with each of its tensors gathered."""
    if isinstance(out, tuple):
        return tuple(gather(x) if isinstance(x, torch.Tensor) else x for x in out)
    return type(out)(**{k: gather(v) if isinstance(v, torch.Tensor) else v for k, v in out.items()})


def _single(out: Any) -> bool:
    """Whether a call's output holds one tensor (the sample), as the pairs of CFG calls pair it;
    LTX-2's video and audio samples: no (its pipeline batches the two branches in one call)."""
    if out is None:
        return True
    values = out if isinstance(out, tuple) else tuple(out.values())
    return sum(isinstance(v, torch.Tensor) for v in values) == 1


def _with_sample(out: Any, sample: torch.Tensor) -> Any:
    return (sample, *out[1:]) if isinstance(out, tuple) else type(out)(sample=sample)
