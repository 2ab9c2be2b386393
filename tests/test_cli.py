"""The command line: generate and verify end to end, bad input, and failing ranks."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff import ParallelConfig, UsageError
from cocodiff.cli import main
from cocodiff.launch import RankError, spawn


def cocodiff(*args: str, timeout: float = RANK_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cocodiff", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_writes_image_table_and_json(tmp_path):
    out, figures = tmp_path / "img.png", tmp_path / "g.json"
    run = cocodiff("generate", "--steps", "2", "--height", "64", "--width", "48", "--nproc", "4",
                   "--ranks-per-node", "2", "--out", str(out), "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0
    assert "latency / step" in run.stdout
    result = json.loads(figures.read_text())
    assert (result["nproc"], result["nodes"], result["ranks_per_node"]) == (4, 2, 2)
    assert len(result["step_ms"]) == 2 and result["step_ms_median"] > 0
    # 2 ranks per node: a2a traffic crosses both link classes.
    assert result["a2a_same_node_bytes"] > 0 and result["a2a_other_node_bytes"] > 0
    assert 0 < result["comm_wait_share"] < 1


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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "'no-such-model' is neither a preset"),
        (["--model", "tiny-flux", "--height", "100"], "--height 100 must be a positive multiple of 16"),
        (["--height", "30"], "--height 30 must be a positive multiple of 4"),
        (["--width", "0"], "--width 0 must be a positive multiple of 4"),
        (["--nproc", "0"], "--nproc 0 must be at least 1"),
        (["--nproc", "5"], "5 ranks is more than the 4 attention heads of tiny-shapes"),
        (["--model", "tiny-flux", "--nproc", "5"], "5 ranks is more than the 4 attention heads of tiny-flux"),
        (["--model", "tiny-sd3", "--nproc", "7"], "7 ranks is more than the 6 attention heads"),
        (["--nproc", "4", "--ranks-per-node", "3"], "--ranks-per-node 3 must be at least 1 and divide the 4 ranks"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
        (["--comm", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "verify"])
def test_bad_input_is_one_line_and_exit_2(capsys, command, args, message):
    with pytest.raises(SystemExit) if "--comm" in args else _no_raise():
        code = main([command, *args])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_input_from_the_shell_exits_2_without_traceback():
    run = cocodiff("verify", "--height", "30", timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == "cocodiff: error: --height 30 must be a positive multiple of 4 (VAE factor x patch size of tiny-shapes)"


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
        parallelize(transformer, topology=four_ranks)


def test_parallelize_rejects_unknown_models():
    import torch

    from cocodiff import Topology, parallelize

    two_ranks = Topology(rank=0, world_size=2, ranks_per_node=2, device=torch.device("cpu"))
    with pytest.raises(UsageError, match="Linear has no Ulysses plan; supported: FluxTransformer2DModel"):
        parallelize(torch.nn.Linear(2, 2), topology=two_ranks)
