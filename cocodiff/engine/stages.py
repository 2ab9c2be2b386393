"""Pipeline stages (`--plan p2u2`): the transformer's blocks cut into contiguous ranges, one per
stage, and each call's images passed from stage to stage as micro-batches. Exact.

    stage 0: embedders, blocks [0, b1)  --hidden state-->  stage 1: blocks [b1, b2)  ...  last stage: ..., output layers
                  ^                                                                              |
                  +-------------------------- the output, to every earlier stage ----------------+

The blocks are the transformer's repeated blocks in the order they run (`cache_blocks`: FLUX's
double- then single-stream blocks, SD3's, Wan's, ...). Each stage's ranks keep only their range
(the other blocks leave their ModuleLists, and their weights the rank), cut where the stages'
costs are most even (`stage_ranges` over `token_params`: the weights its image tokens' matmuls
read). Inside a stage the sequence-parallel plan runs as without stages: the stage boundary
joins the ranks at the same place in the sequence (`PlanGroups.stage_members`), so each rank
hands on its own shard.

Every rank runs the stock forward on its cut transformer (`cut_stages`, before anything is
installed on the blocks, so that a plan splitting the sequence at `blocks.0` splits it at each
stage's first block). A stage other than the first computes the embedders itself (the same tensors
as the first stage: the same inputs), and its first block takes the streams its blocks change
(`Family.block_streams`: `hidden_states` and `encoder_hidden_states`; LTX-2's video and audio) from
the stage before instead (a forward pre-hook, `_receive`); its
receive buffers take the shapes of what it computed, so no shape crosses the link. A stage other
than the last ends its forward at the next stage's first block (`_Handoff`, in that block's place
in its list): it sends the block's inputs on and stops. The last stage runs the output layers and
sends the output's samples (LTX-2: two) to the earlier stages' ranks at its place (their count and
shapes once for each input shape, the first time it is seen).

The micro-batches are a call's images (a CFG call's two branches are two), at most two per stage
(`config.parallel.micro_batches`: a larger batch passes in micro-batches of several images): stage 0
starts micro-batch i + 1 while stage 1 runs micro-batch i. Every send is posted as soon as its
tensor exists and waited for at the end of the call. Every receive of a call is posted as the call
begins, once a first call of the same shapes has shown them (`_post_ahead`): the stage before
never waits for this one to reach its first block, and an output lands while this stage computes.
The output travels back over groups of its own (`PlanGroups.output_group`), and each boundary's
hand-ons over a pair's group of its own (`PlanGroups.boundary_groups`): on NCCL each a communicator
and stream of its own, so a receive posted ahead never queues in front of a send to the same peer,
or a middle stage's receives from the stage before in front of its sends to the next. Every receive
is bounded by the peer timeout and names the stage and the peer (on gloo: NCCL's own watchdog
bounds its waits, docs/usage.md). One
image per call (FLUX without CFG, batch 1) leaves the stages in turn, with no overlap, unless it
runs in displaced patches (`--pipe-patches`, engine/patches.py: LOSSY), which pass through
the stages as the images do. The boundary's floating-point tensors travel in the wire format of
their link (`--wire node=fp8`: packed as the exchanges pack theirs, LOSSY), all else exactly.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..config.parallel import micro_batches
from ..config.plan import stage_ranges
from ..config.sizes import split_sizes
from ..config.wire import EXACT, Wire
from ..distributed.comm import CommStats
from ..distributed.comm.ulysses import bounded
from ..distributed.comm.wire import pack, packed_bytes, unpack
from ..distributed.topology import PlanGroups, Topology
from ..errors import UsageError
from .cache.steps import cache_blocks
from .data_parallel import _each_output, _sample, _take
from .patches import Patches

__all__ = ["StageCut", "StageForward", "block_lists", "cut_stages", "keep_cut", "stage_lists", "stage_parameters", "stage_ranges",
           "token_params", "whole_cut"]

KIND = "stage"
HEADER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The output dtypes a header names (by index): the receivers allocate the output as it was sent."""
"""The stage boundary's traffic in the communication counters."""


@dataclass
class _Posted:
    """A receive posted: its buffer (packed in the link's wire format) and what it unpacks to."""

    work: dist.Work
    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    fmt: str
    peer: int


def _samples(out: Any) -> list[torch.Tensor]:
    """The tensors of a transformer call's output, in order (LTX-2's: the video's and the audio's)."""
    values = out if isinstance(out, tuple) else tuple(out.values())
    return [v for v in values if isinstance(v, torch.Tensor)]


class _StageEnd(Exception):
    """This stage's blocks are done: its forward stops at the next stage's first block."""


class _Handoff(nn.Module):
    """In the place of the next stage's first block: send that block's inputs on, and stop."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self._signature = inspect.signature(block.forward)
        self.__dict__["stage"] = None  # the `StageForward` installed now (not a submodule)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        self.stage.hand_on([bound.get(name) for name in self.stage.streams])
        raise _StageEnd


@dataclass
class StageCut:
    """A transformer cut for one rank's stage: kept on it (`cut_stages`), since the blocks it gave
    up are gone, so that parallelizing it again (another variant of `bench e2e`) finds its cut."""

    stages: int
    stage: int
    ranges: list[tuple[int, int]]
    """[start, end) of every stage's blocks, in the order the blocks run."""
    first: nn.Module
    """This stage's first block (its inputs come from the stage before, past the first stage)."""
    handoff: _Handoff | None
    """In the place of the next stage's first block (None on the last stage)."""

    @property
    def start(self) -> int:
        return self.ranges[self.stage][0]

    @property
    def end(self) -> int:
        return self.ranges[self.stage][1]


def _per_token(name: str) -> bool:
    """Whether a block's parameter `name` is read by the image tokens' matmuls: not the text
    stream's (`*_context`, `add_*`, `to_add_out`, `txt_*`), not a norm's or a modulation's (applied
    to the timestep's embedding, once per image: `norm*`, `*_mod`)."""
    return not any(part.startswith(("norm", "add_", "txt_")) or "context" in part or part == "to_add_out"
                   or part.endswith("_mod") for part in name.split("."))


def token_params(block: nn.Module) -> int:
    """A block's cost per image token, for cutting stages: the parameters its image tokens' matmuls
    read. FLUX's double-stream blocks hold twice a single-stream block's weights, half of them the
    text's, and their modulations' per image; per image token the two cost the same (12 d^2)."""
    return sum(p.numel() for name, p in block.named_parameters() if _per_token(name))


def stage_parameters(transformer: nn.Module, stages: int) -> list[list[nn.Parameter]]:
    """Each stage's parameters (of a transformer not cut yet), as `cut_stages` leaves them: the parts
    outside the blocks (every stage keeps them) and the stage's blocks."""
    blocks = cache_blocks(transformer)
    inside = {id(p) for block in blocks for p in block.parameters()}
    outside = [p for p in transformer.parameters() if id(p) not in inside]
    return [outside + [p for block in blocks[start:end] for p in block.parameters()]
            for start, end in stage_ranges([token_params(b) for b in blocks], stages)]


def cut_stages(transformer: nn.Module, groups: PlanGroups) -> StageCut:
    """Keep this rank's stage's blocks in each of `transformer`'s block lists (and, before the next
    stage's first block, a `_Handoff`); the others leave it. Before anything is installed on the
    blocks, so that the split hooks and processors go on the blocks this stage runs: a plan that
    splits the sequence at `blocks.0` splits it at this stage's first block."""
    stages, stage = len(groups.stage_members), groups.stage_index
    cut = transformer.__dict__.get("_cocodiff_stage_cut")
    if cut is not None:
        if (cut.stages, cut.stage) != (stages, stage):
            raise UsageError(f"--plan {groups.plan.short}: this transformer was cut for stage {cut.stage} of "
                             f"{cut.stages} already; load it again for another cut")
        return cut
    cut, lists = stage_lists(transformer, groups)
    keep_cut(transformer, cut, lists)
    return cut


def stage_lists(transformer: nn.Module, groups: PlanGroups) -> tuple[StageCut, dict[str, nn.ModuleList]]:
    """This rank's stage under `groups`' plan, and each of `transformer`'s block lists as the stage
    keeps it (its blocks and, before the next stage's first block, a `_Handoff`); the transformer
    is left as it is."""
    stages, stage = len(groups.stage_members), groups.stage_index
    try:
        blocks = cache_blocks(transformer)
    except UsageError:
        raise UsageError(f"--plan {groups.plan.short}: {type(transformer).__name__} has no list of blocks taking "
                         f"hidden_states and encoder_hidden_states to cut into pipeline stages") from None
    ranges = stage_ranges([token_params(b) for b in blocks], stages)
    start, end = ranges[stage]
    index = {id(b): i for i, b in enumerate(blocks)}
    handoff, lists = None, {}
    for name, child in block_lists(transformer, index):
        kept: list[nn.Module] = []
        for block in child:
            i = index[id(block)]
            if start <= i < end:
                kept.append(block)
            elif i == end and stage < stages - 1:
                handoff = _Handoff(block)
                kept.append(handoff)
        lists[name] = nn.ModuleList(kept)
    return StageCut(stages, stage, ranges, blocks[start], handoff), lists


def block_lists(transformer: nn.Module, index: dict[int, int] | None = None) -> list[tuple[str, nn.ModuleList]]:
    """The transformer's lists of blocks (`cache_blocks`' blocks, keyed by `id` in `index`), by name."""
    index = index if index is not None else {id(b): i for i, b in enumerate(cache_blocks(transformer))}
    return [(name, child) for name, child in transformer.named_children()
            if isinstance(child, nn.ModuleList) and len(child) and all(id(b) in index for b in child)]


def keep_cut(transformer: nn.Module, cut: StageCut, lists: dict[str, nn.ModuleList]) -> None:
    """Make `lists` the transformer's block lists for good, and note its cut on it."""
    for name, kept in lists.items():
        setattr(transformer, name, kept)
    transformer.__dict__["_cocodiff_stage_cut"] = cut  # not a submodule, not a parameter


def whole_cut(transformer: nn.Module) -> StageCut:
    """One stage of every block: `--pipe-patches` without `p` in the plan (the displaced schedule's
    single-stage reference, engine/patches.py)."""
    blocks = cache_blocks(transformer)
    return StageCut(1, 0, [(0, len(blocks))], blocks[0], None)


class StageForward:
    """The transformer's `forward` on one rank of a pipeline stage (an instance attribute)."""

    def __init__(self, transformer: nn.Module, cut: StageCut, groups: PlanGroups, topology: Topology,
                 stats: CommStats, batch_args: tuple[str, ...], patches: Patches | None = None,
                 step: Callable[[], float | None] | None = None, wire: Wire | None = None,
                 last_step: Callable[[], bool] = lambda: False,
                 streams: tuple[str, ...] = ("hidden_states", "encoder_hidden_states"),
                 build_output: Callable[[list[torch.Tensor]], Any] | None = None) -> None:
        self.transformer, self.cut, self.topology, self.stats = transformer, cut, topology, stats
        self.batch_args = batch_args
        self.streams, self.build_output = streams, build_output
        """The block arguments handed on from stage to stage (`Family.block_streams`), and how a stage
        that received the samples builds a `return_dict` output of several (`Family.stage_output`)."""
        self.patches, self.step, self.wire, self.last_step = patches, step, wire, last_step
        """The displaced schedule (engine/patches.py) and the call's step value, with `--pipe-patches`;
        the wire formats (`--wire`) the boundary's tensors travel in, per link."""
        self.members, self.stage, self.stages = groups.stage_members, cut.stage, cut.stages
        self.ranges = cut.ranges
        self.forward = transformer.__dict__.get("forward") or type(transformer).forward.__get__(transformer)
        self._parameters = list(inspect.signature(type(transformer).forward).parameters)[1:]
        self.output_group = groups.output_group
        boundaries = groups.boundary_groups
        self.previous_group = boundaries[self.stage - 1] if self.stage > 0 else None
        self.next_group = boundaries[self.stage] if self.stage < len(boundaries) else None
        """The hand-ons' groups: from the stage before, to the next (engine/topology `boundary_groups`)."""
        """The output's way back, apart from the block inputs' way on (topology.PlanGroups)."""
        self._sends: list[dist.Work] = []
        self._kept: list[torch.Tensor] = []
        self._out_shapes: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        """Each signature's output samples as the last stage sent them: their shapes and dtypes (their headers)."""
        self._inputs: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        """Per call signature (`_post_ahead`): the block inputs this stage receives, in order, as the
        first such call received them; later calls post them all as they begin."""
        self._heard: list[tuple[torch.Size, torch.dtype]] | None = None
        self._ahead: deque[_Posted] = deque()
        self._outputs_ahead: deque[list[_Posted]] = deque()
        self._hooks = []
        self.live: Callable[[], bool] | None = None
        """Whether this stage's plan runs now (`--plan auto`'s trials, engine/stage_trials.py); None: always."""
        if cut.handoff is not None:
            cut.handoff.stage = self
        if not self.first:
            self._hooks.append(cut.first.register_forward_pre_hook(self._receive, with_kwargs=True))
        self._given: tuple[tuple, dict[str, Any]] | None = None
        """With patches: the call's arguments as given, before any hook split them."""
        self._inner = False
        if patches is not None:  # first of all pre-hooks: each patch runs them again on the arguments as given
            self._hooks.append(transformer.register_forward_pre_hook(self._keep_given, with_kwargs=True, prepend=True))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def describe(self) -> str:
        ranges = ", ".join(f"{a}-{b - 1}" for a, b in self.ranges)
        patches = (f"; {self.patches.count} displaced patches per step after {self.patches.warmup} whole "
                   f"(LOSSY)" if self.patches is not None else "")
        return f"{self.stages} stages of blocks {ranges}; this rank: stage {self.stage}{patches}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._inner:  # one patch, its arguments split by the hooks
            return self.forward(*args, **kwargs)
        kwargs = {**dict(zip(self._parameters, args)), **kwargs}
        if self.patches is not None:
            return self._displaced(kwargs)
        hidden = kwargs["hidden_states"]
        batch = hidden.shape[0]
        sizes = split_sizes(batch, micro_batches(batch, self.stages))
        keys = [((size, *hidden.shape[1:]), hidden.dtype) for size in sizes]
        outputs, samples, start = [], [], 0
        try:
            signature = self._post_ahead(kwargs, "images", keys)
            for size, key in zip(sizes, keys):
                share = {k: _take(v, start, size, batch, k) if k in self.batch_args else v for k, v in kwargs.items()}
                start += size
                try:
                    out = self.forward(**share)
                except _StageEnd:
                    continue
                outputs.append(out)
                samples.append(self._send_output(key, _samples(out)))
            if not self.last:
                samples = [self._receive_output(key) for key in keys]
            self._wait_sends()
            self._heard_all(signature)
        finally:
            self._call_ended()
        return self._result(outputs[0] if outputs else None, [torch.cat(parts) for parts in zip(*samples)], kwargs)

    def _displaced(self, kwargs: dict[str, Any]) -> Any:
        """A call under `--pipe-patches`: the whole batch as M patches one after the other (a
        warm-up call: whole), each handed on as soon as this stage's blocks are done with it."""
        patches = self.patches
        patched = patches.begin_call(self.step())
        key = (tuple(kwargs["hidden_states"].shape), kwargs["hidden_states"].dtype)
        given, self._given = self._given, None
        out = None
        try:
            signature = self._post_ahead(kwargs, "patches" if patched else "whole", [key])
            if not patched:
                try:
                    out = self.forward(**kwargs)
                except _StageEnd:
                    pass
            for index in range(patches.count) if patched else ():
                patches.index = index
                self._inner = True  # the module's call again: its split hooks cut this patch
                try:
                    out = self.transformer(*given[0], **given[1])
                except _StageEnd:
                    pass
                finally:
                    self._inner = False
            if self.last:
                sample = self._send_output(key, [_sample(out)])
            else:
                sample = self._receive_output(key)
            self._wait_sends()
            self._heard_all(signature)
        finally:
            patches.end_call(patched, last_step=self.last_step())
            self._call_ended()
        return self._result(out if self.last else None, sample, kwargs)

    def _post_ahead(self, kwargs: dict[str, Any], mode: str, keys: list[tuple]) -> tuple:
        """At a call's start, every receive whose buffer is known posted at once: the block inputs of
        each micro-batch (or patch) from the stage before, as the first call of this signature
        received them, and the output of each from the last stage, once its shape is known. So the
        stage before never waits for this one to reach a block to hand its tensors on, and an output
        can land while this stage computes. The call's signature: `mode` and its tensors' shapes."""
        signature = (mode, *((k, tuple(v.shape), v.dtype) for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
        if not self.first:
            inputs = self._inputs.get(signature)
            self._heard = [] if inputs is None else None
            previous = self.members[self.stage - 1]
            self._ahead.extend(self._post(shape, dtype, previous, self.previous_group) for shape, dtype in inputs or ())
        if not self.last and all(key in self._out_shapes for key in keys):
            self._outputs_ahead.extend([self._post(*shape, self.members[-1], self.output_group)
                                        for shape in self._out_shapes[key]] for key in keys)
        return signature

    def _heard_all(self, signature: tuple) -> None:
        """A call's end: the block inputs it received, kept for the next call of its signature."""
        if self._heard is not None:
            self._inputs[signature] = self._heard

    def _call_ended(self) -> None:
        self._sends, self._kept, self._heard = [], [], None
        self._ahead.clear()
        self._outputs_ahead.clear()

    def _wait_sends(self) -> None:
        """The call's sends, posted as their tensors came, done (each within the peer timeout)."""
        for work in self._sends:
            bounded(work, f"{KIND} {self.stage}: a send to the next stage")

    def _keep_given(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._inner:
            self._given = (args, dict(kwargs))

    def _result(self, output: Any, samples: list[torch.Tensor], kwargs: dict[str, Any]) -> Any:
        """The call's output: the last stage's own with `samples` in it, or built around them."""
        if output is not None:
            given = iter(samples)
            return _each_output(output, lambda _tensor: next(given))
        if not kwargs.get("return_dict", True):
            return tuple(samples)
        if self.build_output is not None:
            return self.build_output(samples)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=samples[0])

    def hand_on(self, streams: list[Any]) -> None:
        """The next stage's first block's inputs (its `streams`' values): sent to this rank's peer there."""
        peer = self.members[self.stage + 1]
        self._send([t for t in streams if isinstance(t, torch.Tensor)], [peer], group=self.next_group)

    def _receive(self, block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        """This stage's first block: its streams as the stage before computed them."""
        if self.live is not None and not self.live():
            return None
        names = list(inspect.signature(block.forward).parameters)
        args = list(args)
        peer = self.members[self.stage - 1]
        for name in self.streams:
            at = names.index(name) if name in names else None
            if at is not None and at < len(args):
                if isinstance(args[at], torch.Tensor):
                    args[at] = self._block_input(args[at], peer)
            elif isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = self._block_input(kwargs[name], peer)
        return tuple(args), kwargs

    def _block_input(self, local: torch.Tensor, peer: int) -> torch.Tensor:
        """One of the first block's inputs from the stage before: posted ahead, or now (the first call
        of its signature, which notes its shape)."""
        if self._ahead:
            posted = self._ahead.popleft()
            if (posted.shape, posted.dtype) != (local.shape, local.dtype):
                raise RuntimeError(f"{KIND} {self.stage}: a block input posted ahead as {tuple(posted.shape)} "
                                   f"{posted.dtype}, but this call's is {tuple(local.shape)} {local.dtype}")
            return self._finish(posted, "the block inputs")
        if self._heard is not None:
            self._heard.append((local.shape, local.dtype))
        return self._recv(local.shape, local.dtype, peer, "the block inputs", self.previous_group)

    def _send_output(self, key: tuple, samples: list[torch.Tensor]) -> list[torch.Tensor]:
        """The last stage: an image's output samples to every earlier stage's rank at this place."""
        earlier = list(self.members[:-1])
        if key not in self._out_shapes:  # a header first: how many samples, each one's shape and dtype, on the
            # device (a CPU tensor fails on NCCL)
            self._out_shapes[key] = [(sample.shape, sample.dtype) for sample in samples]
            rows = [[sample.dim(), *sample.shape, *[0] * (8 - sample.dim()), HEADER_DTYPES.index(sample.dtype)]
                    for sample in samples]
            device = samples[0].device
            count = torch.tensor([[len(samples), *[0] * 9]], dtype=torch.int64, device=device)
            self._send([count, torch.tensor(rows, dtype=torch.int64, device=device)], earlier, count=False,
                       group=self.output_group)
        self._send(samples, earlier, group=self.output_group)
        return samples

    def _receive_output(self, key: tuple) -> list[torch.Tensor]:
        if self._outputs_ahead:
            return [self._finish(posted, "an output") for posted in self._outputs_ahead.popleft()]
        peer = self.members[-1]
        if key not in self._out_shapes:
            count = self._recv((1, 10), torch.int64, peer, "the output's sample count", self.output_group).tolist()[0][0]
            rows = self._recv((count, 10), torch.int64, peer, "the output's shapes", self.output_group).tolist()
            self._out_shapes[key] = [(torch.Size(row[1 : 1 + row[0]]), HEADER_DTYPES[row[9]]) for row in rows]
        return [self._recv(*shape, peer, "an output", self.output_group) for shape in self._out_shapes[key]]

    def _format(self, peer: int, tensor: torch.Tensor) -> str:
        """The wire format (`--wire`) of a floating-point tensor over the link to `peer`; exact otherwise."""
        if self.wire is None or not tensor.is_floating_point() or tensor.dim() == 0:
            return EXACT
        return self.wire.format_for(self.topology.link_level(peer), self.topology.link_levels[0][0])

    def _send(self, tensors: list[torch.Tensor], peers: list[int], count: bool = True,
              group: dist.ProcessGroup | None = None) -> None:
        """Post `tensors`' sends to `peers` (global ranks; over `group`, the stage members', or the
        default group), each packed in its link's wire format."""
        for tensor in tensors:
            tensor = tensor.contiguous()
            sizes = [0] * dist.get_world_size()
            packed: dict[str, torch.Tensor] = {}
            for peer in peers:
                fmt = self._format(peer, tensor)
                if fmt not in packed:
                    packed[fmt] = tensor if fmt == EXACT else pack(tensor, (fmt,), tensor.shape[-1])
                    self._kept.append(packed[fmt])  # alive until its send is waited for
                self._sends.append(dist.isend(packed[fmt], peer, group=group))
                sizes[peer] = packed[fmt].numel() * packed[fmt].element_size()
            if count:
                self.stats.record_send(KIND, self.topology, sizes)

    def _post(self, shape: tuple | torch.Size, dtype: torch.dtype, peer: int,
              group: dist.ProcessGroup | None = None) -> _Posted:
        """A receive from `peer` (over `group`, the stage members', or the default group) posted
        now, into a buffer of `shape` packed in the link's wire format."""
        buffer = torch.empty(shape, dtype=dtype, device=self.topology.device)
        fmt = self._format(peer, buffer)
        data = buffer if fmt == EXACT else torch.empty(
            packed_bytes(buffer.numel(), (fmt,), buffer.shape[-1], buffer.element_size()), dtype=torch.uint8,
            device=buffer.device)
        return _Posted(dist.irecv(data, peer, group=group), data, buffer.shape, dtype, fmt, peer)

    def _finish(self, posted: _Posted, what: str) -> torch.Tensor:
        """A posted receive, waited for within the peer timeout (timed as the stage's wait), unpacked."""
        start = self.stats.mark() if self.stats.timed else None
        peer = posted.peer
        bounded(posted.work, f"{KIND} {self.stage}: {what} from rank {peer} (stage {self.members.index(peer)})")
        if start is not None:
            self.stats.waited(KIND, start, self.stats.mark())
        if posted.fmt == EXACT:
            return posted.data
        return unpack(posted.data, (posted.fmt,), math.prod(posted.shape), posted.shape[-1],
                      posted.dtype).view(posted.shape)

    def _recv(self, shape: tuple | torch.Size, dtype: torch.dtype, peer: int, what: str,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return self._finish(self._post(shape, dtype, peer, group), what)

    def undo(self) -> None:
        """The hooks go; the blocks this rank gave up stay gone (as sharded weights stay sharded)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.transformer.__dict__.get("forward") is self:
            del self.transformer.forward
