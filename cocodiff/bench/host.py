"""`cocodiff bench host`: the host's cost of one exchange call, the part a GPU cannot hide.

On a GPU the host enqueues each layer's kernels and collectives; once its time per call passes
the device's, the device waits for it (docs/gpu.md: a FLUX.1-dev-size transformer is host-bound
at 8 ranks and more). This times `seq_to_head` as rank 0 of torch's `fake` process group (the
collective itself is a no-op, so what is timed is the engine's Python and torch's dispatch) on
tiny CPU tensors, per exchange, with and without byte counting, in microseconds per call
(median of three alternated rounds after a warm-up round).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..comm import CommStats, make_exchange
from ..levels import parse_levels
from ..topology import Topology

__all__ = ["host_cost"]


def host_cost(ranks: int, calls: int = 200) -> list[dict[str, Any]]:
    """Rows of (exchange, counting, microseconds per call) for a world of `ranks` in two nodes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rows = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        topology = Topology.from_env(levels=parse_levels(f"node=2,rank={ranks // 2}"), device=torch.device("cpu"))
        x = torch.zeros(1, 4, ranks, 8)  # (B, S_r, H, D): a few tokens of one head per rank
        seq = [4] * ranks
        cases = [(comm, counted) for comm in ("flat", "tapa") for counted in (False, True)]
        exchanges = {case: make_exchange(case[0], topology, CommStats() if case[1] else None) for case in cases}
        times: dict[tuple, list[float]] = {case: [] for case in cases}
        for rep in range(4):  # alternated; the first round warms every path up and is not kept
            for case, exchange in exchanges.items():
                start = time.perf_counter()
                for _ in range(calls):
                    exchange.seq_to_head(x, seq).wait()
                if rep:
                    times[case].append((time.perf_counter() - start) / calls * 1e6)
        for (comm, counted), us in times.items():
            rows.append({"exchange": comm, "counting": counted, "us_per_call": statistics.median(us)})
    finally:
        dist.destroy_process_group()
    return rows
