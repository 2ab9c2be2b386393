"""Sharded weights (`+shard`) in the cost model: the all-gathers of each block's weights.

With `--shard-weights on` (cocodiff/engine/shard.py, FSDP2) the n ranks of a node share the transformer's
weights. Per transformer call the units run in order, u_0 the root (embedders, norms, output
projection: what the repeated blocks leave) and u_1 .. u_B the repeated blocks, with p_i
parameters each (`models.counts.transformer_units`: the checkpoint's config built on `meta`,
or the preset). Each unit's weights are all-gathered over the node's ranks just before it runs:

    gather g_i     every rank sends its shard, p_i x item / n bytes, to the n - 1 others of its
                   node, every node at once (network.gather_matrix, the all-gather the output's
                   gather uses), timed by the same link model and figures: busiest link /
                   bandwidth plus message latencies; without the system's incast term, which
                   is fitted to the all-to-all (the collective library's all-gather is a ring
                   or reads from its peers: one flow into each rank at a time; with it, Aurora's
                   fan-in of 11 would slow each block's gather about 11x)
    received       p_i x item x (n - 1) / n bytes per rank (`shard_gather_bytes`, per step; kept
                   apart from the sequence-parallel exchanges' `intra_node_bytes`)
    exposed        g_0 + max(0, g_1 - c_0) + sum over b = 1 .. B-1 of max(0, g_{b+1} - c_b)

Each unit starts the next one's gather as it begins (forward prefetch), so block b+1's weights
travel while block b computes (c_b); the root's gather waits on nothing and hides nothing, and the
root's own compute c_0 is 0 (the embedders are left out of the workload, workload.py), so the first
block's gather is exposed too. c_b is block b's compute (`model.nominal_compute_s` of its attention
layers, times the compute scale): the spec's layer kinds in order when their counts add up to the
blocks (FLUX.1: 19 double-stream, then 38 single-stream), one layer of every kind per block when each
kind has one per block (Wan, LTX-Video: self- and cross-attention), else the call's compute spread
evenly over the blocks. Not modelled: the gathers sharing the node's links with the exchanges (they
hide under compute only, not under a block's exposed exchanges), FSDP's padding of each parameter
to a multiple of n, wire formats (weights travel in the run's dtype).

With pipeline stages (stages.py) each stage holds the root and its own blocks, shared by its ranks
on one node: every micro-batch (or patch) a stage runs gathers them again, behind that stage's
blocks' compute (the root is counted on every stage, though a stage before the last runs no
output layers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ..errors import UsageError
from .network import gather_matrix, phase_load, routing
from .system import LinkParams, System
from .workload import Workload

__all__ = ["Gathers", "Units", "add_weight_gathers", "block_compute", "sharers", "stage_costs_of", "units_of",
           "weight_gathers"]


@dataclass(frozen=True, slots=True)
class Units:
    """The units one sharded transformer gathers, in the order they run."""

    root: int
    """Parameters of the root unit (gathered first)."""
    blocks: tuple[int, ...]
    """Parameters of each repeated block."""

    @property
    def params(self) -> int:
        return self.root + sum(self.blocks)


@functools.lru_cache(maxsize=None)
def units_of(model: str) -> Units:
    """The units of the simulator's model `model` (torch and diffusers imported here, only for `+shard`)."""
    from ..models.counts import transformer_units

    try:
        root, blocks = transformer_units(model)
    except UsageError as error:
        raise UsageError(f"+shard on {model}: {error}") from None
    return Units(root, blocks)


@functools.lru_cache(maxsize=None)
def stage_costs_of(model: str) -> tuple[int, ...]:
    """Each block's cost per image token in the order the blocks run, by which engine/stages.py cuts
    pipeline stages (torch and diffusers imported here, only for `p` plans)."""
    from ..models.counts import stage_blocks

    return stage_blocks(model)[2]


@dataclass(frozen=True, slots=True)
class Gathers:
    """One transformer call's weight gathers on the slowest rank."""

    received_bytes: float
    """Bytes one rank receives."""
    comm_s: float
    """Every gather's time, none hidden."""
    exposed_s: float
    """What compute does not hide (the module's docstring)."""
    where: str
    """`intra` or `inter`: the bottleneck of the slowest gather (`intra` on every shipped system)."""


def block_compute(layer_s: list[float], counts: list[int], blocks: int) -> list[float]:
    """Seconds of compute of each block from the seconds of one layer of each kind (`counts` layers
    of it per call): the kinds in order when the counts add up to the blocks, every kind in each
    block when each kind has one layer per block, else the whole evenly."""
    if sum(counts) == blocks:
        return [s for s, n in zip(layer_s, counts) for _ in range(n)]
    if all(n == blocks for n in counts):
        return [sum(layer_s)] * blocks
    total = sum(s * n for s, n in zip(layer_s, counts))
    return [total / blocks] * blocks


def sharers(system: System, ranks: list[int] | None = None) -> np.ndarray:
    """(P, P): 1 where two ranks share a copy of the weights: the same node (and both among `ranks`,
    a pipeline stage's; None: every rank)."""
    mask = routing(system).same_node.astype(np.float64)
    if ranks is not None:
        inside = np.zeros(system.ranks)
        inside[list(ranks)] = 1.0
        mask = mask * np.outer(inside, inside)
    return mask


def weight_gathers(units: Units, compute_s: list[float], workload: Workload, system: System, params: LinkParams,
                   ranks: list[int] | None = None) -> Gathers:
    """The gathers of one call: `compute_s[b]` is block b's compute (len(units.blocks) of them);
    `ranks`: the ranks holding these units (a pipeline stage's), each copy shared by those of a node."""
    route = routing(system)
    params = replace(params, incast=None)  # the all-to-all's incast term (see the module's docstring)
    same = sharers(system, ranks)  # (P, P): the gathers stay inside each node (and stage)
    n = int(same.sum(axis=1).max())
    times, received, where = [], 0.0, "intra"
    for p in (units.root, *units.blocks):
        phase = phase_load(route, gather_matrix(system.ranks, p * workload.item_bytes / n) * same)
        t, kind = phase.time(params)
        if not times or t > max(times):
            where = kind
        times.append(t)
        received += float(phase.received.max())
    hiding = [0.0, *compute_s[:-1]]  # unit i's gather flies while unit i - 1 computes; the root's under nothing
    exposed = times[0] + sum(max(0.0, g - c) for g, c in zip(times[1:], hiding))
    return Gathers(received_bytes=received, comm_s=sum(times), exposed_s=exposed, where=where)


def add_weight_gathers(per_call: dict[str, float], workload: Workload, system: System, params: LinkParams,
                       layer_s: list[float]) -> None:
    """Add one call's weight gathers to the cost model's per-call sums (`layer_s`: one layer's
    compute per kind of `workload.model.layers`)."""
    units = units_of(workload.model.name)
    counts = [kind.count for kind in workload.model.layers]
    g = weight_gathers(units, block_compute(layer_s, counts, len(units.blocks)), workload, system, params)
    for key, value in (("exposed", g.exposed_s), (g.where, g.exposed_s), ("comm", g.comm_s),
                       ("shard_exposed", g.exposed_s), ("shard_comm", g.comm_s), ("shard_bytes", g.received_bytes)):
        per_call[key] += value
