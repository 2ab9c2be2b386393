"""Halo rows between neighbouring bands: each rank holds a horizontal band of an image's rows
(rank order = top to bottom) and a convolution needs `rows` rows of each neighbour's band.

    halo_rows: x (..., h_r, W) -> above (..., rows, W), below (..., rows, W)
        above: the last `rows` rows of rank r-1's x (zeros on rank 0: the image's top edge)
        below: the first `rows` rows of rank r+1's x (zeros on the last rank: the bottom edge)

Zeros at the image's edges are what a convolution's zero padding would add there, so a
convolution without row padding over [above; x; below] gives exactly the whole image's rows of
this band. Every rank calls it with the same leading shape and width (the bands differ in rows only).
Point to point with the neighbours only, every wait bounded (`Works`, PeerTimeout names them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocodiff.errors import PeerTimeout
from .ulysses import Works

__all__ = ["halo_rows"]


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def halo_rows(x: torch.Tensor, rows: int, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rows` rows of each neighbour's band that go above and below `x` (..., h_r, W) (zeros
    at the image's edges): two (..., rows, W). Needs h_r >= rows on every rank."""
    if x.shape[-2] < rows:
        raise ValueError(f"a band of {x.shape[-2]} rows cannot lend {rows} halo rows to its neighbours")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = (*x.shape[:-2], rows, x.shape[-1])
    above, below = x.new_zeros(shape), x.new_zeros(shape)
    receives = [(t, _global(group, r)) for t, r in ((above, rank - 1), (below, rank + 1)) if 0 <= r < world]
    sends = [(t.contiguous(), _global(group, r))
             for t, r in ((x[..., :rows, :], rank - 1), (x[..., -rows:, :], rank + 1)) if 0 <= r < world]
    peers = [peer for _, peer in receives + sends]
    if dist.get_backend(group) == "gloo":  # every receive posted before any send (see comm.ulysses.receives_first)
        works = [dist.irecv(t, peer, group=group) for t, peer in receives]
        works += [dist.isend(t, peer, group=group) for t, peer in sends]
    else:  # NCCL pairs a neighbour's send with its receive only within one batch
        ops = [dist.P2POp(dist.irecv, t, peer, group) for t, peer in receives]
        ops += [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
        works = dist.batch_isend_irecv(ops) if ops else []
    handle = Works(works, peers if len(works) == len(peers) else None, len(receives))
    try:
        handle.wait()
    except PeerTimeout as error:
        error.kind = "vae halo rows"
        raise
    return above, below
