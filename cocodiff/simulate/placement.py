"""A parallel plan laid over a system's ranks, and the traffic matrices of its collectives.

    ranks = pipe x cfg x batch x ring x ulysses        (config/plan.py; N = cfg x batch data groups)

The plan's axes lie over the node-major ranks outermost first, exactly as `Topology.split` lays
them: an axis's members are `stride` ranks apart, stride = the product of the degrees of the
axes inside it. With pipeline stages a placement is one stage's: its ranks run the rest of the
plan, and the rank at place i of stage s hands its shard on to the rank at place i of stage
s + 1 (`stage_ranks`; place = the data group, then the sequence-parallel position). Each data group d (CFG branch and batch share, CFG-major) runs the whole
sequence-parallel plan on its ring x ulysses ranks: its ring chunk g's Ulysses group holds
sequence-parallel positions g U .. g U + U - 1 (chunk-major, as the engine shards); ring u joins
the u-th member of every Ulysses group of the same data group. The data groups' members at one
sequence-parallel position trade the transformer's output once per call (`data_gather`).

Every collective of a plan is the union of its groups' collectives, all in flight at once, so one
(P, P) traffic matrix per phase:

    Ulysses exchange   each group's swap (flat: one phase) or TAPA phases (network.py), inside the group
    ring step j        rank (g, u) sends the K/V block it holds, chunk (g - j) mod R's tokens x its
                       heads x 2 D, to (g + 1, u); R - 1 steps per attention layer
    output gather      the padded image shards inside each Ulysses group, then each group's padded
                       chunk to the other ring members (the engine's two gathers; one gather over all
                       P would move the same total bytes but not over the same links: with Ulysses
                       across nodes the ring gather forwards inside a node what has already crossed)
    data gather        every rank sends its group's output to the N - 1 ranks at its position in
                       the other data groups

TAPA inside a Ulysses group: its first phase joins the members that share one of the system's
TAPA blocks (`tapa_group` consecutive ranks); when no block holds two members, the members that
share a node (the engine's own split: the group's members per node). A first phase of one
member, or of the whole group, leaves one phase. Over every rank (ring 1) this is today's TAPA
with the system's `tapa_group`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config.plan import Plan, equal_runs
from .network import swap_matrix, tapa_matrices
from .system import System

__all__ = ["Placement", "Unplaceable", "place", "stage_ranks"]


class Unplaceable(Exception):
    """A plan whose groups the engine cannot build on this system (the message says why)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """The groups of one plan on one system."""

    plan: Plan
    ranks: int
    groups: tuple[tuple[int, ...], ...]
    """groups[d R + g][u]: the global rank of Ulysses index u in ring chunk g's Ulysses group of data
    group d (N R groups), in this placement's pipeline stage."""
    first_phase: int
    """Members of a TAPA first-phase group, consecutive in Ulysses order (see the module docstring)."""

    @property
    def ring(self) -> int:
        return self.plan.ring

    @property
    def ulysses(self) -> int:
        return self.plan.ulysses

    @property
    def data(self) -> int:
        """N: data groups (CFG branches x batch shares)."""
        return self.plan.cfg * self.plan.batch

    def _union(self, blocks: list[np.ndarray]) -> np.ndarray:
        """(U, U) matrices, one per ring chunk (the same in every data group) -> one (P, P) matrix."""
        T = np.zeros((self.ranks, self.ranks))
        for members, block in zip(self.groups, blocks * self.data):
            T[np.ix_(members, members)] = block
        return T

    @property
    def whole(self) -> bool:
        """One Ulysses group of every rank, in rank order (its matrices are the group's own)."""
        return self.groups == (tuple(range(self.ranks)),)

    def flat(self, gathers: list[list[int]], scatters: list[list[int]], unit: float) -> list[np.ndarray]:
        """Every Ulysses group's one-phase exchange: chunk g's member u holds gathers[g][u] rows of
        all scatters[g] columns (see network.swap_matrix), in every data group."""
        if self.whole:
            return [swap_matrix(gathers[0], scatters[0], unit)]
        return [self._union([swap_matrix(g, s, unit) for g, s in zip(gathers, scatters)])]

    def tapa(self, gathers: list[list[int]], scatters: list[list[int]], unit: float,
             kept: list[np.ndarray] | None = None, index: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Every Ulysses group's two TAPA phases (network.tapa_matrices), first phases at once, then
        second phases at once; kept/index per group as there (V-Major), None: in full."""
        per_group = [
            tapa_matrices(g, s, unit, self.first_phase, None if kept is None else kept[i], None if index is None else index[i])
            for i, (g, s) in enumerate(zip(gathers, scatters))
        ]
        if self.whole:
            return list(per_group[0])
        return [self._union([phases[k] for phases in per_group]) for k in range(2)]

    def ring_step(self, step: int, block_bytes: np.ndarray) -> np.ndarray:
        """Ring step `step`: rank (g, u) sends block_bytes[(g - step) mod R, u] to (g + 1, u), in
        every data group."""
        T = np.zeros((self.ranks, self.ranks))
        R = self.ring
        for d in range(self.data):
            for g in range(R):
                for u, sender in enumerate(self.groups[d * R + g]):
                    T[sender, self.groups[d * R + (g + 1) % R][u]] = block_bytes[(g - step) % R, u]
        return T

    def ulysses_gather(self, shard_bytes: list[float]) -> np.ndarray:
        """All-gather inside each Ulysses group: chunk g's members send shard_bytes[g] to each other."""
        T = np.zeros((self.ranks, self.ranks))
        for members, shard in zip(self.groups, shard_bytes * self.data):
            T[np.ix_(members, members)] = shard
        np.fill_diagonal(T, 0.0)
        return T

    def ring_gather(self, chunk_bytes: float) -> np.ndarray:
        """All-gather around each ring: every rank sends its group's chunk to its other ring members."""
        T = np.zeros((self.ranks, self.ranks))
        R = self.ring
        for d in range(self.data):
            for u in range(self.ulysses):
                ring = [members[u] for members in self.groups[d * R : (d + 1) * R]]
                T[np.ix_(ring, ring)] = chunk_bytes
        np.fill_diagonal(T, 0.0)
        return T

    def data_gather(self, output_bytes: float) -> np.ndarray:
        """The data groups' gather: every rank sends `output_bytes` (its sequence shard of its
        group's output, padded to the largest share) to the ranks at its sequence-parallel
        position in the other groups."""
        T = np.zeros((self.ranks, self.ranks))
        R, U = self.ring, self.ulysses
        for g in range(R):
            for u in range(U):
                peers = [self.groups[d * R + g][u] for d in range(self.data)]
                T[np.ix_(peers, peers)] = output_bytes
        np.fill_diagonal(T, 0.0)
        return T


def _first_phase(members: tuple[int, ...], system: System) -> int:
    """Members of one TAPA first-phase group: those sharing a TAPA block, else a node (1: none)."""
    for block in (system.tapa_group, system.ranks_per_node):
        run = equal_runs([m // block for m in members])
        if run is not None and run > 1:
            return run
    return 1


def stage_ranks(plan: Plan, system: System) -> np.ndarray:
    """(pipe, ranks / pipe): the global ranks of each pipeline stage, in place order (data group
    CFG-major, then the sequence-parallel position, chunk-major: the order of `token_split`)."""
    grid = np.arange(system.ranks).reshape([degree for _, degree in plan.mesh_dims])
    axes = [plan.order.index(a) for a in ("pipe", "cfg", "batch", "ring", "ulysses")]
    return np.moveaxis(grid, axes, [0, 1, 2, 3, 4]).reshape(plan.pipe, -1)


def place(plan: Plan, system: System, stage: int = 0) -> Placement:
    """`plan` over `system`'s node-major ranks, the groups of pipeline stage `stage` (the only
    one without `p`); raises Unplaceable where `Topology.split` would refuse it (Ulysses groups
    that do not fall into equal runs of ranks per node)."""
    P = system.ranks
    # (S, C, B, R, U) -> stage's (N R, U): [d R + g, u] -> rank, data groups CFG-major
    by_chunk = stage_ranks(plan, system)[stage].reshape(plan.cfg * plan.batch * plan.ring, plan.ulysses)
    groups = tuple(tuple(int(r) for r in row) for row in by_chunk)
    whole = groups == (tuple(range(P)),)
    if not whole and any(equal_runs([m // system.ranks_per_node for m in g]) is None for g in groups):
        raise Unplaceable(f"plan {plan.short}: its Ulysses groups do not fall into equal runs of ranks per node "
                          f"({system.ranks_per_node} ranks per node)")
    first = system.tapa_group if whole else _first_phase(groups[0], system)
    return Placement(plan=plan, ranks=P, groups=groups, first_phase=first)
