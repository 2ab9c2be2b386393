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

__all__ = ["Topology", "default_device", "backend_for"]


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


@dataclass(frozen=True)
class Topology:
    """This rank's place in the cluster, and the process groups built from it."""

    rank: int
    world_size: int
    ranks_per_node: int
    device: torch.device
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """2-D mesh (nodes, ranks_per_node) named ("inter", "intra"); None for one process."""

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
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if self.world_size > 1 else None

    @property
    def intra_group(self) -> dist.ProcessGroup | None:
        """The ranks of this node."""
        return self.mesh.get_group("intra") if self.mesh is not None else None

    @property
    def inter_group(self) -> dist.ProcessGroup | None:
        """The ranks with this rank's local index, one per node."""
        return self.mesh.get_group("inter") if self.mesh is not None else None

    def describe(self) -> str:
        return f"{self.world_size} ranks = {self.nodes} node(s) x {self.ranks_per_node} ({self.device.type})"
