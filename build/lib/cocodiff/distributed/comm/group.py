"""A group of ranks that trade whole tensors point to point: ring attention's ring, the data
groups of CFG and batch parallelism.

`PeerGroup` holds the group (`members[i]` is the global rank of group index i, `index` this
rank's) and moves tensors between members with every wait bounded (`Works`: PeerTimeout names
the peers), counting bytes per link class and waits in `CommStats` under the caller's kind.

    gather: this rank's (..., n_i, ...) piece along `dim`, uneven n_i -> the whole tensor, in
            group order, on every member (padded to the largest piece on the wire, trimmed)

With `wire` (LOSSY, config/wire.py) a message to a member over a level with a format travels packed
(distributed/comm/wire.py): `formats_to` says in which, per role of a row; the others go exactly, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cocodiff.errors import PeerTimeout
from ..topology import Topology
from cocodiff.config.wire import EXACT, Wire
from .stats import CommStats
from .ulysses import Works
from .wire import Formats, pack, packed_bytes, unpack

__all__ = ["PeerGroup"]


@dataclass
class PeerGroup:
    """This rank's group: `members[i]` is the global rank of group index i; `index` is this rank's."""

    topology: Topology
    """The whole run's topology (global ranks, nodes), for counting bytes per link class."""
    group: dist.ProcessGroup | None
    members: tuple[int, ...]
    index: int
    stats: CommStats | None = None
    wire: Wire | None = None
    """Wire formats per level (LOSSY) for what this group packs (None: every message exact)."""

    @property
    def size(self) -> int:
        return len(self.members)

    def _p2p(self, receives: list[tuple[torch.Tensor, int]], sends: list[tuple[torch.Tensor, int]]) -> Works:
        """Post point-to-point transfers (global peer ranks): on gloo every receive before any
        send (see comm.ulysses.receives_first); elsewhere as one batch, which NCCL needs to pair
        a ring's sends with its receives."""
        peers = [peer for _, peer in receives + sends]
        if dist.get_backend(self.group) == "gloo":
            works = [dist.irecv(t, peer, group=self.group) for t, peer in receives]
            works += [dist.isend(t, peer, group=self.group) for t, peer in sends]
            return Works(works, peers, len(receives))
        ops = [dist.P2POp(dist.irecv, t, peer, self.group) for t, peer in receives]
        ops += [dist.P2POp(dist.isend, t, peer, self.group) for t, peer in sends]
        works = dist.batch_isend_irecv(ops)
        return Works(works, peers if len(works) == len(peers) else None, len(receives))

    def _wait(self, works: Works, kind: str) -> None:
        """Wait for a transfer (bounded: `Works` raises PeerTimeout naming the peers), as `kind`."""
        try:
            works.wait()
        except PeerTimeout as error:
            error.kind = kind
            raise

    def _count(self, kind: str, peer: int, tensor: torch.Tensor) -> None:
        if self.stats is not None:
            bytes_to = [0] * self.topology.world_size
            bytes_to[peer] = tensor.numel() * tensor.element_size()
            self.stats.record_send(kind, self.topology, bytes_to)

    def formats_to(self, peer: int, roles: tuple[str, ...]) -> Formats | None:
        """The formats of a message to global rank `peer` whose rows hold `roles` ('k' for keys,
        '' for the rest; config.wire.Wire.format_for); None when it travels exactly."""
        if self.wire is None:
            return None
        outermost = self.topology.link_levels[0][0]
        formats = tuple(self.wire.format_for(self.topology.link_level(peer), outermost, role) for role in roles)
        return None if all(f == EXACT for f in formats) else formats

    def gather(self, chunk: torch.Tensor, dim: int, sizes: list[int], kind: str = "gather", packed: bool = False) -> torch.Tensor:
        """Every member's piece (uneven `sizes` along `dim`) -> the whole tensor, in group order.

        `packed` (floating pieces only): the pieces over levels with a wire format travel in it,
        with one scale per row of the last dim (the CFG / batch gathers); others exactly."""
        longest = max(sizes)
        pad = [0, 0] * (chunk.dim() - 1 - dim % chunk.dim()) + [0, longest - chunk.shape[dim]]
        mine = F.pad(chunk, pad).contiguous()
        others = [i for i in range(self.size) if i != self.index]
        formats = {i: self.formats_to(self.members[i], ("",)) if packed and mine.is_floating_point() else None for i in others}
        block, item = mine.shape[-1] if mine.dim() else 1, mine.element_size()
        sent = {i: mine if formats[i] is None else pack(mine, formats[i], block) for i in others}
        wire = {i: torch.empty_like(mine) if formats[i] is None
                else mine.new_empty(packed_bytes(mine.numel(), formats[i], block, item), dtype=torch.uint8) for i in others}
        works = self._p2p(receives=[(wire[i], self.members[i]) for i in others], sends=[(sent[i], self.members[i]) for i in others])
        for i in others:
            self._count(kind, self.members[i], sent[i])
        start = self.stats.mark() if self.stats is not None else None
        self._wait(works, kind)
        if self.stats is not None:
            self.stats.waited(kind, start, self.stats.mark())
        parts = [mine if i == self.index else wire[i] if formats[i] is None
                 else unpack(wire[i], formats[i], mine.numel(), block, mine.dtype).view(mine.shape) for i in range(self.size)]
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)
