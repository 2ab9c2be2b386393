"""The shape of the package holds: layered imports, no cycles, torch-free grammar (docs/architecture.md).

The contracts themselves are `[tool.importlinter]` in pyproject.toml; `lint-imports` reads every
import, function-level ones included. One test plants an upward import in a copy of the package
and checks that the linter refuses it, so the contracts cannot pass by checking nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cocodiff"


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_inside_a_function_breaks_the_layers(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "cocodiff", ignore=shutil.ignore_patterns("__pycache__", "weights"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    plan = tmp_path / "cocodiff" / "config" / "plan.py"
    plan.write_text(plan.read_text() + "\n\ndef _upward():\n    from ..run import launch  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "cocodiff.config is not allowed to import cocodiff.run" in result.stdout, result.stdout


def test_the_grammar_catalog_simulate_and_cluster_load_no_torch():
    code = (
        "import importlib, pkgutil, sys, cocodiff.config; "
        "[importlib.import_module(m.name) for m in pkgutil.iter_modules(cocodiff.config.__path__, 'cocodiff.config.')]; "
        "import cocodiff.models.catalog, cocodiff.simulate.cli, cocodiff.cluster.cli; "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers')); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_the_package_root_holds_only_the_public_api_the_entry_points_and_the_errors():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "cli.py", "errors.py"], modules
