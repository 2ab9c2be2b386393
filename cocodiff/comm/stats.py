"""Counts what the collectives move and how long ranks wait for them.

Bytes are counted per link class: `same_node` (to ranks on this node) and `other_node` (to ranks
on other nodes); what a rank keeps for itself crosses no link and is not counted. Time is the
time this rank spent blocked in `wait()`, which is the communication it could not hide.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..topology import Topology

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Per-rank counters, keyed by operation kind (`a2a`, `gather`, ...)."""

    same_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    other_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    in_flight_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds transfers spent between being posted and being found complete, for kinds that
    overlap them with compute (ring): with `wait_s`, the share that compute hid."""

    def record_send(self, kind: str, topology: Topology, bytes_to: list[int]) -> None:
        """Count one collective in which this rank sends `bytes_to[r]` bytes to rank r."""
        self.calls[kind] += 1
        for dst, nbytes in enumerate(bytes_to):
            if dst == topology.rank or nbytes == 0:
                continue
            if topology.node_of(dst) == topology.node:
                self.same_node_bytes[kind] += nbytes
            else:
                self.other_node_bytes[kind] += nbytes

    def record_wait(self, kind: str, seconds: float) -> None:
        self.wait_s[kind] += seconds

    def record_in_flight(self, kind: str, seconds: float) -> None:
        self.in_flight_s[kind] += seconds

    def reset(self) -> None:
        for counter in (self.same_node_bytes, self.other_node_bytes, self.wait_s, self.calls, self.in_flight_s):
            counter.clear()

    def totals(self) -> dict[str, float]:
        """All kinds added up: bytes per link class, seconds waited, calls."""
        return {
            "same_node_bytes": sum(self.same_node_bytes.values()),
            "other_node_bytes": sum(self.other_node_bytes.values()),
            "wait_s": sum(self.wait_s.values()),
            "calls": sum(self.calls.values()),
        }
