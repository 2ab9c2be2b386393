"""`--offload-text-encoders` (engine/offload.py) and footprint's memory flags, in process: where the encoders live,
that what they compute is unchanged, and footprint's figures for the issue's targets."""

import json
from types import SimpleNamespace

import pytest
import torch

from cocodiff.footprint import estimate as fp
from cocodiff.cli import main
from cocodiff.errors import UsageError
from cocodiff.distributed.memory import weight_bytes
from cocodiff.engine.offload import place_text_encoders, text_encoders, text_tokens
from cocodiff.models.presets import load_pipeline
from cocodiff.run.pipeline import run_pipeline
from cocodiff.run.load import load
from cocodiff.run.spec import GenerateSpec
from cocodiff.config.parallel import ParallelConfig

CPU = torch.device("cpu")


def test_other_ranks_free_their_text_encoders():
    pipe, encoder = load_pipeline("tiny-flux")
    tokens = text_tokens(encoder)
    own = torch.nn.Linear(8, 8)  # a checkpoint's text encoder: a pipeline component
    stand_in = SimpleNamespace(components={"text_encoder": own, "vae": pipe.vae}, text_encoder=own, vae=pipe.vae)
    placed = place_text_encoders(stand_in, encoder, CPU, offload=True, encodes=False)
    assert placed.names == ("text_encoder", "prompt_encoder") and placed.describe() == "text encoders freed"
    assert stand_in.text_encoder is None  # never loaded to the device, never called (encode_once)
    assert all(p.device.type == "meta" for p in encoder.parameters()) and weight_bytes(encoder) == 0
    assert text_tokens(encoder) == tokens  # known from before its weights went


def test_the_encoding_rank_streams_them_and_computes_the_same():
    pipe, encoder = load_pipeline("tiny-flux")
    prompts = ["a red circle above a blue square", ""]
    before = [t.clone() for t in encoder(prompts) if isinstance(t, torch.Tensor)]
    placed = place_text_encoders(pipe, encoder, CPU, offload=True, encodes=True)
    assert placed.describe().startswith("text encoders on the host")
    hooked = [m for m in encoder.modules() if getattr(m, "_diffusers_hook", None) is not None]
    assert hooked  # diffusers' group offloading: each leaf moved to the device as it runs
    assert all(p.device == CPU for p in encoder.parameters())  # between calls, on the host
    after = [t for t in encoder(prompts) if isinstance(t, torch.Tensor)]
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))  # bit for bit


def test_a_run_with_offloaded_encoders_is_exact():
    def latents(offload: str) -> torch.Tensor:
        spec = GenerateSpec(model="tiny-flux", steps=2, height=64, width=64,
                            parallel=ParallelConfig(offload_text_encoders=offload))
        pipe, encoder = load(spec)
        assert spec.parallel.offload_text_encoders is (offload == "on")
        assert text_encoders(pipe, encoder)  # one rank: it encodes, so it keeps them
        return run_pipeline(spec, pipe, encoder, None, decode=False)["latents"]

    assert torch.equal(latents("on"), latents("off"))


def test_auto_offloads_only_when_memory_is_short(monkeypatch):
    def needs(free: float):
        return lambda *a, **k: (None, 100, free, 1)

    args = dict(pipe=None, height=64, width=64, pixel_multiple=16, batch=1, steps=1, shard_ranks=1)
    monkeypatch.setattr(fp, "_memory_needs", needs(1000.0))
    assert not fp.wants_offload(**args, device=torch.device("cuda"), encoder_bytes=500)  # 100 + 500 fit in 1000
    assert fp.wants_offload(**args, device=torch.device("cuda"), encoder_bytes=950)  # they do not
    assert not fp.wants_offload(**args, device=torch.device("cuda"), encoder_bytes=0)  # nothing to offload
    monkeypatch.setattr(fp, "_memory_needs", needs(50.0))  # on the CPU the encoders are already in memory
    assert fp.wants_offload(**args, device=CPU, encoder_bytes=10)


def test_a_refusal_names_the_memory_flags_not_on(monkeypatch):
    """Each flag not on is named where it could help: sharding only where a node's ranks sharing
    the weights would make room."""
    footprint = SimpleNamespace(image_tokens=4096)
    monkeypatch.setattr(fp, "_memory_needs", lambda *a, **k: (footprint, 10**12, 1e9, 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(fp, "sharding_frees", lambda pipe, ranks, device, stages=1: 0 if ranks == 1 else 10**12)
    args = dict(height=8192, width=8192, pixel_multiple=16, batch=1, steps=1, device=CPU)
    with pytest.raises(UsageError, match="--shard-weights on and --offload-text-encoders on"):
        fp.check_footprint(None, **args)
    monkeypatch.setattr(fp, "sharding_frees", lambda *a: 0)  # sharding gives nothing back: not suggested
    with pytest.raises(UsageError, match="use a smaller size or --offload-text-encoders on \\("):
        fp.check_footprint(None, **args)
    with pytest.raises(UsageError) as error:
        fp.check_footprint(None, **args, shard_ranks=2, offloaded=True)
    assert "--offload-text-encoders" not in str(error.value) and "smaller size" in str(error.value)


def test_weights_on_the_host_too_large_for_the_device_are_refused(monkeypatch):
    """`--shard-weights auto` kept whole weights that wait on the host (run.load) and would
    leave no room at all on the device: a one-line refusal before they are moved there."""
    footprint = SimpleNamespace(image_tokens=4096)
    monkeypatch.setattr(fp, "_memory_needs", lambda *a, **k: (footprint, 10**9, 60e9, 1))
    monkeypatch.setattr(fp, "sharding_frees",  # a 64 GB transformer to bring whole, or 8 GB a rank of a node of 8
                        lambda pipe, ranks, device, stages=1: -64 * 10**9 if ranks == 1 else 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = dict(height=1024, width=1024, pixel_multiple=16, batch=1, steps=1, device=torch.device("cuda", 0))
    with pytest.raises(UsageError, match="more than the 0.00 MB free on cuda 0 beside the transformer's whole weights; use a smaller size or --shard-weights on"):
        fp.check_footprint(None, **args)


def footprint(tmp_path, *args: str) -> dict:
    path = tmp_path / "fp.json"
    assert main(["footprint", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_flux2_dev_on_8_ranks_sharded_and_offloaded_is_under_40_gb(tmp_path):
    args = ("--model", "flux2-dev", "--height", "1024", "--width", "1024", "--nproc", "8", "--shard-weights", "on")
    kept = footprint(tmp_path, *args, "--offload-text-encoders", "off")
    offloaded = footprint(tmp_path, *args, "--offload-text-encoders", "on")
    assert kept["per_rank_bytes"] > 60e9 and kept["parts"]["text_encoder"] > 45e9  # Mistral 24B whole on every rank
    assert offloaded["offload_text_encoders"] == "on" and offloaded["per_rank_bytes"] < 40e9
    assert offloaded["parts"]["text_encoder"] < 3e9  # two of its leaf modules (the 0.67 B embedding) at a time
    # FSDP moves (N - 1) / N of the 32.2 B bf16 parameters to each rank per step (one call: guidance-distilled).
    assert offloaded["shard_gather_bytes_per_step"] == offloaded["parameters"]["transformer"] * 2 * 7 // 8


def test_wan22_a14b_720p_81_frames_on_16_ranks_is_under_60_gb(tmp_path):
    figures = footprint(tmp_path, "--model", "wan22-a14b", "--height", "720", "--width", "1280", "--frames", "81",
                        "--nproc", "16", "--shard-weights", "on", "--offload-text-encoders", "on")
    assert figures["per_rank_bytes"] < 60e9
    assert 27e9 < figures["parameters"]["transformer"] < 30e9  # two experts of 14.3 B
    whole = footprint(tmp_path, "--model", "wan22-a14b", "--nproc", "16", "--shard-weights", "off",
                      "--offload-text-encoders", "off")
    assert whole["parts"]["transformer"] > 56e9  # both experts held whole: 57 GB


def test_parallel_vae_divides_the_decode(tmp_path):
    args = ("--model", "flux2-dev", "--height", "2048", "--width", "2048", "--nproc", "8")
    whole = footprint(tmp_path, *args, "--parallel-vae", "off")
    bands = footprint(tmp_path, *args, "--parallel-vae", "on")
    assert bands["parallel_vae"] is True and whole["parallel_vae"] is False
    # 256 latent rows: a band of 32 own rows, every convolution borrowing 1 of each neighbour:
    # 34 / 256 of the whole decode.
    assert bands["parts"]["vae_decode"] == pytest.approx(whole["parts"]["vae_decode"] * 34 / 256, rel=1e-6)
    # The Wan video VAE likewise; 720p is 90 latent rows.
    args = ("--model", "wan22-a14b", "--height", "720", "--width", "1280", "--frames", "81", "--nproc", "16")
    whole = footprint(tmp_path, *args, "--parallel-vae", "off")
    bands = footprint(tmp_path, *args, "--parallel-vae", "on")
    clip = 81 * 720 * 1280 * 3 * 2  # the decoded clip rank 0 gathers, bf16: not split
    assert bands["parts"]["vae_decode"] - clip == pytest.approx((whole["parts"]["vae_decode"] - clip) * (6 + 2) / 90, rel=1e-6)
    # LTX-Video's too: 512 px is 16 latent rows of 32 pixels, a band of 1 own row and 2 borrowed.
    args = ("--model", "ltx-video", "--height", "512", "--width", "704", "--nproc", "16")
    whole = footprint(tmp_path, *args, "--parallel-vae", "off")
    bands = footprint(tmp_path, *args, "--parallel-vae", "on")
    clip = 161 * 512 * 704 * 3 * 2  # its default 161 frames, gathered on rank 0
    assert bands["parts"]["vae_decode"] - clip == pytest.approx((whole["parts"]["vae_decode"] - clip) * 3 / 16, rel=1e-6)
    assert footprint(tmp_path, *args, "--parallel-vae", "auto")["parallel_vae"] is False  # 1 row a rank: under 2
    assert main(["footprint", "--model", "qwen-image", "--nproc", "16", "--parallel-vae", "on"]) == 2  # not split
