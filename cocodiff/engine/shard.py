"""Transformer weights sharded across a node's ranks for inference, with torch's FSDP2.

Each rank of a node keeps 1/N of every repeated block's parameters (and of the transformer's own,
its embedders and output projection). A block's parameters are all-gathered just before it runs
and freed right after (`reshard_after_forward=True`); the next block's all-gather is issued as the
current block starts (forward prefetch), so it travels while the current block computes:

    per rank    P / N  +  the running block  +  the block being gathered

The weights are shared inside a node only (the mesh's inner dim: the node's ranks, the fast
links); every node holds a whole copy. Under pipeline stages (`--plan p2u2`, engine/stages.py) a
rank holds its stage's blocks only, and shares them with the ranks of its node in its stage: every
stage's blocks are held once per node that runs the stage. The sequence-parallel hooks, processors and exchanges of
`engine/parallelize.py` are untouched: FSDP2 adds its own hooks around each block and the root (its root
pre-forward runs first, its post-forward last), and a block's forward sees plain, whole tensors.

The whole transformer is never on the device. With `--shard-weights on`, every rank loads it on
the host (run.load; the rest of the pipeline goes to the device), and `fully_shard` moves each
unit's parameters to the mesh's device and shards them there, one unit at a time (FSDP2's
`_move_states_to_device`, then its sharded copy): the device holds the shards so far plus one
unit whole, the host copy of each unit is freed as it goes. Every rank loading its own host copy
is the simplest correct design: no rank waits on another's reads, nothing is broadcast, the
weights are the same bits on every rank (the same checkpoint, or the same seed), and a GPU
node's host memory holds a transformer per rank (8 x 64 GB for FLUX.2-dev, until each is
sharded). Loading on rank 0 alone (`meta` elsewhere, then `set_model_state_dict(...,
broadcast_from_rank0=True)`) would trade that host memory for a broadcast of every weight.
Nothing between the load and `shard_weights` reads the transformer's device: the pipeline's
`_execution_device` (where latents are made) is the device of its first component not on the
CPU, the VAE, until the transformer arrives there. `--shard-weights auto` loads it on the host
too and decides from its sizes there: the transformer goes to the device whole only when kept whole.

Sharding is not undone: `Parallelized.undo()` leaves the weights sharded. A sharded transformer
still computes the same output when every rank of the mesh runs it, never on one rank alone
(verify rebuilds its one-process reference from the checkpoint: run/jobs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    AllGather,
    DefaultAllocMixin,
)
from torch.distributed.tensor import DTensor

from ..config.plan import Plan
from ..distributed.memory import tensor_bytes
from ..distributed.topology import Topology
from ..errors import UsageError
from .families import Family, class_name, repeated_block_names

__all__ = ["BroadcastAllGather", "ShardedWeights", "is_sharded", "local_parameter_bytes", "repeated_blocks", "shard_weights",
           "sharing_mesh", "sharing_rows"]


@dataclass
class ShardedWeights:
    """What `shard_weights` did: the mesh the weights are shared on and the blocks wrapped."""

    mesh: DeviceMesh
    """1-D: the ranks of this rank's node, which share the weights."""
    blocks: list[torch.nn.Module]
    """The repeated blocks, each its own FSDP unit, in the order they run."""
    made: bool = False
    """The mesh's group was made for these weights (not a sharding found in place): the run's
    owner destroys it with the run's other groups (`Parallelized.release_groups`)."""

    @property
    def ranks(self) -> int:
        return self.mesh.size()

    def describe(self) -> str:
        return f"{len(self.blocks)} blocks + root sharded over {self.ranks} ranks of a node (FSDP2)"


def repeated_blocks(transformer: torch.nn.Module, family: Family) -> list[torch.nn.Module]:
    """The transformer's repeated blocks in module order (the order they run): the family's
    repeated block names (`repeated_block_names`)."""
    names = repeated_block_names(transformer, family)
    return [m for m in transformer.modules() if class_name(m) in names]


def is_sharded(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def sharing_rows(topology: Topology, plan: Plan | None) -> list[list[int]]:
    """The sets of ranks that share one copy of the weights: the ranks of one node in one pipeline
    stage (every rank of a node without stages), each in rank order."""
    stride, stages = 1, 1
    if plan is not None and plan.pipe > 1:  # the plan's axes lie over the ranks outermost first
        names = [axis for axis, _ in plan.mesh_dims]
        stride, stages = math.prod(degree for _, degree in plan.mesh_dims[names.index("pipe") + 1 :]), plan.pipe
    rows: dict[tuple[int, int], list[int]] = {}
    for rank in range(topology.world_size):
        rows.setdefault((topology.node_of(rank), rank // stride % stages), []).append(rank)
    return list(rows.values())


def sharing_mesh(topology: Topology, plan: Plan | None) -> DeviceMesh:
    """This rank's 1-D mesh of the ranks it shares the weights with (a collective: every rank builds
    every row's group, in the same order): one row per node (and pipeline stage), `sharing_rows`.
    Only these groups: a 2-D mesh would also make a group per column (the copies across nodes),
    which nothing uses."""
    rows = sharing_rows(topology, plan)
    if len({len(row) for row in rows}) > 1 or len(rows[0]) < 2:  # only with stages: a node's ranks are 2 or more
        fewest = min(len(row) for row in rows)
        raise UsageError(f"--shard-weights on with --plan {plan.short}: a pipeline stage shares its weights among its ranks "
                         f"on one node, and some stage has {fewest} on a node; at least 2 on every node are needed "
                         f"(fewer stages, or more ranks per node)")
    mine: tuple[Any, list[int]] | None = None
    for row in rows:
        group = dist.new_group(row)
        if topology.rank in row:
            mine = (group, row)
    assert mine is not None
    return DeviceMesh.from_group(mine[0], topology.device.type, mesh=torch.tensor(mine[1]), mesh_dim_names=("shard",))


def shard_weights(transformer: torch.nn.Module, family: Family, topology: Topology, plan: Plan | None = None) -> ShardedWeights:
    """Shard `transformer`'s parameters over the ranks of each node (of each node in each pipeline
    stage of `plan`; a collective: every rank calls it).

    Each repeated block becomes an FSDP unit, then the root takes what is left (embedders, norms,
    `proj_out`). Already sharded (a second `parallelize` of the same pipeline): left as it is.
    """
    if topology.ranks_per_node < 2:
        raise UsageError(
            f"--shard-weights on shares the weights among a node's ranks; --ranks-per-node {topology.ranks_per_node} leaves none to share with"
        )
    blocks = repeated_blocks(transformer, family)
    if not blocks:
        raise UsageError(f"--shard-weights on: {type(transformer).__name__} names no repeated blocks to shard one by one")
    if is_sharded(transformer):
        return ShardedWeights(next(p for p in transformer.parameters() if isinstance(p, DTensor)).device_mesh, blocks)
    dtypes = {p.dtype for p in transformer.parameters()}
    if len(dtypes) > 1:  # one all-gather per unit packs one dtype
        raise UsageError(f"--shard-weights on needs one parameter dtype; {type(transformer).__name__} has {sorted(map(str, dtypes))}")
    mesh = sharing_mesh(topology, plan)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    edges = _edge_parts(transformer, blocks)
    for part in edges:  # gathered only while each runs, not for the whole call
        fully_shard(part, mesh=mesh, reshard_after_forward=True)
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True)  # what is left: the root frees it after the call
    units: list[FSDPModule] = [transformer, *blocks]  # type: ignore[list-item]
    for unit, following in zip(units, units[1:]):  # each unit starts the next one's all-gather
        unit.set_modules_to_forward_prefetch([following])
    # A unit's all-gather buffer is freed right after its copy-out, before the next unit's
    # all-gather starts (the explicit prefetch above keeps the overlap). FSDP2's default keeps it
    # until the next unit's copy-out: three blocks' worth at the peak instead of two.
    transformer._set_unshard_async_op(True)
    if topology.device.type == "cpu":  # gloo gathers into a flat copy of its own: one more block's worth
        for unit in [*units, *edges]:
            unit.set_custom_all_gather(BroadcastAllGather())
    return ShardedWeights(mesh, blocks, made=True)


class _Works(dist.Work):
    """Several collectives' works waited on as one."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        return True


class BroadcastAllGather(DefaultAllocMixin, AllGather):
    """FSDP2's all-gather as one broadcast per rank, each straight into that rank's rows of FSDP's
    buffer (gloo's all-gather fills a flat buffer of its own, then copies it out)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        rows = output_tensor.view(group.size(), -1)
        mine = rows[group.rank()]  # FSDP copies this rank's shard there already; anything else is copied in
        if input_tensor._base is not output_tensor or input_tensor.storage_offset() != mine.storage_offset():
            mine.copy_(input_tensor.view(-1))
        works = [dist.broadcast(row, group_src=r, group=group, async_op=True) for r, row in enumerate(rows)]
        if async_op:
            return _Works(works)
        for work in works:
            work.wait()
        return None


def _edge_parts(transformer: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The transformer's children with parameters outside its blocks (embedders, output norm and
    projection): each its own unit, gathered only while it runs."""
    inside = {id(m) for block in blocks for m in block.modules()}
    parts, children = [], list(transformer.children())
    while children:
        child = children.pop(0)
        if id(child) in inside or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)) or any(id(m) in inside for m in child.modules()):
            children[:0] = child.children()  # a container runs no forward of its own: its members do
        else:
            parts.append(child)
    return parts


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters held by this rank: a sharded parameter's local shard."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += tensor_bytes(local)
    return total
