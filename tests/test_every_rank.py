"""Every rank of a world on the device-only stand-in for NCCL (every_rank.py), checked across ranks.

Each case simulates all its ranks in turn (model on `meta` in bf16, `meta:fake` groups: a CPU tensor
in a collective fails, as on NCCL), two transformer calls each, and holds their records against
each other: the same groups made in the same order, the same collectives on each group, every send
received. A case takes 0.5-5 s (24 ranks).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from every_rank import check, simulate

from cocodiff import ParallelConfig, parallelize
from cocodiff.config.levels import parse_levels
from cocodiff.config.plan import parse_plan
from cocodiff.distributed.topology import Topology
from cocodiff.engine.families.sample_inputs import forward_inputs
from cocodiff.models.presets import load_pipeline

META = torch.device("meta")


@functools.cache
def _transformer(model: str) -> torch.nn.Module:
    pipe, _ = load_pipeline(model, seed=0)
    return pipe.transformer.to(device=META, dtype=torch.bfloat16)


def _world(levels: str) -> int:
    return math.prod(size for _, size in parse_levels(levels))


def _calls(model: str, plan: str, levels: str, comm: str = "flat", calls: int = 2, **options):
    """What each rank runs: the model parallelized by `plan` on `levels`, then `calls` transformer calls."""

    def run(_rank: int) -> None:
        transformer = copy.deepcopy(_transformer(model))
        topology = Topology.from_env(levels=parse_levels(levels), device=META)
        parallelize(transformer, ParallelConfig(plan=parse_plan(plan), comm=comm, **options), topology)
        inputs = forward_inputs(transformer, META, torch.bfloat16)
        with torch.no_grad():
            for _ in range(calls):
                transformer(**inputs)

    return run


# (plan, levels, exchange): every plan axis alone and combined, on one node, on nodes that the
# Ulysses groups fill or span, and on nodes of 6 and 8 with Ulysses degrees that divide them.
CASES = [
    ("u2", "node=1,rank=2", "flat"), ("u1r2", "node=1,rank=2", "flat"), ("c2u1", "node=1,rank=2", "flat"),
    ("b2u1", "node=1,rank=2", "flat"), ("p2", "node=2,rank=1", "flat"),
    ("u4", "node=2,rank=2", "tapa"), ("u2r2", "node=2,rank=2", "flat"), ("r2u2", "node=2,rank=2", "tapa"),
    ("c2u2", "node=2,rank=2", "tapa"), ("p2u2", "node=2,rank=2", "flat"), ("c2p2", "node=2,rank=2", "flat"),
    ("u4r2", "node=2,rank=4", "tapa"), ("p2u4", "node=2,rank=4", "tapa"), ("c2b2u2", "node=2,rank=4", "flat"),
    ("u2r3b2", "node=2,rank=6", "tapa"), ("u4r3", "node=2,rank=6", "tapa"), ("r6u4", "node=3,rank=8", "flat"),
]
MODELS = ["tiny-flux", "tiny-sd3", "tiny-qwen-image"]


@pytest.mark.parametrize("plan, levels, comm", CASES)
@pytest.mark.parametrize("model", MODELS)
def test_every_rank_agrees_with_every_other(model, plan, levels, comm):
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)  # something was exchanged, and checked


def test_the_checker_finds_each_kind_of_mismatch():
    """Hand-made faults on 2 ranks, each reported: groups made on one rank only, an all-reduce of
    another shape, a send nobody receives, a CPU tensor (refused by the device-only group)."""

    def faults(rank: int) -> None:
        x = torch.zeros(4, device=META)
        dist.all_reduce(x)
        if rank == 1:
            dist.new_group([0, 1])
        dist.all_reduce(torch.zeros(4 + rank, device=META))
        if rank == 0:
            dist.isend(x, 1)

    problems = check(simulate(2, faults))
    assert any(p.startswith("new_group: rank 1 made 1 groups, rank 0 0") for p in problems), problems
    assert any("rank 1's collectives differ from rank 0's at call 1" in p for p in problems), problems
    assert any(p.startswith("rank 0 sends") and "which receives []" in p for p in problems), problems
    cpu = check(simulate(2, lambda rank: dist.all_reduce(torch.zeros(4))))
    assert cpu == [*(f"rank {r} raised RuntimeError: No backend type associated with device type cpu" for r in (0, 1)),
                   *(f"rank {r} put a tensor on ['cpu']" for r in (0, 1))]
    assert check(simulate(2, lambda rank: dist.all_reduce(torch.zeros(4, device=META)))) == []


@pytest.mark.parametrize("plan, levels, message", [
    ("r3u4", "node=2,rank=6", "lie over the nodes in different ways (node=1,rank=4, node=2,rank=2)"),
    ("r8u3", "node=3,rank=8", "do not fall into equal runs of ranks per node"),
])
def test_a_plan_whose_ulysses_groups_lie_unevenly_is_refused_by_every_rank_first(plan, levels, message):
    """Consecutive Ulysses groups of 4 on nodes of 6 fall on the nodes in different ways from group
    to group (ranks 0-3 in one node, 4-7 over two), and groups of 3 on nodes of 8 straddle them
    unevenly: every rank refuses the plan the same way, before it makes a group of it. (Read from
    its own group only, on 2 x 6 ranks 0-3 and 8-11 made 15 groups and ranks 4-7 27.)"""
    records = simulate(_world(levels), _calls("tiny-flux", plan, levels))
    errors = {r.error for r in records}
    assert len(errors) == 1 and f"UsageError: --plan {plan}: its Ulysses groups {message}" in errors.pop(), errors
    topology_only = simulate(_world(levels), lambda _rank: Topology.from_env(levels=parse_levels(levels), device=META), [0])
    assert {tuple(r.groups) for r in records} == {tuple(topology_only[0].groups)}  # the run's levels' groups, no more


@pytest.mark.parametrize("levels", ["node=3,rank=8", "node=2,rank=6"])
def test_plan_auto_builds_the_same_candidates_and_groups_on_every_rank(levels):
    """`--plan auto`'s candidates and their groups (FLUX's 24 heads, guided), built on every rank:
    the same candidate list and the same `new_group` sequence everywhere."""
    from cocodiff.engine.plan_trials import build_plan_trials

    candidates = {}

    def build(rank: int) -> None:
        topology = Topology.from_env(levels=parse_levels(levels), device=META)
        trials = build_plan_trials(ParallelConfig(plan="auto"), topology, heads=24, guided=True, images=1)
        candidates[rank] = [c.name for c in trials.options]

    records = simulate(_world(levels), build)
    assert check(records) == [] and len({tuple(c) for c in candidates.values()}) == 1, candidates
    assert len(candidates[0]) > 1


def test_stage_hand_ons_travel_on_their_boundary_pairs():
    """Three stages: each boundary's hand-ons on a group of the pair alone (on NCCL a communicator
    each), the output's way back on the column's; nothing on the default group, where the middle
    stage's receives posted ahead from stage 0 would queue in front of its sends to stage 2."""
    records = simulate(3, _calls("tiny-flux", "p3", "node=3,rank=1"))
    assert check(records) == []
    by_pair = {pair: {entry[2] for entry in sends} for r in records for pair, sends in r.sends.items()}
    assert by_pair == {(0, 1): {(0, 1)}, (1, 2): {(1, 2)}, (2, 0): {(0, 1, 2)}, (2, 1): {(0, 1, 2)}}, by_pair
