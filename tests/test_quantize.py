"""Quantized weights (`--quantize`, models/quantize.py, LOSSY): every linear weight of the
transformer stored in int8 or fp8 through torchao (or, `float8storage`, what diffusers' layerwise
casting stores in fp8), counted at the bytes it holds, exact under
stages and Ulysses against one process on the same quantized weights, and held to the weights as
they come by a PSNR floor. The matrix's `quantize int8` and `fp8 storage` columns run it on every preset."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import cocodiff, exit_status

from cocodiff.distributed.memory import weight_bytes
from cocodiff.models.presets import load_pipeline
from cocodiff.models.quantize import apply_quantize

pytest.importorskip("torchao")


@pytest.mark.parametrize("mode", ["int8wo", "float8wo"])
def test_every_linear_weight_is_quantized_and_counted_at_the_bytes_it_holds(mode):
    pipe = load_pipeline("tiny-flux")[0]
    linears = [m for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    before = weight_bytes(pipe.transformer)
    x = torch.randn(3, linears[0].in_features)
    exact = linears[0](x)
    record = apply_quantize(pipe, mode)
    assert record["mode"] == mode and record["layers"] == len(linears) == 50
    assert all(type(m.weight).__name__ != "Parameter" for m in linears)  # torchao's tensors, every one
    # One byte a weight and a scale per output channel, not the nominal float32's four bytes.
    assert record["weight_bytes"] == before and record["quantized_bytes"] < 0.3 * before
    assert weight_bytes(pipe.transformer) == record["quantized_bytes"] + sum(
        b.numel() * b.element_size() for b in pipe.transformer.buffers())
    moved = (linears[0](x) - exact).abs().max() / exact.abs().max()
    assert 0 < moved < 0.1, moved  # rounded, not replaced


def test_float8_storage_keeps_what_diffusers_casts_in_float8_and_computes_in_the_runs_dtype():
    """`float8storage`: diffusers' layerwise casting stores the linear weights outside the norms and
    position embeddings in float8 e4m3, one byte each, and each layer still computes in float32."""
    pipe = load_pipeline("tiny-flux")[0]
    before = weight_bytes(pipe.transformer)
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    x = torch.randn(3, layer.in_features)
    exact = layer(x)
    record = apply_quantize(pipe, "float8storage")
    stored = {name for name, m in pipe.transformer.named_modules()
              if any(p.dtype == torch.float8_e4m3fn for p in m.parameters(recurse=False))}
    assert record["mode"] == "float8storage" and record["layers"] == len(stored) == 42
    assert "transformer_blocks.0.attn.to_q" in stored and not any("norm" in name for name in stored)
    assert record["weight_bytes"] == before and record["quantized_bytes"] < 0.5 * before
    assert weight_bytes(pipe.transformer) == record["quantized_bytes"] + sum(
        b.numel() * b.element_size() for b in pipe.transformer.buffers())
    out = layer(x)
    moved = (out - exact).abs().max() / exact.abs().max()
    assert out.dtype == torch.float32 and 0 < moved < 0.1, moved  # rounded in storage, computed in float32


def _text_encoders() -> dict[str, torch.nn.Module]:
    """Real text encoder classes at a small seeded size: what a checkpoint's pipeline holds."""
    import transformers

    torch.manual_seed(0)
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                           num_heads=4))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16))
    return {"text_encoder": clip.eval(), "text_encoder_2": t5.eval()}


@pytest.mark.parametrize("mode", ["int8wo", "float8storage"])
def test_text_encoders_are_quantized_in_the_runs_mode_and_counted_as_footprint_counts_them(mode):
    """`--quantize-text-encoders`: CLIP's and T5's weights quantized in the transformer's mode, each
    encoder's bytes before and after in the record, equal to what `footprint` counts from its shapes,
    and the prompt's embeddings rounded, not replaced."""
    from types import SimpleNamespace

    from cocodiff.footprint.cli import encoder_weight_bytes
    from cocodiff.models.counts import _float8_stored, _linear_counts

    encoders = _text_encoders()
    ids = torch.tensor([[5, 9, 17, 2, 33, 1]])
    with torch.no_grad():
        exact = {name: encoder(input_ids=ids).last_hidden_state for name, encoder in encoders.items()}
    shapes = {name: (*_linear_counts(encoder), _float8_stored(encoder)) for name, encoder in encoders.items()}
    params = {name: (type(encoder).__name__, sum(p.numel() for p in encoder.parameters()))
              for name, encoder in encoders.items()}
    record = apply_quantize(SimpleNamespace(components={}), mode, encoders)
    counts = SimpleNamespace(text_encoders=params, encoder_quantizable=shapes)  # footprint's, of these encoders
    setting = SimpleNamespace(quantize=mode, quantize_text_encoders=True, item_bytes=4)
    for name, encoder in encoders.items():
        held = record["text_encoders"][name]
        linears = sum(1 for m in encoder.modules() if isinstance(m, torch.nn.Linear))
        assert held["layers"] >= linears > 0 if mode == "float8storage" else held["layers"] == linears
        assert held["quantized_bytes"] == weight_bytes(encoder) - sum(b.numel() * b.element_size() for b in encoder.buffers())
        assert held["quantized_bytes"] < 0.5 * held["weight_bytes"]
        assert encoder_weight_bytes(counts, setting, name) == held["quantized_bytes"]
        with torch.no_grad():
            moved = (encoder(input_ids=ids).last_hidden_state - exact[name]).abs().max() / exact[name].abs().max()
        assert 0 < moved < 0.2, (name, moved)


def test_verify_quantized_under_stages_and_ulysses(tmp_path):
    """Quantized on the host before the cut: every stage's ranks hold quantized weights, the run is
    exact against one process on the same quantized weights, and within its floor of the weights
    as they come."""
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-flux", "--quantize", "int8wo", "--quantize-text-encoders", "--nproc", "4", "--plan", "p2u2",
                   "--ranks-per-node", "2", "--steps", "2", "--height", "64", "--width", "64", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert "quantized weights (LOSSY)" in run.stdout and "same quantized weights" in run.stdout
    result = json.loads(figures.read_text())
    assert result["ok"] and result["lossy"] and result["plan"] == "p2u2"
    assert result["quantize"]["layers"] == 50 and result["quantize"]["text_encoders"]["prompt_encoder"]["layers"] == 1
    assert "quantized prompt_encoder (LOSSY)" in run.stdout
    assert result["same_weights"]["ok"] and result["same_weights"]["max_rel_diff"] <= result["tolerance"]
    assert result["psnr_floor"] == 30 and result["psnr"] is not None and result["psnr"] >= 30
    assert result["latent"]["max_rel_diff"] > 100 * result["same_weights"]["max_rel_diff"]  # quantizing moved it
    # A stage's ranks hold about half of the quantized weights, a quarter of the unquantized ones' bytes.
    assert result["transformer_param_bytes"] < 0.2 * result["quantize"]["weight_bytes"]


@pytest.mark.parametrize(("args", "message"), [
    (["--quantize", "int8wo", "--shard-weights", "on"], "--quantize int8wo does not combine with --shard-weights on"),
    (["--quantize", "float8dq"], "--quantize float8dq runs fp8 matmuls, which the CPU does not have"),
    (["--quantize-text-encoders"], "--quantize-text-encoders quantizes the text encoders in --quantize's mode"),
    # bench e2e's variants, checked as generate checks its flags
    (["bench", "--variants", "flat,flat+quantize=int8wo", "--shard-weights", "on"],
     "variant 'flat+quantize=int8wo': --quantize int8wo does not combine with --shard-weights on"),
    (["bench", "--variants", "flat,flat+quantize=float8dq"], "--quantize float8dq runs fp8 matmuls, which the CPU does not have"),
])
def test_what_cannot_be_quantized_is_one_line_before_any_rank(capsys, no_ranks, args, message):
    if torch.cuda.is_available() and "float8dq" in args[-1]:
        pytest.skip("a GPU may run fp8 matmuls")
    command = ["bench", "e2e"] if args[0] == "bench" else ["verify"]
    assert exit_status([*command, "--model", "tiny-flux", "--nproc", "2", *args[args[0] == "bench":]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("mode", ["int8wo", "float8wo", "float8storage"])
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan22"])
def test_footprint_counts_the_quantized_weights_a_run_holds(tmp_path, model, mode):
    """`footprint --quantize` from the config: the bytes torchao's weights hold once quantized, to the byte
    (both of Wan 2.2's experts)."""
    from cocodiff.cli import main

    figures = tmp_path / "f.json"
    assert main(["footprint", "--model", model, "--nproc", "2", "--quantize", mode, "--quantize-text-encoders",
                 "--json", str(figures)]) == 0
    estimated = json.loads(figures.read_text())
    pipe, encoder = load_pipeline(model)
    held = apply_quantize(pipe, mode, {"prompt_encoder": encoder})
    assert estimated["quantize"] == mode and estimated["parts"]["transformer"] == held["quantized_bytes"]
    assert estimated["parts"]["text_encoder"] == held["text_encoders"]["prompt_encoder"]["quantized_bytes"]
