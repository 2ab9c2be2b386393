"""LoRA adapters (`--lora`, models/lora.py): fused into the weights through diffusers' loader,
exact against one process with the same adapters under stages and sharded weights, and refused in
one line where they cannot load. The matrix's `lora` column runs one on every preset."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import cocodiff, exit_status

from cocodiff.errors import UsageError
from cocodiff.models.lora import Adapter, apply_adapters, make_adapter
from cocodiff.models.presets import load_pipeline


@pytest.fixture(scope="module")
def flux_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / "tiny-flux"
    make_adapter(load_pipeline("tiny-flux")[0], folder)
    return folder


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.transformer.state_dict().items()}


def test_an_adapter_is_fused_into_the_weights_at_its_scale(flux_adapter):
    """The projections it targets change by scale x B A (relative ||dW|| / ||W|| reported), nothing
    else does, and no LoRA layer is left behind; at scale 0 nothing changes."""
    before = _weights(load_pipeline("tiny-flux")[0])
    pipe = load_pipeline("tiny-flux")[0]
    record = apply_adapters(pipe, (Adapter(str(flux_adapter), 0.8),))
    after = _weights(pipe)
    assert set(after) == set(before)  # the LoRA layers are gone
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert len(changed) == record["layers"] == 12 and all(k.endswith(("to_q.weight", "to_k.weight", "to_v.weight")) for k in changed)
    largest = max((after[k] - before[k]).norm() / before[k].norm() for k in changed).item()
    assert record["weight_change"] == pytest.approx(largest, rel=1e-4) and largest > 1e-3
    # Twice the scale, twice the change (fused, not merely loaded).
    pipe = load_pipeline("tiny-flux")[0]
    assert apply_adapters(pipe, (Adapter(str(flux_adapter), 1.6),))["weight_change"] == pytest.approx(2 * largest, rel=1e-4)
    pipe = load_pipeline("tiny-flux")[0]
    assert apply_adapters(pipe, (Adapter(str(flux_adapter), 0.0),))["weight_change"] == 0
    assert all(torch.equal(before[k], v) for k, v in _weights(pipe).items())


def test_verify_with_an_adapter_under_stages_and_sharded_weights(tmp_path, flux_adapter):
    """Fused on the host before the cut and the shards: every stage's ranks hold the adapted
    weights, equal to one process with the same adapter."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-flux", "--lora", f"{flux_adapter}:0.8", "--nproc", "4", "--plan", "p2u2",
                   "--ranks-per-node", "2", "--shard-weights", "on", "--steps", "2", "--height", "64", "--width", "64",
                   "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["ok"] and result["plan"] == "p2u2" and result["shard_weights"]
    assert result["lora"]["layers"] == 12 and result["lora"]["adapters"] == [{"path": str(flux_adapter), "scale": 0.8}]


@pytest.mark.parametrize(("lora", "message"), [
    ("{tmp}/none.safetensors", "--lora {tmp}/none.safetensors is no such file or folder"),
    ("{tmp}", "--lora {tmp} holds no pytorch_lora_weights.safetensors"),
    ("{tmp}/text.safetensors", "text.safetensors is not a safetensors file"),
    ("{tmp}/plain.safetensors", "plain.safetensors holds no LoRA weights (1 tensors, none named lora_*)"),
    ("{adapter}:nan", "its scale nan must be a finite number"),
])
def test_a_bad_adapter_is_one_line_before_any_rank(tmp_path, capsys, no_ranks, flux_adapter, lora, message):
    from safetensors.torch import save_file

    (tmp_path / "text.safetensors").write_text("not a tensor file")
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    given = lora.format(tmp=tmp_path, adapter=flux_adapter)
    assert exit_status(["verify", "--model", "tiny-flux", "--lora", given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(tmp=tmp_path) in err, err


def test_a_pipeline_without_a_lora_loader_is_refused_before_any_rank(capsys, no_ranks, flux_adapter):
    assert exit_status(["generate", "--model", "tiny-hunyuanvideo15", "--lora", str(flux_adapter)]) == 2
    assert "HunyuanVideo15Pipeline has no LoRA loader in diffusers" in capsys.readouterr().err


def test_an_adapter_of_another_model_is_one_line(tmp_path):
    """Another model's adapter (tiny-sd3's projections are narrower than tiny-flux's, tiny-wan's have
    other names): the rank that loads it names the adapter, the model and the first misfit."""
    for other, misfit in (("tiny-sd3", "size mismatch for transformer_blocks.0"), ("tiny-wan", "Target modules")):
        make_adapter(load_pipeline(other)[0], tmp_path / other)
        with pytest.raises(UsageError) as refused:
            apply_adapters(load_pipeline("tiny-flux")[0], (Adapter(str(tmp_path / other)),))
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"--lora {tmp_path / other} does not fit FluxTransformer2DModel: {misfit}")
