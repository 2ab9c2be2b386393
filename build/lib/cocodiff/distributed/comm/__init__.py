"""Collectives for sequence parallelism: the Ulysses exchange (flat, TAPA), gathers, statistics,
and the optional codec an exchange may use for its inter-node pieces."""

from ..topology import Topology
from cocodiff.config.wire import Wire
from .auto import AutoChoice, AutoExchange, StepTrials, calibrate, time_exchanges
from .codec import SlowPhaseCodec
from .stats import CommStats
from .tapa import TapaExchange, TapaFullExchange, full_depth_differs
from .ulysses import Exchange, FlatExchange, Pending, split_sizes, transport

__all__ = [
    "AutoChoice",
    "AutoExchange",
    "CommStats",
    "Exchange", "FlatExchange", "Pending", "SlowPhaseCodec", "StepTrials", "TapaExchange", "TapaFullExchange",
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
    codec: SlowPhaseCodec | None = None,
    v_first: bool | None = None,
    lossy_wire: Wire | None = None,
) -> Exchange:
    """The exchange for `comm`: 'flat', 'tapa' (two hops: node, rest), 'tapa-full' (one hop per
    level of more than one rank), or 'auto' (decided by timing the run's first steps:
    `StepTrials`; `v_first` True or False fixes V-First there, None lets it decide), counting into
    `stats`, its inter-node pieces through `codec` if given (not with 'auto'); `lossy_wire`: the
    wire format a `--lossy-budget` lets 'auto' try as more candidates (config/lossy_budget.py).

    TAPA on one node, or with one rank per node, would be a flat all-to-all plus copies, so it is
    flat there; full-depth TAPA over fewer than three levels is two-level TAPA (or flat)."""
    if comm == "auto":
        if codec is not None:
            raise ValueError("the auto exchange takes no codec: which pieces cross nodes depends on its choice")
        return AutoExchange(topology, stats, v_first=v_first, lossy_wire=lossy_wire)
    if comm == "tapa-full" and full_depth_differs(topology):
        return TapaFullExchange(topology, stats, codec)
    if comm in ("tapa", "tapa-full") and topology.hierarchical:
        return TapaExchange(topology, stats, codec)
    if comm in ("flat", "tapa", "tapa-full"):
        return FlatExchange(topology, stats, codec)
    raise ValueError(f"unknown exchange {comm!r}")
