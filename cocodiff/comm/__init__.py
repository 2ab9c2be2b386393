"""Collectives for sequence parallelism: the Ulysses exchange (flat, TAPA), gathers, statistics."""

import time

from ..cache import VMajor
from ..topology import Topology
from .auto import AutoChoice, AutoExchange, calibrate, time_exchanges
from .stats import CommStats
from .tapa import TapaExchange
from .ulysses import Exchange, FlatExchange, Pending, split_sizes, transport

__all__ = [
    "AutoChoice",
    "AutoExchange",
    "CommStats",
    "Exchange", "FlatExchange", "Pending", "TapaExchange",
    "calibrate",
    "make_exchange",
    "split_sizes",
    "time_exchanges",
    "transport",
]


def make_exchange(
    comm: str, topology: Topology, stats: CommStats | None = None, auto_budget_s: float = 20.0, vmajor: VMajor | None = None
) -> Exchange:
    """The exchange for `comm`: 'flat', 'tapa', or 'auto' (calibrated now, a collective call).

    TAPA on one node, or with one rank per node, would be a flat all-to-all plus copies, so it is
    flat there."""
    if comm == "auto":
        start = time.perf_counter()
        choices = calibrate(topology, auto_budget_s)
        return AutoExchange(topology, stats, choices, calibration_s=time.perf_counter() - start)
    if comm == "tapa" and topology.nodes > 1 and topology.ranks_per_node > 1:
        return TapaExchange(topology, stats, vmajor)
    if comm in ("flat", "tapa"):
        return FlatExchange(topology, stats, vmajor)
    raise ValueError(f"unknown exchange {comm!r}")
