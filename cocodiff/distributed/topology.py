"""Where each rank sits: its levels (nodes, cards, tiles, ...) and the process groups that follow.

One `Topology` is built once per process, after `torch.distributed` is initialized, and passed
to whatever needs it. Ranks are numbered node-major, as torchrun numbers them: rank r lives on
node r // ranks_per_node at local index r % ranks_per_node. Inside a node there may be more
levels (`--levels node=2,card=2,tile=2`, config/levels.py): the ranks are then a mixed radix of the
level sizes, outermost first, and each level has its process groups.

    intra-node groups: the ranks of one node                 (fast links: NVLink, Xe Link, loopback)
    inter-node groups: the ranks with the same local index    (one rail each, slow links)
    level groups:      the ranks that differ only at one level (a card's tiles, a node's cards
                       at one tile index, ...)

Only levels and plan axes of more than one rank get groups: a group of one rank never reaches a
collective (its exchanges copy locally), so creating one per rank would only cost start-up time
(24 store rounds on gloo, 24 communicators on NCCL, per such dim at 24 ranks).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config.env import LEVELS_ENV
from ..config.levels import (
    Levels,
    block,
    digit,
    format_levels,
    link_level,
    member_levels,
    parse_levels,
    two_levels,
)
from ..config.plan import Plan
from ..config.timeouts import DEFAULT_TIMEOUT_S
from ..errors import UsageError
from .devices import host_name, process_device, ranks_per_node_from_hosts

__all__ = ["PlanGroups", "Topology", "bound_device", "destroy_groups", "level_groups", "peer_timeout_s", "ranks_per_node_of", "set_peer_timeout"]

_peer_timeout_s = DEFAULT_TIMEOUT_S


def set_peer_timeout(seconds: float) -> None:
    """Set the longest a rank waits on a peer (`launch.init_distributed` does, from `--timeout`)."""
    global _peer_timeout_s
    _peer_timeout_s = seconds


def peer_timeout_s() -> float:
    """The longest a rank waits on a peer: the process group's timeout (`--timeout`).

    Every wait on a peer (collectives and the exchanges' point-to-point messages, on any group)
    is bounded by it: on gloo by the waits themselves, on NCCL/XCCL by the watchdog (run/lifetime.py).
    """
    return _peer_timeout_s


def bound_device() -> torch.device:
    """The device the default process group is bound to: this process's device (distributed/devices.py)."""
    if dist.is_initialized() and dist.get_backend() in ("nccl", "xccl"):
        kind = "cuda" if dist.get_backend() == "nccl" else "xpu"
        module = torch.cuda if kind == "cuda" else torch.xpu
        return torch.device(kind, module.current_device())
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    return process_device()


def ranks_per_node_of(world_size: int) -> int:
    """Ranks per node from every rank's host name (one all-gather); torch's single-process `fake`
    backend (the CPU stand-in for NCCL in tests) has no peers to ask: the launcher's count."""
    if world_size == 1:
        return 1
    if "fake" in dist.get_backend():
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, host_name())
    return ranks_per_node_from_hosts(hosts)


@dataclass(frozen=True)
class Topology:
    """This rank's place in the cluster, and the process groups built from it."""

    rank: int
    world_size: int
    ranks_per_node: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup] | None = field(default=None, compare=False, repr=False)
    """This rank's group of each level of more than one rank, by level name (with more than two
    levels, also "intra": the node's ranks); None for one process."""
    members: tuple[int, ...] | None = None
    """Global ranks of this topology's ranks, for a group of a plan (None: every rank, in order).
    `rank`, `world_size` and the node numbers then count within the group."""
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """The group's process group, with `members` (None: the default group)."""
    levels: Levels = ()
    """(name, size) per level, outermost (the nodes) first; the sizes multiply to `world_size` and
    those inside the node level to `ranks_per_node`. Empty: the two levels of `ranks_per_node`."""
    link_levels: Levels = ()
    """The whole run's levels, to name the link between two global ranks (`link_level`); empty:
    `levels` (this topology is the whole run)."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise UsageError(
                f"--ranks-per-node {self.ranks_per_node} must divide the world size {self.world_size}"
            )
        if not self.levels:
            object.__setattr__(self, "levels", two_levels(self.world_size, self.ranks_per_node))
        sizes = [size for _, size in self.levels]
        if math.prod(sizes) != self.world_size or math.prod(sizes[1:]) != self.ranks_per_node:
            raise UsageError(
                f"--levels {format_levels(self.levels)} must multiply to the {self.world_size} ranks, "
                f"{self.ranks_per_node} per node"
            )
        if not self.link_levels:
            object.__setattr__(self, "link_levels", self.levels)

    @classmethod
    def single(cls, device: torch.device | None = None) -> Topology:
        """One process, no groups: the reference run."""
        return cls(rank=0, world_size=1, ranks_per_node=1, device=device or process_device())

    @classmethod
    def from_env(
        cls, ranks_per_node: int | None = None, device: torch.device | None = None, levels: Levels | None = None
    ) -> Topology:
        """Build from an initialized default process group and the launcher's environment.

        `ranks_per_node` overrides torchrun's `LOCAL_WORLD_SIZE`, e.g. to treat the ranks on one
        machine as several emulated nodes; `levels` (outermost first) gives the whole hierarchy
        instead, its first level being the nodes. Neither given: the launcher's levels
        (`COCODIFF_LEVELS`), else two levels from the ranks' host names (all-gathered: equal,
        node-major runs of ranks, distributed/devices.py). `device` defaults to the one the process group
        is bound to.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call cocodiff.run.launch.init_distributed first")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if not levels and ranks_per_node is None and os.environ.get(LEVELS_ENV):
            levels = parse_levels(os.environ[LEVELS_ENV])
        if levels:
            sizes = [size for _, size in levels]
            if math.prod(sizes) != world_size:
                raise UsageError(f"--levels {format_levels(levels)} multiply to {math.prod(sizes)}, not to the {world_size} ranks")
            if ranks_per_node is not None and ranks_per_node != math.prod(sizes[1:]):
                raise UsageError(f"--ranks-per-node {ranks_per_node} disagrees with --levels {format_levels(levels)}")
            ranks_per_node = math.prod(sizes[1:])
        if ranks_per_node is None:
            ranks_per_node = ranks_per_node_of(world_size)
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise UsageError(f"--ranks-per-node {ranks_per_node} must divide the world size {world_size}")
        levels = tuple(levels) if levels else two_levels(world_size, ranks_per_node)
        device = device or bound_device()
        groups = level_groups(torch.arange(world_size), 0, levels)
        return cls(rank=rank, world_size=world_size, ranks_per_node=ranks_per_node, device=device, groups=groups, levels=levels)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def hierarchical(self) -> bool:
        """More than one node and more than one rank per node: where TAPA's two phases differ from
        the flat all-to-all (elsewhere TAPA would be flat plus copies, and runs as flat)."""
        return self.nodes > 1 and self.ranks_per_node > 1

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def global_rank(self, rank: int) -> int:
        """The default group's number of this topology's `rank`."""
        return self.members[rank] if self.members is not None else rank

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank of this topology (the default group, or a plan's group). A plan's group of one
        rank has none: the exchanges copy locally there and never reach a collective (a `None`
        group would mean the whole world to torch)."""
        if self.world_size == 1:
            if self.members is not None:
                raise RuntimeError("a one-rank group has no process group; copy locally instead of a collective")
            return None
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def intra_group(self) -> dist.ProcessGroup | None:
        """The ranks of this node."""
        if self.groups is None or len(self.levels) == 1:
            return None
        return self.groups.get(self.levels[1][0] if len(self.levels) == 2 else "intra")

    @property
    def inter_group(self) -> dist.ProcessGroup | None:
        """The ranks with this rank's local index, one per node."""
        return self.level_group(0)

    def level_group(self, d: int) -> dist.ProcessGroup | None:
        """The ranks that differ from this one only at level d, in the order of their digit (None
        for a level of one rank)."""
        return self.groups.get(self.levels[d][0]) if self.groups is not None else None

    def level_peers(self, d: int) -> list[int]:
        """This topology's ranks of `level_group(d)`, by group rank (= their digit at level d)."""
        step, mine = block(self.levels, d + 1), digit(self.levels, self.rank, d)
        return [self.rank + (j - mine) * step for j in range(self.levels[d][1])]

    @property
    def active_levels(self) -> tuple[int, ...]:
        """Levels of more than one rank (outermost first): where a hop of TAPA goes somewhere."""
        return tuple(d for d, (_, size) in enumerate(self.levels) if size > 1)

    @functools.cached_property
    def peer_links(self) -> tuple[tuple[str, bool], ...]:
        """Per rank of this topology: (the level of the link to it, whether it is on this node),
        computed once, so that counting a message's bytes costs a lookup (distributed/comm/stats.py)."""
        return tuple((self.link_level(r) or "", self.node_of(r) == self.node) for r in range(self.world_size))

    def link_level(self, rank: int) -> str | None:
        """Name of the link between this rank and `rank` (both this topology's): the outermost
        level of the whole run at which they differ; None for this rank itself."""
        return link_level(self.link_levels, self.global_rank(self.rank), self.global_rank(rank))

    def split(self, plan: Plan) -> PlanGroups:
        """This rank's groups under `plan` (a collective call: every rank builds every group).

        The plan's axes lie over the node-major ranks outermost first (see config/plan.py). The Ulysses
        group becomes a topology of its own, with its members' node layout, so the exchanges
        (TAPA included) run inside it unchanged; the ring is the ranks that share this rank's
        Ulysses index across the sequence chunks; the data group is the ranks at this rank's
        place in the sequence across the CFG branches and batch shares (CFG-major); the stage
        peers, the ranks at this rank's place in every pipeline stage (stage order).
        """
        plan.check(self.world_size)
        if plan.sp == self.world_size and plan.ring == 1:
            return PlanGroups(plan, self, None, (self.rank,), 0)
        names = tuple(axis for axis, _ in plan.mesh_dims)
        grid = torch.arange(self.world_size).reshape([degree for _, degree in plan.mesh_dims])
        made: dict[tuple, dist.ProcessGroup] = {}  # one group per set of ranks, whichever axis or level asks
        here = [int(c) for c in (grid == self.rank).nonzero()[0]]

        def along(axis: str) -> tuple[int, ...]:
            i = names.index(axis)
            return tuple(int(grid[(*here[:i], j, *here[i + 1 :])]) for j in range(grid.shape[i]))

        ulysses, ring = along("ulysses"), along("ring")
        # Every Ulysses group's levels, checked on every rank before any group is made: a rank that
        # read its own group's only would raise where others go on to make groups (a hang on NCCL).
        at = names.index("ulysses")
        every = {member_levels(line, self.levels) for line in grid.movedim(at, -1).reshape(-1, plan.ulysses).tolist()}
        if None in every:
            raise UsageError(f"--plan {plan.short}: its Ulysses groups do not fall into equal runs of ranks per node")
        if len(every) > 1:
            raise UsageError(f"--plan {plan.short}: its Ulysses groups lie over the nodes in different ways "
                             f"({', '.join(sorted(format_levels(levels) for levels in every))}); a Ulysses degree "
                             f"that divides the {self.ranks_per_node} ranks per node, or a multiple of them, fits")
        levels = member_levels(ulysses, self.levels)
        data, data_group = _data_groups(grid, names, here, plan)
        # The Ulysses axis split into its members' own levels (their nodes, cards, ...) gives the
        # groups TAPA needs inside the Ulysses group.
        view = Topology(
            rank=ulysses.index(self.rank), world_size=plan.ulysses, ranks_per_node=block(levels, 1), device=self.device,
            groups=level_groups(grid, at, levels, made), members=ulysses,
            group=_subgroup(grid, [at], made) if plan.ulysses > 1 else None, levels=levels, link_levels=self.link_levels,
        )
        ring_group = _subgroup(grid, [names.index("ring")], made) if plan.ring > 1 else None
        stages = along("pipe")
        stage_group = output_group = None
        boundaries: list[dist.ProcessGroup | None] = []
        if plan.pipe > 1 and self.world_size > plan.pipe:  # the ranks of this rank's stage: every axis but the stages'
            # (a stage of one rank has none: a communicator of one would only hold resources)
            stage_group = _subgroup(grid, [i for i, name in enumerate(names) if name != "pipe"], made)
        if plan.pipe > 1:
            at = names.index("pipe")  # the output's way back: groups of its own, whatever other groups hold these ranks
            columns = grid.movedim(at, -1).reshape(-1, plan.pipe).tolist()
            output_group, _ = dist.new_subgroups_by_enumeration(columns)
            # Each boundary's hand-ons (stage k to k + 1, per column): a pair's group of its own, so
            # that receives posted ahead from stage k - 1 never queue in front of sends to k + 1.
            for k in range(plan.pipe - 1):
                boundaries.append(dist.new_subgroups_by_enumeration([column[k : k + 2] for column in columns])[0])
        return PlanGroups(plan, view, ring_group, ring, ring.index(self.rank), data_group, data, data.index(self.rank),
                          stages, stages.index(self.rank), stage_group, output_group, tuple(boundaries))

    def describe(self) -> str:
        text = f"{self.world_size} ranks = {self.nodes} node(s) x {self.ranks_per_node} ({self.device.type})"
        return text if len(self.levels) == 2 else f"{text}, levels {format_levels(self.levels)}"


def destroy_groups(groups: Iterable[dist.ProcessGroup | None]) -> int:
    """Destroy these process groups (each once; never the default group) -> how many. A run's own
    groups go when it is undone: each gloo group holds threads and sockets, each NCCL group a
    communicator and its buffers, and a process that parallelizes run after run would pile them up."""
    seen: dict[int, dist.ProcessGroup] = {}
    for group in groups:
        if group is not None and group is not dist.group.WORLD:
            seen.setdefault(id(group), group)
    for group in seen.values():
        dist.destroy_process_group(group)
    return len(seen)


def level_groups(
    grid: torch.Tensor, at: int, levels: Levels, made: dict[tuple, dist.ProcessGroup] | None = None
) -> dict[str, dist.ProcessGroup]:
    """This rank's group of each level of more than one rank, by name, where dim `at` of `grid`
    (the ranks, one dim per plan axis, or 1-D) is cut into `levels` (outermost first); with more
    than two levels, also "intra": the ranks of the levels inside the first (the node's ranks).
    A collective call: every rank creates every group, in the same order."""
    sizes = [size for _, size in levels]
    cut = grid.reshape(*grid.shape[:at], *sizes, *grid.shape[at + 1 :])
    made = {} if made is None else made
    groups = {name: _subgroup(cut, [at + d], made) for d, (name, size) in enumerate(levels) if size > 1}
    if len(levels) > 2 and math.prod(sizes[1:]) > 1:
        groups["intra"] = _subgroup(cut, list(range(at + 1, at + len(levels))), made)
    return groups


def _subgroup(grid: torch.Tensor, dims: list[int], made: dict[tuple, dist.ProcessGroup]) -> dist.ProcessGroup:
    """This rank's group of the ranks that differ only along `dims` of `grid`, in the order of
    those coordinates. Every rank creates every such group, in the same order (a collective call);
    a set of groups already in `made` (another axis or level with the same ranks) is reused."""
    others = [i for i in range(grid.dim()) if i not in dims]
    rows = grid.permute(*others, *dims).reshape(-1, math.prod(grid.shape[d] for d in dims))
    key = tuple(tuple(row) for row in rows.tolist())
    if key not in made:
        if len(key) == 1:  # every rank, in order (`grid` numbers them all): the default group
            made[key] = dist.group.WORLD
        else:
            made[key], _ = dist.new_subgroups_by_enumeration([list(row) for row in key])
    return made[key]


def _data_groups(grid: torch.Tensor, names: tuple[str, ...], here: list[int], plan: Plan) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
    """This rank's data group (its cfg x batch neighbours, CFG-major) and its process group; every
    rank creates every data group, in the same order (a collective call)."""
    data_axes = [names.index("cfg"), names.index("batch")]
    others = [i for i in range(len(names)) if i not in data_axes]
    # (other coordinates..., cfg, batch): each row is one data group, CFG-major.
    rows = grid.permute(*others, *data_axes).reshape(-1, plan.cfg * plan.batch)
    groups = [tuple(int(r) for r in row) for row in rows]
    mine = next(g for g in groups if int(grid[tuple(here)]) in g)
    if len(mine) == 1:
        return mine, None
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return mine, group


@dataclass(frozen=True)
class PlanGroups:
    """This rank's share of a plan: its Ulysses group (a topology) and its ring."""

    plan: Plan
    ulysses: Topology
    ring_group: dist.ProcessGroup | None = field(compare=False, repr=False)
    ring_members: tuple[int, ...]
    """Global ranks holding this rank's heads for each sequence chunk, in chunk order."""
    ring_index: int
    data_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    data_members: tuple[int, ...] | None = None
    """Global ranks holding this rank's place in the sequence for each CFG branch and batch share
    (CFG-major); None: no data parallelism."""
    data_index: int = 0
    stage_members: tuple[int, ...] = ()
    """Global ranks at this rank's place in the sequence and data groups in each pipeline stage,
    in stage order (empty: one stage)."""
    stage_index: int = 0
    stage_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """The ranks of this rank's pipeline stage, which run the same layers (None: one stage)."""
    output_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """`stage_members` as a group of their own, which carries the last stage's output back to the
    earlier stages: on NCCL its own communicator and stream, so that an output's receive posted
    ahead never queues in front of a send of the next micro-batch to the same peer."""
    boundary_groups: tuple[dist.ProcessGroup | None, ...] = field(default=(), compare=False, repr=False)
    """Per stage boundary k (stage k hands on to k + 1): this rank's pair's group across it, None
    where this rank is on neither side. On NCCL a communicator per pair: a middle stage's receives
    from the stage before and its sends to the next queue on different streams."""

    @property
    def sp_index(self) -> int:
        """This rank's place in the sequence: chunk-major, then Ulysses rank."""
        return self.ring_index * self.plan.ulysses + self.ulysses.rank


