"""`bench quality --patches SPEC`: each displaced patch setting is one more entry
`patches=M,warmup=K,text=T` against the exact run, run on two pipeline stages."""

import json
import math

import command
import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff.bench.quality import parse_patches, patch_plan
from cocodiff.bench.report import render
from cocodiff.cli import main
from cocodiff.config.parallel import ParallelConfig
from cocodiff.config.quality import FLOORS_DB
from cocodiff.errors import UsageError

DEFAULTS = ParallelConfig()
"""What a spec leaves out is generate's default (--pipe-warmup, --pipe-text)."""


def test_parse_patches_normalizes_each_spec_to_its_full_name():
    entries = parse_patches(["2", " 4 , warmup=2 , text=whole;3,text=patched,warmup=0"])
    assert [e.name for e in entries] == [
        f"patches=2,warmup={DEFAULTS.pipe_warmup},text={DEFAULTS.pipe_text}",
        "patches=4,warmup=2,text=whole",
        "patches=3,warmup=0,text=patched",
    ]
    assert (entries[1].count, entries[1].warmup, entries[1].text) == (4, 2, "whole")
    assert parse_patches([]) == []
    with pytest.raises(UsageError, match="names the entry patches=2,warmup=1,text=whole twice"):
        parse_patches(["2,text=whole;2,warmup=1,text=whole"])


@pytest.mark.parametrize("spec, message", [
    ("1", "the patch count '1' is not a number of at least 2"),
    ("x", "the patch count 'x' is not a number of at least 2"),
    ("2,warmup=-1", "warmup=-1 is not a number of steps"),
    ("2,text=foo", "text=foo is not one of patched, whole"),
    ("2,bogus=1", "'bogus=1' is not warmup=K or text=patched|whole"),
    (" ; ", "names no patch count"),
])
def test_bad_patches_are_a_one_line_usage_error_before_any_rank(capsys, no_ranks, spec, message):
    with pytest.raises(UsageError, match=message) as error:
        parse_patches([spec])
    assert f"--patches {spec!r}" in str(error.value) and "\n" not in str(error.value)
    assert main(["bench", "quality", "--patches", spec]) == 2  # refused before any rank starts
    err = capsys.readouterr().err.strip()
    assert err.startswith("cocodiff: error:") and message in err and "\n" not in err


def test_the_patch_plan_puts_two_stages_outermost():
    assert (patch_plan(2), patch_plan(4), patch_plan(8)) == ("p2u1", "p2u2", "p2u4")
    assert patch_plan(3) is None  # the default plan: the schedule on one stage, the same numbers


def test_bench_quality_patches_writes_its_entry(tmp_path):
    """tiny-shapes, 6 steps, 2 ranks as one node (patches alone need no second node): the entry runs
    on p2u1 and moves the image, within the mode's floor; `off` beside it is the exact run."""
    figures = tmp_path / "q.json"
    run = command.cocodiff(
        "bench", "quality", "--model", "tiny-shapes", "--nproc", "2",
         "--patches", "2", "--steps", "6", "--json", str(figures), timeout=RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    name = f"patches=2,warmup={DEFAULTS.pipe_warmup},text={DEFAULTS.pipe_text}"
    assert set(result["schedules"]) == {"off", name} and result["patch_plan"] == "p2u1"  # patches alone: off only
    off, patched = result["schedules"]["off"], result["schedules"][name]
    assert off["psnr"] == float("inf") and off["mse"] == 0.0 and off["lossy"] is False
    assert patched["lossy"] is True and math.isfinite(patched["psnr"]) and patched["psnr"] < off["psnr"]
    # Displaced, not rounded: the same stages running every step whole land near 140 dB (fp32 rounding);
    # the displaced steps near 40, within the mode's floor.
    assert FLOORS_DB["patches"] <= patched["psnr"] < 80 and 0 < patched["ssim"] < 1
    assert patched["inter_node_bytes_saved"] is None and patched["cache_bytes"] > 0  # another plan; K/V buffers
    assert f"{name} (LOSSY)" in run.stdout and "displaced patches (p2u1)" in run.stdout


def test_results_page_shows_no_bytes_saved_for_patches(tmp_path):
    entry = {"lossy": True, "psnr": 40.0, "ssim": 0.99, "mse": 1e-4, "inter_node_bytes_saved": None, "cache_bytes": 2**21}
    result = {"date": "2026-01-01", "model": "tiny-shapes", "height": 64, "width": 64, "steps": 20, "tensors": "v",
              "nproc": 4, "nodes": 2, "ranks_per_node": 2, "patch_plan": "p2u2",
              "schedules": {"off": {**entry, "lossy": False, "inter_node_bytes_saved": 0.0, "cache_bytes": 0},
                            "patches=2,warmup=1,text=whole": entry}}
    (tmp_path / "q.json").write_text(json.dumps(result))
    page = render(tmp_path)
    heading = next(line for line in page.splitlines() if line.startswith("**bench quality**"))
    assert "displaced patches (p2u2);" in heading and "V-Major" not in heading
    assert "| patches=2,warmup=1,text=whole (lossy) | 40.0 | 0.9900 | - | 2.00 |" in page
    assert "| off (exact) | 40.0 | 0.9900 | 0.0% | 0.00 |" in page
