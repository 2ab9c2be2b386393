"""`--compile`: regional compilation with the exchanges as functional collectives.

The graph-break checks trace each block with `torch._dynamo.explain` as rank 0 of a fake world
(no data moves; fast). The exactness checks run real ranks on gloo: by default with dynamo's
`eager` backend (the traced graphs run as they are: the functional collectives really move the
data, in seconds), and with inductor in the slow suite (its CPU compile takes about a minute).
"""

import json
import os

import command
import pytest
import torch
from conftest import RANK_TIMEOUT_S, patience
from torch._dynamo.utils import counters

from cocodiff import ParallelConfig, UsageError, parallelize
from cocodiff.bench.graphs import GraphsSpec, graph_breaks
from cocodiff.engine.families.sample_inputs import forward_inputs
from cocodiff.models.presets import load_pipeline, pipeline_inputs
from cocodiff.config.variants import parse_variant

RUNS_LONG = 4  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


def _rows(model: str, cases, functional=(True,)):
    return graph_breaks(GraphsSpec(model=model, ranks=4, cases=cases, functional=functional),
                        lambda _model, transformer: forward_inputs(transformer))


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd3", "tiny-qwen-image"])
def test_blocks_compile_whole_with_flat_and_tapa(model):
    rows = _rows(model, (("u4", "flat"), ("u4", "tapa")))
    assert len(rows) >= 2 and all(r["graphs"] == 1 and r["breaks"] == 0 for r in rows), rows


def test_blocks_on_c10d_works_break_at_every_collective():
    """Eager's path (async works) through dynamo: what the functional collectives avoid; the
    check above can fail."""
    rows = _rows("tiny-sd3", (("u4", "flat"),), functional=(False,))
    assert rows and all(r["breaks"] > 0 and any("async_op" in reason for reason in r["reasons"]) for r in rows), rows


def _verify(model: str, tmp_path, backend: str, *flags: str) -> dict:
    out = tmp_path / f"{model}{''.join(flags)}.json"
    env = dict(os.environ, COCODIFF_COMPILE_BACKEND=backend)
    run = command.cocodiff("verify", "--model", model, "--nproc", "2", "--height", "32", "--width", "48",
                           "--steps", "2", "--json", str(out), *flags, env=env, timeout=4 * RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


# The matrix's compile column runs every preset as this does (2 ranks, eager backend, exactness and
# the graphs traced); here, on one, the bytes counted inside compiled blocks.
def test_compiled_blocks_equal_one_process(tmp_path, model="tiny-flux"):
    compiled = _verify(model, tmp_path, "eager", "--compile")
    assert compiled["ok"] and compiled["max_rel_diff"] <= 1e-4 and compiled["compile"] is True
    # Bytes inside compiled blocks are counted from each layout's eager call: the same as eager's.
    assert compiled["bytes_by_axis"] == _verify(model, tmp_path, "eager")["bytes_by_axis"]


@pytest.mark.slow
def test_verify_compile_with_a_cache_equals_eager_with_it(tmp_path):
    """2 ranks, `--compile --cache`: the same steps skipped, the same bytes sent (a skipped block
    adds none) and the same error against the uncached run as eager with the same cache."""
    flags = ("--steps", "6", "--cache", "dbcache:F1B0W1,0.6")
    compiled, eager = _verify("tiny-flux", tmp_path, "eager", "--compile", *flags), _verify("tiny-flux", tmp_path, "eager", *flags)
    assert compiled["ok"] and compiled["compile"] and compiled["lossy"] and compiled["cache"] == eager["cache"]
    assert 0 < eager["cache"]["skipped_steps"] < 6 and compiled["bytes_by_axis"] == eager["bytes_by_axis"]
    assert compiled["max_rel_diff"] == pytest.approx(eager["max_rel_diff"], rel=1e-3, abs=1e-5)


@pytest.mark.slow
# The default preset and the one with complex rotary embeddings (about 90 s each on 2 cores);
# SD3's joint blocks are FLUX's double blocks for the compiler, and the eager-backend checks above
# and the matrix's compile column cover every family's graphs.
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-qwen-image"])
def test_inductor_compiled_blocks_equal_one_process(model, tmp_path):
    result = _verify(model, tmp_path, "inductor", "--compile")
    assert result["ok"] and result["max_rel_diff"] <= 1e-4


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(comm="auto"), "--compile runs fixed exchanges and plans; --comm auto switches"),
        (dict(plan="auto"), "--plan auto switches"),
        (dict(v_major="linear"), "--v-major linear switches"),
    ],
)
def test_compile_takes_fixed_exchanges_and_plans(config, message):
    with pytest.raises(UsageError, match=message):
        ParallelConfig(compile=True, **config)


def test_compile_as_a_bench_variant():
    assert parse_variant("u2r2:tapa+vfirst+compile").compile
    assert parse_variant("tapa+compile+vfirst") == parse_variant("tapa+vfirst+compile")
    with pytest.raises(UsageError, match=r"\+compile runs fixed exchanges and plans"):
        parse_variant("auto+compile")
    cached = parse_variant("u2:flat+vfirst+cache=dbcache:F1B0,0.08+compile")  # a cache wraps the compiled blocks
    assert cached.compile and cached.cache == "dbcache:F1B0,0.08"


def test_compile_with_auto_is_one_line_with_exit_2():
    run = command.cocodiff("generate", "--compile", "--comm", "auto", timeout=patience(60))
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "--compile runs fixed exchanges and plans" in run.stderr


CACHE = "dbcache:F1B0W1,0.6"
"""Skips 4 of 6 steps of tiny-flux at 32x48 on one process (measured: steps 1, 2, 4, 5): a mix of both."""


def _cached_run(compile: bool) -> tuple[torch.Tensor, list[int], dict]:
    """tiny-flux, 6 steps under `CACHE` on this process's one-rank world: the latents, the skipped
    count after each step, the cache's report."""
    pipe, encoder = load_pipeline("tiny-flux", seed=0)
    pipe.set_progress_bar_config(disable=True)
    parallel = parallelize(pipe, ParallelConfig(cache=CACHE, compile=compile))
    skipped = []

    def after_step(_pipe, _step, _t, outputs):
        skipped.append(parallel.cache.skipped_steps)
        return outputs

    latents = pipe(**pipeline_inputs(pipe, encoder, "a small green star"), height=32, width=48,
                   num_inference_steps=6, generator=torch.Generator().manual_seed(0), output_type="latent",
                   callback_on_step_end=after_step).images
    report = parallel.cache.report()
    parallel.undo()
    return latents, skipped, report


def test_compiled_blocks_under_a_step_cache_skip_the_same_steps(monkeypatch, one_rank):
    """`--compile --cache`: the cache wraps the compiled forwards, so its decision (an all-reduce
    and a host read) runs eagerly outside the graphs (no graph break), the same steps are skipped
    and the latents equal eager's with the same cache."""
    monkeypatch.setenv("COCODIFF_COMPILE_BACKEND", "eager")
    eager, eager_skips, eager_report = _cached_run(compile=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_skips, compiled_report = _cached_run(compile=True)
    assert compiled_skips == eager_skips == [0, 1, 2, 2, 3, 4] and compiled_report == eager_report  # a mix
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # the blocks did run compiled
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def compiled_run(model: str, steps: int) -> int:
    """`model` under `--compile` (dynamo's `eager` backend) for `steps` steps, with any recompilation an
    error: the graphs compiled."""
    import torch._dynamo

    from cocodiff.config.env import COMPILE_BACKEND_ENV

    os.environ[COMPILE_BACKEND_ENV] = "eager"
    torch._dynamo.config.error_on_recompile = True
    pipe, _ = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    parallelize(pipe, ParallelConfig(compile=True))
    pipe("a small green star", height=64, width=64, num_inference_steps=steps, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    return int(counters["stats"]["unique_graphs"])


def test_blocks_of_one_list_share_one_graph_across_blocks_and_steps():
    """FLUX.2 on the generic layer (its stock processors reach the exchange through the dispatcher): each
    list's blocks compile once, not once per block (a block's name read in its graph would be a guard) nor
    once per call (nor a counter read there): six steps, no recompilation, one graph per kind of block."""
    from cocodiff.run.launch import spawn

    assert spawn(compiled_run, 2, "tiny-flux2", 6, timeout_s=RANK_TIMEOUT_S) == [2, 2]
