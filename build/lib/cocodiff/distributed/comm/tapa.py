"""TAPA: the Ulysses all-to-all in one phase per level of the hierarchy, innermost first.

Ranks are a mixed radix of the hops' sizes, outermost first (node, card, tile: rank =
(node * cards + card) * tiles + tile). A chunk from rank s to rank d travels one hop per digit,
fixing the destination's digits from the innermost out:

    phase of hop k (innermost first): rank a gives the peer that differs from it only in digit k,
             and has digit j there, every chunk it holds whose destination has digit j at k
             -> one all-to-all per group of that hop, all of them in parallel

Before the phase of hop k, rank a holds the chunks from the sources that share its digits
0..k (they differ only at inner hops) to the destinations that share its digits k+1..; after
the outermost phase, the chunks from every source to itself, in source order, which is what
the flat exchange receives. The bytes are the flat exchange's, moved unchanged: the result is
bit for bit the flat one, uneven sequence and head splits included.

Two decompositions, two exchanges (`make_exchange`):
- `TapaExchange` ("tapa"): two hops, inside each node then between nodes among ranks of the
  same local index (one rail each). This is Tutel's 2DH and DeepSpeed-MoE's hierarchical
  all-to-all: inter-node bytes are the flat ones, in G times fewer, G times larger messages.
- `TapaFullExchange` ("tapa-full"): one hop per level of the topology (`--levels
  node=2,card=2,tile=2`: between a card's tiles, then between a node's cards, then between
  nodes), the paper's tile-aware decomposition; with two levels it is "tapa".
Each phase after the first reorders what the previous one received (one copy per hop); the
first is folded into the copy a flat exchange makes anyway. The output all-gather at the
transformer's exit takes the same hops (`gather_seq`).

With a codec (codec.py), the outermost phase - the only one that crosses nodes - goes through
it, chunk by chunk (a chunk from this node's local source j to node n' is the piece named
(n', j)); the inner phases always send in full.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cocodiff.config.levels import block
from ..topology import Topology
from .ulysses import Exchange, Pending, _pad_to, _trim_cat

__all__ = ["Hop", "TapaExchange", "TapaFullExchange", "full_depth_differs"]

Chunks = dict[tuple[int, int], torch.Tensor]
"""Chunks held between phases, by (source rank, destination rank)."""


@dataclass(frozen=True)
class Hop:
    """One digit of the decomposition: `size` ranks, `step` ranks apart, talking in `group`."""

    size: int
    step: int
    group: dist.ProcessGroup | None
    crosses_nodes: bool

    def digit(self, rank: int) -> int:
        return rank // self.step % self.size

    def peers(self, rank: int) -> list[int]:
        """The ranks that differ from `rank` only at this hop, by their digit (= group rank)."""
        return [rank + (j - self.digit(rank)) * self.step for j in range(self.size)]


@dataclass(frozen=True)
class _Phase:
    """Who sends what in one phase, for one layout of the sequence and head splits. Sizes are in
    units of B x D elements (a chunk from `src` to `dst` is N_dst x B x M_src x D)."""

    peers: tuple[int, ...]
    """The hop's ranks, by their digit (= group rank)."""
    sends: tuple[tuple[int, int], ...]
    """The (source, destination) chunks sent, in order: grouped by peer, source-major."""
    send_units: tuple[int, ...]
    """Per peer of the hop."""
    receives: tuple[tuple[int, int], ...]
    """The chunks received, in order: grouped by peer."""
    receive_units: tuple[int, ...]
    """Per peer of the hop."""
    chunk_units: tuple[int, ...]
    """Per received chunk."""


class TapaExchange(Exchange):
    """Two hops: inside each node, then between nodes (same local index)."""

    name = "tapa"

    @functools.cached_property
    def _hops(self) -> list[Hop]:
        return self.hops()

    @functools.cached_property
    def _layouts(self) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[_Phase]]:
        return {}

    def _phases(self, gather_sizes: list[int], scatter_sizes: list[int]) -> list[_Phase]:
        """Each hop's phase (outermost first) for one layout, worked out once: the host's share of
        an exchange call is then the copies and the collective, not the bookkeeping."""
        key = (tuple(gather_sizes), tuple(scatter_sizes))
        if key not in self._layouts:
            self._layouts[key] = self._plan_phases(*key)
        return self._layouts[key]

    def _plan_phases(self, gather_sizes: tuple[int, ...], scatter_sizes: tuple[int, ...]) -> list[_Phase]:
        t, hops = self.topology, self._hops
        phases: list[_Phase] = [None] * len(hops)  # type: ignore[list-item]
        held = [(t.rank, d) for d in range(t.world_size)]  # before the innermost phase: this rank's chunks
        for k in range(len(hops) - 1, -1, -1):
            hop = hops[k]
            peers, outer, order = hop.peers(t.rank), hop.step * hop.size, sorted(held)
            # To the peer of digit j: the chunks bound for digit j at this hop, source-major.
            sends = [[pair for pair in order if hop.digit(pair[1]) == j] for j in range(hop.size)]
            # From peer p: the chunks of the sources that share its digits 0..k (its own sources)
            # to the destinations that share this rank's digits k.. (this rank's own destinations).
            destinations = range(t.rank % outer, t.world_size, outer)
            receives = [
                [(src, dst) for src in range(p // hop.step * hop.step, (p // hop.step + 1) * hop.step) for dst in destinations]
                for p in peers
            ]

            def units(pair: tuple[int, int]) -> int:
                return scatter_sizes[pair[1]] * gather_sizes[pair[0]]

            held = [pair for pairs in receives for pair in pairs]
            phases[k] = _Phase(
                peers=tuple(peers),
                sends=tuple(pair for pairs in sends for pair in pairs),
                send_units=tuple(sum(map(units, pairs)) for pairs in sends),
                receives=tuple(held),
                receive_units=tuple(sum(map(units, pairs)) for pairs in receives),
                chunk_units=tuple(map(units, held)),
            )
        return phases

    def hops(self) -> list[Hop]:
        """The decomposition, outermost first; the sizes multiply to the world size."""
        t = self.topology
        return [Hop(t.nodes, t.ranks_per_node, t.inter_group, True), Hop(t.ranks_per_node, 1, t.intra_group, False)]

    def report(self) -> dict:
        t = self.topology
        return {"name": self.name, "hops": [hop.size for hop in self.hops()], "levels": [list(level) for level in t.levels]}

    def _move(self, rows, gather_sizes, scatter_sizes, finish, cache_key=None, kind="a2a_in", values=None) -> Pending:
        t, hops = self.topology, self._hops
        _, B, _, D = rows.shape
        starts = [0, *itertools.accumulate(scatter_sizes)]
        coded = (
            self.codec is not None and hops[0].crosses_nodes
            and self.codec.admits(t, cache_key, rows, gather_sizes, scatter_sizes)
        )

        phases = self._phases(gather_sizes, scatter_sizes)

        def phase(k: int, held: Chunks) -> Pending:
            hop = hops[k]
            if k == 0 and coded:
                return self._coded_phase(hop, held, gather_sizes, scatter_sizes, B, D, finish, cache_key, kind)
            plan = phases[k]
            send = torch.cat([held[pair] for pair in plan.sends]).flatten()
            send_sizes = [u * B * D for u in plan.send_units]
            recv_sizes = [u * B * D for u in plan.receive_units]
            work, landed = self._all_to_all(send, send_sizes, recv_sizes, hop.group, list(plan.peers), kind, values)

            def then() -> Pending | torch.Tensor:
                recv = landed()
                if k == 0:  # every source's chunk to this rank, in source order: as flat receives it
                    return finish(recv)
                return phase(k - 1, dict(zip(plan.receives, recv.split([u * B * D for u in plan.chunk_units]))))

            return Pending(work, then, self.stats, kind, phases=k + 1)

        # (N, B, M_r, D) rows: the chunk for rank d is its N_d rows.
        mine = {(t.rank, d): rows[starts[d] : starts[d + 1]] for d in range(t.world_size)}
        return phase(len(hops) - 1, mine)

    def _coded_phase(self, hop, held, gather_sizes, scatter_sizes, B, D, finish, cache_key, kind) -> Pending:
        """The outermost phase through the codec: the same messages, each chunk a piece (encoded
        unless it stays on this node, sent in full)."""
        t = self.topology
        G, me = t.ranks_per_node, hop.digit(t.rank)
        peers = hop.peers(t.rank)
        # Held: this node's sources to one destination per node (this rank's local index there).
        sends = [[pair for pair in sorted(held) if hop.digit(pair[1]) == node] for node in range(hop.size)]
        pieces = [
            (held[(src, dst)].reshape(scatter_sizes[dst], B, gather_sizes[src], D), None if node == me else (node, src % G))
            for node, pairs in enumerate(sends) for src, dst in pairs
        ]
        sources = [[src for src in range(t.world_size) if hop.digit(src) == node] for node in range(hop.size)]
        incoming = [
            (gather_sizes[src], None if node == me else (node, src % G)) for node, srcs in enumerate(sources) for src in srcs
        ]
        send, piece_sizes, recv_piece_sizes, unpack = self.codec.move(
            cache_key, pieces, incoming, scatter_sizes[t.rank], B, D, pieces[0][0].dtype
        )
        send_sizes = _sums(piece_sizes, [len(pairs) for pairs in sends])
        recv_sizes = _sums(recv_piece_sizes, [len(srcs) for srcs in sources])
        work, recv = self._all_to_all(send, send_sizes, recv_sizes, hop.group, peers, kind)
        return Pending(work, lambda: finish(torch.cat(unpack(recv()))), self.stats, kind)

    def gather_seq(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """The output all-gather in the same hops, innermost first: a card's shards, then the
        node's cards' blocks, then the nodes' blocks between ranks of the same local index.
        Same bytes per link class as flat."""
        t = self.topology
        if t.world_size == 1:
            return x
        hops = self.hops()
        mine = _pad_to(x, dim, max(sizes))
        held = mine
        for hop in hops[:0:-1]:  # every hop but the outermost, innermost first
            held = torch.stack(self._all_gather(held, hop.group, hop.peers(t.rank)))  # (size, ...held)
        blocks = self._all_gather(held, hops[0].group, hops[0].peers(t.rank))
        shards = [shard for b in blocks for shard in b.reshape(-1, *mine.shape).unbind(0)]  # global rank order
        return _trim_cat(shards, dim, sizes)


class TapaFullExchange(TapaExchange):
    """One hop per level of the topology of more than one rank (tile, card, node, ...)."""

    name = "tapa-full"

    def hops(self) -> list[Hop]:
        t = self.topology
        return [Hop(t.levels[d][1], block(t.levels, d + 1), t.level_group(d), d == 0) for d in t.active_levels]


def full_depth_differs(topology: Topology) -> bool:
    """Whether full-depth TAPA has other hops than two-level TAPA (or flat): more than two levels
    of more than one rank, or two inside one node (cards and tiles, no node hop)."""
    return len(topology.active_levels) > (2 if topology.hierarchical else 1)


def _sums(sizes: list[int], counts: list[int]) -> list[int]:
    """`sizes` added up in consecutive runs of `counts`."""
    ends = list(itertools.accumulate(counts))
    return [sum(sizes[end - n : end]) for end, n in zip(ends, counts)]

