"""Collectives for sequence parallelism: the Ulysses exchange (flat, TAPA), gathers, statistics,
and the optional codec an exchange may use for its inter-node pieces."""

import time

from ..topology import Topology
from .auto import AutoChoice, AutoExchange, calibrate, time_exchanges
from .codec import SlowPhaseCodec
from .stats import CommStats
from .tapa import TapaExchange
from .ulysses import Exchange, FlatExchange, Pending, split_sizes, transport

__all__ = [
    "AutoChoice",
    "AutoExchange",
    "CommStats",
    "Exchange", "FlatExchange", "Pending", "SlowPhaseCodec", "TapaExchange",
    "calibrate",
    "make_exchange",
    "split_sizes",
    "time_exchanges",
    "transport",
]


def make_exchange(
    comm: str,
    topology: Topology,
    stats: CommStats | None = None,
    auto_budget_s: float = 20.0,
    codec: SlowPhaseCodec | None = None,
) -> Exchange:
    """The exchange for `comm`: 'flat', 'tapa', or 'auto' (calibrated now, a collective call),
    counting into `stats`, its inter-node pieces through `codec` if given (not with 'auto').

    TAPA on one node, or with one rank per node, would be a flat all-to-all plus copies, so it is
    flat there."""
    if comm == "auto":
        if codec is not None:
            raise ValueError("the auto exchange takes no codec: which pieces cross nodes depends on its choice")
        start = time.perf_counter()
        choices = calibrate(topology, auto_budget_s)
        return AutoExchange(topology, stats, choices, calibration_s=time.perf_counter() - start)
    if comm == "tapa" and topology.hierarchical:
        return TapaExchange(topology, stats, codec)
    if comm in ("flat", "tapa"):
        return FlatExchange(topology, stats, codec)
    raise ValueError(f"unknown exchange {comm!r}")
