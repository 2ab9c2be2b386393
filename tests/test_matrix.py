"""The model x feature matrix (cocodiff/matrix): its declarations against the engine, a family that
enters it by its declaration alone, and the whole matrix (slow: CI runs it)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff.cli import build_parser, main
from cocodiff.config.env import PLUGINS_ENV
from cocodiff.engine.families import FAMILIES
from cocodiff.matrix.cells import FEATURES
from cocodiff.matrix.run import REFUSED, _resolve, plan_cells, run_matrix
from cocodiff.models.presets import PRESETS

PRESET_NAMES = list(PRESETS)


@pytest.fixture
def toy_family(monkeypatch):
    """tests/toy_family.py imported here and in every rank; its preset and family gone afterwards."""
    monkeypatch.setenv(PLUGINS_ENV, "toy_family")
    module = importlib.import_module("toy_family")
    yield module
    PRESETS.pop(module.NAME, None)
    FAMILIES.pop("ToyTransformer2DModel", None)
    sys.modules.pop("toy_family", None)


def test_every_declared_refusal_is_the_engines_and_the_engine_refuses_nothing_else(tmp_path):
    """Before any rank starts: a cell refuses (one line, as `verify` parses and resolves it) exactly
    when its feature or its family declares so, with the declared reason."""
    cells = plan_cells(PRESET_NAMES, list(FEATURES), tmp_path)
    parse = build_parser().parse_args
    for cell in cells:
        _resolve(cell, parse)
    wrong = [(c.model, c.feature.name, c.expected, c.outcome, c.message) for c in cells
             if (c.outcome == REFUSED) != (c.expected == REFUSED) or (c.outcome == REFUSED and not c.passed)]
    assert wrong == []
    refused = {(c.model, c.feature.name) for c in cells if c.outcome == REFUSED}
    assert ("tiny-zimage", "cfg groups") in refused and ("tiny-wan", "img2img") in refused
    assert ("tiny-flux", "cfg groups") not in refused


def test_a_new_family_enters_the_matrix_by_its_declaration(tmp_path, toy_family):
    """A preset and a family record (tests/toy_family.py) and nothing else: its cells run exact (or
    lossy within the floor) on 2 ranks, and what its record refuses is refused in one line with its reason."""
    features = [f for f in FEATURES if f.name in ("ring", "batch 2", "cfg groups", "fbcache")]
    cells = plan_cells([toy_family.NAME], features, tmp_path)
    run_matrix(cells, build_parser().parse_args, timeout_s=RANK_TIMEOUT_S, report=lambda line: None)
    outcome = {c.feature.name: (c.outcome, c.passed) for c in cells}
    assert outcome == {"ring": ("exact", True), "batch 2": ("exact", True), "cfg groups": ("refused", True),
                       "fbcache": ("lossy", True)}
    refused = next(c for c in cells if c.feature.name == "cfg groups")
    assert toy_family.REASON in refused.message and "ToyTransformer2DModel" in refused.message


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_preset_with_every_feature(tmp_path):
    """The matrix: no cell crashes, hangs, differs beyond its bound without saying LOSSY, or
    refuses where nothing declares it; it writes the table users read."""
    table, figures = tmp_path / "matrix.md", tmp_path / "matrix.json"
    code = main(["matrix", "--models", ",".join(PRESET_NAMES), "--markdown", str(table), "--json", str(figures), "--timeout", str(RANK_TIMEOUT_S)])
    cells = json.loads(figures.read_text())["cells"]
    failed = [(c["model"], c["feature"], c["expected"], c["outcome"], c["message"]) for c in cells if not c["passed"]]
    assert failed == [] and code == 0
    assert len(cells) == len(PRESET_NAMES) * len(FEATURES)
    assert table.read_text().count("\n| ") == len(FEATURES) + 1
