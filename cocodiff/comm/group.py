"""A group of ranks that trade whole tensors point to point: ring attention's ring, the data
groups of CFG and batch parallelism.

`PeerGroup` holds the group (`members[i]` is the global rank of group index i, `index` this
rank's) and moves tensors between members with every wait bounded (`Works`: PeerTimeout names
the peers), counting bytes per link class and waits in `CommStats` under the caller's kind.

    gather: this rank's (..., n_i, ...) piece along `dim`, uneven n_i -> the whole tensor, in
            group order, on every member (padded to the largest piece on the wire, trimmed)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import PeerTimeout
from ..topology import Topology
from .stats import CommStats
from .ulysses import Works

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

    def gather(self, chunk: torch.Tensor, dim: int, sizes: list[int], kind: str = "gather") -> torch.Tensor:
        """Every member's piece (uneven `sizes` along `dim`) -> the whole tensor, in group order."""
        longest = max(sizes)
        pad = [0, 0] * (chunk.dim() - 1 - dim % chunk.dim()) + [0, longest - chunk.shape[dim]]
        mine = F.pad(chunk, pad).contiguous()
        parts = [mine if i == self.index else torch.empty_like(mine) for i in range(self.size)]
        others = [i for i in range(self.size) if i != self.index]
        works = self._p2p(receives=[(parts[i], self.members[i]) for i in others], sends=[(mine, self.members[i]) for i in others])
        for i in others:
            self._count(kind, self.members[i], mine)
        start = self.stats.mark() if self.stats is not None else None
        self._wait(works, kind)
        if self.stats is not None:
            self.stats.waited(kind, start, self.stats.mark())
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)
