"""The benchmark commands run and write the JSON their contracts promise (figures not asserted:
speed is measured by the commands, never by tests)."""

import json

import command
import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn
from cocodiff.config.variants import parse_variants

RUNS_LONG = 3  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


def cocodiff(*args):
    return command.cocodiff(*args, timeout=2 * RANK_TIMEOUT_S)


def test_bench_a2a_json_and_plot(tmp_path):
    out = tmp_path / "a2a.json"
    run = cocodiff("bench", "a2a", "--min-size", "64KiB", "--max-size", "128KiB", "--repeat", "1",
                   "--auto-budget", "5", "--nproc", "4", "--ranks-per-node", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert {"fabric", "nproc", "ranks_per_node", "auto_choice", "results"} <= set(result)
    assert (result["nproc"], result["ranks_per_node"]) == (4, 2)
    assert [r["bytes_per_rank"] for r in result["results"]] == [65536, 131072]
    for r in result["results"]:
        assert r["flat_ms"] > 0 and r["tapa_ms"] > 0 and r["speedup"] == pytest.approx(r["flat_ms"] / r["tapa_ms"])
    assert all(b["choice"] in ("flat", "tapa") for b in result["auto_choice"]["buckets"])
    assert (tmp_path / "a2a.png").stat().st_size > 0


def test_bench_e2e_json(tmp_path):
    out = tmp_path / "e2e.json"
    run = cocodiff("bench", "e2e", "--model", "tiny-sd3", "--variants", "flat,tapa+vfirst,tapa,auto", "--steps", "3",
                   "--height", "48", "--width", "80", "--repeat", "1", "--nproc", "4", "--ranks-per-node", "2",
                   "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert {"fabric", "model", "nproc", "variants"} <= set(result)
    for name, figures in result["variants"].items():
        assert {"step_ms", "inter_node_bytes", "intra_node_bytes", "exposed_comm_ms", "speedup_vs_flat"} <= set(figures)
        assert figures["max_abs_diff_vs_first"] == 0.0, name  # exact variants give the same image
        assert figures["peak_bytes"] > 0 and figures["estimated_bytes"] > 0, name  # the largest rank's
    assert result["variants"]["flat"]["speedup_vs_flat"] == 1.0
    for figures in result["variants"].values():  # per image: the mean step, not the median, times the steps
        assert figures["image_ms"] == pytest.approx(figures["step_ms_mean"] * 3)  # 3 steps: their median is not their mean
        assert figures["speedup_per_image_vs_flat"] == pytest.approx(
            result["variants"]["flat"]["step_ms_mean"] / figures["step_ms_mean"])
    assert "one node:" not in run.stdout  # two nodes: TAPA has a slower link to save
    # TAPA crosses nodes with the same bytes as flat and adds intra-node relaying.
    assert result["variants"]["tapa"]["inter_node_bytes"] == result["variants"]["flat"]["inter_node_bytes"]
    assert result["variants"]["tapa"]["intra_node_bytes"] > result["variants"]["flat"]["intra_node_bytes"]
    # `auto` is measured against the fastest variant that fixes what it chooses, and says so.
    fixed = {name: result["variants"][name]["step_ms"] for name in ("flat", "tapa+vfirst", "tapa")}
    versus = result["variants"]["auto"]["vs_fastest_fixed"]
    assert versus["variant"] == min(fixed, key=fixed.get)
    assert versus["ratio"] == pytest.approx(result["variants"]["auto"]["step_ms"] / min(fixed.values()))
    assert not any("vs_fastest_fixed" in result["variants"][name] for name in fixed)
    assert f"fastest fixed variant, {versus['variant']}" in run.stdout
    report = result["v_first"]["tapa+vfirst"]
    assert report["against"] == "tapa" and len(report["layers"]) == 4  # 3 joint layers + SD3.5's attn2
    assert report["overlap_ms"] == pytest.approx(sum(layer["overlap_ms"] for layer in report["layers"]))


def test_bench_e2e_plan_auto_times_plans_and_keeps_its_choice_across_runs(tmp_path):
    """An `auto` plan variant runs the plan trials once for all its runs (warm-up run included):
    the report names the candidates (a stage per node last: the variant runs on a copy of its
    own), the choice and the plan run after it; the image stays exact."""
    out = tmp_path / "e2e.json"
    run = cocodiff("bench", "e2e", "--model", "tiny-sd3", "--variants", "flat,auto:flat", "--steps", "10",
                   "--height", "48", "--width", "80", "--repeat", "1", "--nproc", "4", "--ranks-per-node", "2",
                   "--json", str(out))
    assert run.returncode == 0, run.stderr
    auto = json.loads(out.read_text())["variants"]["auto:flat"]
    trials = auto["plan_trials"]
    assert [c["name"] for c in trials["candidates"]] == ["c2u2", "c2b2u1", "u4", "r2u2", "p2u2"]
    assert trials["chosen"] == auto["plan"] and auto["plan_description"].startswith(auto["plan"] + " (")
    assert auto["max_abs_diff_vs_first"] <= 1e-4  # fp32 rounding of another split of the same work
    assert auto["vs_fastest_fixed"]["variant"] == "flat"


def test_bench_e2e_against_diffusers_ulysses(tmp_path):
    """diffusers' own Ulysses as a variant: same bytes as our flat exchange, same image."""
    out = tmp_path / "e2e.json"
    run = cocodiff("bench", "e2e", "--model", "tiny-shapes", "--variants", "diffusers-ulysses,flat,tapa+vfirst",
                   "--steps", "2", "--height", "64", "--width", "64", "--repeat", "1", "--nproc", "4",
                   "--ranks-per-node", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    variants = json.loads(out.read_text())["variants"]
    theirs, flat = variants["diffusers-ulysses"], variants["flat"]
    assert theirs["inter_node_bytes"] == flat["inter_node_bytes"] > 0
    assert theirs["intra_node_bytes"] == flat["intra_node_bytes"] > 0
    for name, figures in variants.items():
        # The same per-head attention over the same gathered sequence: fp32 rounding at most.
        assert figures["max_abs_diff_vs_diffusers"] <= 1e-5, name
        assert figures["speedup_vs_diffusers"] > 0


def test_bench_e2e_times_quantized_weights_and_attention_kernels_in_one_run(tmp_path):
    """`+quantize=MODE` runs on a quantized copy (LOSSY, its weight bytes recorded), `+attn=NAME` on
    the backend's kernel on every rank, and the variant after it on the default kernel again."""
    out = tmp_path / "e2e.json"
    run = cocodiff("bench", "e2e", "--model", "tiny-flux", "--variants", "flat,flat+quantize=int8wo,flat+attn=_native_math",
                   "--steps", "2", "--height", "64", "--width", "64", "--repeat", "1", "--nproc", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    variants = json.loads(out.read_text())["variants"]
    flat, quantized, math = variants["flat"], variants["flat+quantize=int8wo"], variants["flat+attn=_native_math"]
    assert quantized["lossy"] and not flat["lossy"] and not math["lossy"]
    assert quantized["quantize"]["mode"] == "int8wo" and flat["quantize"] is None
    assert quantized["transformer_param_bytes"] == quantized["quantize"]["quantized_bytes"] < flat["transformer_param_bytes"] / 3
    assert 0 < quantized["max_abs_diff_vs_first"] < 0.1 and math["max_abs_diff_vs_first"] < 1e-4
    assert math["attention_backend"] == {"name": "_native_math", "kernels": ["_native_math_attention"]}
    assert flat["attention_backend"] == {"name": None, "kernels": ["scaled_dot_product_attention"]}


def test_diffusers_ulysses_refuses_uneven_sequences():
    run = cocodiff("bench", "e2e", "--model", "tiny-flux", "--variants", "diffusers-ulysses,flat", "--steps", "1",
                   "--height", "64", "--width", "64", "--repeat", "1", "--nproc", "2")
    assert run.returncode == 2
    assert "11 text tokens do not divide by 2 ranks" in run.stderr


def test_variant_names_are_checked():
    assert [v.name for v in parse_variants("flat, tapa+vfirst")] == ["flat", "tapa+vfirst"]
    cocodiff, theirs = parse_variants("cocodiff,diffusers-ulysses")  # the alias simulate used runs here too
    assert (cocodiff.comm, cocodiff.v_first, cocodiff.v_major, cocodiff.v_major_tensors) == ("tapa", True, "linear", "v")
    assert theirs.baseline and not cocodiff.baseline
    with pytest.raises(UsageError, match="'ring' is not one of flat, tapa, tapa-full, auto"):
        parse_variants("ring")
    with pytest.raises(UsageError, match="option 'vlast' is not one of vfirst, vmajor, vmajorqk"):
        parse_variants("flat+vlast")
    with pytest.raises(UsageError, match="names a variant twice"):
        parse_variants("flat,flat")
    quantized, math = parse_variants("u2:flat+quantize=int8wo, flat+attn=_native_math")
    assert (quantized.quantize, quantized.inexact, math.attention, math.inexact) == ("int8wo", True, "_native_math", False)
    with pytest.raises(UsageError, match="does not combine with \\+shard"):
        parse_variants("flat+quantize=int8wo+shard")
    with pytest.raises(UsageError, match="names no name"):
        parse_variants("flat+attn=")


def timeline_of_one_forward():
    import torch
    from model_cases import forward_inputs

    from cocodiff import ParallelConfig, parallelize
    from cocodiff.engine.attention.core import resolve_timeline
    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline("tiny-flux", seed=0)
    parallel = parallelize(pipe, ParallelConfig(comm="tapa", ranks_per_node=2))
    parallel.ctx.timeline = {}
    with torch.no_grad():
        pipe.transformer(**forward_inputs("tiny-flux", pipe.transformer))
    return resolve_timeline(parallel.ctx.timeline, torch.device("cpu"))


def test_v_first_instrumentation_sees_v_in_flight():
    timeline = spawn(timeline_of_one_forward, 4, timeout_s=RANK_TIMEOUT_S)[0]
    assert len(timeline) == 4  # 2 double-stream + 2 single-stream layers
    for calls in timeline.values():
        assert calls[0]["v_comm_ms"] > 0 and calls[0]["qk_compute_ms"] > 0


def test_report_regenerates_the_results_section(tmp_path):
    from cocodiff.bench.report import BEGIN, END, update_readme

    results = tmp_path / "results"
    results.mkdir()
    a2a = {
        "date": "2026-01-02", "fabric": "rail 2x2 (rail 400mbit, spine 100mbit)", "nproc": 4, "nodes": 2,
        "ranks_per_node": 2, "repeat": 5, "auto_choice": {"buckets": [{"bytes_per_rank": 65536, "choice": "tapa"}]},
        "results": [{"bytes_per_rank": 1048576, "flat_ms": 60.0, "tapa_ms": 24.0, "speedup": 2.5}],
    }
    (results / "a2a.json").write_text(json.dumps(a2a))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n\n{BEGIN}\nstale table\n{END}\n\n## After\n")
    update_readme(readme, results)
    text = readme.read_text()
    assert "stale table" not in text and text.endswith("## After\n") and text.count(BEGIN) == 1
    assert "| 1024 KiB | 60.00 | 24.00 | 2.50x |" in text and "rail 2x2" in text and "2026-01-02" in text
    assert "64K tapa (64K: timed by its own calibration, not in the table)" in text  # no choice passed off as the table's


def test_report_reads_v_first_under_the_old_and_the_new_keys(tmp_path):
    """`bound_ms` was renamed `overlap_ms` (it is the paper's expectation, not a bound): files
    written before the rename still render, with the same figures."""
    from cocodiff.bench.report import render

    layer = {"layer": "l0", "hidden_ms": 3.0}
    entry = {"against": "flat", "hidden_ms": 3.0}
    e2e = {"model": "tiny-flux", "height": 64, "width": 64, "batch": 1, "steps": 1, "repeat": 1, "fabric": "f",
           "nproc": 4, "nodes": 2, "ranks_per_node": 2, "date": "2026-01-02",
           "variants": {name: {"step_ms": 10.0, "inter_node_bytes": 0, "exposed_comm_ms": 1.0}
                        for name in ("flat", "flat+vfirst")}}
    texts = []
    for overlap, share in (("bound_ms", "hidden_over_bound"), ("overlap_ms", "hidden_over_overlap")):
        v_first = {**entry, overlap: 2.0, share: 1.5, "layers": [{**layer, overlap: 2.0, share: 1.5}]}
        (tmp_path / "e2e.json").write_text(json.dumps({**e2e, "v_first": {"flat+vfirst": v_first}}))
        texts.append(render(tmp_path))
    assert texts[0] == texts[1]
    assert "hidden 3.0 ms per step, 150% of the 2.0 ms overlap" in texts[0] and "per layer 150%" in texts[0]


@pytest.mark.slow
def test_bench_e2e_runs_shorter_than_the_plan_trials_stay_exact(tmp_path):
    """`auto:auto` on runs of 4 steps (the trials span the bench's runs, true CFG's pairs start
    mid-run): exact against flat, and the report says whether the trials finished; on one node
    it says why TAPA gains nothing there."""
    out = tmp_path / "e2e.json"
    run = cocodiff("bench", "e2e", "--model", "tiny-shapes", "--variants", "flat,tapa,auto:auto", "--steps", "4",
                   "--height", "64", "--width", "64", "--repeat", "1", "--nproc", "4", "--json", str(out))
    assert run.returncode == 0, run.stderr
    auto = json.loads(out.read_text())["variants"]["auto:auto"]
    assert auto["max_abs_diff_vs_first"] <= 1e-4  # fp32 rounding of another split of the same work
    assert ("chose " if auto["auto_choice"]["chosen"] else "the trials did not finish") in run.stdout
    assert "one node: TAPA's phases cross no slower link here" in run.stdout
