"""The Ulysses exchange: a sequence shard of all heads <-> the full sequence of a share of heads.

Sequence and heads may both split unevenly (`split_sizes`): rank r holds `seq_sizes[r]` tokens
before the exchange and `head_sizes[r]` heads after it. Because every rank sends a different
amount to every other rank, the exchange is one `all_to_all_single` over a flat buffer with
explicit split sizes; no padding, no masking, and the result equals one process exactly (it only
moves data).

    seq_to_head: (B, S_r, H, D) -> (B, H_r, S, D)   ready for scaled_dot_product_attention
    head_to_seq: (B, H_r, S, D) -> (B, S_r, H, D)

Token order after `seq_to_head` is rank-major (rank 0's shard, then rank 1's, ...), the order in
which the shards were cut, so the full sequence is the original one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..topology import Topology
from .stats import CommStats

__all__ = ["split_sizes", "Pending", "FlatExchange"]


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `torch.tensor_split(range(n), parts)`: the first n % parts parts get one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass
class Pending:
    """An exchange in flight. `wait()` blocks until it lands and returns the finished tensor."""

    work: dist.Work | None
    finish: Callable[[], torch.Tensor]
    stats: CommStats | None = None
    kind: str = "a2a"

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            if self.stats is not None:
                self.stats.record_wait(self.kind, time.perf_counter() - start)
        return self.finish()


class FlatExchange:
    """One all-to-all over every rank: the paper's baseline ("Flat" Ulysses)."""

    name = "flat"

    def __init__(self, topology: Topology, stats: CommStats | None = None) -> None:
        self.topology = topology
        self.stats = stats

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> tuple[dist.Work, torch.Tensor]:
        recv = send.new_empty(sum(recv_sizes))
        if self.stats is not None:
            self.stats.record_send("a2a", self.topology, [n * send.element_size() for n in send_sizes])
        work = dist.all_to_all_single(
            recv, send, recv_sizes, send_sizes, group=self.topology.world_group, async_op=True
        )
        return work, recv

    def seq_to_head(self, x: torch.Tensor, seq_sizes: list[int]) -> Pending:
        """(B, S_r, H, D) on every rank -> (B, H_r, S, D), S = sum(seq_sizes)."""
        return self._swap(x, seq_sizes, split_sizes(x.shape[2], self.topology.world_size))

    def head_to_seq(self, x: torch.Tensor, seq_sizes: list[int], num_heads: int) -> Pending:
        """(B, H_r, S, D) on every rank -> (B, S_r, H, D), H = num_heads."""
        return self._swap(x, split_sizes(num_heads, self.topology.world_size), seq_sizes)

    def _swap(self, x: torch.Tensor, gather_sizes: list[int], scatter_sizes: list[int]) -> Pending:
        """(B, M_r, N, D) -> (B, N_r, M, D): scatter dim 2 in `scatter_sizes`, gather dim 1.

        Rank r holds gather_sizes[r] rows of dim 1 and ends with scatter_sizes[r] of dim 2.
        """
        r = self.topology.rank
        B, M_r, N, D = x.shape
        assert M_r == gather_sizes[r], f"rank {r} holds {M_r} rows, the layout says {gather_sizes[r]}"
        assert N == sum(scatter_sizes), f"{N} rows to scatter, the layout says {sum(scatter_sizes)}"
        send = x.permute(2, 0, 1, 3).contiguous().flatten()  # (N, B, M_r, D): each rank's share contiguous
        recv_sizes = [scatter_sizes[r] * B * m * D for m in gather_sizes]
        work, recv = self._all_to_all(send, [n * B * M_r * D for n in scatter_sizes], recv_sizes)

        def finish() -> torch.Tensor:
            parts = [c.view(scatter_sizes[r], B, m, D) for c, m in zip(recv.split(recv_sizes), gather_sizes)]
            return torch.cat(parts, dim=2).permute(1, 0, 2, 3)  # (N_r, B, M, D) -> (B, N_r, M, D)

        return Pending(work, finish, self.stats)


def gather_seq(x: torch.Tensor, dim: int, sizes: list[int], topology: Topology, stats: CommStats | None = None) -> torch.Tensor:
    """All-gather sequence shards of uneven `sizes` along `dim`: every rank gets the full tensor.

    gloo has no uneven all-gather, so shards are padded to the largest, gathered and trimmed.
    """
    r, longest = topology.rank, max(sizes)
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, longest - sizes[r]]
    padded = torch.nn.functional.pad(x, pad).contiguous()
    out = [torch.empty_like(padded) for _ in sizes]
    if stats is not None:
        stats.record_send("gather", topology, [padded.numel() * padded.element_size()] * len(sizes))
    start = time.perf_counter()
    dist.all_gather(out, padded, group=topology.world_group)
    if stats is not None:
        stats.record_wait("gather", time.perf_counter() - start)
    return torch.cat([t.narrow(dim, 0, s) for t, s in zip(out, sizes)], dim=dim)
