"""Collectives for sequence parallelism: the Ulysses exchange, gathers, and their statistics."""

from .stats import CommStats
from .ulysses import FlatExchange, Pending, gather_seq, split_sizes

__all__ = ["CommStats", "FlatExchange", "Pending", "gather_seq", "split_sizes"]
