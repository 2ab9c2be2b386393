"""The simulator's video and new image workloads: tokens, cross-attention, head-divisible plans, --frames."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cocodiff.cli import main
from cocodiff.errors import UsageError
from cocodiff.simulate.model import modelled_variants, predict
from cocodiff.simulate.table import table_rows
from cocodiff.simulate.system import load_system
from cocodiff.simulate.workload import MODELS, Workload

NODES = [1, 2, 4, 8]


def simulate(argv: list[str]) -> int:
    return main(["simulate", *argv])


@pytest.mark.parametrize("model,size,frames,tokens", [
    ("wan21-14b", (720, 1280), 81, 75_600),     # 21 x 45 x 80 (DIFFUSERS-NOTES section 5)
    ("wan21-14b", (480, 832), 81, 32_760),      # 21 x 30 x 52
    ("wan22-ti2v-5b", (704, 1280), 121, 27_280),  # 31 x 22 x 40
    ("hunyuanvideo15", (720, 1280), 121, 111_600),  # 31 x 45 x 80
    ("ltx-video", (512, 768), 121, 6_144),      # 16 x 16 x 24
    ("ltx2", (512, 768), 121, 6_144),           # 16 x 16 x 24
    ("minimax-h3", (768, 1344), 124, 37_296),   # 37 x 24 x 42: its VAE makes 17 n + 5 frames 5 n + 2 latent
    ("wan21-14b", (720, 1280), 1, 3_600),       # one frame: one latent frame
])
def test_video_tokens_count_latent_frames(model, size, frames, tokens):
    workload = Workload(model=MODELS[model], height=size[0], width=size[1], frames=frames)
    assert workload.image_tokens == tokens


@pytest.mark.parametrize("system", ["aurora", "dgx-h100"])
def test_wan_720p_on_1_to_8_nodes_keeps_ulysses_dividing_40_heads(system, tmp_path, capsys):
    out = tmp_path / "wan.json"
    assert simulate(["--system", system, "--model", "wan21-14b", "--resolution", "720x1280", "--frames", "81",
                     "--nodes", "1,2,4,8", "--variants", "flat,tapa+vfirst", "--json", str(out)]) == 0
    capsys.readouterr()
    figures = json.loads(out.read_text())
    assert figures["tokens"] == 75_600 and figures["frames"] == 81 and not figures["not_runnable"]
    assert sorted({r["nodes"] for r in figures["rows"]}) == NODES
    ranks = load_system(system).ranks_per_node
    for row in figures["rows"]:
        plan = row["plan"]
        ulysses = int(plan.split("u")[1].split("r")[0])
        ring = int(plan.split("r")[1].split("u")[0]) if "r" in plan else 1
        assert 40 % ulysses == 0 and ulysses * ring == row["nodes"] * ranks, plan
        assert row["step_ms"] > 0


@pytest.mark.parametrize("system", ["aurora", "dgx-h100"])
def test_flux2_at_1024_on_1_to_8_nodes(system, tmp_path, capsys):
    out = tmp_path / "flux2.json"
    assert simulate(["--system", system, "--model", "flux2-dev", "--resolution", "1024", "--nodes", "1,2,4,8",
                     "--variants", "flat,tapa+vfirst", "--json", str(out)]) == 0
    assert "4096 image + 512 text tokens" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["tokens"] == 4096 and figures["frames"] == 1 and not figures["not_runnable"]
    assert sorted({r["nodes"] for r in figures["rows"]}) == NODES
    assert all(48 % int(r["plan"].split("u")[1].split("r")[0]) == 0 for r in figures["rows"])


@pytest.mark.parametrize("system", ["aurora", "dgx-h100"])
def test_local_cross_attention_sends_nothing_and_costs_its_flops(system):
    """Wan without its cross-attention layers: the same bytes on every link, less compute."""
    wan = MODELS["wan21-14b"]
    self_only = replace(wan, layers=tuple(k for k in wan.layers if not k.cross))
    at = load_system(system, nodes=2)
    flat = modelled_variants("flat")[0]
    full, bare = (predict(Workload(model=m, height=720, width=1280, frames=81), at, at.nominal(), flat)
                  for m in (wan, self_only))
    assert full.inter_node_bytes == bare.inter_node_bytes and full.intra_node_bytes == bare.intra_node_bytes
    assert full.comm_s == bare.comm_s and full.exposed_s == bare.exposed_s
    cross = next(k for k in wan.layers if k.cross)
    workload = Workload(model=wan, height=720, width=1280, frames=81)
    f = workload.flops(cross, at.ranks)
    shard = -(-75_600 // at.ranks)  # the largest rank's video tokens
    d = wan.hidden
    # all 40 heads of its own queries against the whole text, which it projects itself
    assert f["attention"] == 4.0 * shard * 512 * 128 * 40
    assert f["v"] == 2.0 * d * d * 512 and f["qk"] == 2.0 * d * d * (shard + 512)
    assert full.compute_s > bare.compute_s


def test_exchanged_cross_attention_sends_the_text_and_the_queries():
    """LTX's cross-attention goes through the exchange: more bytes than its self-attention alone."""
    ltx = MODELS["ltx-video"]
    self_only = replace(ltx, layers=tuple(k for k in ltx.layers if not k.cross))
    at = load_system("dgx-h100", nodes=2)
    flat = modelled_variants("flat")[0]
    full, bare = (predict(Workload(model=m, height=512, width=704), at, at.nominal(), flat) for m in (ltx, self_only))
    # per layer and call (CFG batch 2): V of the text, Q of the video + K of the text, O of the video,
    # each cut to the heads of the others; inter-node: the 8 of 16 ranks on the other node
    video, text, B = 21 * 16 * 22, 128, 2
    sent = B * 2 * ltx.hidden * (text + video + text + video)  # bytes, all ranks, all destinations, bf16
    assert full.inter_node_bytes - bare.inter_node_bytes == pytest.approx(28 * sent * 8 / 16, rel=0.02)


def test_zimage_takes_only_ulysses_degrees_dividing_30_heads(capsys):
    workload = Workload(model=MODELS["zimage-turbo"], height=1024, width=1024)
    for system, nodes in (("aurora", NODES), ("dgx-h100", NODES)):
        rows, skipped = table_rows(workload, load_system(system), nodes, modelled_variants("flat,auto:tapa"),
                                   lambda s: s.nominal())
        assert not skipped
        for row in rows:
            ulysses = int(row["plan"].split("u")[1].split("r")[0])
            assert 30 % ulysses == 0, (system, row["nodes"], row["plan"])
    aurora = load_system("aurora", nodes=1)
    assert predict(workload, aurora, aurora.nominal(), modelled_variants("flat")[0]).plan.short in ("u6r2", "r2u6")
    with pytest.raises(UsageError, match="Ulysses degree 12 does not divide the 30 attention heads of zimage-turbo"):
        predict(workload, aurora, aurora.nominal(), modelled_variants("u12:flat")[0])
    assert simulate(["--system", "aurora", "--model", "zimage-turbo", "--nodes", "1", "--variants", "u12:flat"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "1, 2, 3, 5, 6, 10, 15, 30" in err


def test_frames_on_an_image_model_is_one_line_exit_2(capsys):
    assert simulate(["--model", "flux2-dev", "--frames", "81"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--frames 81" in err and "flux2-dev" in err


@pytest.mark.parametrize("model, frames, form", [("wan21-14b", "0", "4 x k + 1"), ("wan21-14b", "80", "4 x k + 1"),
                                                  ("minimax-h3", "121", "17 x k + 5")])
def test_frames_off_the_temporal_grid_is_one_line_exit_2(model, frames, form, capsys):
    assert simulate(["--model", model, "--nodes", "1", "--frames", frames]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--frames {frames}" in err and form in err


def test_video_defaults_are_the_models_standard_size_and_frames(tmp_path, capsys):
    out = tmp_path / "ltx.json"
    assert simulate(["--system", "dgx-h100", "--model", "ltx-video", "--nodes", "1", "--variants", "flat",
                     "--json", str(out)]) == 0
    capsys.readouterr()
    figures = json.loads(out.read_text())
    assert figures["resolution"] == [512, 704] and figures["frames"] == 161 and figures["tokens"] == 21 * 16 * 22


def test_specs_match_diffusers_defaults():
    """Heads, head size and blocks of each new spec against diffusers 0.42.1's own defaults."""
    import inspect

    import diffusers

    def defaults(cls: str) -> dict:
        return {k: p.default for k, p in inspect.signature(getattr(diffusers, cls).__init__).parameters.items()}

    wan, hy, ltx, z = (defaults(c) for c in ("WanTransformer3DModel", "HunyuanVideo15Transformer3DModel",
                                               "LTXVideoTransformer3DModel", "ZImageTransformer2DModel"))
    spec = MODELS["wan21-14b"]
    assert (spec.heads, spec.head_dim, spec.layers[0].count) == (wan["num_attention_heads"], wan["attention_head_dim"],
                                                                 wan["num_layers"])
    assert spec.layers[0].rest_flops == pytest.approx(2 + 4 * wan["ffn_dim"] / spec.hidden)
    spec = MODELS["hunyuanvideo15"]
    assert (spec.heads, spec.head_dim, spec.layers[0].count, spec.patch) == (
        hy["num_attention_heads"], hy["attention_head_dim"], hy["num_layers"], hy["patch_size"])
    spec = MODELS["ltx-video"]
    assert (spec.heads, spec.head_dim, spec.layers[0].count, spec.out_channels) == (
        ltx["num_attention_heads"], ltx["attention_head_dim"], ltx["num_layers"], ltx["out_channels"])
    spec = MODELS["zimage-turbo"]
    assert (spec.hidden, spec.heads, spec.layers[0].count, spec.layers[1].count) == (
        z["dim"], z["n_heads"], z["n_layers"], z["n_refiner_layers"])
    h3, ltx2, q21 = (defaults(c) for c in ("MiniMaxH3Transformer3DModel", "LTX2VideoTransformer3DModel",
                                           "QwenImage21Transformer2DModel"))
    spec = MODELS["minimax-h3"]
    assert (spec.heads, spec.head_dim, spec.layers[0].count, spec.out_channels) == (
        h3["num_attention_heads"], h3["attention_head_dim"], h3["num_layers"],
        h3["in_channels"] * 4 + h3["audio_in_channels"])  # patch 1x2x2, both heads on every row
    width = h3["hidden_size"] / spec.hidden  # the stream is narrower than the heads
    assert spec.layers[0].rest_flops + 6 == pytest.approx(8 * width + 6 * width * h3["ffn_dim"] / spec.hidden)
    spec = MODELS["ltx2"]
    assert (spec.heads, spec.head_dim, spec.layers[0].count, spec.out_channels) == (
        ltx2["num_attention_heads"], ltx2["attention_head_dim"], ltx2["num_layers"], ltx2["out_channels"])
    spec = MODELS["qwen-image-2.1"]
    assert (spec.heads, spec.head_dim, spec.layers[0].count, spec.patch, spec.out_channels) == (
        q21["num_attention_heads"], q21["attention_head_dim"], q21["num_layers"], q21["patch_size"],
        q21["out_channels"])
    assert spec.layers[0].rest_flops == pytest.approx(2 + 6 * q21["mlp_ratio"])
