"""The command line: generate and verify end to end, bad input, and failing ranks."""

import json
import os
import subprocess
import time

import command
import pytest
from conftest import RANK_TIMEOUT_S, patience

from cocodiff import ParallelConfig, UsageError
from cocodiff.cli import main
from cocodiff.run.launch import RankError, spawn

RUNS_LONG = 5  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


def cocodiff(*args: str, timeout: float = RANK_TIMEOUT_S) -> subprocess.CompletedProcess:
    return command.cocodiff(*args, timeout=timeout)


def test_generate_writes_image_table_and_json(tmp_path):
    out, figures = tmp_path / "img.png", tmp_path / "g.json"
    run = cocodiff("generate", "--steps", "2", "--height", "64", "--width", "48", "--nproc", "4",
                   "--ranks-per-node", "2", "--prompt", "a green star", "--seed", "7",
                   "--out", str(out), "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0
    assert "latency / step" in run.stdout
    assert "a green star" in run.stdout and "7" in run.stdout.split("seed", 1)[1].splitlines()[0]
    result = json.loads(figures.read_text())
    assert (result["prompt"], result["seed"]) == ("a green star", 7)
    assert (result["nproc"], result["nodes"], result["ranks_per_node"]) == (4, 2, 2)
    assert len(result["step_ms"]) == 2 and result["step_ms_median"] > 0
    # 2 ranks per node: a2a traffic crosses both link classes.
    assert result["a2a_same_node_bytes"] > 0 and result["a2a_other_node_bytes"] > 0
    assert 0 < result["comm_wait_share"] < 1
    assert result["peak_bytes"] > 0 and result["estimated_bytes"] > 0  # the largest rank's, measured and expected
    assert "peak memory / rank (measured vs estimate)" in run.stdout


def test_verify_passes_and_reports(tmp_path):
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-sd3", "--steps", "2", "--height", "48", "--width", "80",
                   "--nproc", "3", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["ok"] is True
    assert {"ok", "max_abs_diff", "max_rel_diff", "model", "nproc", "comm"} <= set(result)
    assert (result["model"], result["nproc"], result["comm"]) == ("tiny-sd3", 3, "flat")
    assert 0 <= result["max_rel_diff"] <= result["tolerance"]


def test_verify_past_the_head_count(tmp_path):
    """6 ranks, 5 heads: with no plan, Ulysses 3 inside and ring 2 outside, exact, said in the JSON."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-qwen-image", "--steps", "2", "--height", "48", "--width", "80",
                   "--nproc", "6", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["plan"] == "r2u3"
    assert "6 ranks > 5 heads" in result["plan_description"]


def test_plan_auto_runs_cfg_across_the_nodes(tmp_path):
    """SD3 guides (a batch of 2 per call): `--plan auto` on 2 nodes x 2 starts with its rule's
    plan, the two branches on the two nodes with Ulysses inside each (two steps: the warm-up and
    the first trial step, both the rule's, the second not timed: a step's time is taken when the
    next one starts); exact, and the report says why."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-sd3", "--steps", "2", "--height", "48", "--width", "80",
                   "--nproc", "4", "--ranks-per-node", "2", "--plan", "auto", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["plan"] == "c2u2"
    description = result["plan_description"]
    assert description.startswith("c2u2 (cfg 2 x ulysses 2, outermost first): auto: undecided after 0 trial step(s)")
    assert "this step's plan: auto: CFG 2 (guided)" in description
    axes = result["bytes_by_axis"]  # CFG spans the nodes, Ulysses stays inside each
    assert axes["ulysses"]["inter_node"] == 0 < axes["ulysses"]["intra_node"]
    assert axes["cfg/batch"]["inter_node"] > 0


@pytest.mark.parametrize("model,comm,candidates", [
    ("tiny-sd3", "flat", ["c2u2", "c2b2u1", "u4", "r2u2", "p2u2"]),  # u4 leaves 2 of 6 heads on some ranks: r2u2 evens them
    ("tiny-shapes", "flat", ["c2u2", "c2b2u1", "u4", "p2u2"]),
    ("tiny-flux", "auto", ["u4:flat", "u4:tapa", "b2u2:flat", "b4u1:flat", "p2u2:flat"]),
])
def test_plan_auto_times_its_candidate_plans_on_the_first_steps_and_stays_exact(tmp_path, model, comm, candidates):
    """`--plan auto` on 2 nodes x 2: a warm-up step, then each candidate two steps (three more
    for those within 5% of the best), then the fastest. Guided: CFG x Ulysses, CFG x batch (each
    rank runs the whole step: a call has fewer items than the four groups) and Ulysses over all
    four ranks, and last a pipeline stage per node; SD3 batches its CFG branches, tiny-shapes makes
    two calls per step (paired across the CFG groups). Unguided with `--comm auto`: plans and
    exchanges together, TAPA where the Ulysses group spans the nodes. Switching between steps keeps
    every run exact (32 steps: enough to decide with every candidate confirmed)."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", model, "--steps", "32", "--height", "48", "--width", "80", "--comm", comm,
                   "--nproc", "4", "--ranks-per-node", "2", "--plan", "auto", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    trials = result["plan_trials"]
    confirmed = trials["confirmed"]
    assert result["ok"] is True and trials["trial_steps"] == 2 * len(candidates) + 3 * len(confirmed)
    assert [c["name"] for c in trials["candidates"]] == candidates
    assert all(c["steps"] == (5 if c["name"] in confirmed else 2) for c in trials["candidates"])
    fastest = min(trials["candidates"], key=lambda c: c["step_ms"])
    assert trials["chosen"] == fastest["name"] and fastest["name"].startswith(result["plan"] + (":" if comm == "auto" else ""))
    assert "auto: the fastest of the plans timed on the first steps" in result["plan_description"]
    # The steps really ran under each plan: u4's cross the nodes with Ulysses.
    axes = result["bytes_by_axis"]
    assert axes["ulysses"]["inter_node"] > 0
    if comm == "auto":  # the exchange was chosen with the plan
        assert result["auto_choice"] == trials
    else:  # and the others' with the CFG gather
        assert axes["cfg/batch"]["inter_node"] > 0


def test_comm_auto_times_its_candidates_on_the_first_steps_and_stays_exact(tmp_path):
    """`--comm auto` on 2 nodes x 2: a warm-up step, then flat and TAPA with and without V-First
    two steps each (three more for those within 5% of the best), then the fastest for the rest;
    every step is a real one, so the image is exact."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-flux", "--steps", "22", "--height", "48", "--width", "80",
                   "--nproc", "4", "--ranks-per-node", "2", "--comm", "auto", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    auto = result["auto_choice"]
    confirmed = auto["confirmed"]
    assert result["ok"] is True and auto["trial_steps"] == 8 + 3 * len(confirmed)
    assert [c["name"] for c in auto["candidates"]] == ["flat", "flat+vfirst", "tapa", "tapa+vfirst"]
    assert all(c["steps"] == (5 if c["name"] in confirmed else 2) for c in auto["candidates"])
    fastest = min(auto["candidates"], key=lambda c: c["step_ms"])
    assert auto["chosen"] == fastest["name"]


def test_verify_batch_groups_with_an_uneven_batch(tmp_path):
    """3 images on 2 batch groups (2 and 1) of Ulysses 2, across 2 nodes: exact, every image."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-flux", "--steps", "2", "--height", "48", "--width", "80", "--batch", "3",
                   "--nproc", "4", "--ranks-per-node", "2", "--plan", "b2u2", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["plan"] == "b2u2"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "'no-such-model' is neither a preset"),
        (["--model", "tiny-flux", "--height", "100"], "--height 100 must be a positive multiple of 16"),
        (["--height", "30"], "--height 30 must be a positive multiple of 4"),
        (["--width", "0"], "--width 0 must be a positive multiple of 4"),
        (["--nproc", "0"], "--nproc 0 must be at least 1"),
        (["--nproc", "5", "--plan", "u5"], "--plan u5: Ulysses degree 5 is larger than the 4 attention heads; use ring"),
        (["--model", "tiny-sd3", "--nproc", "8", "--plan", "u8"], "Ulysses degree 8 is larger than the 6 attention heads"),
        (["--plan", "u2r3"], "--plan u2r3: its degrees multiply to 6, not to the 4 ranks"),
        (["--plan", "u4x2"], "--plan 'u4x2' is not a plan"),
        (["--nproc", "6", "--plan", "c3u2"], "cfg=3, but classifier-free guidance has 2 branches"),
        (["--nproc", "4", "--ranks-per-node", "3"], "--ranks-per-node 3 must be at least 1 and divide the 4 ranks"),
        (["--steps", "0"], "--steps 0 must be from 1 to 1000"),
        (["--comm", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
        (["--model", "tiny-flux", "--frames", "9"], "--frames 9: tiny-flux makes images, not videos"),
        (["--model", "tiny-wan", "--frames", "0"], "--frames 0 must be at least 1"),
        (["--model", "tiny-wan", "--frames", "6"], "--frames 6: tiny-wan makes clips of 4k+1 frames (1, 5, 9, ..."),
        (["--model", "tiny-wan", "--height", "40"], "--height 40 must be a positive multiple of 16"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "verify"])
def test_bad_input_is_one_line_and_exit_2(capsys, command, args, message):
    assert exit_status([command, *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def exit_status(argv: list[str]) -> int:
    """What `cocodiff ARGV` exits with: `main`'s return value, or the code argparse exits with inside it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def test_bad_input_from_the_shell_exits_2_without_traceback():
    run = cocodiff("verify", "--height", "30", timeout=patience(60))
    assert run.returncode == 2
    assert run.stderr.strip() == "cocodiff: error: --height 30 must be a positive multiple of 4 (VAE factor x patch size of tiny-shapes)"


def assert_one_line_error(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cocodiff: error: ") and message in lines[0], run.stderr


def test_a_model_folder_without_model_index_is_one_line(tmp_path):
    (tmp_path / "transformer").mkdir()  # parts, but no pipeline index
    run = cocodiff("generate", "--model", str(tmp_path), timeout=patience(60))
    assert_one_line_error(run, f"--model {tmp_path}: the folder has no model_index.json")


def test_a_size_beyond_memory_is_one_line_before_anything_is_allocated(tmp_path):
    run = cocodiff("generate", "--height", "100000", "--width", "100000", "--nproc", "2", "--out", str(tmp_path / "x.png"))
    assert_one_line_error(run, "--height 100000 --width 100000 needs about ")
    assert "available on this machine; use a smaller size" in run.stderr


def test_footprint_passes_default_runs_and_warns_about_hours():
    import torch

    from cocodiff.footprint.estimate import check_footprint, estimate
    from cocodiff.models.presets import load_preset

    pipe = load_preset("tiny-shapes")
    size = {"height": 64, "width": 64, "pixel_multiple": 4, "batch": 1, "device": torch.device("cpu"), "text_tokens": 12}
    assert check_footprint(pipe, steps=20, **size) is None  # the default run: seconds, a few MB
    warning = check_footprint(pipe, steps=10**8, **size)
    assert warning is not None and "64x64, 100000000 steps (256 image tokens) will take about" in warning
    assert len(warning.splitlines()) == 1
    small, large = (estimate(pipe.transformer.config, pipe.vae.config, height=h, width=64, pixel_multiple=4, text_tokens=12)
                    for h in (64, 6400))
    assert (small.image_tokens, large.image_tokens) == (256, 25600)
    assert 90 < large.rank_bytes / small.rank_bytes <= 100  # activations grow with the tokens (no (S, S) scores)
    assert large.flops / small.flops > 100  # attention's work grows with their square


def test_parallel_config_rejects_bad_values():
    with pytest.raises(UsageError, match="--comm 'ring'"):
        ParallelConfig(comm="ring")
    with pytest.raises(UsageError, match="--ranks-per-node 0"):
        ParallelConfig(ranks_per_node=0)


def usage_error_on_every_rank():
    raise UsageError("degree 4 is larger than the 2 heads")


def rank_one_dies():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed")
    dist.barrier()  # the others would wait here forever without the launcher


def test_usage_error_in_ranks_reaches_the_caller():
    with pytest.raises(UsageError, match="degree 4 is larger than the 2 heads"):
        spawn(usage_error_on_every_rank, 2, timeout_s=RANK_TIMEOUT_S)


def test_a_failing_rank_takes_the_others_down():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 failed first(.|\n)*RuntimeError: rank 1 failed"):
        spawn(rank_one_dies, 3, timeout_s=RANK_TIMEOUT_S)
    assert time.monotonic() - start < 60
    children = subprocess.run(["pgrep", "-a", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    ranks = [line for line in children.splitlines() if "spawn_main" in line]  # not the resource tracker
    assert ranks == []


def test_parallelize_rejects_more_ranks_than_heads():
    import torch
    from diffusers import FluxTransformer2DModel

    from cocodiff import Topology, parallelize

    transformer = FluxTransformer2DModel(
        num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, in_channels=4, axes_dims_rope=(2, 2, 4),
    )
    four_ranks = Topology(rank=0, world_size=4, ranks_per_node=4, device=torch.device("cpu"))
    with pytest.raises(UsageError, match="Ulysses degree 4 is larger than the 2 attention heads"):
        parallelize(transformer, ParallelConfig(plan="u4"), topology=four_ranks)


def test_parallelize_rejects_unknown_models():
    import torch

    from cocodiff import Topology, parallelize

    two_ranks = Topology(rank=0, world_size=2, ranks_per_node=2, device=torch.device("cpu"))
    with pytest.raises(UsageError, match=r"^Linear cannot run sequence-parallel: it declares no _cp_plan, .*none can be inferred: it has no list of blocks with attention .*supported: FluxTransformer2DModel"):
        parallelize(torch.nn.Linear(2, 2), topology=two_ranks)


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-shapes", "tiny-qwen-image"])
def test_a_preset_pipeline_makes_several_images_per_prompt(model):
    """`pipe(prompt, num_images_per_prompt=3)` as in diffusers: the preset's encoder gives the
    stock pipeline embeddings, which it does not repeat itself; each image is its own (own noise)."""
    import numpy as np

    from cocodiff.models.presets import load_preset

    pipe = load_preset(model)
    pipe.set_progress_bar_config(disable=True)
    images = pipe("a red circle", num_images_per_prompt=3, num_inference_steps=1, height=32, width=32, output_type="np").images
    assert len(images) == 3 and not np.allclose(images[0], images[1])
