"""Bad input the command line can decide: one line on stderr, exit 2, before any rank starts."""

import importlib.util
import json
import warnings

import pytest

from cocodiff.cli import main


def exit_status(argv: list[str]) -> int:
    """What `cocodiff ARGV` exits with: `main`'s return value, or the code argparse exits with inside it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def refused(capsys, argv: list[str], *parts: str) -> str:
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(part in lines[0] for part in parts), err
    return lines[0]


@pytest.mark.parametrize("args, parts", [
    (["--model", "tiny-wan", "--frames", "100001"],
     ["--frames 100001 is 25001 latent frames", "64 positions", "rope_max_seq_len", "at most 253"]),
    (["--model", "tiny-wan", "--height", "2048"], ["--height 2048 is 128 patches", "at most 1024"]),
    (["--model", "tiny-sd3", "--height", "2048"], ["--height 2048", "pos_embed_max_size 64", "at most 1024"]),
    (["--seed", str(2**70)], [f"--seed {2**70} must be from 0 to 2**63 - 1"]),
    (["--seed", "-1"], ["--seed -1 must be from 0 to 2**63 - 1"]),
    (["--nproc", "1", "--shard-weights", "on"], ["--shard-weights on", "--nproc 1 leaves none to share with"]),
    (["--nproc", "4", "--ranks-per-node", "1", "--shard-weights", "on"], ["--ranks-per-node 1 leaves none to share with"]),
    (["--nproc", "4", "--plan", "p4", "--shard-weights", "on"], ["--plan p4u1", "leaves none to share with"]),
    (["--wire", "foo=fp8"], ["--wire 'foo=fp8'", "level 'foo'", "(node, rank)"]),
    (["--model", "tiny-flux", "--cache", "dbcache:F99B99"], ["dbcache:F99B99", "F99 + B99", "has 4"]),
    (["--height", "1048576"], ["--height 1048576 --width 64 needs about", "available on this machine; use ", "a smaller size"]),
    (["--model", "tiny-flux", "--nproc", "8", "--plan", "p8"], ["8 pipeline stages", "has 4 blocks", "at most 4"]),
    (["--model", "tiny-zimage", "--nproc", "4", "--plan", "p2u2"], ["ZImageTransformer2DModel", "one joined sequence"]),
    (["--model", "tiny-zimage", "--nproc", "2", "--pipe-patches", "2"], ["ZImageTransformer2DModel: its layers take one joined "
                                                                           "sequence", "that a pipeline stage hands on"]),
    (["--model", "tiny-flux", "--nproc", "4", "--plan", "c2p2", "--pipe-patches", "2"],
     ["--plan c2p2u1: displaced patches (--pipe-patches) do not combine with the data axes (cfg 2)"]),
    (["--model", "tiny-flux", "--nproc", "2", "--plan", "p2", "--pipe-patches", "1"], ["--pipe-patches 1 must be at least 2"]),
    # Digits that str.isdigit takes and int refuses: one line, not a traceback.
    (["--plan", "pipe=\u00b2"], ["'pipe=\u00b2' is not AXIS=DEGREE"]),
    (["--model", "tiny-flux", "--nproc", "2", "--plan", "p2", "--pipe-patches", "\u00b2"], ["is neither a count nor auto"]),
    (["--levels", "node=\u00b2"], ["is not NAME=SIZE"]),
    (["--v-major", "warmup:\u00b2,linear"], ["--v-major 'warmup:\u00b2,linear' is not one of"]),
    (["--model", "tiny-flux", "--nproc", "2", "--plan", "c2u1"], ["tiny-flux: its pipeline call runs without classifier-free guidance"]),
    (["--nproc", "100000"], ["needs about", "(100000 local rank(s)) available on this machine; use fewer local ranks (it fits on at most"]),
    # Work bounded before it starts, and schedule flags that would be ignored.
    (["--steps", "1000000000"], ["--steps 1000000000 must be from 1 to 1000"]),
    (["--model", "tiny-flux", "--nproc", "2", "--plan", "p2", "--height", "64", "--pipe-patches", "100000"],
     ["--pipe-patches 100000 is more than the 4 rows of tokens of a 64-pixel-high image: at most 4"]),
    (["--pipe-warmup", "2"], ["--pipe-warmup set displaced patches' schedule: give --pipe-patches too"]),
    (["--pipe-warmup", "0", "--pipe-text", "patched"], ["--pipe-warmup and --pipe-text set displaced patches'"]),
])
@pytest.mark.parametrize("command", ["generate", "verify"])
def test_refused_before_any_rank(capsys, no_ranks, command, args, parts):
    line = refused(capsys, [command, *args], "cocodiff: error: ", *parts)
    assert "--shard-weights on" not in line or "shard-weights on shares" in line  # sharding would not make it fit


@pytest.mark.parametrize("args, parts", [
    (["--nproc", "3", "--variants", "flat,p2:tapa"], ["variant 'p2:tapa': --plan p2u1", "not to the 3 ranks"]),
    (["--nproc", "2", "--variants", "p2:tapa+dbcache"], ["variant 'p2:tapa+dbcache': ", "cache"]),
    (["--nproc", "2", "--variants", "p2:tapa+vmajor"], ["variant 'p2:tapa+vmajor': ", "--v-major"]),
    (["--nproc", "4", "--variants", "r2p2:tapa+patches=2"], ["variant 'r2p2:tapa+patches=2': ", "ring"]),
    (["--nproc", "2", "--variants", "p2:tapa+shard"], ["variant 'p2:tapa+shard': ", "leaves none to share with"]),
    (["--model", "tiny-zimage", "--nproc", "2", "--variants", "p2:tapa"], ["variant 'p2:tapa': ", "ZImageTransformer2DModel"]),
    pytest.param(["--nproc", "2", "--variants", "xdit-ulysses,flat"], ["variant 'xdit-ulysses': xDiT is not installed (pip install"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("xfuser") is not None, reason="xDiT is installed here")),
])
def test_bench_e2e_refuses_a_variant_before_any_rank(capsys, no_ranks, args, parts):
    """Each variant as `generate` refuses it, named, before the ranks start and load."""
    refused(capsys, ["bench", "e2e", "--model", "tiny-flux", "--steps", "2", *args], "cocodiff: error: ", *parts)


@pytest.mark.parametrize("flag", ["--steps", "--height", "--seed", "--nproc"])
def test_integer_flags_take_ascii_digits_only(capsys, no_ranks, flag):
    assert exit_status(["generate", flag, "\uff16\uff14"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"argument {flag}" in err and "not an integer" in err, err


@pytest.mark.parametrize("value", ["1e300", "0", "nan", "inf", "soon"])
def test_a_timeout_outside_its_range_names_the_range(capsys, no_ranks, value):
    assert exit_status(["generate", "--timeout", value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"'{value}' is not a number of seconds above 0 and below 1e+09" in err, err


def test_footprint_integer_flags_take_ascii_digits_only(capsys):
    assert exit_status(["footprint", "--height", "6_4"]) == 2
    assert "'6_4' is not an integer" in capsys.readouterr().err


@pytest.mark.parametrize("args, part", [
    (["--batch-window-ms", "nan"], "--batch-window-ms nan a finite number at least 0"),
    (["--compile", "--cache", "dbcache"], "--cache dbcache does not combine with --compile"),
])
def test_serve_refuses(capsys, no_ranks, args, part):
    refused(capsys, ["serve", "--port", "0", *args], part)


@pytest.mark.parametrize("args, part", [
    (["--plan", "p2", "--nproc", "2"], "--plan p2u1 leaves none to share with (use --shard-weights off, or fewer stages)"),
    (["--nproc", "1"], "--nproc 1 leaves none to share with"),
])
def test_footprint_refuses_sharding_that_every_run_refuses(capsys, args, part):
    refused(capsys, ["footprint", "--shard-weights", "on", *args], part)


def test_footprint_device_memory_nan(capsys):
    refused(capsys, ["footprint", "--device-memory", "nan"], "--device-memory nan must be a finite number of GB")


@pytest.mark.parametrize("text, part", [
    ('{"variants": {"flat": ', "is not a readable JSON file"),  # truncated
    ("[" * 100000 + "]" * 100000, "is not a readable JSON file (RecursionError"),  # nested past the parser's depth
    ('{"model": "x", "levels": 5, "variants": 3}', "is not a bench --json file of its kind (KeyError: 'height')"),
])
def test_report_names_a_json_file_it_cannot_read(capsys, tmp_path, text, part):
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench.json").write_text(text)
    refused(capsys, ["report", "--results", str(results), "--readme", str(tmp_path / "README.md")],
            f"{results / 'bench.json'} {part}")


@pytest.mark.parametrize("text, part", [
    ("[" * 100000 + "]" * 100000, "cannot read a bench e2e JSON file (RecursionError"),
    ("[1, 2]", "not a bench e2e JSON file (a JSON list, not an object)"),
    ('{"variants": {"flat": 3}, "model": "tiny-flux", "height": 5, "width": "x", "nodes": 2, "ranks_per_node": 2, '
     '"fabric": "rail 2x2"}', "not a bench e2e JSON file (ValueError: invalid literal for int()"),
])
def test_simulate_validate_names_a_json_file_it_cannot_read(capsys, tmp_path, text, part):
    path = tmp_path / "e2e.json"
    path.write_text(text)
    refused(capsys, ["simulate", "--system", "rail-2x2", "--validate", str(path)], f"{path}: {part}")


def pipeline_folder(tmp_path, index: str):
    from cocodiff.models.presets import load_pipeline

    folder = tmp_path / "pipe"
    load_pipeline("tiny-flux")[0].save_pretrained(folder)
    (folder / "model_index.json").write_text(index)
    return folder


@pytest.mark.parametrize("command", ["generate", "verify"])
def test_a_truncated_model_index_is_one_line(capsys, no_ranks, tmp_path, command):
    folder = pipeline_folder(tmp_path, '{"_class_name": "FluxPipeline", "transformer": ["diffusers", ')
    refused(capsys, [command, "--model", str(folder)], f"--model {folder}: its model_index.json could not be read")


def test_an_incomplete_model_index_is_one_line(capsys, no_ranks, tmp_path):
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "T5EncoderModel"]}
    folder = pipeline_folder(tmp_path, json.dumps(index))
    refused(capsys, ["generate", "--model", str(folder)], "lists text_encoder (T5EncoderModel), but the folder has no text_encoder/")
    del index["transformer"], index["text_encoder"]
    (folder / "model_index.json").write_text(json.dumps(index))
    refused(capsys, ["generate", "--model", str(folder)], "lists no transformer")


def test_train_tiny_resume_without_checkpoints_is_refused(capsys, tmp_path):
    refused(capsys, ["train-tiny", "--out", str(tmp_path), "--resume"],
            f"--resume: --out {tmp_path} has no checkpoint to resume from")


def test_ranks_ignore_the_foreign_warnings_only():
    from cocodiff.run.lifetime import quiet_foreign_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_foreign_warnings()
        seen = []
        for module in ("torch.distributed.distributed_c10d", "cocodiff.engine.steps"):
            seen += [module] if _warns(module, caught) else []
    assert seen == ["cocodiff.engine.steps"]  # the same warning from any other module still shows


def _warns(module: str, caught: list) -> bool:
    before = len(caught)
    warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "x.py", 1, module=module)
    return len(caught) > before


def test_xdits_baseline_is_refused_where_it_cannot_run():
    """xDiT's baseline runs its FLUX.1 transformer, with the heads split evenly (checked on the ranks,
    before xDiT is imported)."""
    from types import SimpleNamespace

    from cocodiff.bench.xdit import check_supported
    from cocodiff.errors import UsageError

    class SD3Transformer2DModel:
        config = SimpleNamespace(num_attention_heads=4)

    class FluxTransformer2DModel:
        config = SimpleNamespace(num_attention_heads=6)

    with pytest.raises(UsageError, match="runs xDiT's FLUX.1 transformer, not SD3Transformer2DModel"):
        check_supported(SD3Transformer2DModel(), 2)
    with pytest.raises(UsageError, match="splits the 6 heads evenly, and 4 ranks do not divide them"):
        check_supported(FluxTransformer2DModel(), 4)
