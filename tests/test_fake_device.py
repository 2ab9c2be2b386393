"""CPU stand-ins for a GPU: every family, plan shape and exchange as rank 0 of a larger world.

Two stand-ins, both in this process, on torch's `fake` process group (rank 0 of 2, 8 or 24 ranks;
collectives complete at once and move nothing, so only shapes, devices and arguments matter):

* **NCCL's code path and argument checks**: CPU tensors. The engine takes its non-gloo path
  (`all_to_all_single`, `batch_isend_irecv`), and the fake backend checks each collective's
  arguments as ProcessGroupNCCL does (one split per group rank, ...): a one-rank group passed
  as `group=None` (the whole world) fails here as it would on NCCL.
* **A device**: the model and inputs on `meta`. A tensor made on the CPU that meets them raises,
  as it would on CUDA, and so does any host sync (`.item()`, `float(t)`, `.tolist()`): none may
  happen inside a layer, nor at the transformer's entry: denoising steps come from the step clock
  (engine/steps.py), which reads no tensor. Every plan and exchange on a device, for every rank of
  the world rather than rank 0, is test_every_rank.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cocodiff import ParallelConfig, parallelize
from cocodiff.engine.families.sample_inputs import forward_inputs
from cocodiff.config.levels import parse_levels
from cocodiff.config.plan import parse_plan, trial_plans
from cocodiff.models.presets import PRESETS, load_pipeline
from cocodiff.distributed.topology import Topology

RUNS_LONG = 2  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)

FAMILIES = ["tiny-flux", "tiny-sd3", "tiny-qwen-image"]

# Plans per world size: Ulysses over all, a one-rank Ulysses group with a ring (u1rN), ring outer
# (rNuM) and inner (uMrN), CFG and batch groups (c2uN, bNu1); each within every family's heads (4, 5, 6).
PLANS = {
    2: ["u2", "u1r2", "c2u1", "b2u1"],
    8: ["u2r4", "r2u4", "u1r8", "c2u4", "b8u1", "c2b4u1"],
    24: ["u4r6", "r6u4", "u1r24", "c2u4r3", "b24u1", "c2b3u4"],
}
# Hierarchies for the exchanges that need one: two nodes, and three levels for tapa-full.
LEVELS = {2: "node=2,rank=1", 8: "node=2,card=2,tile=2", 24: "node=2,card=3,tile=4"}
EXCHANGES = [("flat", True), ("flat", False), ("tapa", True), ("tapa-full", True)]


@pytest.fixture
def fake_world(request):
    """A default process group of `request.param` ranks in this process; this process is rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=request.param)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def _inputs(model: str, transformer: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    """Forward arguments for a batch of 2 with 48 image and 7 text tokens (more than 24 ranks)."""
    return forward_inputs(transformer, device, dtype)


def _prepare(model: str, world: int, plan: str, comm: str, v_first: bool, device: str, dtype=torch.float32):
    """A family's transformer on `device`, parallelized by `plan` and `comm`, and its inputs."""
    pipe, _ = load_pipeline(model, seed=0)
    pipe.to(device=device, dtype=dtype)
    levels = parse_levels(LEVELS[world]) if comm != "flat" else None
    topology = Topology.from_env(levels=levels, device=torch.device(device))
    parallelize(pipe.transformer, ParallelConfig(comm=comm, v_first=v_first, plan=parse_plan(plan)), topology)
    return pipe.transformer, _inputs(model, pipe.transformer, torch.device(device), dtype)


def _forward(model: str, world: int, plan: str, comm: str, v_first: bool, device: str, dtype=torch.float32) -> torch.Tensor:
    transformer, inputs = _prepare(model, world, plan, comm, v_first, device, dtype)
    with torch.no_grad():
        out = transformer(**inputs, return_dict=False)[0]
    assert out.device.type == device
    return out


@pytest.mark.parametrize("fake_world", [2, 8, 24], indirect=True)
@pytest.mark.parametrize("model", FAMILIES)
def test_every_plan_and_exchange_on_the_nccl_path(fake_world, model):
    """CPU tensors: the fake backend checks every collective's arguments as NCCL would."""
    for plan in PLANS[fake_world]:
        for comm, v_first in EXCHANGES if fake_world > 2 else EXCHANGES[:2]:
            _forward(model, fake_world, plan, comm, v_first, "cpu")


@pytest.mark.parametrize("fake_world", [8, 24], indirect=True)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_trials_of_plan_auto(fake_world, device):
    """Each plan `--plan auto` may try (with CFG, one and several images), as a fixed plan."""
    heads = PRESETS["tiny-qwen-image"].heads
    plans = {p.short for images in (1, 2) for p in trial_plans(fake_world, heads, fake_world // 2, cfg=True, images=images)}
    assert any(p.ulysses == 1 for p in map(parse_plan, plans))  # the candidates that crashed NCCL once
    for plan in sorted(plans):
        _forward("tiny-qwen-image", fake_world, plan, "flat", True, device)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
@pytest.mark.parametrize("tensors", ["v", "vqk"])
def test_v_major_keeps_its_errors_on_the_device(fake_world, tensors, monkeypatch):
    """V-Major on `meta`: a full step, then a selective one (top-k, indices, caches), no host sync
    but its one read per call at the transformer's entry (the timestep, for its jump test), given
    here from a host copy."""
    from cocodiff.engine import steps

    monkeypatch.setattr(steps, "timestep_value", lambda timestep: 0.7)
    pipe, _ = load_pipeline("tiny-flux", seed=0)
    pipe.to(device="meta", dtype=torch.bfloat16)
    topology = Topology.from_env(levels=parse_levels(LEVELS[8]), device=torch.device("meta"))
    config = ParallelConfig(comm="tapa", v_major="constant:0.5", v_major_tensors=tensors, plan=parse_plan("u4r2"))
    parallel = parallelize(pipe, config, topology)
    pipe.scheduler.set_timesteps(4, device="meta", mu=1.0)
    for step in (0, 1):
        pipe.scheduler._step_index = step
        with torch.no_grad():
            pipe.transformer(**_inputs("tiny-flux", pipe.transformer, torch.device("meta"), torch.bfloat16))
    vmajor = parallel.ctx.vmajor
    assert vmajor.ratios == [0.0, 0.5] and vmajor.errors and all(e.device.type == "meta" for e in vmajor.errors.values())


@pytest.mark.parametrize("fake_world", [2, 8], indirect=True)
@pytest.mark.parametrize("guidance", [None, 4.0])
def test_the_serve_stepper_on_a_device(fake_world, guidance):
    """`serve`'s step loop (FLUX, with and without true CFG) on `meta`: its guidance, CFG scale and
    text ids are made on the latents' device."""
    from cocodiff.serve.stepper import Join, Stepper

    pipe, encoder = load_pipeline("tiny-flux", seed=0)
    pipe.to(device="meta", dtype=torch.bfloat16)
    topology = Topology.from_env(device=torch.device("meta"))
    parallelize(pipe, ParallelConfig(plan=parse_plan("u2" if fake_world == 2 else "u4r2")), topology)
    stepper = Stepper(pipe, decode=False)
    join = Join(prompt="a red circle", seeds=(0,), width=64, height=64, steps=2, guidance=guidance)
    with torch.no_grad():
        assert stepper.step([join]) == []
        assert len(stepper.step([])) == 1


FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=[16, 56, 56])
"""FLUX.1-dev's transformer config (its real widths and all 57 blocks)."""


@pytest.mark.parametrize("fake_world", [24], indirect=True)
@pytest.mark.parametrize("comm", ["flat", "tapa"])
def test_flux_dev_size_step_on_a_device(fake_world, comm):
    """FLUX.1-dev's config (11.9 B parameters, on `meta`: nothing allocated) at 1024x1024 as rank 0
    of 24: one call, no host sync inside any layer; the host time per call is printed (`-s`)."""
    import time

    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FLUX_DEV).to(torch.bfloat16)
    levels = parse_levels("node=3,rank=8") if comm == "tapa" else None
    topology = Topology.from_env(levels=levels, device=torch.device("meta"))
    parallelize(transformer, ParallelConfig(comm=comm, plan=parse_plan("u24")), topology)
    inputs = forward_inputs(transformer, "meta", torch.bfloat16, h=64, w=64, text=512, batch=1)
    start = time.perf_counter()
    with torch.no_grad():
        out = transformer(**inputs, return_dict=False)[0]
    print(f"FLUX.1-dev config, rank 0 of 24, {comm}: {(time.perf_counter() - start) * 1e3:.0f} ms of host time per call")
    assert out.shape == (1, 64 * 64, 64) and out.device.type == "meta"


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_qwen_key_mask_is_built_once_per_forward(fake_world, monkeypatch):
    """Qwen-Image's gathered key mask (a Python loop over ranks x streams) is built at the first
    layer of a call and reused by the others; a new call builds its own."""
    from cocodiff.engine.attention.core import UlyssesContext

    built = []
    original = UlyssesContext._build_key_mask
    monkeypatch.setattr(UlyssesContext, "_build_key_mask", lambda self, *a: built.append(1) or original(self, *a))
    transformer, inputs = _prepare("tiny-qwen-image", 8, "u4r2", "flat", True, "cpu")
    assert len(transformer.transformer_blocks) > 1
    with torch.no_grad():
        transformer(**inputs)
        transformer(**{**inputs, "encoder_hidden_states_mask": inputs["encoder_hidden_states_mask"].clone()})
    assert len(built) == 2


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_comm_auto_decides_without_reading_a_timestep(fake_world, monkeypatch):
    """`--comm auto` marks steps by the step clock (the scheduler's counter; here a bare transformer's
    calls, each a step): its trials run and choose, and no call's timestep is read on the host."""
    from cocodiff.engine import steps

    reads = []
    real = steps.timestep_value
    monkeypatch.setattr(steps, "timestep_value", lambda timestep: reads.append(1) or real(timestep))
    pipe, _ = load_pipeline("tiny-flux", seed=0)
    topology = Topology.from_env(device=torch.device("cpu"))
    parallel = parallelize(pipe.transformer, ParallelConfig(comm="auto"), topology)
    inputs = _inputs("tiny-flux", pipe.transformer, torch.device("cpu"), torch.float32)
    trials = parallel.ctx.exchange.trials
    with torch.no_grad():
        for step in range(40):
            pipe.transformer(**{**inputs, "timestep": torch.full((2,), 1.0 - step / 100)})
            if trials.choice is not None:
                break
    assert trials.choice is not None and reads == []


@pytest.mark.parametrize("fake_world", [24], indirect=True)
def test_groups_only_where_ranks_meet(fake_world, monkeypatch):
    """A plan creates groups only for its axes and levels of more than one rank, each set of ranks
    once (start-up: a store round per group on gloo, a communicator on NCCL). On 3 nodes of 8:
    r3u8 needs its 3 Ulysses groups (each one node, so also its level group) and 8 ring groups; a
    device mesh over every dim made 142."""
    from torch.distributed import distributed_c10d

    created = []
    new_group = distributed_c10d._new_group_with_tag
    monkeypatch.setattr(distributed_c10d, "_new_group_with_tag", lambda *a, **k: created.append(a) or new_group(*a, **k))
    topology = Topology.from_env(ranks_per_node=8, device=torch.device("cpu"))
    assert len(created) == 8 + 3  # the nodes' level (8 groups of 3), the ranks' level (3 of 8)
    created.clear()
    groups = topology.split(parse_plan("r3u8"))
    assert len(created) == 3 + 8
    assert dist.get_process_group_ranks(groups.ulysses.world_group) == list(range(8))
    assert dist.get_process_group_ranks(groups.ring_group) == [0, 8, 16]
    assert groups.ulysses.level_group(0) is None and groups.ulysses.intra_group is groups.ulysses.world_group


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_plan_auto_destroys_the_groups_only_its_losing_candidates_used(fake_world):
    """Once `--plan auto` has chosen, the other candidates' process groups are destroyed (each is a
    communicator on NCCL), never the chosen plan's, the run's levels or the default group. The
    stage candidate's are among them: its stage's group and its output's way back."""
    from cocodiff.engine.plan_trials import process_groups, build_plan_trials
    from cocodiff.models.presets import load_pipeline

    topology = Topology.from_env(ranks_per_node=4, device=torch.device("cpu"))
    transformer = load_pipeline("tiny-flux", seed=0)[0].transformer
    trials = build_plan_trials(ParallelConfig(plan="auto"), topology, heads=4, guided=True, images=1, transformer=transformer)
    names = [c.name for c in trials.options]
    staged = next(groups for c, (groups, _) in trials.options.items() if c.plan.short == "p2u4")
    assert {staged.stage_group, staged.output_group} <= set(process_groups(staged))
    chosen = next(c for c in trials.options if c.plan.short == "c2u4")
    others = [g for c, (groups, _) in trials.options.items() if c != chosen for g in process_groups(groups)]
    trials.trials.choice = chosen
    trials.release_losers()
    trials.release_losers()  # once only
    live = [g for g in others if g in dist.distributed_c10d._world.pg_map]
    assert names[0] == "c2u4" and trials.released == len({id(g) for g in others}) > 0 and live == [], names
    kept = [*process_groups(trials.options[chosen][0]), topology.inter_group, topology.intra_group, dist.group.WORLD]
    assert all(g in dist.distributed_c10d._world.pg_map for g in kept)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("auto", ["plan", "comm"])
def test_trial_steps_are_never_skipped_by_a_step_cache(fake_world, auto, monkeypatch):
    """`--plan auto` / `--comm auto` with a step cache: a fake clock that charges a computed call 1
    and a skipped one 0.1 (the real gap is of that order) reads every trial step as computed, so no
    candidate wins by the cache's skips; once chosen, the cache skips (taylorseer: every other step)."""
    from cocodiff.distributed.comm import auto as comm_auto

    pipe, _ = load_pipeline("tiny-flux", seed=0)
    topology = Topology.from_env(device=torch.device("cpu"))
    plan = "auto" if auto == "plan" else parse_plan("u2")
    parallel = parallelize(pipe.transformer, ParallelConfig(plan=plan, comm="auto" if auto == "comm" else "flat",
                                                            cache="taylorseer:N2W0"), topology)
    cache = parallel.cache
    monkeypatch.setattr(comm_auto, "now", lambda _device: cache.computed_steps + 0.1 * cache.skipped_steps)
    trials = parallel.plan_trials.trials if auto == "plan" else parallel.ctx.exchange.trials
    inputs = _inputs("tiny-flux", pipe.transformer, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for step in range(16):
            pipe.transformer(**{**inputs, "timestep": torch.full((2,), 1.0 - step / 100)})
    samples = [t for times in trials.times.values() for t in times]
    assert trials.choice is not None and len(samples) >= 4 and samples == pytest.approx([1.0] * len(samples)), trials.times
    assert cache.skipped_steps > 0


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-qwen-image"])
def test_every_plan_with_a_step_cache_on_the_nccl_path(fake_world, model, monkeypatch):
    """A step cache under Ulysses, ring (u1r2), CFG (c2u1) and batch (b2u1) plans: computed and
    skipped steps (taylorseer skips every other one, whatever the data) pass the NCCL argument
    checks, and every call makes exactly one agreement all-reduce on the world group, skipped or
    not: the decision is the only collective a skip removes blocks around, never one of its own."""
    from cocodiff.distributed.comm import ulysses as ulysses

    agreements = []
    real = ulysses.all_reduce
    monkeypatch.setattr(ulysses, "all_reduce", lambda t, group, what, **kw: (
        agreements.append(group) if what.startswith("agreement") else None) or real(t, group, what, **kw))
    for plan in PLANS[2]:
        pipe, _ = load_pipeline(model, seed=0)
        topology = Topology.from_env(device=torch.device("cpu"))
        parallel = parallelize(pipe.transformer, ParallelConfig(plan=parse_plan(plan), cache="taylorseer:N2W1"), topology)
        inputs = _inputs(model, pipe.transformer, torch.device("cpu"), torch.float32)
        agreements.clear()
        with torch.no_grad():
            for step in range(5):
                pipe.transformer(**{**inputs, "timestep": torch.full((2,), 1.0 - step / 100)})
        report = parallel.cache.report()
        assert (report["computed_steps"], report["skipped_steps"]) == (3, 2), (plan, report)
        assert agreements == [topology.world_group] * 5, plan
        parallel.undo()
