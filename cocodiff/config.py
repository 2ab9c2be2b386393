"""Typed, validated configuration for sequence-parallel inference.

Parsing a config never starts `torch.distributed`: `ParallelConfig` only checks that its fields
make sense together; the process groups are built later by `Topology`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

__all__ = ["COMM_CHOICES", "ParallelConfig"]

COMM_CHOICES = ("flat", "tapa")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How a transformer is split over the ranks of the default process group."""

    comm: str = "flat"
    """All-to-all mechanism: `flat` (one all-to-all over all ranks, the Ulysses baseline) or
    `tapa` (two phases: inside each node, then between nodes among ranks of the same local index)."""

    ranks_per_node: int | None = None
    """Ranks that share a node (fast links). None: taken from the launcher (`LOCAL_WORLD_SIZE`)."""

    def __post_init__(self) -> None:
        if self.comm not in COMM_CHOICES:
            raise UsageError(f"--comm {self.comm!r} is not one of {', '.join(COMM_CHOICES)}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UsageError(f"--ranks-per-node {self.ranks_per_node} must be at least 1")
