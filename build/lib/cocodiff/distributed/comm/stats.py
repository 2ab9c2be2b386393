"""Counts what the collectives move and how long ranks wait for them.

Bytes are counted per link class: `same_node` (to ranks on this node) and `other_node` (to ranks
on other nodes); what a rank keeps for itself crosses no link and is not counted. With deeper
topologies (`--levels node=2,card=2,tile=2`) they are also counted per level (`level_bytes`): a
message counts at the outermost level its sender and receiver differ in, so the outermost
level's bytes are `other_node` and the others add up to `same_node`. Time is the
time this rank's work stood still in `wait()`, which is the communication it could not hide:
on the CPU the host's clock, on CUDA/XPU events on the compute stream around each wait (the
host does not block there), read once when the figures are collected (`settle`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..clock import Clock
from ..topology import Topology

__all__ = ["AXIS_OF_KIND", "LINKS", "CommStats", "add_axes"]

LINKS = ("inter_node", "intra_node")
"""The link classes of `CommStats.by_axis`."""

AXIS_OF_KIND = {"a2a_in": "ulysses", "a2a_out": "ulysses", "ring": "ring", "data": "cfg/batch", "gather": "output"}
"""The plan axis each operation kind serves: Ulysses' all-to-alls, ring's K/V blocks, the CFG and
batch groups' gather of the transformer's output, and the gather of the sequence at the end."""


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
    level_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes per level of the topology (`Topology.link_level`), then per kind."""
    clock: Clock = field(default_factory=Clock)
    """What the waits are timed with (the device's events on CUDA/XPU)."""
    timed: bool = True
    """False: waits are not timed (compiled blocks: a clock read would break their graph)."""
    _marked: list[tuple[dict[str, float], str, Any, Any]] = field(default_factory=list)
    """Timed regions whose device events are not read yet: (counter, kind, start, end)."""

    def record_send(self, kind: str, topology: Topology, bytes_to: list[int]) -> None:
        """Count one collective in which this rank sends `bytes_to[r]` bytes to rank r. Not while
        torch.compile traces (the counters would become guards: a recompilation every call);
        compiled blocks are counted by replaying an eager call's counts (`compiled.CompiledBlocks`)."""
        if torch.compiler.is_compiling():
            return
        self.calls[kind] += 1
        links = topology.peer_links
        for dst, nbytes in enumerate(bytes_to):
            if dst == topology.rank or nbytes == 0:
                continue
            level, same_node = links[dst]
            by_kind = self.level_bytes.setdefault(level, {})
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
            if same_node:
                self.same_node_bytes[kind] += nbytes
            else:
                self.other_node_bytes[kind] += nbytes

    def mark(self) -> Any:
        """A point in time on this rank's clock (`waited` / `in_flight` take two); None untimed."""
        return self.clock.mark() if self.timed else None

    def waited(self, kind: str, start: Any, end: Any) -> None:
        """Record a wait from mark `start` to mark `end`."""
        self._record(self.wait_s, kind, start, end)

    def in_flight(self, kind: str, start: Any, end: Any) -> None:
        """Record a transfer in flight from mark `start` to mark `end`."""
        self._record(self.in_flight_s, kind, start, end)

    def _record(self, counter: dict[str, float], kind: str, start: Any, end: Any) -> None:
        if not self.timed:
            return
        if self.clock.on_device:
            self._marked.append((counter, kind, start, end))  # read in `settle`: no host sync here
        else:
            counter[kind] += self.clock.seconds(start, end)

    def settle(self) -> None:
        """Fold the device-timed regions into the counters (one synchronize, when collecting)."""
        if self._marked:
            self.clock.sync()
            for counter, kind, start, end in self._marked:
                counter[kind] += self.clock.seconds(start, end)
            self._marked.clear()

    def counts(self, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The byte and call counters of `kinds`, a copy (`add` adds one back)."""
        return {
            "same_node_bytes": {k: self.same_node_bytes[k] for k in kinds if k in self.same_node_bytes},
            "other_node_bytes": {k: self.other_node_bytes[k] for k in kinds if k in self.other_node_bytes},
            "calls": {k: self.calls[k] for k in kinds if k in self.calls},
            "level_bytes": {level: {k: n for k, n in by_kind.items() if k in kinds} for level, by_kind in self.level_bytes.items()},
        }

    def add(self, counts: dict[str, Any], sign: int = 1) -> None:
        """Add (sign -1: subtract) counters as `counts` gives them."""
        for name in ("same_node_bytes", "other_node_bytes", "calls"):
            for kind, n in counts[name].items():
                getattr(self, name)[kind] += sign * n
        for level, by_kind in counts["level_bytes"].items():
            mine = self.level_bytes.setdefault(level, {})
            for kind, n in by_kind.items():
                mine[kind] = mine.get(kind, 0) + sign * n

    def reset(self) -> None:
        for counter in (self.same_node_bytes, self.other_node_bytes, self.level_bytes, self.wait_s, self.calls, self.in_flight_s):
            counter.clear()
        self._marked.clear()

    def totals(self) -> dict[str, float]:
        """All kinds added up: bytes per link class, seconds waited, calls."""
        self.settle()
        return {
            "same_node_bytes": sum(self.same_node_bytes.values()),
            "other_node_bytes": sum(self.other_node_bytes.values()),
            "wait_s": sum(self.wait_s.values()),
            "calls": sum(self.calls.values()),
        }

    def by_axis(self) -> dict[str, dict[str, int]]:
        """Bytes per plan axis (`AXIS_OF_KIND`) and link class: {axis: {"inter_node": .., "intra_node": ..}}."""
        axes: dict[str, dict[str, int]] = {}
        for counter, link in ((self.other_node_bytes, "inter_node"), (self.same_node_bytes, "intra_node")):
            for kind, nbytes in counter.items():
                axis = axes.setdefault(AXIS_OF_KIND.get(kind, kind), dict.fromkeys(LINKS, 0))
                axis[link] += nbytes
        return axes

    def by_level(self, kinds: tuple[str, ...] | None = None) -> dict[str, int]:
        """Bytes per level (outermost level = other node), for `kinds` (None: every kind)."""
        return {
            level: sum(n for kind, n in by_kind.items() if kinds is None or kind in kinds)
            for level, by_kind in self.level_bytes.items()
        }


def add_axes(many: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several `CommStats.by_axis` results (e.g. one per rank) added up, axes in name order."""
    return {
        axis: {link: sum(axes.get(axis, {}).get(link, 0) for axes in many) for link in LINKS}
        for axis in sorted({axis for axes in many for axis in axes})
    }
