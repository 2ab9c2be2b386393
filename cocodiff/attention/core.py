"""Ulysses attention shared by every model family.

A family's processor computes this rank's projections exactly as diffusers does (projection,
QK norm, RoPE), hands them here, and gets back this rank's share of the attention output:

    (B, S_r, H, D) q, k, v   --seq_to_head-->   (B, H_r, S, D)   --SDPA-->   (B, H_r, S, D)
                             <--head_to_seq--   (B, S_r, H, D)

`UlyssesContext` is the per-transformer parallel state: topology, exchange, statistics, and the
token layout of the forward pass in flight (how many text and image tokens each rank holds).
It is created by `parallelize` and handed to every processor; nothing is global.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..comm import CommStats, Exchange, gather_seq, split_sizes
from ..topology import Topology

__all__ = ["UlyssesContext", "UlyssesProcessor"]

QK = tuple[torch.Tensor, torch.Tensor]


class UlyssesContext:
    """Parallel state of one transformer: groups, exchange, stats and the current token layout."""

    def __init__(self, topology: Topology, exchange: Exchange, stats: CommStats) -> None:
        self.topology = topology
        self.exchange = exchange
        self.stats = stats
        self.sizes: dict[str, list[int]] = {}
        """Tokens per rank of each stream (`txt`, `img`) in the forward pass in flight."""

    # -- sharding at the transformer's entry and exit ------------------------------------------
    def shard(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """Keep this rank's contiguous slice of `x` along `dim`; remember the split of `stream`."""
        sizes = split_sizes(x.shape[dim], self.topology.world_size)
        self.sizes[stream] = sizes
        start = sum(sizes[: self.topology.rank])
        return x.narrow(dim, start, sizes[self.topology.rank])

    def gather(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """Inverse of `shard`: every rank gets the full tensor."""
        return gather_seq(x, dim, self.sizes[stream], self.topology, self.stats)

    def joint_sizes(self, streams: tuple[str, ...]) -> list[int]:
        """Tokens per rank of the concatenation of `streams` (each rank concatenates its shards)."""
        return [sum(parts) for parts in zip(*(self.sizes[s] for s in streams))]

    def gathered_key_mask(self, masks: dict[str, torch.Tensor | None], streams: tuple[str, ...]) -> torch.Tensor | None:
        """Key-padding mask (B, S) in the rank-major order `seq_to_head` produces.

        `masks[stream]` is the full (B, S_stream) boolean mask of a stream, or None for all-valid.
        """
        if all(masks.get(s) is None for s in streams):
            return None
        batch = next(m for m in masks.values() if m is not None).shape[0]
        pieces = []
        offsets = {s: 0 for s in streams}
        for rank in range(self.topology.world_size):
            for s in streams:
                n = self.sizes[s][rank]
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
    ) -> torch.Tensor:
        """Sequence-parallel attention over the joint sequence of `streams`.

        project_v, project_qk: return this rank's (B, S_r, H, D) V, and Q and K after norm and RoPE.
        key_mask: optional (B, S) boolean mask over the gathered keys (True = attend).
        Returns this rank's (B, S_r, H, D) attention output.
        """
        seq = self.joint_sizes(streams)
        value = project_v()
        query, key = project_qk()
        num_heads = query.shape[2]
        pending = [self.exchange.seq_to_head(t, seq) for t in (query, key, value)]
        q, k, v = (p.wait() for p in pending)  # (B, H_r, S, D)
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.exchange.head_to_seq(out, seq, num_heads).wait()


class UlyssesProcessor:
    """Base of the family processors: holds the shared context."""

    def __init__(self, ctx: UlyssesContext) -> None:
        self.ctx = ctx
