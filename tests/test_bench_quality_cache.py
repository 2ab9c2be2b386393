"""`bench quality --cache SPEC`: each step cache is one more entry `cache=SPEC` against the exact
run, with the contract's keys and the cache's computed / skipped transformer calls."""

import json

import command
import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff.bench.quality import cache_figures, parse_caches
from cocodiff.cli import main
from cocodiff.errors import UsageError
from cocodiff.bench.report import render

CONTRACT = {"psnr", "ssim", "mse", "inter_node_bytes_saved", "cache_bytes", "lossy"}


def test_parse_caches_splits_on_semicolons_and_repeats():
    specs = parse_caches(["fbcache:0.1;dbcache:F1B0W2,0.1", "dbcache"])
    assert [str(s) for s in specs] == ["fbcache:0.1", "dbcache:F1B0W2,0.1", "dbcache"]
    assert parse_caches([]) == []
    with pytest.raises(UsageError, match="names no step cache"):
        parse_caches([" ; "])


def test_cache_figures_share():
    assert cache_figures(3, 1) == {"computed_steps": 3, "skipped_steps": 1, "skipped_share": 0.25}
    assert cache_figures(0, 0)["skipped_share"] == 0.0


def test_bad_cache_is_a_one_line_usage_error(capsys):
    assert main(["bench", "quality", "--cache", "teacache:fast"]) == 2  # before any rank starts
    err = capsys.readouterr().err.strip()
    assert err.startswith("cocodiff: error:") and "'fast' is neither options" in err and "\n" not in err


@pytest.mark.slow
def test_bench_quality_caches_write_their_entries(tmp_path):
    """tiny-flux, 64x64, 2 steps, 4 ranks as 2 nodes x 2 (V-Major's and the bytes' minimum).
    `fbcache:10` skips every step it may (the second: the first has no previous residual);
    threshold 0 never skips, so that entry is the exact run bit for bit (TAPA is exact)."""
    figures = tmp_path / "q.json"
    run = command.cocodiff(
        "bench", "quality", "--model", "tiny-flux", "--height", "64", "--width", "64",
         "--steps", "2", "--nproc", "4", "--cache", "fbcache:10;dbcache:F1B0W0,0", "--json", str(figures), timeout=RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["model"] == "tiny-flux"
    assert set(result["schedules"]) == {"off", "cache=fbcache:10", "cache=dbcache:F1B0W0,0"}  # caches alone: off only
    skipping, never = result["schedules"]["cache=fbcache:10"], result["schedules"]["cache=dbcache:F1B0W0,0"]
    for entry in (skipping, never):
        assert CONTRACT | {"skipped_share", "computed_steps", "skipped_steps"} <= set(entry)
        assert entry["lossy"] is True and entry["cache_bytes"] > 0
    assert (skipping["computed_steps"], skipping["skipped_steps"], skipping["skipped_share"]) == (1, 1, 0.5)
    assert 0 < skipping["inter_node_bytes_saved"] < 0.5  # the first block still sends on the skipped step
    assert (never["skipped_steps"], never["skipped_share"], never["inter_node_bytes_saved"]) == (0, 0.0, 0.0)
    assert never["psnr"] == float("inf") and never["mse"] == 0.0
    assert "cache=fbcache:10 (LOSSY)" in run.stdout and "50% (1/2)" in run.stdout


def test_results_page_shows_the_calls_skipped(tmp_path):
    entry = {"lossy": True, "psnr": 40.0, "ssim": 0.99, "mse": 1e-4, "inter_node_bytes_saved": 0.4, "cache_bytes": 2**20}
    result = {"date": "2026-01-01", "model": "tiny-shapes", "height": 64, "width": 64, "steps": 20, "tensors": "v",
              "nproc": 4, "nodes": 2, "ranks_per_node": 2,
              "schedules": {"off": {**entry, "lossy": False, "inter_node_bytes_saved": 0.0, "cache_bytes": 0},
                            "cache=fbcache:0.1": {**entry, **cache_figures(30, 10)}}}
    (tmp_path / "q.json").write_text(json.dumps(result))
    page = render(tmp_path)
    assert "step caches (TAPA)" in page and "| calls skipped |" in page
    assert "| cache=fbcache:0.1 (lossy) | 40.0 | 0.9900 | 40.0% | 1.00 | 25% (10/40) |" in page
    assert "| off (exact) | 40.0 | 0.9900 | 0.0% | 0.00 | - |" in page  # a V-Major schedule skips no calls
