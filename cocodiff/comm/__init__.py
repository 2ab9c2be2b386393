"""Collectives for sequence parallelism: the Ulysses exchange (flat, TAPA), gathers, statistics."""

from ..topology import Topology
from .stats import CommStats
from .tapa import TapaExchange
from .ulysses import Exchange, FlatExchange, Pending, gather_seq, split_sizes

__all__ = ["CommStats", "Exchange", "FlatExchange", "Pending", "TapaExchange", "gather_seq", "make_exchange", "split_sizes"]


def make_exchange(comm: str, topology: Topology, stats: CommStats | None = None) -> Exchange:
    """The exchange for `comm` ('flat' or 'tapa'). TAPA on one node, or with one rank per node,
    would be a flat all-to-all plus copies, so it is flat there."""
    if comm == "tapa" and topology.nodes > 1 and topology.ranks_per_node > 1:
        return TapaExchange(topology, stats)
    if comm in ("flat", "tapa"):
        return FlatExchange(topology, stats)
    raise ValueError(f"unknown exchange {comm!r}")
