"""Where each rank sits: nodes, ranks per node, and the process groups that follow from them.

One `Topology` is built once per process, after `torch.distributed` is initialized, and passed
to whatever needs it. Ranks are numbered node-major, as torchrun numbers them: rank r lives on
node r // ranks_per_node at local index r % ranks_per_node.

    intra-node groups: the ranks of one node                 (fast links: NVLink, Xe Link, loopback)
    inter-node groups: the ranks with the same local index    (one rail each, slow links)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import UsageError
from .lifetime import DEFAULT_TIMEOUT_S
from .plan import Plan, equal_runs

__all__ = ["PlanGroups", "Topology", "default_device", "backend_for", "peer_timeout_s"]


def default_device(local_rank: int = 0) -> torch.device:
    """The accelerator this rank should use, or the CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", local_rank % torch.xpu.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective library for a device: NCCL on NVIDIA, XCCL on Intel, gloo on CPU."""
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")



def peer_timeout_s() -> float:
    """The longest a rank waits on a peer: the default process group's timeout.

    `launch.init_distributed` sets it from `--timeout`; every wait on a peer (collectives and the
    exchanges' point-to-point messages, on any group) is bounded by it.
    """
    if dist.is_initialized():
        world = dist.group.WORLD
        for device in world._device_types:
            try:
                return world._get_backend(device).options._timeout.total_seconds()
            except (AttributeError, RuntimeError):  # a backend that does not say: the default
                continue
    return DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class Topology:
    """This rank's place in the cluster, and the process groups built from it."""

    rank: int
    world_size: int
    ranks_per_node: int
    device: torch.device
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """2-D mesh (nodes, ranks_per_node) named ("inter", "intra"); None for one process."""
    members: tuple[int, ...] | None = None
    """Global ranks of this topology's ranks, for a group of a plan (None: every rank, in order).
    `rank`, `world_size` and the node numbers then count within the group."""
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """The group's process group, with `members` (None: the default group)."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise UsageError(
                f"--ranks-per-node {self.ranks_per_node} must divide the world size {self.world_size}"
            )

    @classmethod
    def single(cls, device: torch.device | None = None) -> Topology:
        """One process, no groups: the reference run."""
        return cls(rank=0, world_size=1, ranks_per_node=1, device=device or default_device())

    @classmethod
    def from_env(cls, ranks_per_node: int | None = None, device: torch.device | None = None) -> Topology:
        """Build from an initialized default process group and the launcher's environment.

        `ranks_per_node` overrides torchrun's `LOCAL_WORLD_SIZE`, e.g. to treat the ranks on one
        machine as several emulated nodes.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call cocodiff.launch.init_distributed first")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise UsageError(f"--ranks-per-node {ranks_per_node} must divide the world size {world_size}")
        device = device or default_device(rank % ranks_per_node)
        mesh = init_device_mesh(
            device.type,
            (world_size // ranks_per_node, ranks_per_node),
            mesh_dim_names=("inter", "intra"),
        )
        return cls(rank=rank, world_size=world_size, ranks_per_node=ranks_per_node, device=device, mesh=mesh)

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
        """Every rank of this topology (the default group, or a plan's group)."""
        if self.world_size == 1:
            return None
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def intra_group(self) -> dist.ProcessGroup | None:
        """The ranks of this node."""
        return self.mesh.get_group("intra") if self.mesh is not None else None

    @property
    def inter_group(self) -> dist.ProcessGroup | None:
        """The ranks with this rank's local index, one per node."""
        return self.mesh.get_group("inter") if self.mesh is not None else None

    def split(self, plan: Plan) -> PlanGroups:
        """This rank's groups under `plan` (a collective call: every rank builds every group).

        The plan's axes lie over the node-major ranks outermost first (see plan.py). The Ulysses
        group becomes a topology of its own, with its members' node layout, so the exchanges
        (TAPA included) run inside it unchanged; the ring is the ranks that share this rank's
        Ulysses index across the sequence chunks; the data group is the ranks at this rank's
        place in the sequence across the CFG branches and batch shares (CFG-major).
        """
        plan.check(self.world_size)
        if plan.sp == self.world_size and plan.ring == 1:
            return PlanGroups(plan, self, None, (self.rank,), 0)
        names = tuple(axis for axis, _ in plan.mesh_dims)
        grid = torch.arange(self.world_size).reshape([degree for _, degree in plan.mesh_dims])
        mesh = DeviceMesh(self.device.type, grid, mesh_dim_names=names)
        here = [int(c) for c in (grid == self.rank).nonzero()[0]]

        def along(axis: str) -> tuple[int, ...]:
            i = names.index(axis)
            return tuple(int(grid[(*here[:i], j, *here[i + 1 :])]) for j in range(grid.shape[i]))

        ulysses, ring = along("ulysses"), along("ring")
        data, data_group = _data_groups(grid, names, here, plan)
        per_node = _members_per_node([self.node_of(m) for m in ulysses], plan)
        # The Ulysses axis split in two (its members on other nodes, its members on this node)
        # gives the groups TAPA needs inside the Ulysses group.
        at = names.index("ulysses")
        shape = [*grid.shape[:at], plan.ulysses // per_node, per_node, *grid.shape[at + 1 :]]
        split_names = (*names[:at], "inter", "intra", *names[at + 1 :])
        view_mesh = DeviceMesh(self.device.type, grid.reshape(shape), mesh_dim_names=split_names)
        view = Topology(
            rank=ulysses.index(self.rank), world_size=plan.ulysses, ranks_per_node=per_node, device=self.device,
            mesh=view_mesh, members=ulysses, group=mesh.get_group("ulysses") if plan.ulysses > 1 else None,
        )
        return PlanGroups(
            plan, view, mesh.get_group("ring") if plan.ring > 1 else None, ring, ring.index(self.rank),
            data_group, data, data.index(self.rank),
        )

    def describe(self) -> str:
        return f"{self.world_size} ranks = {self.nodes} node(s) x {self.ranks_per_node} ({self.device.type})"


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


def _members_per_node(nodes: list[int], plan: Plan) -> int:
    """Members per node of a group whose members live on `nodes` (in group order)."""
    per_node = equal_runs(nodes)
    if per_node is None:
        raise UsageError(f"--plan {plan.short}: its Ulysses groups do not fall into equal runs of ranks per node")
    return per_node


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

    @property
    def sp_index(self) -> int:
        """This rank's place in the sequence: chunk-major, then Ulysses rank."""
        return self.ring_index * self.plan.ulysses + self.ulysses.rank
