"""The Ulysses exchange: a sequence shard of all heads <-> the full sequence of a share of heads.

Sequence and heads may both split unevenly (`split_sizes`): rank r holds `seq_sizes[r]` tokens
before the exchange and `head_sizes[r]` heads after it. Every rank sends a different amount to
every other rank, so the exchange moves flat buffers with explicit split sizes: no padding, no
masking, and the result equals one process exactly (it only moves data).

    seq_to_head: (B, S_r, H, D) -> (B, H_r, S, D)   ready for scaled_dot_product_attention
    head_to_seq: (B, H_r, S, D) -> (B, S_r, H, D)

Both directions are one operation, `swap`: (B, M_r, N, D) -> (B, N_r, M, D), scattering dim 2
over the ranks and gathering dim 1. Token order after `seq_to_head` is rank-major, the order in
which the shards were cut, so the full sequence is the original one.

`FlatExchange` does it with one all-to-all over all ranks (the paper's "Flat" baseline);
`TapaExchange` (tapa.py) in two phases, inside each node then between nodes, and
`TapaFullExchange` in one phase per level of the topology (a card's tiles, a node's cards, the
nodes). All return a `Pending`.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from typing import Callable, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cocodiff.config.sizes import split_sizes
from cocodiff.config.wire import EXACT, Wire
from cocodiff.errors import PeerTimeout

from ..topology import Topology, peer_timeout_s
from .codec import SlowPhaseCodec
from .stats import CommStats
from .wire import Formats, pack_messages

__all__ = ["split_sizes", "Pending", "Exchange", "FlatExchange", "Works", "all_reduce", "bounded", "receives_first",
           "stream_ordered", "transport"]


Next = Callable[[], Union["Pending", torch.Tensor]]
Values = tuple[tuple[str, ...], int]
"""What a message's values are, for a wire format: rows of one block per role (`k` for keys, ''
for the rest), each block `int` values (a head's head_dim; fused Q|K rows are two blocks)."""


class Pending:
    """A collective in flight, in one or more phases.

    `advance()` waits for the current phase and starts the next one (so a caller can overlap
    compute with each phase); `wait()` runs every remaining phase and returns the result.

    Ranks must issue the collectives of each process group in the same order. A caller with
    several exchanges in flight therefore calls `issue_all()` on the older one before a newer
    one can reach a group the older one still has to use; `poll()` only moves on when that
    cannot reorder anything (see `UlyssesContext.attention`).
    """

    def __init__(
        self, work: dist.Work | None, then: Next, stats: CommStats | None = None, kind: str = "a2a", phases: int = 1
    ) -> None:
        self._work: dist.Work | None = work
        self._then: Next | None = then
        self._result: torch.Tensor | None = None
        self._stats, self._kind = stats, kind
        self.phases_left = phases
        """Collectives still to complete, the one in flight included."""

    @property
    def done(self) -> bool:
        return self._then is None

    def advance(self) -> None:
        if self._then is None:
            return
        if self._work is not None:
            start = self._stats.mark() if self._stats is not None else None
            try:
                self._work.wait()
            except PeerTimeout as error:
                error.kind = self._kind
                raise
            if self._stats is not None:
                self._stats.waited(self._kind, start, self._stats.mark())
        following = self._then()
        self.phases_left -= 1
        if isinstance(following, Pending):
            self._work, self._then = following._work, following._then
        else:
            self._work, self._then, self._result = None, None, following

    def issue_all(self) -> None:
        """Wait for earlier phases until the last collective is issued."""
        while self.phases_left > 1:
            self.advance()

    def poll(self) -> None:
        """Start the next phase if the current one has landed; never blocks."""
        while not self.done and (self._work is None or self._work.is_completed()):
            self.advance()

    def wait(self) -> torch.Tensor:
        while not self.done:
            self.advance()
        assert self._result is not None
        return self._result


class Exchange:
    """Shared layout logic of the Ulysses exchange; subclasses move the bytes.

    `stats` counts the traffic; `codec`, where given, encodes the pieces that cross nodes
    (codec.py; None: every piece is sent as it is, exact). Both are fixed at construction:
    `with_state` gives an exchange with other ones, sharing everything else. `wire` (LOSSY, set
    after construction, kept by `with_state`) packs each message into its link level's format
    (config/wire.py, wire.py); None: every message travels exactly.
    """

    name = "?"

    functional = False
    """True: collectives through torch's functional collectives (`torch.compile` traces them, so a
    block compiles whole); False: c10d's async works (gloo's receive-first point-to-point)."""

    def __init__(self, topology: Topology, stats: CommStats | None = None, codec: SlowPhaseCodec | None = None) -> None:
        self.topology = topology
        self.stats = stats
        self.codec = codec
        self.wire: Wire | None = None

    def with_state(self, stats: CommStats | None, codec: SlowPhaseCodec | None = None) -> Exchange:
        """This exchange counting into `stats` and encoding through `codec` (a new object)."""
        exchange = type(self)(self.topology, stats, codec)
        exchange.functional = self.functional
        exchange.set_wire(self.wire)
        return exchange

    def set_wire(self, wire: Wire | None) -> None:
        """Pack messages over the levels `wire` names into their formats from now on (None: exact)."""
        self.wire = wire

    def _formats(self, peers: list[int], values: Values | None) -> list[Formats] | None:
        """Per peer (this topology's ranks), the formats of a message of `values` to it; None
        when every one travels exactly."""
        if self.wire is None or values is None:
            return None
        t, (roles, _) = self.topology, values
        outermost = t.link_levels[0][0]
        formats = [tuple(self.wire.format_for(t.link_level(p), outermost, role) for role in roles) for p in peers]
        return None if all(f == EXACT for fmts in formats for f in fmts) else formats

    def report(self) -> dict:
        """What this exchange is, for reports."""
        return {"name": self.name, **({"wire": self.wire.text} if self.wire is not None else {})}

    def seq_to_head(self, x: torch.Tensor, seq_sizes: list[int], cache_key: tuple | None = None) -> Pending:
        """(B, S_r, H, D) on every rank -> (B, H_r, S, D), S = sum(seq_sizes).

        `cache_key` names the tensor (layer, kind, call) for the codec, which may send only what
        changed since an earlier call; without a codec it is ignored.
        """
        return self.swap(x, seq_sizes, split_sizes(x.shape[2], self.topology.world_size), cache_key, kind="a2a_in")

    def head_to_seq(self, x: torch.Tensor, seq_sizes: list[int], num_heads: int) -> Pending:
        """(B, H_r, S, D) on every rank -> (B, S_r, H, D), H = num_heads."""
        return self.swap(x, split_sizes(num_heads, self.topology.world_size), seq_sizes, kind="a2a_out")

    def swap(
        self,
        x: torch.Tensor,
        gather_sizes: list[int],
        scatter_sizes: list[int],
        cache_key: tuple | None = None,
        kind: str = "a2a_in",
    ) -> Pending:
        """(B, M_r, N, D) -> (B, N_r, M, D): scatter dim 2 in `scatter_sizes`, gather dim 1.

        Rank r holds gather_sizes[r] rows of dim 1 and ends with scatter_sizes[r] of dim 2.
        `kind` labels the traffic in the stats: `a2a_in` (projections) or `a2a_out` (attention output).
        """
        if self.topology.world_size == 1:  # a group of one rank (u1 plans): a local view, no collective
            return Pending(None, lambda: x.transpose(1, 2), self.stats, kind)
        r = self.topology.rank
        B, M_r, N, D = x.shape
        assert M_r == gather_sizes[r], f"rank {r} holds {M_r} rows, the layout says {gather_sizes[r]}"
        assert N == sum(scatter_sizes), f"{N} rows to scatter, the layout says {sum(scatter_sizes)}"
        recv_sizes = [scatter_sizes[r] * B * m * D for m in gather_sizes]

        def finish(recv: torch.Tensor) -> torch.Tensor:
            """Receive buffer, ordered by source rank -> (B, N_r, M, D)."""
            parts = [c.view(scatter_sizes[r], B, m, D) for c, m in zip(recv.split(recv_sizes), gather_sizes)]
            return torch.cat(parts, dim=2).permute(1, 0, 2, 3)  # (N_r, B, M, D) -> (B, N_r, M, D)

        rows = x.permute(2, 0, 1, 3)  # (N, B, M_r, D): the rows for rank d are contiguous along dim 0
        tensor = cache_key[1] if cache_key is not None else ""
        values: Values = (("", "k"), D // 2) if tensor == "qk" else (("k",) if tensor == "k" else ("",), D)
        return self._move(rows, gather_sizes, scatter_sizes, finish, cache_key, kind, values)

    def _move(
        self,
        rows: torch.Tensor,
        gather_sizes: list[int],
        scatter_sizes: list[int],
        finish: Callable[[torch.Tensor], torch.Tensor],
        cache_key: tuple | None = None,
        kind: str = "a2a_in",
        values: Values | None = None,
    ) -> Pending:
        """Deliver rows[N_d block] to every rank d; hand `finish` the buffer ordered by source.
        `values` says what the rows hold, for the wire formats (None: send them exactly)."""
        raise NotImplementedError

    def _all_to_all(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        group: dist.ProcessGroup | None,
        peers: list[int],
        kind: str,
        values: Values | None = None,
    ) -> tuple[dist.Work | None, Callable[[], torch.Tensor]]:
        """Async all-to-all of flat buffers in `group` (no work to wait for when functional); `peers[i]` is this topology's rank of group
        rank i (`Topology.global_rank` maps it to the default group's, for a plan's sub-topology).
        Returns the work and what gives the received buffer once it has landed. Messages over
        levels with a wire format travel packed (`values` says how they are rows; bytes as they are
        - a codec's - never are) and are unpacked on landing."""
        formats = self._formats(peers, values) if send.is_floating_point() else None
        if formats is not None:
            assert values is not None
            data, data_sizes, recv_data_sizes, unpack = pack_messages(send, send_sizes, recv_sizes, formats, values[1])
            work, recv = self._all_to_all(data, data_sizes, recv_data_sizes, group, peers, kind)
            return work, lambda: unpack(recv())
        self._count(kind, peers, [n * send.element_size() for n in send_sizes])
        if self.functional:  # waited where the result is first used (in a compiled graph, placed by inductor)
            result = funcol.all_to_all_single(send, recv_sizes, send_sizes, group)
            return None, lambda: result
        recv = send.new_empty(sum(recv_sizes))
        if dist.get_backend(group) == "gloo":
            me = peers.index(self.topology.rank)
            ranks = [self.topology.global_rank(p) for p in peers]
            return receives_first(list(recv.split(recv_sizes)), list(send.split(send_sizes)), group, ranks, me), lambda: recv
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)
        return work, lambda: recv

    def _count(self, kind: str, peers: list[int], nbytes: list[int]) -> None:
        """Record one collective that sends `nbytes[i]` to this topology's rank `peers[i]`."""
        if self.stats is not None:
            bytes_to = [0] * self.topology.world_size
            for peer, n in zip(peers, nbytes):
                bytes_to[peer] = n
            self.stats.record_send(kind, self.topology, bytes_to)

    def gather_seq(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """All-gather sequence shards of uneven `sizes` along `dim`: every rank gets the full tensor.

        Shards are padded to the largest (gloo has no uneven all-gather), gathered and trimmed.
        """
        t = self.topology
        if t.world_size == 1:  # a group of one rank: it holds everything already
            return x
        shards = self._all_gather(_pad_to(x, dim, max(sizes)), t.world_group, list(range(t.world_size)))
        return _trim_cat(shards, dim, sizes)

    def _all_gather(self, x: torch.Tensor, group: dist.ProcessGroup | None, peers: list[int]) -> list[torch.Tensor]:
        """Every group rank's `x` (same shape everywhere), in group order; synchronous, counted as `gather`."""
        me = peers.index(self.topology.rank)
        self._count("gather", peers, [x.numel() * x.element_size()] * len(peers))
        if self.functional and torch.compiler.is_compiling():  # traced in the graph (eager: bounded, below)
            return list(funcol.all_gather_tensor(x, 0, group).chunk(len(peers)))
        start = self.stats.mark() if self.stats is not None else None
        if dist.get_backend(group) == "gloo":
            out = [x if i == me else torch.empty_like(x) for i in range(len(peers))]
            try:
                ranks = [self.topology.global_rank(p) for p in peers]
                receives_first(out, [x] * len(peers), group, ranks, me).wait()
            except PeerTimeout as error:
                error.kind = "gather"
                raise
        else:
            out = [torch.empty_like(x) for _ in peers]
            dist.all_gather(out, x, group=group)
        if self.stats is not None:
            self.stats.waited("gather", start, self.stats.mark())
        return out


def _pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`x` zero-padded along `dim` to `length`, contiguous."""
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, length - x.shape[dim]]
    return torch.nn.functional.pad(x, pad).contiguous()


def _trim_cat(shards: list[torch.Tensor], dim: int, sizes: list[int]) -> torch.Tensor:
    """Padded shards in rank order -> their first `sizes[r]` rows along `dim`, concatenated."""
    return torch.cat([shard.narrow(dim, 0, n) for shard, n in zip(shards, sizes)], dim=dim)


def transport(backend: str) -> str:
    """How the exchanges move their bytes on `backend`, for reports."""
    return "point-to-point, receives posted first" if backend == "gloo" else "all_to_all_single"


class Works:
    """Several point-to-point operations in flight, behind one `dist.Work`-like handle.

    `wait` gives up after `timeout_s` in all (default: `peer_timeout_s()`) and raises
    `PeerTimeout` naming the peers whose messages did not arrive (or, when every receive landed,
    that did not take this rank's). `peers[i]`, where given, is the global rank `works[i]` talks
    to; the first `receives` works are receives.
    """

    def __init__(
        self,
        works: list[dist.Work],
        peers: list[int] | None = None,
        receives: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._works, self._peers = works, peers
        self._receives = len(works) if receives is None else receives
        self.timeout_s = peer_timeout_s() if timeout_s is None else timeout_s

    def wait(self) -> bool:
        if stream_ordered():  # NCCL/XCCL: the compute stream waits, not the host; the watchdog bounds it
            for work in self._works:
                work.wait()
            return True
        deadline = time.monotonic() + self.timeout_s
        for i, work in enumerate(self._works):
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError as error:
                if time.monotonic() < deadline and "timed out" not in str(error).lower():
                    raise  # not a timeout: a peer that went away, reported as such
                raise PeerTimeout(dist.get_rank(), self._missing(i), self.timeout_s) from None
        return True

    def _missing(self, timed_out: int) -> list[int]:
        """The peers still owing a message once work `timed_out` gave up (the works after it may
        have landed: gloo only says so when asked to wait, so each gets a last millisecond)."""
        if self._peers is None:
            return []
        late = [i for i in range(timed_out + 1, len(self._works)) if not _landed(self._works[i])]
        receives = [i for i in [timed_out, *late] if i < self._receives]
        return sorted({self._peers[i] for i in (receives or [timed_out, *late])})

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def stream_ordered() -> bool:
    """Whether waits on peers order device streams instead of blocking the host: NCCL and XCCL.

    There `work.wait()` only makes the current stream wait; a wait with a timeout would block the
    host in 1 ms polls (ProcessGroupNCCL's busy-wait) and drain the device's queue. So waits there
    are plain, and the process group's watchdog enforces `--timeout` (it aborts the rank; the
    launcher then names the rank and its step). On gloo every wait is bounded here (PeerTimeout).
    """
    return dist.is_initialized() and dist.get_backend() in ("nccl", "xccl")


def bounded(work: dist.Work, kind: str) -> None:
    """Wait for one collective (`async_op=True`) within the peer timeout; a rank that never joins
    fails it with `PeerTimeout` naming `kind` (which peers, a collective does not say)."""
    try:
        Works([work]).wait()
    except PeerTimeout as error:
        error.kind = kind
        raise


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, kind: str,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """`dist.all_reduce` in place, bounded like every other wait on a peer (see `bounded`)."""
    bounded(dist.all_reduce(tensor, op=op, group=group, async_op=True), kind)
    return tensor


def _landed(work: dist.Work) -> bool:
    try:
        work.wait(timedelta(milliseconds=1))
    except RuntimeError:
        return False
    return True


def receives_first(
    recvs: list[torch.Tensor], sends: list[torch.Tensor], group: dist.ProcessGroup | None, peers: list[int], me: int
) -> Works:
    """Deliver `sends[i]` to group rank i into its `recvs[me]`, every receive posted before any send.

    `peers[i]` is the global rank of group rank i and `me` this rank's group rank; empty messages
    are skipped on both sides, this rank's own piece is copied. gloo's all-to-all sends first; a
    message that arrives before its receive is posted makes gloo's TCP pair stall that direction,
    so a pair exchanging in both directions often runs at half its link rate (measured on a
    400 Mbit/s link, 8 MiB each way: 175 ms every time with receives posted first, 175-350 ms,
    median ~300, with gloo's all-to-all). Same bytes, same result.
    """
    n = len(peers)
    sources = [(me - i) % n for i in range(1, n)]  # the ring order of gloo's own all-to-all
    targets = [(me + i) % n for i in range(1, n)]
    sources = [s for s in sources if recvs[s].numel()]
    targets = [t for t in targets if sends[t].numel()]
    works = [dist.irecv(recvs[s], peers[s], group=group) for s in sources]
    works += [dist.isend(sends[t], peers[t], group=group) for t in targets]
    if recvs[me] is not sends[me]:
        recvs[me].copy_(sends[me])
    return Works(works, [peers[i] for i in sources + targets], len(sources), peer_timeout_s())


class FlatExchange(Exchange):
    """One all-to-all over every rank: the paper's baseline ("Flat" Ulysses).

    With a codec, the pieces for ranks on other nodes - the inter-node part of the exchange -
    go through it (codec.py); pieces for ranks on this node are always sent in full.
    """

    name = "flat"

    def _move(self, rows, gather_sizes, scatter_sizes, finish, cache_key=None, kind="a2a_in", values=None) -> Pending:
        t, (_, B, M_r, D) = self.topology, rows.shape
        r = t.rank
        if self.codec is not None and self.codec.admits(t, cache_key, rows, gather_sizes, scatter_sizes):
            starts = [0, *itertools.accumulate(scatter_sizes)]

            def peer(rank: int) -> tuple | None:
                return None if t.node_of(rank) == t.node else (rank,)

            pieces = [(rows[starts[d] : starts[d + 1]], peer(d)) for d in range(t.world_size)]
            incoming = [(gather_sizes[src], peer(src)) for src in range(t.world_size)]
            send, send_sizes, recv_sizes, unpack = self.codec.move(cache_key, pieces, incoming, scatter_sizes[r], B, D, rows.dtype)
            work, recv = self._all_to_all(send, send_sizes, recv_sizes, t.world_group, list(range(t.world_size)), kind)
            return Pending(work, lambda: finish(torch.cat(unpack(recv()))), self.stats, kind)
        send = rows.contiguous().flatten()
        work, recv = self._all_to_all(
            send,
            [n * B * M_r * D for n in scatter_sizes],
            [scatter_sizes[r] * B * m * D for m in gather_sizes],
            self.topology.world_group,
            list(range(self.topology.world_size)),
            kind,
            values,
        )
        return Pending(work, lambda: finish(recv()), self.stats, kind)


def all_ranks_sum(topology: Topology) -> Callable[[torch.Tensor], list[float]]:
    """values (a tensor) -> their sums over every rank (float64 all-reduce on the world group)."""

    def agree(values: torch.Tensor) -> list[float]:
        t = values.to(device=topology.device, dtype=torch.float64, copy=True)
        return all_reduce(t, topology.world_group, "agreement (all-reduce)").tolist()

    return agree
