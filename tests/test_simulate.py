"""`cocodiff simulate`: the cost model's invariants, its agreement with a measured run's bytes, the
calibration's fit, and the command's errors and JSON. Pure computation: no torch.distributed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cocodiff.cli import main
from cocodiff.errors import UsageError
from cocodiff.simulate.calibrate import fit_a2a, predict_a2a, validate_e2e
from cocodiff.simulate.model import NotRunnable, modelled_variants, predict, table_rows
from cocodiff.simulate.network import phase_load, routing, swap_matrix, tapa_matrices
from cocodiff.simulate.system import SYSTEMS, LinkParams, load_system
from cocodiff.simulate.workload import MODELS, Workload

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


def test_head_count_limit():
    workload = Workload(model=MODELS["sd35-large"], height=1024, width=1024)
    aurora = load_system("aurora")
    with pytest.raises(NotRunnable, match="38 attention heads"):
        predict(workload, aurora.with_nodes(4), aurora.nominal(), variant("flat"))
    rows, skipped = table_rows(workload, aurora, [1, 2, 4], modelled_variants("flat,tapa"), lambda s: s.nominal())
    assert [r["nodes"] for r in rows] == [1, 1, 2, 2]  # 24 ranks over 38 heads: uneven, runnable
    assert [s["nodes"] for s in skipped] == [4] and "48 ranks" in skipped[0]["reason"]


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
    (["--model", "flux1-dev", "--variants", "c2u2:flat"], "plans are not modelled"),
    (["--model", "flux1-dev", "--resolution", "1000"], "1000"),
    (["--model", "flux1-dev", "--nodes", "0,2"], "0,2"),
    ([], "--model"),
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
    from cocodiff.report import render

    assert simulate(["--system", "dgx-h100", "--model", "flux1-dev", "--nodes", "1,2", "--json", str(tmp_path / "sim.json")]) == 0
    capsys.readouterr()
    text = render(tmp_path)
    assert "### Simulated (cost model)" in text and "predicted, not measured" in text
    assert "| 2 | cocodiff (lossy) |" in text


def test_bench_and_simulate_share_one_variant_grammar():
    from cocodiff.variants import parse_variant, parse_variants

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
    for bad, message in [("ring", "'ring' is not one of flat, tapa, auto, diffusers-ulysses, cocodiff"),
                         ("u4x:tapa", "'u4x' is not a plan"), ("auto+vmajor", "needs tapa or flat"),
                         ("tapa+vmajor+vmajorqk", "exclude each other"), ("cocodiff+vfirst", "takes no options"),
                         ("diffusers-ulysses+vfirst", "takes no options"), ("cocodiff,tapa+vfirst+vmajor", "twice")]:
        with pytest.raises(UsageError) as bench:
            parse_variants(bad)
        with pytest.raises(UsageError) as sim:
            modelled_variants(bad)
        assert str(bench.value) == str(sim.value) and message in str(sim.value), bad
        assert len(str(sim.value).splitlines()) == 1
    for runnable_only in ("auto", "auto+vfirst", "flat+vmajor", "diffusers-ulysses"):  # bench runs them; no model here
        assert parse_variants(runnable_only)
        with pytest.raises(UsageError, match=re.escape(f"variant '{runnable_only}': ")):
            modelled_variants(runnable_only)


def test_tables_print_no_negative_zero_and_whole_headers(capsys):
    from cocodiff.tables import fixed

    assert [fixed(-1e-17), fixed(-0.04, sign=True), fixed(-0.4, 0), fixed(-0.06)] == ["0.0", "+0.0", "0", "-0.1"]
    # one node of Aurora: TAPA's exposed inter-node time is a rounding error below zero
    assert simulate(["--system", "aurora", "--model", "qwen-image", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "-0.0" not in out and "…" not in out
    for header in ("nodes x ranks", "exposed inter", "comm share", "inter-node MiB"):
        assert header in out, header  # on one line: the table is wide enough for its headers
