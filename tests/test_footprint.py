"""`cocodiff footprint` (in process: configs on the meta device, no ranks) and the measured peaks in run JSON."""

import json
import subprocess
import sys

import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff.cli import main
from cocodiff.models.catalog import MODELS

FLUX_DEV_PARAMS = 11.9e9
"""FLUX.1-dev's transformer, as published (11.9 B parameters)."""


def footprint(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    path = tmp_path / "fp.json"
    assert main(["footprint", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_flux_dev_on_1_and_8_ranks(tmp_path, capsys):
    one, table = footprint(tmp_path, capsys, "--model", "flux1-dev", "--height", "1024", "--width", "1024", "--nproc", "1")
    eight, _ = footprint(tmp_path, capsys, "--model", "flux1-dev", "--height", "1024", "--width", "1024", "--nproc", "8")
    for figures in (one, eight):
        assert sum(figures["parts"].values()) == figures["per_rank_bytes"]
        # bf16 weights, whole on every rank (the default fits 80 GB): parameters x 2 bytes.
        assert abs(figures["parts"]["transformer"] / (FLUX_DEV_PARAMS * 2) - 1) < 0.05
        assert figures["shard_weights"] == "off" and figures["fits"] is True
        assert {"text_encoder", "text_encoder_2", "vae", "vae_decode", "comm_buffers"} <= set(figures["parts"])
    assert eight["parts"]["activations"] < one["parts"]["activations"] / 4  # Ulysses shares one image's tokens
    assert one["parts"]["comm_buffers"] == 0 < eight["parts"]["comm_buffers"]
    assert (one["plan"], eight["plan"], one["dtype"]) == ("u1", "u8", "bfloat16")
    assert "transformer weights" in table and "11.90 B parameters" in table


def test_shard_weights_on_counts_1_over_n(tmp_path, capsys):
    whole, _ = footprint(tmp_path, capsys, "--model", "flux1-dev", "--nproc", "8", "--shard-weights", "off")
    sharded, table = footprint(tmp_path, capsys, "--model", "flux1-dev", "--nproc", "8", "--shard-weights", "on")
    assert sharded["shard_weights"] == "on" and "weights sharded" in table
    assert sharded["parts"]["transformer"] < whole["parts"]["transformer"] / 4  # 1/8 plus two blocks
    assert sharded["parts"]["text_encoder_2"] == whole["parts"]["text_encoder_2"]  # text encoders stay whole


def test_what_does_not_fit_says_what_would(tmp_path, capsys):
    # FLUX.2-dev whole (64 GB of transformer, 48 GB of Mistral text encoder) on one 80 GB device.
    figures, table = footprint(tmp_path, capsys, "--model", "flux2-dev", "--nproc", "1", "--shard-weights", "off",
                               "--offload-text-encoders", "off", "--device-memory", "80")
    assert figures["fits"] is False and figures["per_rank_bytes"] > 80e9
    alternative = figures["alternative"]  # the cheapest first: the text encoders offloaded on this one rank
    assert alternative["offload_text_encoders"] is True and alternative["per_rank_bytes"] <= 80e9
    assert f"on 1 ranks (u1) with --offload-text-encoders on:" in figures["suggestion"]
    assert "needs" in table
    # On a 64 GB tile one rank cannot hold the 64 GB transformer: sharding it over more ranks is named too.
    figures, _ = footprint(tmp_path, capsys, "--model", "flux2-dev", "--nproc", "1", "--shard-weights", "off",
                           "--offload-text-encoders", "off", "--device-memory", "64")
    alternative = figures["alternative"]
    assert alternative["shard_weights"] is True and alternative["offload_text_encoders"] is True
    assert f"with --shard-weights on --offload-text-encoders on:" in figures["suggestion"]


def test_auto_shards_only_what_does_not_fit(tmp_path, capsys):
    figures, _ = footprint(tmp_path, capsys, "--model", "flux2-dev", "--nproc", "8", "--device-memory", "80",
                           "--offload-text-encoders", "off")
    assert figures["shard_weights"] == "on" and figures["fits"] is True
    # With offloading allowed, the whole transformer fits once the Mistral encoder waits on the host.
    figures, _ = footprint(tmp_path, capsys, "--model", "flux2-dev", "--nproc", "8", "--device-memory", "80")
    assert (figures["shard_weights"], figures["offload_text_encoders"], figures["fits"]) == ("off", "on", True)


def test_a_preset(tmp_path, capsys):
    figures, table = footprint(tmp_path, capsys, "--model", "tiny-flux", "--nproc", "2", "--height", "64", "--width", "64")
    assert {"per_rank_bytes", "parts", "shard_weights", "fits", "device_memory_bytes", "plan", "dtype"} <= set(figures)
    assert figures["dtype"] == "float32" and figures["plan"] == "u2"
    assert sum(figures["parts"].values()) == figures["per_rank_bytes"] > 0
    assert all(isinstance(n, int) for n in figures["parts"].values())
    assert "tiny-flux" in table


def test_a_local_pipeline_folder(tmp_path, capsys):
    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline("tiny-flux")
    pipe.save_pretrained(tmp_path / "pipe")  # configs and weights; footprint reads only the configs
    figures, _ = footprint(tmp_path, capsys, "--model", str(tmp_path / "pipe"), "--nproc", "2", "--height", "64",
                           "--width", "64")
    params = sum(p.numel() for p in pipe.transformer.parameters())
    assert figures["dtype"] == "bfloat16" and figures["parts"]["transformer"] == params * 2
    assert figures["parameters"]["vae"] == sum(p.numel() for p in pipe.vae.parameters())


def test_a_video_checkpoint_counts_its_frames(tmp_path, capsys):
    short, _ = footprint(tmp_path, capsys, "--model", "wan21-14b", "--frames", "5", "--nproc", "16")
    long, _ = footprint(tmp_path, capsys, "--model", "wan21-14b", "--frames", "81", "--nproc", "16")
    assert (long["height"], long["width"]) == (720, 1280)
    assert long["parts"]["activations"] > 10 * short["parts"]["activations"]  # 21 latent frames against 2


@pytest.mark.parametrize("args,message", [
    (["--model", "no-such-model"], "--model 'no-such-model' is not a preset"),
    (["--model", "flux1-dev", "--height", "1000"], "--height 1000 must be a positive multiple of 16"),
    (["--model", "flux1-dev", "--frames", "9"], "--frames 9: flux1-dev makes images"),
    (["--model", "wan21-14b", "--frames", "80"], "--frames 80 must be 4 x k + 1"),
    (["--model", "minimax-h3", "--frames", "125"], "--frames 125 must be 17 x k + 5"),
    (["--model", "flux1-dev", "--nproc", "8", "--plan", "u4"], "--plan u4: its degrees multiply to 4"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["footprint", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cocodiff: error: ") and message in err[0], err


# One run in a process of its own: its resident set as the run starts is the runtime's, whatever
# this process loaded before.
_GENERATE = """
import json, sys
from cocodiff.run.jobs import generate_job
from cocodiff.run.spec import GenerateSpec
result = generate_job(GenerateSpec(steps=1, height=32, width=32))
with open(sys.argv[1], "w") as out:
    json.dump({k: result[k] for k in ("peak_bytes", "estimated_bytes")}, out)
"""


def test_generate_reports_its_peak_and_estimate(tmp_path):
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, "-c", _GENERATE, str(out)], capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["peak_bytes"] > 0 and result["estimated_bytes"] > 0
    assert isinstance(result["peak_bytes"], int) and isinstance(result["estimated_bytes"], int)
    # The run's peak (not the load's) against the estimate with the runtime's resident set as the run starts.
    assert abs(result["estimated_bytes"] / result["peak_bytes"] - 1) < 0.15, (result["peak_bytes"], result["estimated_bytes"])


@pytest.mark.parametrize("model,params,size,frames", [
    # published sizes of the transformers: Wan2.2 TI2V 5B, HunyuanVideo 1.5 8.3B, LTX-Video 2B, Z-Image 6B,
    # MiniMax-H3 33B, LTX-2 19B; Qwen-Image 2.1: its diffusers 0.42.1 defaults' own count (7.1B)
    ("wan22-ti2v-5b", 5.0e9, (704, 1280), 121),
    ("hunyuanvideo15", 8.3e9, (720, 1280), 121),
    ("ltx-video", 1.9e9, (512, 704), 161),
    ("zimage-turbo", 6.15e9, (1024, 1024), 1),
    ("minimax-h3", 33e9, (768, 1344), 124),
    ("ltx2", 19e9, (512, 768), 121),
    ("qwen-image-2.1", 7.1e9, (1024, 1024), 1),
])
def test_the_new_checkpoints_count_their_real_configs(tmp_path, capsys, model, params, size, frames):
    figures, _ = footprint(tmp_path, capsys, "--model", model, "--nproc", "8")
    assert abs(figures["parameters"]["transformer"] / params - 1) < 0.05
    assert (figures["height"], figures["width"], figures["frames"]) == (*size, frames)
    assert figures["parts"]["activations"] > 0 and sum(figures["parts"].values()) == figures["per_rank_bytes"]
    if frames > 1:  # a video's activations grow with its latent frames (the fewest: 1 frame, MiniMax-H3's 5)
        fewest = (MODELS[model].frame_chunk or (1, 1))[1]
        short, _ = footprint(tmp_path, capsys, "--model", model, "--nproc", "8", "--frames", str(fewest))
        assert short["parts"]["activations"] < figures["parts"]["activations"] / 4
