"""Transformer weights sharded over a node's ranks (`--shard-weights on`, FSDP2): exact against the
whole weights, 1/N of the parameter bytes per rank, and clear refusals.

Each rank runs the pipeline twice: first with its whole weights in one process (the reference,
no collective), then parallelized with the weights sharded; both from the same seed.
"""

import json

import pytest
import torch

from conftest import RANK_TIMEOUT_S
from test_cli import assert_one_line_error, cocodiff

from cocodiff.config.parallel import ParallelConfig
from cocodiff.engine.families.pipelines import ANIMATE_PIPELINES, NEEDS_REFERENCE
from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn
from cocodiff.models.presets import PRESETS

RTOL_OF_SCALE = 1e-4  # fp32: sharded attention sums keys in another order than one process (as tests/test_models.py)
HEIGHT, WIDTH = 48, 80  # odd token counts on purpose (3 x 5 latent tokens)


def run_sharded(model: str, config: ParallelConfig) -> dict:
    """The pipeline's output with whole weights (one process) and sharded (all ranks), and the
    bytes of the transformer's parameters this rank holds before and after sharding."""
    from cocodiff import parallelize
    from cocodiff.footprint.estimate import estimated_rank_bytes
    from cocodiff.models.presets import load_pipeline
    from cocodiff.engine.shard import local_parameter_bytes

    pipe, encoder = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)

    video = PRESETS[model].frames is not None

    def one_run() -> torch.Tensor:  # a video at its preset's size and frames (LTX's multiples differ)
        size = {} if video else {"height": HEIGHT, "width": WIDTH}
        out = pipe("a small green star", num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0), **size)
        return out.frames if video else out.images

    size = dict(height=HEIGHT, width=WIDTH, pixel_multiple=16, batch=1, text_tokens=None)
    whole, whole_estimate = local_parameter_bytes(pipe.transformer), estimated_rank_bytes(pipe, encoder, **size)
    reference = one_run()
    parallel = parallelize(pipe, config)
    blocks = parallel.sharded.blocks
    sharded = one_run()
    between = local_parameter_bytes(pipe.transformer)  # after the call: every block resharded
    parallel.undo()  # the weights stay sharded; parallelized again (as `bench e2e` does per variant)
    again = parallelize(pipe, config)
    sharded_again = one_run()
    again.undo()
    largest_block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    return {"reference": reference, "sharded": sharded, "again": sharded_again, "whole_bytes": whole, "sharded_bytes": between,
            "largest_block": largest_block, "ranks": parallel.sharded.ranks,
            "estimates": (whole_estimate, estimated_rank_bytes(pipe, encoder, **size))}


SETUPS = {
    "tiny-flux-2": ("tiny-flux", 2, ParallelConfig(shard_weights="on")),
    "tiny-wan-2": ("tiny-wan", 2, ParallelConfig(shard_weights="on")),
    # 2 nodes x 2: each node shares its weights, TAPA's two phases cross the nodes.
    "tiny-flux-4": ("tiny-flux", 4, ParallelConfig(shard_weights="on", comm="tapa", ranks_per_node=2)),
    "tiny-wan-4": ("tiny-wan", 4, ParallelConfig(shard_weights="on", comm="tapa", ranks_per_node=2)),
    # Every other family, 2 ranks: their embedders and output layers are units of their own too
    # (tiny-flux-kontext is tiny-flux's transformer; the image-to-video presets animate an image: the matrix
    # shards them with one).
    **{f"{m}-2": (m, 2, ParallelConfig(shard_weights="on")) for m in PRESETS
       if m not in ("tiny-flux", "tiny-wan", "tiny-flux-kontext") and PRESETS[m].pipeline not in ANIMATE_PIPELINES
       and PRESETS[m].pipeline not in NEEDS_REFERENCE},  # the matrix's `shard weights` column runs those with an image
}


@pytest.mark.parametrize("setup", [pytest.param(s, marks=[pytest.mark.slow] if s != "tiny-flux-2" else []) for s in SETUPS])
def test_sharded_weights_equal_whole_weights_at_1_over_n_bytes(setup):
    model, nproc, config = SETUPS[setup]
    runs = spawn(run_sharded, nproc, model, config, timeout_s=RANK_TIMEOUT_S * nproc // 2)
    for run in runs:
        scale = run["reference"].abs().max().item()
        assert (run["sharded"] - run["reference"]).abs().max().item() <= RTOL_OF_SCALE * scale
        assert (run["again"] - run["reference"]).abs().max().item() <= RTOL_OF_SCALE * scale
        n = run["ranks"]
        assert n == config.ranks_per_node or n == nproc
        # 1/N of every parameter (FSDP chunks rows as torch.chunk: a few rows more or fewer at most).
        assert run["whole_bytes"] / n * 0.9 <= run["sharded_bytes"] <= run["whole_bytes"] / n * 1.1
        whole_estimate, sharded_estimate = run["estimates"]
        # The estimate counts the shards, not the whole weights, plus two blocks held whole while they run.
        assert sharded_estimate < whole_estimate - (run["whole_bytes"] - run["sharded_bytes"]) + 3 * run["largest_block"]


def test_shard_weights_text_and_refusals():
    assert ParallelConfig(shard_weights="on").shard_weights is True
    assert ParallelConfig(shard_weights="off").shard_weights is False
    assert ParallelConfig(shard_weights="auto").shard_weights == "auto"
    with pytest.raises(UsageError, match="--shard-weights 'half' is not one of auto, on, off"):
        ParallelConfig(shard_weights="half")
    with pytest.raises(UsageError, match="does not combine with --compile"):
        ParallelConfig(shard_weights="on", compile=True)


def test_shard_weights_with_compile_is_one_line_before_any_rank_starts():
    run = cocodiff("verify", "--model", "tiny-flux", "--nproc", "2", "--shard-weights", "on", "--compile")
    assert_one_line_error(run, "--shard-weights on does not combine with --compile")


def run_refused(config: ParallelConfig) -> None:
    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline

    parallelize(load_pipeline("tiny-flux", seed=0)[0], config)


def test_one_rank_per_node_has_no_one_to_share_weights_with():
    with pytest.raises(UsageError, match="--ranks-per-node 1 leaves none to share with"):
        spawn(run_refused, 2, ParallelConfig(shard_weights="on", ranks_per_node=1), timeout_s=RANK_TIMEOUT_S)


def test_shard_variant_grammar():
    from cocodiff.config.variants import parse_variant

    v = parse_variant("u4:tapa+shard+vfirst")
    assert v.shard and v.canonical == "u4:tapa+vfirst+shard" and not parse_variant("tapa+vfirst").shard
    for bad, message in [("tapa+shard+compile", "\\+shard does not combine with \\+compile"),
                         ("diffusers-ulysses+shard", "takes no options|does not combine")]:
        with pytest.raises(UsageError, match=message):
            parse_variant(bad)


@pytest.mark.slow
def test_bench_e2e_times_sharded_and_whole_weights_in_one_run(tmp_path):
    figures = tmp_path / "e2e.json"
    run = cocodiff("bench", "e2e", "--model", "tiny-flux", "--height", "64", "--width", "64", "--nproc", "4",
                   "--ranks-per-node", "2", "--variants", "tapa,tapa+shard", "--steps", "2", "--repeat", "1",
                   "--json", str(figures))
    assert run.returncode == 0, run.stderr
    whole, sharded = (json.loads(figures.read_text())["variants"][k] for k in ("tapa", "tapa+shard"))
    assert not whole["shard_weights"] and sharded["shard_weights"]
    assert sharded["max_abs_diff_vs_first"] == 0.0  # the same weights, gathered: bitwise the same image
    assert sharded["transformer_param_bytes"] * 2 <= whole["transformer_param_bytes"] * 1.01  # 1/2 per rank of a node


@pytest.fixture
def fake_world(request):
    """A default process group of 2 ranks (or the test's `indirect` parameter) in this process
    (torch's `fake` backend); this is rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = getattr(request, "param", 2)
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_shard_on_loads_the_transformer_on_the_host_and_fully_shard_moves_it(fake_world, monkeypatch):
    """`--shard-weights on` never puts the whole transformer on the device: `load` leaves it on the
    host, the rest of the pipeline on the device (`meta` stands in for it: the CPU is both host and
    device); `parallelize` then leaves only DTensor shards on the device.
    FSDP2 takes no `meta` mesh, so the sharding half runs with the CPU as the device."""
    from torch.distributed.tensor import DTensor

    from cocodiff import parallelize
    from cocodiff.run import load
    from cocodiff.run.spec import GenerateSpec
    from cocodiff.distributed.topology import Topology

    meta = torch.device("meta")
    monkeypatch.setattr(load, "bound_device", lambda: meta)
    monkeypatch.setattr(load, "check_footprint", lambda **_: None)  # its figures need a real device
    spec = GenerateSpec(model="tiny-flux", parallel=ParallelConfig(shard_weights="on", ranks_per_node=2))
    pipe, _ = load.load(spec)
    assert {p.device.type for p in pipe.transformer.parameters()} == {"cpu"}
    # The rest on the device; on a GPU `pipe._execution_device`, where latents are made, is then
    # the VAE's (diffusers prefers a component off the CPU, but skips `meta` too: not checked here).
    assert pipe.vae.device == meta

    off = GenerateSpec(model="tiny-flux", parallel=ParallelConfig(shard_weights="off", ranks_per_node=2))
    assert load.load(off)[0].transformer.device == meta  # whole on the device, as before

    pipe.vae.to_empty(device="cpu")  # the device is the CPU from here
    topology = Topology.from_env(2, device=torch.device("cpu"))
    parallel = parallelize(pipe, spec.parallel, topology=topology, time_plans=False)
    assert parallel.weights_sharded
    assert all(isinstance(p, DTensor) and p.device == topology.device for p in pipe.transformer.parameters())
    assert pipe._execution_device == topology.device


@pytest.mark.parametrize("fake_world", [8], indirect=True)
@pytest.mark.parametrize("memory", ["short", "ample"])
def test_shard_auto_decides_before_the_transformer_reaches_the_device(fake_world, monkeypatch, memory):
    """`--shard-weights auto` decides with the transformer still on the host: where the device's
    (faked) free memory holds the activations only beside sharded weights, the transformer never
    reaches the device (`meta` stands in for it, as above) and waits there for `parallelize`;
    with ample memory it goes to the device whole, as before. 8 ranks: sharding the preset's few
    blocks over 2 would keep as much as the whole."""
    from cocodiff.footprint import estimate as fp
    from cocodiff.run import load
    from cocodiff.run.spec import GenerateSpec
    from cocodiff.engine.offload import text_tokens
    from cocodiff.models.presets import load_pipeline

    meta = torch.device("meta")
    monkeypatch.setattr(load, "bound_device", lambda: meta)
    monkeypatch.setattr(load, "check_footprint", lambda **_: None)  # its figures need a real device
    monkeypatch.setattr(fp, "agreed", lambda value, *_: value)  # fake collectives move nothing; `meta` holds no value
    spec = GenerateSpec(model="tiny-flux", parallel=ParallelConfig(shard_weights="auto", ranks_per_node=8,
                                                                          offload_text_encoders="off"))
    host, encoder = load_pipeline("tiny-flux")  # the same pipeline on the host: the figures the decision sees
    size = dict(height=spec.height, width=spec.width, pixel_multiple=load.pixel_multiple(spec.model), batch=spec.batch,
                steps=spec.steps, device=meta, text_tokens=text_tokens(encoder))
    needed = fp._memory_needs(host, **size)[1]
    kept = -fp.sharding_frees(host, 8, meta)  # the shard and two blocks whole, brought from the host
    free = needed + kept if memory == "short" else 10**15  # short: the activations fit only beside the shard
    monkeypatch.setattr(fp, "available_bytes", lambda device: free)

    pipe, _ = load.load(spec)
    assert spec.parallel.shard_weights is (memory == "short")
    transformer_on = {p.device.type for p in pipe.transformer.parameters()}
    assert transformer_on == ({"cpu"} if memory == "short" else {"meta"})  # never on the device when sharded
    assert pipe.vae.device == meta


def test_sharding_brings_weights_that_wait_on_the_host():
    """The pre-run check's room: sharding frees the whole transformer's bytes less the shard and two
    blocks where it is on the device, and brings those where it waits on the host (`--shard-weights on`);
    kept whole (1 rank), it frees nothing where it is on the device and brings it all from the host."""
    from cocodiff.engine.families import family_of
    from cocodiff.footprint.estimate import sharding_frees
    from cocodiff.distributed.memory import weight_bytes
    from cocodiff.models.presets import load_pipeline
    from cocodiff.engine.shard import repeated_blocks

    pipe = load_pipeline("tiny-flux", seed=0)[0]
    whole = weight_bytes(pipe.transformer)
    largest = max(weight_bytes(b) for b in repeated_blocks(pipe.transformer, family_of(pipe.transformer)))
    kept = whole // 8 + 2 * largest  # 8 ranks: less than the whole, even at the preset's few blocks
    assert 0 < kept < whole
    assert sharding_frees(pipe, 8, torch.device("cpu")) == whole - kept  # on the device (the CPU): whole
    assert sharding_frees(pipe, 8, torch.device("meta")) == -kept  # on the host, not the device
    assert sharding_frees(pipe, 1, torch.device("cpu")) == 0  # whole, where it already is
    assert sharding_frees(pipe, 1, torch.device("meta")) == -whole  # whole, from the host (`auto` kept it off)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_the_weights_mesh_makes_only_the_groups_that_share_them(fake_world, monkeypatch):
    """2 nodes x 4 ranks: one group per node, whose ranks share the weights, and no group of the
    copies across the nodes, which nothing uses; the group is released with the run's."""
    import torch.distributed as dist

    from cocodiff.distributed.topology import Topology
    from cocodiff.engine.shard import ShardedWeights, sharing_mesh

    topology = Topology.from_env(ranks_per_node=4, device=torch.device("meta"))
    made: list[list[int]] = []
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append(sorted(ranks)) or new_group(ranks, **kw))
    before = len(dist.distributed_c10d._world.pg_map)
    mesh = sharing_mesh(topology, None)
    assert made == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(dist.distributed_c10d._world.pg_map) - before == 1  # this rank's row (the other is not its group)
    assert mesh.mesh.tolist() == [0, 1, 2, 3] and mesh.mesh_dim_names == ("shard",)
    assert ShardedWeights(mesh, [], made=True).made
