"""`cocodiff simulate`: the cost model's invariants, its agreement with a measured run's bytes, the
calibration's fit, and the command's errors and JSON. Pure computation: no torch.distributed."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cocodiff.cli import main
from cocodiff.errors import UsageError
from cocodiff.config.plan import Plan, default_plan
from cocodiff.simulate.calibrate import fit_a2a, predict_a2a, validate_e2e
from cocodiff.simulate.model import NotRunnable, data_shares, modelled_variants, predict
from cocodiff.simulate.table import table_rows
from cocodiff.simulate.network import phase_load, routing, swap_matrix, tapa_matrices
from cocodiff.simulate.system import SYSTEMS, LinkParams, load_system
from cocodiff.simulate.workload import MODELS, LayerKind, ModelSpec, Workload

RESULTS = Path(__file__).resolve().parent / "data"  # copies of docs/results files: regenerating results cannot break tests
E2E_RAIL = RESULTS / "e2e-rail2x2-512.json"


def variant(name: str):
    return modelled_variants(name)[0]


def test_every_shipped_system_loads():
    assert {"aurora", "dgx-h100", "rail-2x2", "shared-2x2"} <= set(SYSTEMS)
    aurora = load_system("aurora")
    assert aurora.ranks_per_node == 12 and aurora.tapa_group == 2
    assert load_system("rail-2x2", nodes=3).ranks == 6


@pytest.mark.parametrize("system", ["rail-2x2", "dgx-h100", "aurora"])
def test_flat_and_tapa_move_the_same_inter_node_bytes(system):
    at = load_system(system, nodes=2)
    workload = Workload(model=MODELS["flux1-dev"], height=768, width=768)
    flat, tapa = (predict(workload, at, at.nominal(), variant(v)) for v in ("flat", "tapa"))
    assert tapa.inter_node_bytes == pytest.approx(flat.inter_node_bytes, rel=1e-12)
    # uneven tokens and heads too, phase by phase
    route, gather, scatter = routing(at), [5, 3, 4, 4] * (at.ranks // 4), [2, 1] * (at.ranks // 2)
    flat_bytes = phase_load(route, swap_matrix(gather, scatter, 8.0)).inter_node_bytes
    tapa_bytes = sum(phase_load(route, T).inter_node_bytes for T in tapa_matrices(gather, scatter, 8.0, at.ranks_per_node))
    assert tapa_bytes == pytest.approx(flat_bytes, rel=1e-12)


@pytest.mark.parametrize("system", ["dgx-h100", "rail-2x2"])  # TAPA's first-phase group is the whole node
def test_tapa_on_one_node_is_flat(system):
    at = load_system(system, nodes=1)
    workload = Workload(model=MODELS["flux1-dev"], height=1024, width=1024)
    flat, tapa = (predict(workload, at, at.nominal(), variant(v)) for v in ("flat", "tapa"))
    assert tapa.step_s == pytest.approx(flat.step_s, rel=1e-12)
    assert tapa.intra_node_bytes == pytest.approx(flat.intra_node_bytes, rel=1e-12)


def test_link_load_makes_tapa_win_on_rails_and_not_on_a_shared_uplink():
    size = 16 * 2**20
    rail = load_system("rail-2x2")
    flat, tapa = predict_a2a(rail, rail.nominal(), size)
    assert tapa < 0.5 * flat  # the spine (100 Mbit/s per rail) is flat's bottleneck; TAPA stays on the rails
    shared = load_system("shared-2x2")
    flat, tapa = predict_a2a(shared, shared.nominal(), size)
    assert tapa >= flat  # the same bytes through the same uplink, plus the first phase


def test_v_first_and_v_major_only_help():
    at = load_system("dgx-h100", nodes=2)
    workload = Workload(model=MODELS["flux1-dev"], height=1536, width=1536)
    p = {v: predict(workload, at, at.nominal(), variant(v)) for v in ("tapa", "tapa+vfirst", "cocodiff", "tapa+vfirst+vmajorqk")}
    assert p["tapa+vfirst"].step_s <= p["tapa"].step_s
    assert p["tapa+vfirst+vmajorqk"].inter_node_bytes < p["cocodiff"].inter_node_bytes < p["tapa"].inter_node_bytes
    assert p["cocodiff"].intra_node_bytes == pytest.approx(p["tapa"].intra_node_bytes)  # first phase in full


def test_more_ranks_than_heads_run_under_ulysses_x_ring(capsys):
    workload = Workload(model=MODELS["sd35-large"], height=2304, width=2304)
    aurora = load_system("aurora")
    rows, skipped = table_rows(workload, aurora, [2, 4, 8], modelled_variants("flat,tapa+vfirst"), lambda s: s.nominal())
    assert not skipped
    # 24 ranks over 38 heads: Ulysses alone (uneven); 48 and 96 ranks: the engine's default_plan
    assert [(r["nodes"], r["plan"]) for r in rows] == [(n, plan) for n, plan in [(2, "u24"), (4, "u24r2"), (8, "u32r3")]
                                                       for _ in range(2)]
    for r in rows[2:]:
        assert r["ring_exposed_ms"] >= 0 and r["ring_hidden_ms"] > 0 and "ring" in r["plan_description"]
        assert r["ring_exposed_ms"] <= r["exposed_comm_ms"]
    assert "ring_exposed_ms" not in rows[0]
    assert simulate(["--system", "aurora", "--model", "sd35-large", "--resolution", "2304", "--nodes", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "not runnable" not in out and "u24r2" in out and "u32r3" in out and "ring exposed / hidden" in out


def test_a_plan_the_engine_cannot_lay_over_the_nodes_is_not_runnable():
    # r3u32 on 8 nodes of 12: Ulysses groups of 32 consecutive ranks fall into runs of 12, 12, 8
    workload = Workload(model=MODELS["sd35-large"], height=1024, width=1024)
    aurora = load_system("aurora", nodes=8)
    with pytest.raises(NotRunnable, match="equal runs of ranks per node"):
        predict(workload, aurora, aurora.nominal(), variant("r3u32:flat"))
    rows, skipped = table_rows(workload, aurora, [8], modelled_variants("flat,r3u32:flat"), lambda s: s.nominal())
    assert [r["variant"] for r in rows] == ["flat"] and [s["variant"] for s in skipped] == ["r3u32:flat"]


TWO_BY_FOUR = replace(load_system("rail-2x2"), levels=(replace(load_system("rail-2x2").levels[0], size=4),),
                      network=replace(load_system("rail-2x2").network, nics=4), tapa_group=4)
"""rail-2x2 with 4 ranks per node: 2 nodes x 4 ranks, a rail per local rank."""
HAND = ModelSpec(name="hand", source="test", heads=4, head_dim=8, layers=(LayerKind(name="joint", count=1, rest_flops=18.0),),
                 text_tokens=16, vae_factor=8, patch=2, out_channels=4, cfg="none", default_steps=1, default_dtype="fp32")
"""One joint layer, 4 heads x 8: at 128 x 128 pixels 64 image + 16 text tokens, 10 per rank of 8."""


def test_hybrid_bytes_are_a_hand_count():
    workload = Workload(model=HAND, height=128, width=128, dtype="fp32", steps=1)
    at = TWO_BY_FOUR
    # One all-to-all message: 10 tokens x 1 head x 8 x 4 bytes = 320 (the output: 1 head x 10 tokens, the same);
    # V, Q+K (two units) and O: 4 units. A ring block: a chunk's 40 tokens x 1 head x 2 (K, V) x 8 x 4 = 2560.
    # Output gather: a rank's 8 image tokens x 4 channels x 4 bytes = 128; a chunk's 32 tokens: 512.
    message, block, shard, chunk = 320, 2560, 128, 512
    # r2u4: each node one Ulysses group, the ring between nodes: 8 ranks send their block once, then their
    # chunk; the all-to-alls (3 peers each) and the Ulysses gather stay inside the nodes.
    p = predict(workload, at, at.nominal(), variant("r2u4:flat"))
    assert p.plan.short == "r2u4"
    assert p.inter_node_bytes == 8 * block + 8 * chunk
    assert p.intra_node_bytes == 8 * 3 * 4 * message + 8 * 3 * shard
    # u4r2: Ulysses groups {0, 2, 4, 6} and {1, 3, 5, 7} (2 members per node), rings {0, 1}, {2, 3}, ...:
    # 2 of each rank's 3 all-to-all peers (and gather peers) are on the other node; the ring stays inside.
    p = predict(workload, at, at.nominal(), variant("u4r2:flat"))
    assert p.plan.short == "u4r2"
    assert p.inter_node_bytes == 8 * 2 * 4 * message + 8 * 2 * shard
    assert p.intra_node_bytes == 8 * 1 * 4 * message + 8 * block + 8 * shard + 8 * chunk
    # TAPA inside the Ulysses groups: the same bytes between nodes, relayed inside them
    for plan in ("r2u4", "u4r2"):
        flat, tapa = (predict(workload, at, at.nominal(), variant(f"{plan}:{comm}")) for comm in ("flat", "tapa"))
        assert tapa.inter_node_bytes == flat.inter_node_bytes, plan
    assert tapa.intra_node_bytes > flat.intra_node_bytes  # u4r2: two members per node, two phases
    # no plan: the engine's default (8 ranks > 4 heads)
    assert predict(workload, at, at.nominal(), variant("flat")).plan.short == "r2u4"


@pytest.mark.parametrize("name,inter,intra", [
    ("r2u4:flat", 21016576, 28379136), ("u4r2:flat", 18919424, 30476288), ("u4r2:tapa", 18919424, 38887424)])
def test_hybrid_bytes_match_the_measured_run(name, inter, intra):
    """bench e2e's byte counts on the emulated rail 2x4, tiny-flux 1024x1024, 3 steps, fp32
    (docs/results/e2e-rail2x4-ring-1024.json): all-to-alls, ring blocks and both gathers."""
    workload = Workload(model=MODELS["tiny-flux"], height=1024, width=1024, steps=3, dtype="fp32")
    p = predict(workload, TWO_BY_FOUR, TWO_BY_FOUR.nominal(), variant(name))
    assert (p.inter_node_bytes, p.intra_node_bytes) == (inter, intra)


def test_validation_of_a_ring_run_scales_compute_by_its_flat_baseline(tmp_path):
    """A bench e2e file whose baseline is flat under a plan (measured on the emulated rail 2x1,
    docs/results/e2e-rail2x1-ring-1024.json): its compute profile comes from `u1r2:flat`."""
    run = {"fabric": "rail 2x1", "model": "tiny-flux", "nodes": 2, "ranks_per_node": 1, "height": 1024, "width": 1024,
           "steps": 3, "batch": 1, "baseline": "u1r2:flat", "variants": {
               "u1r2:flat": {"step_ms": 414.0, "exposed_comm_ms": 97.5, "inter_node_bytes": 17870848},
               "u2:flat": {"step_ms": 568.7, "exposed_comm_ms": 205.3, "inter_node_bytes": 17870848}}}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(run))
    rail = load_system("rail-2x2")
    two_by_one = replace(rail, levels=(replace(rail.levels[0], size=1),), network=replace(rail.network, nics=1), tapa_group=1)
    entries = validate_e2e(two_by_one, lambda s: s.nominal(), path)
    assert [(e["variant"], e["plan"]) for e in entries] == [("u1r2:flat", "u1r2"), ("u2:flat", "u2")]
    assert entries[0]["compute_ms"] == pytest.approx(414.0 - 97.5)
    assert all(e["bytes_error"] == 0 for e in entries)
    assert entries[0]["predicted_ms"] < entries[1]["predicted_ms"]  # measured too: ring hides its blocks, Ulysses waits


@pytest.mark.parametrize("system,nodes", [("two-by-four", 2), ("rail-2x2", 4), ("shared-2x2", 4)])
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-qwen-image"])
def test_default_placement_is_the_faster_when_the_ring_hides_nothing(system, nodes, model):
    at = TWO_BY_FOUR if system == "two-by-four" else load_system(system, nodes=nodes)
    workload = Workload(model=MODELS[model], height=512, width=512, dtype="fp32", steps=4)
    chosen = default_plan(at.ranks, workload.model.heads, at.ranks_per_node)
    other = Plan(ring=chosen.ring, ulysses=chosen.ulysses, order=chosen.order[:2] + chosen.order[2:][::-1])
    assert {chosen.short, other.short} == {"r2u4", "u4r2"}

    def unhidden(plan: Plan) -> float:  # the step if none of the ring's transfers hid behind attention
        p = predict(workload, at, at.nominal(), variant(f"{plan.short}:flat"))
        return p.step_s + p.ring_hidden_s

    assert unhidden(chosen) < unhidden(other)


def test_plain_ulysses_predictions_are_unchanged():
    """Rows of the paper table written before plans and incast were modelled (Ulysses over every
    rank): Aurora without its incast term gives them again."""
    before = json.loads((RESULTS / "simulate-paper-aurora.json").read_text())["rows"]
    aurora = replace(load_system("aurora"), incast=None)
    for model, res in [("sd35-large", 2304), ("qwen-image", 1536), ("flux1-dev", 768)]:
        workload = Workload(model=MODELS[model], height=res, width=res, steps=MODELS[model].default_steps)
        rows, _ = table_rows(workload, aurora, [1, 2], modelled_variants("flat,tapa,tapa+vfirst,cocodiff"), lambda s: s.nominal())
        old = [r for r in before if r["model"] == model and r["resolution"] == res and r["nodes"] in (1, 2)]
        assert len(rows) == len(old) == 8
        for new, was in zip(rows, old):
            assert {k: new[k] for k in was if k not in ("model", "resolution")} == {
                k: v for k, v in was.items() if k not in ("model", "resolution")}
            assert new["plan"] == f"u{new['ranks']}"


def test_tiny_flux_bytes_match_the_measured_run():
    measured = json.loads(E2E_RAIL.read_text())
    system = load_system("rail-2x2", nodes=measured["nodes"])
    workload = Workload(model=MODELS[measured["model"]], height=measured["height"], width=measured["width"],
                        batch=measured["batch"], steps=measured["steps"], dtype="fp32")
    for name, figures in measured["variants"].items():
        p = predict(workload, system, system.nominal(), variant(name))
        assert p.inter_node_bytes == pytest.approx(figures["inter_node_bytes"], rel=0.01), name
        assert p.intra_node_bytes == pytest.approx(figures["intra_node_bytes"], rel=0.01), name


def test_calibration_recovers_the_figures_that_made_the_data(tmp_path):
    system = load_system("dgx-h100", nodes=2)
    nominal = system.nominal()
    truth = LinkParams(bandwidth={**nominal.bandwidth, "nvlink": 300e9, "nic": 40e9}, latency={"nvlink": 8e-6, "network": 12e-6})
    rows = []
    for size in (2**16 * 2**k for k in range(9)):
        flat, tapa = predict_a2a(system, truth, size)
        rows.append({"bytes_per_rank": size, "flat_ms": flat * 1e3, "tapa_ms": tapa * 1e3})
    path = tmp_path / "a2a.json"
    path.write_text(json.dumps({"fabric": "rail (synthetic)", "nodes": 2, "ranks_per_node": 8, "results": rows}))
    _, fit = fit_a2a(load_system("dgx-h100"), path)
    assert fit.rms_log_error < 0.01
    assert fit.determined["bw:nic"] and fit.determined["lat:network"] and fit.determined["lat:nvlink"]
    assert fit.params.bandwidth["nic"] == pytest.approx(40e9, rel=0.03)
    assert fit.params.latency["network"] == pytest.approx(12e-6, rel=0.03)
    assert fit.params.latency["nvlink"] == pytest.approx(8e-6, rel=0.03)
    assert not fit.determined["bw:nvlink"]  # never the bottleneck here: the data cannot set it


def test_validation_reports_every_variant():
    entries = validate_e2e(load_system("rail-2x2"), lambda s: s.nominal(), E2E_RAIL)
    assert [e["variant"] for e in entries] == list(json.loads(E2E_RAIL.read_text())["variants"])
    flat = entries[0]
    assert flat["compute_ms"] + flat["predicted_exposed_comm_ms"] == pytest.approx(flat["predicted_ms"])
    assert all(abs(e["bytes_error"]) < 0.01 for e in entries)


def test_a_held_out_validation_takes_its_compute_from_another_run():
    """With a compute scale from elsewhere (`--compute-profile`), the file's own flat step does not
    enter the prediction: twice the scale, twice the compute of every variant."""
    own = validate_e2e(load_system("rail-2x2"), lambda s: s.nominal(), E2E_RAIL)
    one = validate_e2e(load_system("rail-2x2"), lambda s: s.nominal(), E2E_RAIL, compute_scale=1.0)
    two = validate_e2e(load_system("rail-2x2"), lambda s: s.nominal(), E2E_RAIL, compute_scale=2.0)
    assert [e["compute_ms"] * 2 for e in one] == pytest.approx([e["compute_ms"] for e in two])
    assert own[0]["compute_ms"] != pytest.approx(one[0]["compute_ms"], rel=0.01)


def simulate(argv: list[str]) -> int:
    """The `simulate` subcommand alone (the full CLI's parser imports the model presets)."""
    import argparse

    from cocodiff.simulate import cli

    parser = argparse.ArgumentParser(prog="cocodiff")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return cli.main(parser.parse_args(["simulate", *argv]))


def test_bad_input_exits_2_with_one_line(capsys):
    assert main(["simulate", "--model", "sdxl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sdxl" in err


@pytest.mark.parametrize("argv,named", [
    (["--model", "sdxl"], "sdxl"),
    (["--system", "frontier", "--model", "flux1-dev"], "frontier"),
    (["--model", "flux1-dev", "--variants", "flat,ring"], "ring"),
    (["--model", "flux1-dev", "--variants", "flat+vmajor"], "flat+vmajor"),
    (["--model", "flux1-dev", "--variants", "auto"], "auto"),
    (["--model", "flux1-dev", "--variants", "diffusers-ulysses"], "diffusers-ulysses"),
    (["--model", "flux1-dev", "--variants", "flat,tapa,flat"], "twice"),
    (["--model", "flux1-dev", "--variants", "c4u3:flat"], "classifier-free guidance has 2 branches"),
    (["--model", "flux1-dev", "--nodes", "2", "--variants", "u4r2:flat"], "multiply to 8, not to the 24 ranks"),
    (["--model", "flux1-dev", "--nodes", "4", "--variants", "u48:flat"], "larger than the 24 attention heads"),
    (["--model", "flux1-dev", "--variants", "u4x:flat"], "'u4x' is not a plan"),
    (["--model", "flux1-dev", "--resolution", "1000"], "1000"),
    (["--model", "flux1-dev", "--nodes", "0,2"], "0,2"),
    ([], "--model"),
    (["--model", "flux1-dev", "--steps", "0"], "--steps 0 must be from 1 to 1000"),
    (["--model", "flux1-dev", "--link-efficiency", "nan"], "--link-efficiency nan must be a positive number"),
])
def test_bad_input_is_one_line_naming_the_value(argv, named):
    with pytest.raises(UsageError) as error:
        simulate(argv)
    assert len(str(error.value).splitlines()) == 1 and named in str(error.value)


def test_bad_input_names_the_allowed_values():
    from cocodiff.simulate.workload import get_model

    with pytest.raises(UsageError, match="flux1-dev, sd35-large, qwen-image, flux2-dev"):
        get_model("sdxl")
    with pytest.raises(UsageError, match="aurora, dgx-h100"):
        load_system("frontier")
    with pytest.raises(UsageError, match="not one of flat, tapa"):
        modelled_variants("ring")
    with pytest.raises(UsageError, match="multiple of 16"):
        Workload(model=MODELS["flux1-dev"], height=1000, width=1024)


def test_json_contract(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["simulate", "--system", "rail-2x2", "--model", "tiny-flux", "--resolution", "512", "--nodes", "1,2",
            "--variants", "flat,tapa+vfirst,cocodiff", "--validate", str(E2E_RAIL), "--json", str(out)]
    assert simulate(argv[1:]) == 0
    capsys.readouterr()
    figures = json.loads(out.read_text())
    assert {"system", "model", "rows", "validation"} <= set(figures)
    assert figures["system"] == "rail-2x2" and figures["model"] == "tiny-flux"
    assert [(r["nodes"], r["variant"]) for r in figures["rows"]] == [
        (n, v) for n in (1, 2) for v in ("flat", "tapa+vfirst", "cocodiff")]
    for row in figures["rows"]:
        assert isinstance(row["step_ms"], float) and isinstance(row["speedup_vs_flat"], float)
    assert figures["validation"] and {"variant", "measured_ms", "predicted_ms", "error"} <= set(figures["validation"][0])


def test_report_renders_simulate_json(tmp_path, capsys):
    from cocodiff.bench.report import render

    assert simulate(["--system", "dgx-h100", "--model", "flux1-dev", "--nodes", "1,2", "--json", str(tmp_path / "sim.json")]) == 0
    capsys.readouterr()
    text = render(tmp_path)
    assert "### Simulated (cost model)" in text and "predicted, not measured" in text
    assert "| 2 | cocodiff (lossy) |" in text


def test_bench_and_simulate_share_one_variant_grammar():
    from cocodiff.config.variants import parse_variant, parse_variants

    names = {name for path in RESULTS.glob("e2e-*.json") for name in json.loads(path.read_text())["variants"]}
    names |= {r["variant"] for path in RESULTS.glob("simulate-*.json") for r in json.loads(path.read_text())["rows"]}
    assert {"flat", "tapa+vfirst+vmajorqk", "diffusers-ulysses", "cocodiff"} <= names
    for name in names:  # every name a results file uses still parses, and names itself
        parsed = parse_variant(name)
        assert parsed.name == name and parse_variant(parsed.canonical) == parsed
    assert parse_variant("tapa+vmajor+vfirst") == parse_variant("cocodiff") == variant("tapa+vfirst+vmajor")
    assert parse_variant("tapa+vmajor+vfirst").name == "tapa+vmajor+vfirst"  # the JSON key is the name as written
    assert parse_variant(" :flat").name == ":flat" and parse_variant(":flat").plan is None
    assert parse_variant("u4r2:tapa+vfirst").plan == "u4r2" and parse_variant("auto:auto").plan == "auto"
    assert parse_variant("u4r2:tapa") != parse_variant("r2u4:tapa")  # the written order is the placement
    for bad, message in [("ring", "'ring' is not one of flat, tapa, tapa-full, auto, diffusers-ulysses, xdit-ulysses, cocodiff"),
                         ("u4x:tapa", "'u4x' is not a plan"), ("auto+vmajor", "needs tapa or flat"),
                         ("tapa+vmajor+vmajorqk", "exclude each other"), ("cocodiff+vfirst", "takes no options"),
                         ("diffusers-ulysses+vfirst", "takes no options"), ("xdit-ulysses+vfirst", "takes no options"),
                         ("cocodiff,tapa+vfirst+vmajor", "twice")]:
        with pytest.raises(UsageError) as bench:
            parse_variants(bad)
        with pytest.raises(UsageError) as sim:
            modelled_variants(bad)
        assert str(bench.value) == str(sim.value) and message in str(sim.value), bad
        assert len(str(sim.value).splitlines()) == 1
    for runnable_only in ("auto", "auto+vfirst", "flat+vmajor", "diffusers-ulysses", "xdit-ulysses", "tapa-full"):  # bench runs them; no model here
        assert parse_variants(runnable_only)
        with pytest.raises(UsageError, match=re.escape(f"variant '{runnable_only}': ")):
            modelled_variants(runnable_only)


def test_tables_print_no_negative_zero_and_whole_headers(capsys):
    from cocodiff.output.tables import fixed

    assert [fixed(-1e-17), fixed(-0.04, sign=True), fixed(-0.4, 0), fixed(-0.06)] == ["0.0", "+0.0", "0", "-0.1"]
    # one node of Aurora: TAPA's exposed inter-node time is a rounding error below zero
    assert simulate(["--system", "aurora", "--model", "qwen-image", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "-0.0" not in out and "…" not in out
    for header in ("nodes x ranks", "exposed inter", "comm share", "inter-node MiB"):
        assert header in out, header  # on one line: the table is wide enough for its headers


def test_paper_json_has_the_contract_keys(tmp_path):
    """`simulate --paper --json`: average and peak speedups, one row per reported figure
    (DESIGN.md), each outside 25% with its reason, the settings kept apart."""
    out = tmp_path / "paper.json"
    assert simulate(["--paper", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["average_speedup"] > 1 and figures["peak_speedup"] >= figures["average_speedup"]
    rows = {r["figure"]: r for r in figures["rows"]}
    assert all(set(r) == {"figure", "predicted", "reported", "reason"} for r in figures["rows"])
    assert rows["average speedup, all mechanisms"]["predicted"] == figures["average_speedup"]
    assert rows["average speedup, all mechanisms"]["reported"] == 3.6
    assert [r["reported"] for r in figures["rows"] if r["figure"].startswith("peak speedup")] == [8.4]
    for r in figures["rows"]:
        assert isinstance(r["predicted"], float), r["figure"]
        within = abs(r["predicted"] / r["reported"] - 1) <= 0.25
        if r["figure"].startswith(("best plan", "plan choice")):  # not in the paper: always said
            assert r["reason"].startswith("plan choice, not in the paper"), r["figure"]
        else:
            assert (r["reason"] is None) == within, r["figure"]
    for figure in ("single node: TAPA", "multi-node: all mechanisms", "all-to-all 48 MB per rank, one node: flat / TAPA",
                   "Qwen-Image: flat's all-to-all share of a step, highest setting"):
        assert figure in rows, figure
    # a best-plan row per setting: CFG groups for the guided models only
    best = [r["figure"] for r in figures["rows"] if r["figure"].startswith("best plan")]
    assert len(best) == len(figures["paper"]["best_plans"]) == 48
    assert not any("c2" in f for f in best if "flux" in f)
    assert any("c2" in f for f in best if "sd35-large" in f) and any("c2" in f for f in best if "qwen-image" in f)
    assert {"model", "nodes", "variant", "step_ms", "plan"} <= set(figures["settings"][0])


def test_aurora_has_three_levels_with_the_papers_tapa():
    aurora = load_system("aurora", nodes=2)
    assert [(lv.name, lv.size, lv.link) for lv in aurora.levels] == [("tile-link", 2, "pair"), ("xe-link", 6, "pair")]
    assert (aurora.network.kind, aurora.network.nics, aurora.tapa_group) == ("direct", 8, 2)
    route = routing(aurora)
    # rank 0's peers at the three distances: its card's other tile, the other cards, the other node
    assert [route.lat_classes[c] for c in route.msg_class[0, [1, 2, 12]]] == ["tile-link", "xe-link", "network"]
    # TAPA's second phase: one all-to-all per tile index across every other card of both nodes
    _, phase2 = tapa_matrices([1] * 24, [1] * 24, 1.0, aurora.tapa_group)
    assert set(np.flatnonzero(phase2[0])) == set(range(2, 24, 2)) and set(np.flatnonzero(phase2[1])) == set(range(3, 24, 2))


def test_incast_is_the_fit_of_the_papers_microbenchmark():
    from cocodiff.simulate.incast import fit_incast

    fit = fit_incast()
    aurora = load_system("aurora")
    assert (aurora.incast.flows, aurora.incast.buffer_MB) == (fit.incast.flows, fit.incast.buffer_MB)
    ratios = [p["predicted_ratio"] for p in fit.points]
    assert ratios[0] < 1.25 and ratios[1] > 1.8 and ratios[2] >= ratios[1]  # near 1x at 6 MB, growing with size


def test_incast_slows_crowded_receivers_only():
    from cocodiff.simulate.incast import a2a_times
    from cocodiff.simulate.system import Incast

    aurora = load_system("aurora")
    bare = replace(aurora.nominal(), incast=None)
    zero = replace(bare, incast=Incast(flows=1, buffer_MB=1e9))  # a buffer nothing fills: no incast
    for size in (6_000_000, 48_000_000):
        assert a2a_times(aurora, zero, size) == a2a_times(aurora, bare, size)
        flat, tapa = a2a_times(aurora, bare, size)
        assert flat < 1.2 * tapa  # one node: the same bytes over the same links (flat: 11 latencies, TAPA 6)
    flat, tapa = a2a_times(aurora, aurora.nominal(), 48_000_000)
    assert flat > 2 * tapa  # flat: 11 senders per receiver, TAPA: 1 then 5
    # a phase with one sender per receiver never slows
    load = phase_load(routing(aurora), tapa_matrices([4] * 12, [1] * 12, 1e6, 2)[0])
    assert load.incast_factor(aurora.nominal()) == 1.0


SHAPES = Workload(model=MODELS["tiny-shapes"], height=128, width=128, dtype="fp32", steps=8)


@pytest.mark.parametrize("name,inter", [("c2u2:flat", 114688), ("auto:flat", 114688), ("flat", 12992512)])
def test_cfg_plan_bytes_match_the_measured_run(name, inter):
    """bench e2e's inter-node bytes on the emulated rail 2x2, tiny-shapes 128x128, 8 steps
    (docs/results/e2e-rail2x2-shapes128-auto.json): CFG across nodes trades only each rank's
    sequence shard of the output, from the second step on (the first step is unpaired and runs
    whole on both groups)."""
    p = predict(SHAPES, load_system("rail-2x2"), load_system("rail-2x2").nominal(), variant(name))
    assert p.inter_node_bytes == inter
    assert p.plan.short == ("u4" if name == "flat" else "c2u2")


def test_batch_plan_splits_the_images():
    workload = replace(SHAPES, batch=4, steps=6)
    rail = load_system("rail-2x2")
    for name in ("b2u2:flat", "c2u2:flat"):  # docs/results/e2e-rail2x2-shapes128-batch4-plans.json
        assert predict(workload, rail, rail.nominal(), variant(name)).inter_node_bytes == 524288, name
    one = predict(replace(workload, batch=1), rail, rail.nominal(), variant("b2u2:flat"))
    assert one.data_exposed_s == 0  # one image, two groups: each runs it whole, nothing to trade
    flux = Workload(model=MODELS["tiny-flux"], height=256, width=256, dtype="fp32", steps=4, batch=3)
    shares = data_shares(flux, Plan(batch=2, ulysses=2))
    assert [(s.items, s.calls, s.exchange) for s in shares] == [(2, 1, True)]  # uneven: the slowest group's 2


def test_cfg_goes_across_nodes_where_the_network_is_slow_and_inside_where_it_is_fast():
    rail = load_system("rail-2x2")

    def step(system, plan):
        return predict(SHAPES, system, system.nominal(), variant(f"{plan}:flat")).step_s

    assert step(rail, "c2u2") < step(rail, "u2c2") < step(rail, "u4")  # slow network: Ulysses stays inside nodes
    # a fast network and a slow node level (per-GPU NICs, no fast intra-node link): Ulysses belongs across
    inverted = replace(rail, levels=(replace(rail.levels[0], GBps=0.002, latency_us=100.0),),
                       network=replace(rail.network, nic_GBps=1.0, spine_GBps_per_rail=1.0, latency_us=100.0))
    assert step(inverted, "u2c2") < step(inverted, "c2u2")


def test_simulate_reports_plans_side_by_side(tmp_path, capsys):
    out = tmp_path / "plans.json"
    assert simulate(["--system", "rail-2x2", "--model", "tiny-shapes", "--resolution", "128", "--dtype", "fp32",
                     "--variants", "flat", "--plan", "auto,c2u2,u4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "CFG 2 (guided)" in text  # auto's reason, printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["plan"]) for r in rows] == [("auto:flat", "c2u2"), ("c2u2:flat", "c2u2"), ("u4:flat", "u4")]
    assert rows[0]["speedup_vs_flat"] > 1.5 and rows[0]["data_gather_ms"] > 0


def test_a_fixed_cost_per_phase_counts_once_per_phase_and_zero_changes_nothing():
    """`phase_us`: every non-empty phase pays it once (TAPA's two phases twice, flat's one once);
    a system without it predicts what it did before."""
    eight = load_system("rail-2x4")
    with_phase = eight.nominal()
    without = replace(eight, phase_us=0.0).nominal()
    phase = with_phase.latency["phase"]
    assert phase == pytest.approx(eight.phase_us * 1e-6) and "phase" not in without.latency
    for size in (64 * 1024, 4 * 2**20):
        (flat1, tapa1), (flat0, tapa0) = predict_a2a(eight, with_phase, size), predict_a2a(eight, without, size)
        assert flat1 - flat0 == pytest.approx(phase) and tapa1 - tapa0 == pytest.approx(2 * phase)
    assert "phase" not in load_system("rail-2x2").nominal().latency  # the 4-rank systems: none modelled


def test_calibration_fits_the_phase_cost_where_the_system_has_one():
    system, fit = fit_a2a(load_system("rail-2x4"), RESULTS / "a2a-rail2x4.json")
    assert "lat:phase" in fit.fitted and fit.params.latency["phase"] != fit.nominal.latency["phase"]
    _, four = fit_a2a(load_system("rail-2x2"), RESULTS / "a2a-rail2x2.json")
    assert "lat:phase" not in four.fitted
