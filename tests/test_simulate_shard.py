"""`simulate` with `+shard`: the weights' all-gathers inside each node (cocodiff/simulate/shard.py).
Pure computation: no torch.distributed; the parameter counts of one real checkpoint come from its
config on `meta`, the rest use fixed counts."""

from __future__ import annotations

import json

import pytest

from cocodiff.cli import main
from cocodiff.simulate import shard
from cocodiff.errors import UsageError
from cocodiff.simulate.model import NotRunnable, modelled_variants, predict
from cocodiff.simulate.shard import Units, weight_gathers
from cocodiff.simulate.system import load_system
from cocodiff.simulate.workload import MODELS, Workload

FAKE = Units(root=3_000_000, blocks=(20_000_000,) * 2 + (8_000_000,) * 2)
"""Four blocks (tiny-flux's 2 double + 2 single), a billion-parameter scale: gathers that cost something."""


def variant(name: str):
    return modelled_variants(name)[0]


@pytest.fixture
def fake_units(monkeypatch):
    monkeypatch.setattr(shard, "units_of", lambda model: FAKE)
    return FAKE


def test_gather_bytes_are_the_parameters_times_two_bytes_times_n_minus_1_over_n():
    """FLUX.1-dev on Aurora (12 ranks a node), bf16, one call per step: every parameter once."""
    units = shard.units_of("flux1-dev")
    assert units.params == 11_901_408_320 and len(units.blocks) == 19 + 38  # the published config
    workload = Workload(model=MODELS["flux1-dev"], height=1024, width=1024, steps=28)
    for nodes in (1, 2):
        at = load_system("aurora", nodes=nodes)
        p = predict(workload, at, at.nominal(), variant("tapa+vfirst+shard"))
        assert p.shard_gather_bytes == pytest.approx(units.params * 2 * 11 / 12, rel=1e-12)
        whole = predict(workload, at, at.nominal(), variant("tapa+vfirst"))
        assert p.intra_node_bytes == whole.intra_node_bytes  # kept apart from the exchanges' bytes


def test_two_calls_per_step_gather_twice(fake_units):
    """Qwen-Image's true CFG (two calls per step) on 2 nodes x 8: each call gathers every block."""
    at = load_system("dgx-h100", nodes=2)
    workload = Workload(model=MODELS["qwen-image"], height=1024, width=1024, steps=4)
    p = predict(workload, at, at.nominal(), variant("flat+shard"))
    assert p.shard_gather_bytes == pytest.approx(2 * FAKE.params * 2 * 7 / 8, rel=1e-12)


@pytest.mark.parametrize("system,model,size", [("aurora", "flux1-dev", 1024), ("dgx-h100", "flux1-dev", 4096),
                                               ("rail-2x2", "tiny-flux", 512), ("aurora", "qwen-image", 2048),
                                               ("dgx-h100", "wan21-14b", 720)])
@pytest.mark.parametrize("name", ["flat", "tapa+vfirst", "auto:tapa", "tapa+vfirst+vmajor", "tapa+fp8"])
def test_shard_is_never_faster(fake_units, system, model, size, name):
    """The same variant with its weights sharded: the same compute and exchanges, plus the gathers."""
    spec = MODELS[model]
    workload = Workload(model=spec, height=size if not spec.video else 720, width=size if not spec.video else 1280,
                        steps=4, frames=None)
    compared = 0
    for nodes in (1, 2, 4):
        at = load_system(system, nodes=nodes)
        base = variant(name)
        try:
            whole = predict(workload, at, at.nominal(), base)
        except (NotRunnable, UsageError):  # a plan that does not fit these ranks: nothing to compare
            continue
        sharded = predict(workload, at, at.nominal(), variant(name + "+shard"))
        assert sharded.step_s > whole.step_s
        assert sharded.step_s == pytest.approx(whole.step_s + sharded.shard_exposed_s, rel=1e-9)
        assert 0 < sharded.shard_exposed_s <= sharded.shard_comm_s
        assert (sharded.compute_s, sharded.inter_node_bytes) == (whole.compute_s, whole.inter_node_bytes)
        compared += 1
    assert compared


def test_gathers_hide_behind_compute_beyond_the_first():
    """Each block's gather flies while the block before it computes: with more compute per block
    than a gather takes, only the first gather is exposed (no root here); with less, more is."""
    at = load_system("dgx-h100", nodes=1)
    workload = Workload(model=MODELS["flux1-dev"], height=1024, width=1024)
    params = at.nominal()
    units = Units(root=0, blocks=(300_000_000,) * 4)
    first = weight_gathers(Units(root=0, blocks=units.blocks[:1]), [0.0], workload, at, params).comm_s
    assert first > 0
    slow = weight_gathers(units, [10 * first] * 4, workload, at, params)
    assert slow.exposed_s == pytest.approx(first, rel=1e-12)
    assert slow.comm_s == pytest.approx(4 * first, rel=1e-12)
    fast = weight_gathers(units, [first / 4] * 4, workload, at, params)
    assert fast.exposed_s == pytest.approx(first + 3 * (first - first / 4), rel=1e-12)


def test_simulate_reports_shard_rows(fake_units, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--system", "rail-2x2", "--model", "tiny-flux", "--resolution", "512", "--nodes", "1,2",
                 "--variants", "tapa+vfirst,tapa+vfirst+shard", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    sharded = [r for r in rows if r["variant"] == "tapa+vfirst+shard"]
    assert [r["nodes"] for r in sharded] == [1, 2]
    for r in sharded:
        assert r["shard_gather_bytes_per_step"] == pytest.approx(FAKE.params * 4 * 1 / 2)  # fp32, 2 ranks a node
        assert 0 < r["shard_exposed_ms"] <= r["shard_gather_ms"]
    assert all("shard_exposed_ms" not in r for r in rows if r["variant"] == "tapa+vfirst")
    assert "weight gathers" in capsys.readouterr().out
