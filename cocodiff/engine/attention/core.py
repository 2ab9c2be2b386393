"""Ulysses attention shared by every model family.

A family's processor computes this rank's projections exactly as diffusers does (projection,
QK norm, RoPE), hands them here, and gets back this rank's share of the attention output:

    (B, S_r, H, D) q, k, v   --seq_to_head-->   (B, H_r, S, D)   --SDPA-->   (B, H_r, S, D)
                             <--head_to_seq--   (B, S_r, H, D)

With a ring in the plan (ranks = ring x ulysses), the exchange runs inside this rank's Ulysses
group and S is that group's chunk of the sequence; SDPA becomes ring attention over every
chunk's keys (ring.py).

`UlyssesContext` is the per-transformer parallel state: topology, exchange, statistics, and the
token layout of the forward pass in flight (how many text and image tokens each rank holds).
It is created by `parallelize` and handed to every processor; nothing is global.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cocodiff.config.plan import Plan
from cocodiff.distributed.clock import Clock
from cocodiff.distributed.comm import CommStats, Exchange, split_sizes
from cocodiff.distributed.comm.ulysses import all_reduce
from cocodiff.distributed.topology import PlanGroups, Topology

from ..patches import Patches
from ..vmajor import VMajor
from .backends import kernel
from .ring import Ring

__all__ = ["LayerTimer", "UlyssesContext", "UlyssesProcessor"]

QK = tuple[torch.Tensor, torch.Tensor]


class UlyssesContext:
    """Parallel state of one transformer: groups, exchange, stats and the current token layout."""

    def __init__(
        self,
        topology: Topology,
        exchange: Exchange,
        stats: CommStats,
        v_first: bool = True,
        fuse_qk: bool = True,
        groups: PlanGroups | None = None,
        attention_backend: str | None = None,
    ) -> None:
        self.topology = topology
        """Every rank of the run."""
        self.exchange = exchange
        """The Ulysses exchange, over this rank's Ulysses group (`groups.ulysses`)."""
        self.stats = stats
        self.v_first = v_first
        self.fuse_qk = fuse_qk
        self.attention_backend = attention_backend
        """The dispatcher's backend the attention runs on (`--attention-backend`, backends.py); None:
        torch's SDPA here, the dispatcher's active backend in the stock processors."""
        self._kernel = kernel(attention_backend) if attention_backend is not None else None
        self.kernels: set[str] = set()
        """The functions the attention of this rank ran on (backends.kernel_name; `ring` for ring blocks)."""
        self.groups = groups or PlanGroups(Plan(ulysses=topology.world_size), topology, None, (topology.rank,), 0)
        self.ring: Ring | None = None
        """Ring attention across the Ulysses groups, when the plan has a ring."""
        self.use(self.groups, exchange)
        self.sizes: dict[str, list[int]] = {}
        """Tokens of each stream (`txt`, `img`) held by each sequence-parallel rank, in sequence
        order (chunk-major, then Ulysses rank), in the forward pass in flight."""
        self.batched: set[str] = set()
        """The streams of `sizes` split on a tensor with an axis before its tokens (a batch): the
        token streams themselves, not a table of one row per token (rotary angles) split ahead of them."""
        self.whole_kv: set[int] = set()
        """Token counts of K/V that every rank may hold whole (a text that no block hands on, in a plan
        inferred from the model): each module's first call tells (dispatch.py `_whole`)."""
        self.vmajor: VMajor | None = None
        """V-Major state when selective communication is on (set by `parallelize`)."""
        self.patches: Patches | None = None
        """The displaced patch schedule (`--pipe-patches`, engine/patches.py): a forward pass then runs one
        patch of every stream, and attention takes the other patches' keys and values from its buffers."""
        self.timeline: dict[str, list[dict[str, tuple[Any, Any]]]] | None = None
        """Per-layer timings (V in flight, Q/K compute, exposed waits) when set to a dict (not
        with compiled blocks: each clock read would break their graph)."""
        self._key_mask: tuple | None = None
        """(the masks given, the token layout, the gathered key mask) of the last call."""
        self.batch_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by CFG / batch parallelism (engine/data_parallel.py) for the call in flight: gathers this
        rank's sequence shard of the output along the batch (dim 0) across its data group, before
        `gather` joins the shards along the sequence."""

    def use(self, groups: PlanGroups, exchange: Exchange) -> None:
        """Run the next calls under another plan's groups and exchange (`--plan auto`'s trials
        switch plans between denoising steps: engine/plan_trials.py)."""
        self.groups, self.exchange = groups, exchange
        plan = groups.plan
        self.ring = Ring(self.topology, groups.ring_group, groups.ring_members, groups.ring_index, self.stats,
                         wire=exchange.wire) if plan.ring > 1 else None  # K/V blocks in the exchange's wire formats

    def agree_min(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """`tensor`'s element-wise minimum over the ranks that run the same layers, where a layer's
        agreements are taken: every rank, or under pipeline stages the ranks of this rank's stage
        (a stage of one rank agrees with itself: it has no group)."""
        plan = self.groups.plan
        group = self.groups.stage_group if plan.pipe > 1 else self.topology.world_group
        if plan.pipe > 1 and group is None:
            return tensor
        return all_reduce(tensor, group, kind, op=dist.ReduceOp.MIN)

    # -- the token layout: sequence-parallel ranks, chunk by chunk -------------------------------
    def _chunk(self, sizes: list[int], chunk: int) -> list[int]:
        """The sizes of one ring chunk's Ulysses ranks."""
        U = self.groups.plan.ulysses
        return sizes[chunk * U : (chunk + 1) * U]

    # -- sharding at the transformer's entry and exit ------------------------------------------
    def new_forward(self) -> None:
        """A forward pass starts: no stream is split yet (the split hooks record this pass's layout)."""
        self.sizes.clear()  # the same dict: a compiled block's guards on it hold
        self.batched.clear()

    @property
    def split(self) -> bool:
        """Whether the forward pass in flight has split its tokens yet. Attention before the split
        holds whole sequences, the same on every rank; every rank runs the same split hooks, so
        every rank gives the same answer without a collective. A table with a row per token
        (MiniMax-H3's and Qwen-Image's rotary angles, split at dimension 0) may be split before
        the tokens are, ahead of a text refiner that attends over the whole prompt: it does not count."""
        return bool(self.batched)

    def shard(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """Keep this rank's contiguous slice of `x` along `dim`; remember the split of `stream`."""
        sizes = split_sizes(x.shape[dim], self.groups.plan.sp)
        index = self.groups.sp_index
        if dim % x.dim() > 0:
            self.batched.add(stream)
        if self.patches is not None and self.patches.index is not None:  # one patch of this rank's share
            patch = self.patches.cut(stream, sizes)
            self.sizes[stream] = patch
            return x.narrow(dim, self.patches.starts[stream][index], patch[index])
        self.sizes[stream] = sizes
        return x.narrow(dim, sum(sizes[:index]), sizes[index])

    def held(self, stream: str) -> int:
        """This rank's tokens of `stream` in the forward pass in flight."""
        return self.sizes[stream][self.groups.sp_index]

    def gather(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """Inverse of `shard`: every rank gets the full tensor (inside the Ulysses group, then
        around the ring). With `batch_gather` set, the shard is first gathered along the batch
        across the data group: (B_i, S_r, C) -> (B, S_r, C), then (B, S_r, C) -> (B, S, C)."""
        if self.batch_gather is not None:
            x = self.batch_gather(x)
        sizes = self.sizes[stream]
        chunk = self.exchange.gather_seq(x, dim, self._chunk(sizes, self.groups.ring_index))
        if self.patches is not None and self.patches.index is not None:  # a patch: placed in the call's whole output
            return self.patches.place_output(chunk, dim, stream, sizes)
        if self.ring is None:
            return chunk
        return self.ring.gather(chunk, dim, [sum(self._chunk(sizes, g)) for g in range(self.ring.size)])

    def joint_sizes(self, streams: tuple[str, ...]) -> list[int]:
        """Tokens per sequence-parallel rank of the concatenation of `streams` (each rank
        concatenates its shards)."""
        return [sum(parts) for parts in zip(*(self.sizes[s] for s in streams))]

    def gathered_key_mask(self, masks: dict[str, torch.Tensor | None], streams: tuple[str, ...]) -> torch.Tensor | None:
        """Key-padding mask (B, S) over the whole joint sequence, in the order `seq_to_head`
        produces chunk by chunk: sequence-parallel rank-major, each rank's streams in order.

        `masks[stream]` is the full (B, S_stream) boolean mask of a stream, or None for all-valid.
        Built once per forward pass: every layer of a call passes the same mask tensors (the cache
        holds them, so a later call's tensors cannot be taken for them).
        """
        if all(masks.get(s) is None for s in streams):
            return None
        if torch.compiler.is_compiling():  # a compiled block: built in its graph, no Python state
            return self._build_key_mask(masks, streams)
        given = tuple(masks.get(s) for s in streams)
        layout = tuple(tuple(self._key_sizes()[s]) for s in streams)
        cached = self._key_mask
        if cached is not None and cached[1] == layout and all(a is b for a, b in zip(cached[0], given)):
            return cached[2]
        self._key_mask = (given, layout, self._build_key_mask(masks, streams))
        return self._key_mask[2]

    def _key_sizes(self) -> dict[str, list[int]]:
        """The layout a key mask covers: this pass's, or under a patch the whole sequence's (its keys
        are the patch buffers', engine/patches.py)."""
        patched = self.patches is not None and self.patches.index is not None
        return self.patches.full if patched else self.sizes

    def _build_key_mask(self, masks: dict[str, torch.Tensor | None], streams: tuple[str, ...]) -> torch.Tensor:
        batch = next(m for m in masks.values() if m is not None).shape[0]
        pieces = []
        offsets = {s: 0 for s in streams}
        sizes = self._key_sizes()
        for rank in range(self.groups.plan.sp):
            for s in streams:
                n = sizes[s][rank]
                mask = masks.get(s)
                if mask is None:
                    pieces.append(torch.ones(batch, n, dtype=torch.bool, device=self.topology.device))
                else:
                    pieces.append(mask[:, offsets[s] : offsets[s] + n].to(torch.bool))
                offsets[s] += n
        return torch.cat(pieces, dim=1)

    # -- attention -------------------------------------------------------------------------
    def attention(
        self,
        project_v: Callable[[], torch.Tensor],
        project_qk: Callable[[], QK],
        streams: tuple[str, ...],
        key_mask: torch.Tensor | None = None,
        overlap: Callable[[], None] | None = None,
        layer: str = "",
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Sequence-parallel attention over the joint sequence of `streams`.

        project_v, project_qk: return this rank's (B, S_r, H, D) V, and Q and K after norm and RoPE.
        key_mask: optional (B, S) boolean mask over the gathered keys (True = attend).
        overlap: work that does not need the attention output; it runs while the output travels.
        attend: the attention itself, from this Ulysses group's whole sequence on this rank's heads
        ((B, H_r, S, D) q, k, v -> output), where a model's attention is more than one call over
        the whole sequence (Qwen-Image 2.1's block-causal segments); None: `attend_whole` over the
        keys of `key_mask`, or the ring's blocks.
        Returns this rank's (B, S_r, H, D) attention output.

        With V-First, V's exchange is started before Q and K are computed and runs under that
        work (with TAPA, V's inter-node phase also runs under Q/K's intra-node phase); without
        it, V, Q and K are exchanged one after the other once all three are ready. Both orders
        compute the same numbers: only the schedule differs.
        """
        joint = self.joint_sizes(streams)
        seq = self._chunk(joint, self.groups.ring_index)  # this Ulysses group's chunk
        timer = LayerTimer(self.timeline, layer, self.topology.device) if self.timeline is not None else None
        # Per-layer marks (events on a device: never a synchronization inside a layer, where a
        # pipeline stage's receives may be posted): only when a timeline is asked for.
        tick = timer.mark if timer else float
        call = self.vmajor.call if self.vmajor is not None else 0
        v_key, qk_key = (layer, "v", call), (layer, "qk", call)
        if self.v_first:
            value = project_v()
            pending_v = self.exchange.seq_to_head(value, seq, v_key)
            t_v = tick()
            query, key = project_qk()
            t_qk = tick()
            pending_v.poll()  # with TAPA: V's inter-node phase starts now if its first has landed
            finish_qk = self._start_qk(query, key, seq, qk_key)
            # Every rank issues V's remaining phases before Q/K's next ones: the same order per
            # group on all ranks (poll's timing-dependent progress could otherwise reorder them).
            pending_v.issue_all()
            q, k = finish_qk()
            v = pending_v.wait()
            t_done = tick()
            if timer:
                timer.add(qk_compute_ms=(t_v, t_qk), v_comm_ms=(t_v, t_done), input_exposed_ms=(t_qk, t_done))
        elif self.fuse_qk and self.vmajor is None and self.exchange.wire is None:
            # V, Q and K in one message, as Q and K are (V-Major and wire formats treat V apart): one exchange, not two
            value = project_v()
            t_qk0 = tick()
            query, key = project_qk()
            t_v = tick()
            q, k, v = self.exchange.seq_to_head(torch.cat([query, key, value], dim=-1), seq, (layer, "qkv", call)).wait().chunk(3, dim=-1)
            t_done = tick()
            if timer:
                timer.add(qk_compute_ms=(t_qk0, t_v), v_comm_ms=(t_v, t_done), input_exposed_ms=(t_v, t_done))
        else:
            value = project_v()
            t_qk0 = tick()
            query, key = project_qk()
            t_v = tick()
            v = self.exchange.seq_to_head(value, seq, v_key).wait()
            t_v_done = tick()
            q, k = self._start_qk(query, key, seq, qk_key)()
            t_done = tick()
            if timer:
                timer.add(qk_compute_ms=(t_qk0, t_v), v_comm_ms=(t_v, t_v_done), input_exposed_ms=(t_v, t_done))
        if self.patches is not None:  # the keys and values of the whole sequence, displaced
            k, v, _ = self.patches.displace(layer, streams, self.sizes, k, v, None)
        out = attend(q, k, v) if attend is not None else self._attend(q, k, v, joint, key_mask)
        pending_out = self.exchange.head_to_seq(out, seq, query.shape[2])
        if overlap is not None:
            overlap()
        return pending_out.wait()

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: list[int], key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """(B, H_r, S_g, D) q, k, v of this chunk -> attention over the whole sequence's keys."""
        if self.ring is None:
            return self.attend_whole(q, k, v, key_mask[:, None, None, :] if key_mask is not None else None)
        self.ran("ring")
        blocks = [sum(self._chunk(joint, g)) for g in range(self.ring.size)]
        masks = list(key_mask.split(blocks, dim=1)) if key_mask is not None else [None] * len(blocks)
        return self.ring.attention(q, k, v, blocks, masks)

    def attend_whole(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H_r, S_q, D) q over (B, H_r, S_k, D) k, v, all held here, with an optional boolean
        mask broadcast to (B, H_r, S_q, S_k): on the run's attention backend, else torch's SDPA."""
        if self._kernel is None:
            self.ran("scaled_dot_product_attention")
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attend, name = self._kernel
        self.ran(name)
        return attend(q, k, v, mask)

    def ran(self, kernel_name: str) -> None:
        """Record that an attention call ran on `kernel_name` (not while torch.compile traces: a
        guard on the set would recompile)."""
        if not torch.compiler.is_compiling():
            self.kernels.add(kernel_name)

    def _start_qk(self, query: torch.Tensor, key: torch.Tensor, seq: list[int], cache_key: tuple) -> Callable[[], QK]:
        """Start Q and K's exchange (one message, stacked on the last dim, when fused); the
        returned call waits and gives (B, H_r, S, D) Q and K."""
        if self.fuse_qk:
            pending = self.exchange.seq_to_head(torch.cat([query, key], dim=-1), seq, cache_key)  # -> (B, H_r, S, 2D)
            return lambda: pending.wait().chunk(2, dim=-1)
        layer, _, call = cache_key
        pending_q, pending_k = (self.exchange.seq_to_head(t, seq, (layer, kind, call)) for kind, t in (("q", query), ("k", key)))
        return lambda: (pending_q.wait(), pending_k.wait())


class LayerTimer:
    """Per-layer timings of one attention call, appended to the context's timeline as spans
    between two marks: device events on an accelerator (recorded, never waited for inside the
    layer), the host clock on the CPU. `resolve_timeline` reads them once the run has ended."""

    def __init__(self, timeline: dict[str, list[dict[str, tuple[Any, Any]]]], layer: str, device: torch.device) -> None:
        self.timeline, self.layer, self.clock = timeline, layer, Clock(device)

    def mark(self) -> Any:
        return self.clock.mark()

    def add(self, **spans: tuple[Any, Any]) -> None:
        self.timeline.setdefault(self.layer, []).append(spans)


def resolve_timeline(timeline: dict[str, list[dict[str, tuple[Any, Any]]]], device: torch.device) -> dict[str, list[dict[str, float]]]:
    """A timeline's spans in milliseconds, after one synchronization of `device` (call it outside
    the run: no receive is posted then)."""
    clock = Clock(device)
    clock.sync()
    return {layer: [{key: clock.seconds(*span) * 1e3 for key, span in call.items()} for call in calls]
            for layer, calls in timeline.items()}


class UlyssesProcessor:
    """Base of the family processors: the shared context, this layer's name, and the stock
    processor it stands in for (what a trace of the model as diffusers wrote it runs:
    engine/plan_inference.py)."""

    def __init__(self, ctx: UlyssesContext, layer: str = "", stock: Any = None) -> None:
        self.ctx = ctx
        self.layer = layer
        self.stock = stock
