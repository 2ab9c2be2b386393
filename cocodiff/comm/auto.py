"""`--comm auto`: measure flat and TAPA on this fabric once, then pick per message size.

At start-up every rank times both exchanges at a few message sizes (buckets), alternating
A B A B. A collective takes as long as its slowest rank, so each timing is the maximum over
ranks (an all-reduce), which also means every rank holds the same numbers and makes the same
choice: no rank can take a different branch and desynchronize the collectives. The time spent is
bounded: once the (rank-agreed) elapsed time passes the budget, larger buckets inherit the last
measured choice and are marked as not measured.

At run time a message's bucket is chosen from the mean bytes per rank, which every rank computes
from the same global layout, never from its own (uneven) share.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..topology import Topology
from .codec import SlowPhaseCodec
from .stats import CommStats
from .tapa import TapaExchange
from .ulysses import Exchange, FlatExchange, Pending

__all__ = ["AutoChoice", "AutoExchange", "BUCKETS", "calibrate", "time_exchanges"]

KiB = 1024
BUCKETS = [64 * KiB * 4**i for i in range(5)]  # 64 KiB .. 16 MiB per rank
TAPA_MARGIN = 0.95
"""TAPA is chosen only when it is at least 5% faster: flat makes fewer copies and one call."""


def probe(topology: Topology, bytes_per_rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[int]]:
    """A (1, S_r, H, 128) message of about `bytes_per_rank` bytes, with H = world size, and its layout."""
    P, D = topology.world_size, 128
    tokens = max(1, bytes_per_rank // (P * D * torch.finfo(dtype).bits // 8))
    seq = [tokens] * P
    return torch.randn(1, tokens, P, D, dtype=dtype, device=topology.device), seq


def time_exchanges(exchanges: list[Exchange], bytes_per_rank: int, repeats: int) -> list[list[float]]:
    """Seconds per `seq_to_head` for each exchange, `repeats` times, alternating; max over ranks."""
    topology = exchanges[0].topology
    x, seq = probe(topology, bytes_per_rank)
    for exchange in exchanges:  # warm-up: first use of a group and of large buffers
        exchange.seq_to_head(x, seq).wait()
    times = torch.zeros(repeats, len(exchanges), dtype=torch.float64)
    for rep in range(repeats):
        for i, exchange in enumerate(exchanges):
            dist.barrier(group=topology.world_group)
            start = time.perf_counter()
            exchange.seq_to_head(x, seq).wait()
            times[rep, i] = time.perf_counter() - start
    times = times.to(topology.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=topology.world_group)
    return times.cpu().T.tolist()


@dataclass(frozen=True)
class AutoChoice:
    bytes_per_rank: int
    flat_ms: float | None
    tapa_ms: float | None
    choice: str
    measured: bool


def calibrate(topology: Topology, budget_s: float = 20.0, repeats: int = 3) -> list[AutoChoice]:
    """Time flat and TAPA per bucket on this fabric; the same list on every rank."""
    if not topology.hierarchical:
        return [AutoChoice(b, None, None, "flat", False) for b in BUCKETS]  # TAPA would be flat here
    flat, tapa = FlatExchange(topology), TapaExchange(topology)
    choices: list[AutoChoice] = []
    start = time.perf_counter()
    for size in BUCKETS:
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=topology.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=topology.world_group)
        if elapsed.item() > budget_s and choices:
            choices.append(AutoChoice(size, None, None, choices[-1].choice, False))
            continue
        flat_s, tapa_s = (sorted(t)[len(t) // 2] for t in time_exchanges([flat, tapa], size, repeats))
        choice = "tapa" if tapa_s < TAPA_MARGIN * flat_s else "flat"
        choices.append(AutoChoice(size, flat_s * 1e3, tapa_s * 1e3, choice, True))
    return choices


class AutoExchange(Exchange):
    """Flat or TAPA per message, by the calibrated choice for its size bucket (no codec)."""

    name = "auto"

    def __init__(
        self, topology: Topology, stats: CommStats | None, choices: list[AutoChoice], calibration_s: float = 0.0
    ) -> None:
        super().__init__(topology, stats)
        self.choices = choices
        self.calibration_s = calibration_s
        self.flat = FlatExchange(topology, stats)
        self.tapa = TapaExchange(topology, stats) if topology.hierarchical else self.flat

    def with_state(self, stats: CommStats | None, codec: SlowPhaseCodec | None = None) -> AutoExchange:
        """The same calibration, counting into `stats` (a new object; no codec)."""
        if codec is not None:
            raise ValueError("the auto exchange takes no codec: which pieces cross nodes depends on its choice")
        return AutoExchange(self.topology, stats, self.choices, self.calibration_s)

    def pick(self, bytes_per_rank: float) -> Exchange:
        """The exchange for a message of this mean size per rank (nearest bucket, log scale)."""
        nearest = min(self.choices, key=lambda c: abs(math.log2(c.bytes_per_rank) - math.log2(max(bytes_per_rank, 1))))
        return self.tapa if nearest.choice == "tapa" else self.flat

    def swap(
        self,
        x: torch.Tensor,
        gather_sizes: list[int],
        scatter_sizes: list[int],
        cache_key: tuple | None = None,
        kind: str = "a2a_in",
    ) -> Pending:
        B, _, _, D = x.shape
        mean_bytes = B * sum(gather_sizes) * sum(scatter_sizes) * D * x.element_size() / self.topology.world_size
        return self.pick(mean_bytes).swap(x, gather_sizes, scatter_sizes, cache_key, kind)

    def gather_seq(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        # Each rank sends its (padded) shard to every rank: the bytes of an all-to-all of P shards,
        # computed from the global layout so that every rank picks the same exchange.
        others = [n for i, n in enumerate(x.shape) if i != dim % x.dim()]
        shard = math.prod(others) * max(sizes) * x.element_size()
        return self.pick(shard * self.topology.world_size).gather_seq(x, dim, sizes)

    def report(self) -> dict:
        return {"name": self.name, "calibration_s": self.calibration_s, "buckets": [asdict(c) for c in self.choices]}


def summary(choices: list[AutoChoice] | list[dict]) -> str:
    """One line: the choice per bucket, e.g. '64K flat, 256K tapa, ...'."""
    rows = [c if isinstance(c, dict) else asdict(c) for c in choices]
    return ", ".join(f"{r['bytes_per_rank'] // KiB}K {r['choice']}{'' if r['measured'] else '*'}" for r in rows)


