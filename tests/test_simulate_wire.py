"""`cocodiff simulate` with wire formats (`--wire`, `+fp8`): packed bytes per the formula, only
across the named level, the `--paper` fp8 column, and a bad level as a one-line error. In-process."""

from __future__ import annotations

import json

import pytest

from cocodiff.cli import main
from cocodiff.simulate.model import _gathers, modelled_variants, predict
from cocodiff.simulate.network import phase_load, routing, swap_matrix
from cocodiff.simulate.paper import FP8_VARIANT
from cocodiff.simulate.placement import place
from cocodiff.simulate.system import load_system
from cocodiff.simulate.wire import wire_cost
from cocodiff.simulate.workload import MODELS, Workload
from cocodiff.config.wire import parse_wire


def test_fp8_on_the_nodes_halves_inter_node_values_and_leaves_intra_node_bytes():
    at = load_system("aurora", nodes=2)
    D = MODELS["flux1-dev"].head_dim
    route, T = routing(at), swap_matrix([3] * at.ranks, [2] * at.ranks, 256.0)
    exact = phase_load(route, T)
    cost = wire_cost(parse_wire("node=fp8"), at, route, item=2, block=D, tensors={"v": 1.0})
    packed = phase_load(route, *cost.apply(T))
    assert packed.inter_node_bytes == pytest.approx(exact.inter_node_bytes * (1 + 4 / D) / 2, rel=1e-12)
    assert packed.intra_node_bytes == exact.intra_node_bytes
    assert packed.codec_s > 0 and exact.codec_s == 0


def test_fp8_variant_packs_every_exchange_across_nodes_k_at_bf16():
    at = load_system("aurora", nodes=2)
    workload = Workload(model=MODELS["flux1-dev"], height=768, width=768)
    exact, fp8 = (predict(workload, at, at.nominal(), v) for v in modelled_variants("tapa,tapa+fp8"))
    gather = sum(p.inter_node_bytes for p in _gathers(workload, place(exact.plan, at), at))  # not packed
    D = workload.model.head_dim
    ratio = (3 * (1 + 4 / D) / 2 + 1) / 4  # V, Q and O in fp8, K in bf16: per exchanged value
    assert fp8.inter_node_bytes == pytest.approx((exact.inter_node_bytes - gather) * ratio + gather, rel=1e-9)
    assert fp8.intra_node_bytes == pytest.approx(exact.intra_node_bytes, rel=1e-12)
    assert fp8.step_s < exact.step_s


def test_paper_gains_an_fp8_row_per_setting(tmp_path, capsys):
    path = tmp_path / "paper.json"
    assert main(["simulate", "--paper", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "+fp8 vs cocodiff" in out and "+fp8 (not in the paper)" in out
    settings = json.loads(path.read_text())["settings"]
    full = {(r["model"], r["resolution"], r["nodes"]): r for r in settings if r["variant"] == "cocodiff"}
    fp8 = {(r["model"], r["resolution"], r["nodes"]): r for r in settings if r["variant"] == FP8_VARIANT}
    assert full and fp8.keys() == full.keys()
    for key, row in fp8.items():
        assert row["wire"] == "slowest=fp8" and row["lossy"]
        if key[2] == 1:  # one node: nothing crosses the node level
            assert row["step_ms"] == pytest.approx(full[key]["step_ms"], rel=1e-12)
        else:
            assert row["step_ms"] < full[key]["step_ms"]


@pytest.mark.parametrize("wire,named", [("rack=fp8", "'rack'"), ("node=fp4", "'fp4'")])
def test_bad_wire_is_a_one_line_error(capsys, wire, named):
    assert main(["simulate", "--system", "aurora", "--model", "flux1-dev", "--nodes", "2", "--wire", wire]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and err.startswith("cocodiff: error:")
