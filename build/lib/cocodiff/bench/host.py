"""`cocodiff bench host`: the host's cost of one exchange call, the part a GPU cannot hide.

On a GPU the host enqueues each layer's kernels and collectives; once its time per call passes
the device's, the device waits for it (docs/gpu.md: a FLUX.1-dev-size transformer is host-bound
at 8 ranks and more). This times `seq_to_head` as rank 0 of torch's `fake` process group (the
collective itself is a no-op, so what is timed is the engine's Python and torch's dispatch) on
tiny CPU tensors, per exchange, with and without byte counting, in microseconds per call
(median of three alternated rounds after a warm-up round).

`v_major_cost` times the same call through V-Major's codec on a selective step (its inter-node
pieces each pick their most changed tokens): tensors on `meta`, since the fake group's receive
buffers hold no indices a CPU could scatter by, and a host's cost is its dispatch anyway.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.comm import CommStats, make_exchange
from ..config.levels import parse_levels
from ..distributed.topology import Topology

__all__ = ["host_cost", "v_major_cost"]


def host_cost(ranks: int, calls: int = 200) -> list[dict[str, Any]]:
    """Rows of (exchange, counting, microseconds per call) for a world of `ranks` in two nodes."""
    rows = []
    with _fake_world(ranks, "fake"):
        topology = Topology.from_env(levels=parse_levels(f"node=2,rank={ranks // 2}"), device=torch.device("cpu"))
        x = torch.zeros(1, 4, ranks, 8)  # (B, S_r, H, D): a few tokens of one head per rank
        seq = [4] * ranks
        cases = [(comm, counted) for comm in ("flat", "tapa") for counted in (False, True)]
        exchanges = {case: make_exchange(case[0], topology, CommStats() if case[1] else None) for case in cases}
        calls_of = {case: lambda e=exchange: e.seq_to_head(x, seq).wait() for case, exchange in exchanges.items()}
        times = _alternated(calls_of, calls)
        for (comm, counted), us in times.items():
            rows.append({"exchange": comm, "counting": counted, "us_per_call": us})
    return rows


def v_major_cost(ranks: int, calls: int = 200, schedule: str = "constant:0.5") -> list[dict[str, Any]]:
    """Rows of (exchange, V-Major schedule, microseconds per call): one V exchange of a selective
    step (the second), every piece to the other node cached, on `meta`, rank 0 of `ranks` in two nodes."""
    from ..engine.vmajor import VMajor, VMajorCodec, parse_schedule

    rows = []
    with _fake_world(ranks, "cpu:fake,meta:fake"):
        meta = torch.device("meta")
        topology = Topology.from_env(levels=parse_levels(f"node=2,rank={ranks // 2}"), device=meta)
        x = torch.zeros(1, 4, ranks, 8, device=meta)  # (B, S_r, H, D): a few tokens of one head per rank
        seq = [4] * ranks
        cases = {}
        for comm in ("flat", "tapa"):
            state = VMajor(parse_schedule(schedule), agree=lambda sums: [0.0, 1.0])  # adaptive: no error seen
            exchange = make_exchange(comm, topology, codec=VMajorCodec(state))
            state.begin_call(0, 4, 1.0)
            exchange.seq_to_head(x, seq, (0, "v", 0)).wait()  # the full step: mirrors and caches made
            state.begin_call(1, 4, 0.75)
            cases[comm] = lambda e=exchange: e.seq_to_head(x, seq, (0, "v", 0)).wait()
        for comm, us in _alternated(cases, calls).items():
            rows.append({"exchange": comm, "v_major": schedule, "device": "meta", "us_per_call": us})
    return rows


@contextmanager
def _fake_world(ranks: int, backend: str) -> Iterator[None]:
    """Rank 0 of a fake process group of `ranks` for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _alternated(cases: dict[Any, Callable[[], Any]], calls: int) -> dict[Any, float]:
    """Median microseconds per call of each case: rounds of `calls` calls alternated between the
    cases; the first round warms every path up and is not kept."""
    times: dict[Any, list[float]] = {case: [] for case in cases}
    for rep in range(4):
        for case, call in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            if rep:
                times[case].append((time.perf_counter() - start) / calls * 1e6)
    return {case: statistics.median(us) for case, us in times.items()}
