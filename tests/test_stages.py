"""Pipeline stages (`--plan p2`, `p2u2`, `c2p2`; engine/stages.py): each stage keeps a contiguous range of
the blocks, a call's images pass through the stages one by one, and the result equals one process."""

from __future__ import annotations

import command
import pytest
import torch
from conftest import RANK_TIMEOUT_S, patience
from model_cases import run_case
from test_families import RTOL_OF_SCALE, wan_per_token_timesteps

from cocodiff import ParallelConfig
from cocodiff.engine.stages import stage_ranges
from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn

RUNS_LONG = 2  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


def test_stages_take_contiguous_ranges_with_the_least_largest_cost():
    # FLUX's shape: double-stream blocks weigh about twice a single-stream block.
    assert stage_ranges([2, 2, 1, 1, 1, 1], 2) == [(0, 2), (2, 6)]
    assert stage_ranges([2, 2, 1, 1, 1, 1], 3) == [(0, 1), (1, 3), (3, 6)]
    assert stage_ranges([5, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert stage_ranges([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(UsageError, match="4 pipeline stages but the transformer has 3 blocks"):
        stage_ranges([1, 1, 1], 4)


def test_a_block_costs_the_weights_its_image_tokens_read():
    """FLUX's double-stream block holds the text's weights and two modulations beside the image's;
    per image token it computes as much as a single-stream block (12 d^2 each), and SD3's joint
    block leaves its text weights out likewise."""
    from cocodiff.engine.cache.steps import cache_blocks
    from cocodiff.engine.stages import token_params
    from cocodiff.models.presets import load_pipeline

    flux = cache_blocks(load_pipeline("tiny-flux", seed=0)[0].transformer)
    double, single = flux[0], flux[-1]
    d = double.attn.to_q.in_features
    for block in (double, single):  # 12 d^2 weights, and a few biases of d or 4d values
        assert 12 * d * d <= token_params(block) <= 12 * d * d + 16 * d
    assert sum(p.numel() for p in double.parameters()) > 2 * token_params(double)
    sd3 = cache_blocks(load_pipeline("tiny-sd3", seed=0)[0].transformer)[0]
    text = sum(p.numel() for n, p in sd3.named_parameters() if "context" in n or "add_" in n)
    assert 0 < token_params(sd3) < sum(p.numel() for p in sd3.parameters()) - text


def _staged_case(model: str, plan: str) -> tuple[dict[str, torch.Tensor], int, int]:
    """`run_case` under `plan`, and the blocks this rank kept of how many the transformer has."""
    from cocodiff.engine.cache.steps import cache_blocks
    from cocodiff.models.presets import load_pipeline

    whole = len(cache_blocks(load_pipeline(model, seed=0)[0].transformer))
    kept = {}
    import cocodiff.engine.stages as stages

    original = stages.StageForward.__init__

    def counting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        lists = [c for c in self.transformer.children() if isinstance(c, torch.nn.ModuleList)]
        kept["held"] = sum(1 for blocks in lists for b in blocks if not isinstance(b, stages._Handoff))

    stages.StageForward.__init__ = counting
    try:
        return run_case(model, ParallelConfig(plan=plan)), kept["held"], whole
    finally:
        stages.StageForward.__init__ = original


@pytest.mark.parametrize(("model", "plan", "ranks"), [
    ("tiny-flux", "p2", 2),  # no CFG: a batch of 2 is two micro-batches
    ("tiny-flux", "p2u2", 4),
    ("tiny-sd3", "p2u2", 4),  # CFG in one call: its two branches are two micro-batches
    ("tiny-qwen-image", "p2", 2),  # a text mask per image, split with the batch
])
def test_staged_runs_equal_one_process_and_each_rank_holds_its_stage_only(model, plan, ranks):
    ref = run_case(model, None)
    results = spawn(_staged_case, ranks, model, plan, timeout_s=RANK_TIMEOUT_S)
    held = []
    for rank, (out, kept, whole) in enumerate(results):
        for key in ("forward", "latents", "image"):
            diff = (out[key] - ref[key]).abs().max().item()
            # fp32; per image instead of per batch, and one all-to-all pair per layer: rounding only
            assert diff <= RTOL_OF_SCALE * ref[key].abs().max().item(), f"{model} {plan} rank {rank} {key}: {diff:.3g}"
        held.append(kept)
    stages = 2
    per_stage = [held[rank] for rank in range(0, ranks, ranks // stages)]
    assert all(0 < k < whole for k in held) and sum(per_stage) == whole, (held, whole)


@pytest.mark.parametrize(("model", "plan"), [
    ("tiny-sd3", "c2p2"),  # CFG in one call: each branch through its own pair of stages
    ("tiny-flux", "b2p2"),  # the batch shared, each share through the stages
])
def test_data_groups_each_run_their_share_through_the_stages(model, plan):
    ref = run_case(model, None)
    for rank, out in enumerate(spawn(run_case, 4, model, ParallelConfig(plan=plan), timeout_s=RANK_TIMEOUT_S)):
        for key in ("forward", "latents", "image"):
            diff = (out[key] - ref[key]).abs().max().item()
            assert diff <= RTOL_OF_SCALE * ref[key].abs().max().item(), f"{model} {plan} rank {rank} {key}: {diff:.3g}"


def _micro_batches(batch: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A tiny-flux forward of `batch` images under p2: the images of each micro-batch, the output, and one process's."""
    from model_cases import forward_inputs

    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline

    pipe, _encoder = load_pipeline("tiny-flux", seed=0)
    inputs = forward_inputs("tiny-flux", pipe.transformer)
    inputs = {k: torch.cat([v] * (batch // 2)) if k not in ("img_ids", "txt_ids") else v for k, v in inputs.items()}
    with torch.no_grad():
        ref = pipe.transformer(**inputs, return_dict=False)[0]
    parallel = parallelize(pipe, ParallelConfig(plan="p2"))
    sizes, forward = [], parallel.stages.forward
    parallel.stages.forward = lambda **share: sizes.append(share["hidden_states"].shape[0]) or forward(**share)
    with torch.no_grad():
        out = pipe.transformer(**inputs, return_dict=False)[0]
    return sizes, out, ref


def test_a_large_batch_passes_the_stages_in_a_few_micro_batches():
    """8 images over 2 stages: 4 micro-batches of 2 (two per stage), not 8 forwards of one image."""
    for rank, (sizes, out, ref) in enumerate(spawn(_micro_batches, 2, 8, timeout_s=RANK_TIMEOUT_S)):
        assert sizes == [2, 2, 2, 2], (rank, sizes)
        assert (out - ref).abs().max().item() <= RTOL_OF_SCALE * ref.abs().max().item()


def _receives_of_two_calls() -> tuple[list[str], list[str], torch.Tensor, torch.Tensor]:
    """Two forwards of 2 tiny-flux images under p2: per call, this rank's receives posted ('recv')
    and embedder runs ('embed') in order; the last output and one process's."""
    from model_cases import forward_inputs

    import cocodiff.engine.stages as stages
    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline

    pipe, _encoder = load_pipeline("tiny-flux", seed=0)
    inputs = forward_inputs("tiny-flux", pipe.transformer)  # 2 images
    with torch.no_grad():
        ref = pipe.transformer(**inputs, return_dict=False)[0]
    parallelize(pipe, ParallelConfig(plan="p2"))
    events: list[str] = []
    irecv = stages.dist.irecv
    stages.dist.irecv = lambda *args, **kwargs: events.append("recv") or irecv(*args, **kwargs)
    pipe.transformer.x_embedder.register_forward_pre_hook(lambda *_: events.append("embed"))
    calls = []
    with torch.no_grad():
        for _ in range(2):
            events.clear()
            out = pipe.transformer(**inputs, return_dict=False)[0]
            calls.append(list(events))
    stages.dist.irecv = irecv
    return calls[0], calls[1], out, ref


def test_a_stage_posts_its_receives_as_a_call_begins():
    """From the second call of a shape on, every receive of the call is posted before its first
    embedder runs: stage 1 the 2 micro-batches' two block inputs, stage 0 their 2 outputs."""
    first, second = spawn(_receives_of_two_calls, 2, timeout_s=RANK_TIMEOUT_S)
    for rank, (before, after, out, ref) in enumerate((first, second)):
        assert (out - ref).abs().max().item() <= RTOL_OF_SCALE * ref.abs().max().item(), rank
        ahead = after.index("embed")
        assert before.index("embed") == 0, (rank, before)  # the first call learns the shapes
        assert ahead == (2 if rank == 0 else 4) == after.count("recv"), (rank, before, after)


def _parallelized_twice(plan: str) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """A forward under `plan`, undone, and again on the same (already cut) transformer; with each
    forward, the blocks this rank holds and those gone to `meta`."""
    from model_cases import forward_inputs

    from cocodiff import parallelize
    from cocodiff.engine.stages import _Handoff
    from cocodiff.models.presets import load_pipeline

    def held() -> int:
        blocks = [b for lst in pipe.transformer.children() if isinstance(lst, torch.nn.ModuleList) for b in lst]
        return sum(not isinstance(b, _Handoff) and not all(p.is_meta for p in b.parameters()) for b in blocks)

    pipe, _encoder = load_pipeline("tiny-flux", seed=0)
    outs, cuts, whole = [], [], held()
    for _ in range(2):
        parallel = parallelize(pipe, ParallelConfig(plan=plan))
        with torch.no_grad():
            outs.append(pipe.transformer(**forward_inputs("tiny-flux", pipe.transformer), return_dict=False)[0])
        cuts.append((held(), whole))
        parallel.undo()
    return outs, cuts


def test_a_cut_transformer_parallelized_again_keeps_its_cut():
    """`bench e2e` parallelizes one pipeline once per variant and run: the blocks a stage gave up are gone."""
    from model_cases import forward_inputs

    from cocodiff.models.presets import load_pipeline

    pipe, _encoder = load_pipeline("tiny-flux", seed=0)
    with torch.no_grad():
        ref = pipe.transformer(**forward_inputs("tiny-flux", pipe.transformer), return_dict=False)[0]
    for rank, (outs, cuts) in enumerate(spawn(_parallelized_twice, 4, "p2u2", timeout_s=RANK_TIMEOUT_S)):
        for out in outs:
            diff = (out - ref).abs().max().item()
            assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}: max diff {diff:.3g}"
        held, blocks = cuts[0]
        assert 0 < held < blocks and cuts[1] == cuts[0], f"rank {rank}: held {cuts} blocks of {blocks}"


def test_wan_per_token_timesteps_pass_through_the_stages():
    ref = wan_per_token_timesteps(None)
    for rank, out in enumerate(spawn(wan_per_token_timesteps, 4, ParallelConfig(plan="p2u2"), timeout_s=RANK_TIMEOUT_S)):
        diff = (out - ref).abs().max().item()
        assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}: max diff {diff:.3g}"


def _stage_bytes(stages: int) -> list[int]:
    """Bytes of each stage's parameters of tiny-flux, as `cut_stages` would leave them."""
    from cocodiff.engine.stages import stage_parameters
    from cocodiff.models.presets import load_pipeline

    parts = stage_parameters(load_pipeline("tiny-flux", seed=0)[0].transformer, stages)
    return [sum(p.numel() * p.element_size() for p in part) for part in parts]


def _sharded_stage(plan: str, shard: bool) -> tuple[torch.Tensor, torch.Tensor, int, list[int], int, int]:
    """A tiny-flux forward under `plan` on 2 nodes of 2 ranks (FSDP2 inside each stage with `shard`):
    the output, one process's, the bytes this rank holds, the ranks it shares them with, its stage,
    and the parameters the transformer held when it went to the device."""
    from model_cases import forward_inputs

    from cocodiff import parallelize
    from cocodiff.engine.shard import local_parameter_bytes
    from cocodiff.models.presets import load_pipeline

    pipe, _encoder = load_pipeline("tiny-flux", seed=0)
    inputs = forward_inputs("tiny-flux", pipe.transformer)
    with torch.no_grad():
        ref = pipe.transformer(**inputs, return_dict=False)[0]
    moved, to = [], torch.nn.Module.to

    def recording(module, *args, **kwargs):
        if module is pipe.transformer:
            moved.append(sum(p.numel() for p in module.parameters()))
        return to(module, *args, **kwargs)

    torch.nn.Module.to = recording
    try:
        parallel = parallelize(pipe, ParallelConfig(plan=plan, ranks_per_node=2, shard_weights=shard))
    finally:
        torch.nn.Module.to = to
    with torch.no_grad():
        out = pipe.transformer(**inputs, return_dict=False)[0]
    sharers = parallel.sharded.mesh.mesh.tolist() if parallel.sharded is not None else []
    return out, ref, local_parameter_bytes(pipe.transformer), sharers, parallel.stages.stage, moved[-1] if moved else 0


def test_a_stage_goes_to_the_device_once_cut():
    """Loaded on the host under stages (run/load.py), the transformer goes to the device holding its stage's blocks only."""
    parts = _stage_bytes(2)
    for rank, (out, ref, held, _, stage, moved) in enumerate(spawn(_sharded_stage, 4, "p2u2", False, timeout_s=RANK_TIMEOUT_S)):
        assert (out - ref).abs().max().item() <= RTOL_OF_SCALE * ref.abs().max().item(), rank
        assert moved * 4 == held == parts[stage], (rank, moved, held, parts)  # fp32


def test_a_stages_weights_are_sharded_over_its_ranks_on_a_node():
    """`p2u2 --shard-weights on` on 2 nodes x 2: each stage's blocks over the 2 ranks of its node,
    half the stage's bytes per rank, and the output as one process's."""
    parts = _stage_bytes(2)
    for rank, (out, ref, held, sharers, stage, _) in enumerate(spawn(_sharded_stage, 4, "p2u2", True, timeout_s=RANK_TIMEOUT_S)):
        assert (out - ref).abs().max().item() <= RTOL_OF_SCALE * ref.abs().max().item(), rank
        assert sharers == [2 * stage, 2 * stage + 1], (rank, sharers)
        assert abs(2 * held - parts[stage]) <= 64 * 4, (rank, held, parts)  # FSDP2 pads a row or two


def test_sharing_needs_two_ranks_of_a_stage_on_a_node():
    from cocodiff.config.plan import parse_plan
    from cocodiff.distributed.topology import Topology
    from cocodiff.engine.shard import sharing_rows

    four = Topology(rank=0, world_size=4, ranks_per_node=2, device=torch.device("cpu"))
    assert sharing_rows(four, parse_plan("p2u2")) == [[0, 1], [2, 3]]
    assert sharing_rows(four, parse_plan("u4")) == [[0, 1], [2, 3]]
    assert sharing_rows(four, parse_plan("p4")) == [[0], [1], [2], [3]]
    one_node = Topology(rank=0, world_size=4, ranks_per_node=4, device=torch.device("cpu"))
    assert sharing_rows(one_node, parse_plan("p2u2")) == [[0, 1], [2, 3]]
    assert sharing_rows(one_node, parse_plan("u2p2")) == [[0, 2], [1, 3]]


def test_the_memory_check_counts_the_heaviest_stages_weights():
    """Before the cut, the pre-run check counts what a stage will hold: the other stages' blocks are freed."""
    from cocodiff.footprint.estimate import sharding_frees
    from cocodiff.models.presets import load_pipeline

    pipe = load_pipeline("tiny-flux", seed=0)[0]
    parts = _stage_bytes(2)
    whole = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    assert sharding_frees(pipe, 1, torch.device("cpu")) == 0
    assert sharding_frees(pipe, 1, torch.device("cpu"), stages=2) == whole - max(parts) > 0


def _staged_latents(options: dict) -> tuple[torch.Tensor, int]:
    """tiny-flux's final latents over 4 steps with `options`, and the blocks this rank compiled."""
    from cocodiff.run.jobs import generate_run
    from cocodiff.run.spec import GenerateSpec

    result, parallel, *_ = generate_run(GenerateSpec(model="tiny-flux", steps=4, parallel=ParallelConfig(**options)))
    compiled = parallel.compiled.blocks if parallel is not None and parallel.compiled is not None else []
    trials = (result["exchange"] or {}).get("trial_steps", 0)
    return torch.as_tensor(result["latents"]), len(compiled), trials


@pytest.mark.parametrize("options", [
    {"compile": True},  # each stage's blocks compiled (the eager backend: traced whole, no code generated)
    {"comm": "auto"},  # the trial steps switch the exchange between steps, under the stages
])
def test_stages_take_compile_and_comm_auto(monkeypatch, options):
    from cocodiff.config.env import COMPILE_BACKEND_ENV

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")
    exact = spawn(_staged_latents, 1, {}, timeout_s=RANK_TIMEOUT_S)[0][0]
    for rank, (latents, compiled, trials) in enumerate(spawn(_staged_latents, 4, {"plan": "p2u2", "ranks_per_node": 2, **options},
                                                             timeout_s=RANK_TIMEOUT_S)):
        assert (latents - exact).abs().max().item() <= RTOL_OF_SCALE * exact.abs().max().item(), (rank, options)
        assert compiled == (2 if options.get("compile") else 0), (rank, compiled)  # tiny-flux's 4 blocks, 2 a stage
        # 4 steps: the warm-up, then 2 trial steps timed (a third cut short by the run's end; the
        # matrix's comm auto runs enough steps for every exchange)
        assert trials == (2 if options.get("comm") == "auto" else 0), (rank, trials)


@pytest.mark.parametrize(("plan", "options", "clash"), [
    ("p2u2", {"cache": "fbcache"}, "--cache"),
    ("p2u2", {"v_major": "linear"}, "--v-major"),
])
def test_what_stages_do_not_combine_with_is_refused_in_one_line(plan, options, clash):
    with pytest.raises(UsageError, match="pipeline stages do not combine with") as refused:
        ParallelConfig(plan=plan, **options)
    assert clash in str(refused.value) and "\n" not in str(refused.value)


def test_footprint_counts_the_heaviest_stages_weights_as_a_run_holds_them(tmp_path):
    import json
    import subprocess
    import sys

    def run(*args: str) -> dict:
        out = tmp_path / f"{args[0]}.json"
        command.cocodiff(*args, "--model", "tiny-flux", "--nproc", "2", "--plan", "p2", "--json", str(out),
                         timeout=RANK_TIMEOUT_S).check_returncode()
        return json.loads(out.read_text())

    held = run("generate", "--steps", "1")["transformer_param_bytes"]  # the most any rank holds
    counted = run("footprint")["parts"]["transformer"]
    assert counted == held, (counted, held)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "plan", "nproc"), [
    ("tiny-shapes", ("--plan", "p2"), 2),  # step-level batching
    ("tiny-sd3", ("--plan", "p2"), 2),  # one call per batch
    ("tiny-shapes", ("--plan", "p2u2", "--ranks-per-node", "2", "--shard-weights", "on"), 4),  # FSDP2 in each stage
])
def test_serve_with_stages_answers_the_image_one_process_gives(model, plan, nproc):
    import base64
    import io

    import numpy as np
    from live_server import start_server
    from PIL import Image
    from test_serve_faults import _post

    from cocodiff.models.presets import load_pipeline
    from cocodiff.serve.calls import Call, run_call

    server = start_server("--model", model, *plan, "--steps", "2", "--max-batch", "2", nproc=nproc)
    try:
        answers: dict = {}
        threads = [_post(server, {"prompt": prompt, "size": "64x64", "seed": 3, "response_format": "b64_json",
                                  "request_id": prompt.replace(" ", "-")}, answers)
                   for prompt in ("a red circle", "a blue square")]
        threads.append(_post(server, {"prompt": "x", "size": "64x64", "cache": "fbcache", "request_id": "cached"},
                             answers))
        for thread in threads:
            thread.join(RANK_TIMEOUT_S)
    finally:
        server.stop()
    pipe, _encoder = load_pipeline(model, seed=0)  # as serve loads it (one process, every rank encodes)
    pipe.set_progress_bar_config(disable=True)
    for prompt in ("a red circle", "a blue square"):
        status, body = answers[prompt.replace(" ", "-")]
        assert status == 200, body
        served = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))), dtype=np.int16)
        alone = run_call(pipe, Call(prompts=[prompt], seeds=[3], width=64, height=64, steps=2, guidance=None))[0]
        alone = (alone * 255).round().clip(0, 255).astype(np.int16)
        # exact up to fp32 rounding, which may move a pixel across a level of the PNG's 8 bits
        assert np.abs(served - alone).max() <= 1, prompt
    status, body = answers["cached"]
    assert status == 400 and "pipeline stages" in body["error"]["message"], body


def _faulty_p2_run(tmp_path, monkeypatch, rank: int, target: str) -> tuple[str, str, float]:
    """A 1-step tiny-flux `generate` under p2 (--timeout 5) with `target`'s first call faulty on
    `rank` (test_serve_rank_faults._inject): its last line of stderr, all of it, and its seconds.
    The run must fail."""
    import subprocess
    import sys
    import time

    from test_serve_rank_faults import _inject

    _inject(monkeypatch, tmp_path, rank, 1, target)
    started = time.monotonic()
    run = command.cocodiff("generate", "--model", "tiny-flux", "--nproc", "2", "--plan", "p2", "--steps", "1",
                           "--timeout", "5", "--out", str(tmp_path / "x.png"), timeout=RANK_TIMEOUT_S)
    took = time.monotonic() - started
    assert run.returncode != 0
    return run.stderr.strip().splitlines()[-1], run.stderr, took


@pytest.mark.slow
def test_a_stage_that_hangs_fails_its_peer_in_one_line_naming_the_stage(tmp_path, monkeypatch):
    # Rank 1 (stage 1, FLUX's single-stream blocks) hangs in its first block.
    last, stderr, took = _faulty_p2_run(tmp_path, monkeypatch, 1,
                                        "diffusers.models.transformers.transformer_flux:FluxSingleTransformerBlock:stall")
    assert "stage 0" in last and "rank 1 (stage 1)" in last and "5 s" in last, stderr[-2000:]
    assert took < patience(45), f"the peer's failure took {took:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "target"), [
    (1, "diffusers.models.transformers.transformer_flux:FluxSingleTransformerBlock:kill"),  # stage 1, its blocks
    (0, "diffusers.models.transformers.transformer_flux:FluxTransformerBlock:kill"),  # stage 0, its peer waiting
])
def test_a_killed_stage_ends_the_run_in_one_line_naming_it(tmp_path, monkeypatch, rank, target):
    last, stderr, took = _faulty_p2_run(tmp_path, monkeypatch, rank, target)
    assert f"rank {rank} (stage {rank} of 2) was killed by SIGKILL" in last, stderr[-2000:]
    assert took < patience(45), f"the run took {took:.0f} s to end"


def test_a_stage_reads_only_its_share_of_a_checkpoint(tmp_path):
    """A checkpoint folder under p2: each rank reads from the transformer's safetensors only what its
    stage keeps (models/stage_load.py), holds exactly that, and the run equals one process that
    loaded it whole; the two stages' reads cover the checkpoint, each block once."""
    import json
    import subprocess
    import sys

    from tiny_checkpoint import flux_checkpoint

    from cocodiff.models.presets import load_pipeline

    folder = flux_checkpoint(tmp_path)
    figures = tmp_path / "v.json"
    run = command.cocodiff("verify", "--model", str(folder), "--nproc", "2", "--plan", "p2", "--height", "64",
                           "--width", "64", "--steps", "2", "--json", str(figures), timeout=2 * RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    read = result["stage_load"]
    assert result["ok"] and read["read_bytes"] == result["transformer_param_bytes"] < read["checkpoint_bytes"], result
    kept = []
    for stage in (0, 1):
        record: dict = {}
        transformer = load_pipeline(str(folder), stage=(2, stage), read=record)[0].transformer
        kept.append({name for name, p in transformer.named_parameters() if not p.is_meta})
        assert record["stages"] == 2 and record["read_bytes"] < record["checkpoint_bytes"]
    names = {name for name, _ in transformer.named_parameters()}
    blocks = {name for name in names if name.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    assert kept[0] | kept[1] == names and kept[0] & kept[1] & blocks == set()


def _boundary(options: dict) -> tuple[torch.Tensor, int]:
    """A 2-step tiny-flux run of 2 images under `options`: its latents and the stage boundary's inter-node bytes."""
    from cocodiff.run.jobs import generate_run
    from cocodiff.run.spec import GenerateSpec

    spec = GenerateSpec(model="tiny-flux", steps=2, batch=2, parallel=ParallelConfig(ranks_per_node=2, **options))
    result, *_ = generate_run(spec)
    return torch.as_tensor(result["latents"]), result["bytes_by_axis"]["stage"]["inter_node"]


def test_the_boundary_travels_in_the_wire_format_of_its_link():
    """`--wire node=fp8` under `p2u2` on 2 nodes: the boundary's tensors cross in fp8 (and its scales)."""
    exact = spawn(_boundary, 4, {"plan": "p2u2"}, timeout_s=RANK_TIMEOUT_S)
    packed = spawn(_boundary, 4, {"plan": "p2u2", "wire": "node=fp8"}, timeout_s=RANK_TIMEOUT_S)
    for (latents, sent), (ref, full) in zip(packed, exact):
        assert 0 < sent <= 0.3 * full, (sent, full)  # 1 byte per fp32 value, and a 4-byte scale per token
        rel = (latents - ref).abs().max().item() / ref.abs().max().item()
        assert 1e-4 < rel < 0.05, rel  # rounded on the way, not lost
