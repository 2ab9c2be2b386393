"""Step caches beyond DBCache: TaylorSeer (alone and on DBCache), TeaCache and MagCache, on the toy
transformer of test_cache.py; and every kind's ranks agreeing under rank-divergent data."""

import math

import pytest
import torch
from test_cache import Toy, toy_cache, toy_run

from cocodiff.engine.cache import parse_cache
from cocodiff.engine.cache.magcache import MagCurve, load_curve
from cocodiff.config.env import CACHE_DIR_ENV
from cocodiff.engine.cache.taylor import TaylorResidual


def toy_inputs():
    g = torch.Generator().manual_seed(0)
    return Toy(), torch.randn(2, 6, 4, generator=g), torch.randn(2, 3, 4, generator=g)


def test_taylor_extrapolation_is_exact_on_polynomials_of_its_order():
    a, b, c = (torch.randn(2, 3) for _ in range(3))
    text = torch.ones(1, 2)
    for order, residual in [(1, lambda s: a + b * s), (2, lambda s: a + b * s + c * s * s)]:
        taylor = TaylorResidual(order)
        for step in (0, 2, 3, 5):  # computed steps, unevenly spaced
            taylor.update(step, (residual(step), text))
        image, text_out = taylor.predict(7)
        assert torch.allclose(image, residual(7), atol=1e-4) and torch.equal(text_out, text)
    plain = TaylorResidual(0)
    plain.update(0, (a, None))
    plain.update(1, (b, None))
    assert plain.predict(4)[0] is b  # order 0: the last residual itself
    shapes = TaylorResidual(1)
    shapes.update(0, (a, None))
    shapes.update(1, (torch.zeros(4, 3), None))  # another layout: the differences start again
    assert len(shapes.factors) == 1


def test_taylorseer_computes_one_step_in_n_and_extrapolates():
    toy, x, text = toy_inputs()
    plain = toy_run(toy, x, text, 8)
    cache = toy_cache(toy, "taylorseer:N3O1")
    cached = toy_run(toy, x, text, 8)
    # W2 (O1 + 1) warm-up steps, then one computed and two extrapolated: C C S S C S S C.
    assert [torch.equal(a, b) for a, b in zip(plain, cached)] == [True, True, False, False, True, False, False, True]
    assert cache.report() == {"spec": "taylorseer:N3O1", "computed_steps": 4, "skipped_steps": 4}
    cache.undo()
    reused = toy_cache(toy, "dbcache:F1B0W2MC2,1e9")  # the same steps skipped, residual reused as is
    plain_reuse = toy_run(toy, x, text, 8)
    reused.undo()
    assert reused.report()["skipped_steps"] == 4
    error = lambda outs: sum(float((o - p).abs().max()) for o, p in zip(outs, plain))  # noqa: E731
    assert error(cached) < 0.5 * error(plain_reuse)  # the extrapolated residual follows the steps
    every = toy_cache(toy, "taylorseer:N1O2")  # N1: every step computes, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(plain, toy_run(toy, x, text, 8)))
    assert every.report()["skipped_steps"] == 0


def test_taylorseer_on_dbcache():
    toy, x, text = toy_inputs()
    plain = toy_run(toy, x, text, 8)
    runs = {}
    for spec in ("dbcache:F1B1W2MC2,0.5", "dbcache:F1B1W2MC2O1,0.5"):
        cache = toy_cache(toy, spec)
        runs[spec] = (toy_run(toy, x, text, 8), cache.report())
        cache.undo()
    (reused, plain_report), (extrapolated, taylor_report) = runs.values()
    assert plain_report["skipped_steps"] == taylor_report["skipped_steps"] == 4  # the same decisions
    error = lambda outs: sum(float((o - p).abs().max()) for o, p in zip(outs, plain))  # noqa: E731
    assert error(extrapolated) < 0.5 * error(reused)


def test_teacache_accumulates_the_change_of_the_modulated_input():
    toy, x, text = toy_inputs()
    plain = toy_run(toy, x, text, 8)
    cache = toy_cache(toy, "teacache:0.003")  # the toy's input changes by 0.0013 a step
    changes = []
    agree = cache.agree
    cache.agree = lambda values: changes.append(values.tolist()) or agree(values)
    cached = toy_run(toy, x, text, 8)
    report = cache.report()
    cache.undo()
    assert report["rescale"] == "identity" and report["skipped_steps"] >= 1
    same = [torch.equal(a, b) for a, b in zip(plain, cached)]
    # The toy's blocks have no modulation: the signal is its input, whose relative change is known.
    accumulated, expected = 0.0, [True]
    for numerator, denominator, _ in changes[1:]:
        accumulated += numerator / denominator
        skip = accumulated < 0.003
        expected.append(not skip)
        accumulated = accumulated if skip else 0.0
    assert same == expected == [True, False, False, True, False, False, True, False]  # two changes, not three
    never = toy_cache(toy, "teacache:0")  # threshold 0: nothing skipped, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(plain, toy_run(toy, x, text, 8)))
    assert never.report()["skipped_steps"] == 0


def test_magcache_calibrates_once_then_skips(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    toy, x, text = toy_inputs()
    plain = toy_run(toy, x, text, 10)
    first = toy_cache(toy, "magcache:0.5")
    assert all(torch.equal(a, b) for a, b in zip(plain, toy_run(toy, x, text, 10)))  # it calibrates: skips nothing
    report = first.report()
    assert report["calibrating"] and report["skipped_steps"] == 0
    first.finish()  # the run's end: the curve is stored
    curve = load_curve(tmp_path / "magcache" / report["curve"].rsplit("/", 1)[-1])
    assert curve is not None and curve.steps == 10 and curve.ratios[0] == 1.0
    toy_run(toy, x, text, 10)  # the same cache's next run uses the curve it measured
    assert not first.calibrating and first.report()["skipped_steps"] >= 1
    first.undo()
    later = toy_cache(toy, "magcache:0.5")  # a new process: reads the stored curve
    cached = toy_run(toy, x, text, 10)
    assert not later.calibrating and later.report()["skipped_steps"] == first.report()["skipped_steps"]
    assert [torch.equal(a, b) for a, b in zip(plain, cached)][:2] == [True, True]  # W2: 20% of 10 steps
    later.undo()
    never = toy_cache(toy, "magcache:0")
    assert all(torch.equal(a, b) for a, b in zip(plain, toy_run(toy, x, text, 10)))
    assert never.report()["skipped_steps"] == 0


def test_magcache_fingerprint_is_the_same_in_every_process(tmp_path, monkeypatch):
    """diffusers notes in the config the defaults it filled in, as a list in a set's order: that
    order changes from process to process (hash randomization), the fingerprint must not."""
    from cocodiff.engine.cache.magcache import curve_path

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    toy = Toy()
    toy.config = {"num_layers": 2, "_use_default_values": ["a", "b"]}
    first = curve_path(toy)
    toy.config = {"num_layers": 2, "_use_default_values": ["b", "a"]}
    assert curve_path(toy) == first
    toy.config = {"num_layers": 3, "_use_default_values": ["b", "a"]}
    assert curve_path(toy) != first


def test_magcache_curve_reads_through_the_timestep():
    curve = MagCurve((1000.0, 900.0, 800.0, 700.0), (1.0, 1.2, 1.1, 0.9))
    assert curve.ratio(900.0, 800.0) == 1.1  # a calibrated step: its own ratio
    # Two steps' worth: the log-rate read at the span's middle is the mean of the two steps' own,
    # so the ratio is their product exactly (not 1.0, which is the ratio of no step at all).
    assert math.isclose(curve.ratio(900.0, 700.0), 1.1 * 0.9, rel_tol=1e-9)
    assert math.isclose(curve.ratio(1000.0, 800.0), 1.2 * 1.1, rel_tol=1e-9)
    assert math.isclose(curve.ratio(1000.0, 950.0), math.sqrt(1.2))  # half a step: half the log-ratio


def local_teacache_skips(changes: list[tuple], threshold: float) -> list[bool]:
    """The skips a rank would take on its own relative changes (TeaCache's rule, identity rescale)."""
    skips, accumulated = [], 0.0
    for mine, _ in changes:
        accumulated += mine if mine is not None else math.inf
        skips.append(accumulated < threshold)
        accumulated = accumulated if skips[-1] else 0.0
    return skips


DIVERGENT_TEACACHE = "teacache:0.2"
"""On tiny-flux, 48x80, rank 1's weights perturbed, 8 steps, the ranks' own accumulated changes
would skip different steps (measured: at step 5 rank 0 would skip, rank 1 compute; checked in the
test); the world's sums give one set of steps."""


def run_kinds(cache_dir: str) -> dict:
    """tiny-flux under Ulysses over 2 ranks, rank 1 perturbed: each new kind's latents and report
    (magcache: a calibration run, then a run on the curve it measured)."""
    import os

    from test_cache import DIVERGENT, run_flux

    os.environ[CACHE_DIR_ENV] = cache_dir
    out = {"plain": run_flux(None, True, 8)}
    for spec in ("taylorseer:N2O1", "taylorseer:N1", "teacache:0", DIVERGENT_TEACACHE):
        out[spec] = run_flux(spec, True, 8)
    out["magcache"] = run_flux("magcache:0.3", True, 8, runs=2)
    out["dbcache+O1"] = run_flux(DIVERGENT.replace("W1", "W1O1"), True, 6)
    return out


@pytest.mark.slow
def test_new_kinds_agree_across_ranks_with_divergent_data(tmp_path):
    """Rank 1's weights perturbed (test_cache.py): every kind takes the same decisions on both
    ranks and they end with the same latents; N1 and threshold 0 are the uncached run bit for bit;
    TeaCache's own changes would have the ranks skip different steps."""
    from conftest import RANK_TIMEOUT_S
    from test_cache import DIVERGENT, straddled

    from cocodiff.run.launch import spawn

    ranks = spawn(run_kinds, 2, str(tmp_path), timeout_s=2 * RANK_TIMEOUT_S)
    for rank in ranks:
        for exact in ("taylorseer:N1", "teacache:0"):
            assert torch.equal(rank[exact]["latents"], rank["plain"]["latents"]), exact
            assert rank[exact]["report"]["skipped_steps"] == 0
    for kind in ("taylorseer:N2O1", DIVERGENT_TEACACHE, "magcache", "dbcache+O1"):
        first, second = ranks[0][kind], ranks[1][kind]
        assert torch.equal(first["latents"], second["latents"]), kind
        assert first["report"]["skipped_steps"] == second["report"]["skipped_steps"] >= 1, kind
        assert first["report"]["computed_steps"] == second["report"]["computed_steps"], kind
    assert ranks[0]["taylorseer:N2O1"]["report"]["skipped_steps"] == 3  # W2, then one step in 2
    threshold = parse_cache(DIVERGENT_TEACACHE).threshold
    local = [local_teacache_skips(rank[DIVERGENT_TEACACHE]["changes"], threshold) for rank in ranks]
    assert local[0] != local[1], local  # decided locally, the ranks would part
    magcache = [rank["magcache"]["report"] for rank in ranks]
    assert magcache[0]["curve"] != magcache[1]["curve"]  # other weights, another fingerprint
    assert not magcache[0]["calibrating"]  # the second run on the curve the first measured
    assert straddled([rank["dbcache+O1"]["changes"] for rank in ranks], parse_cache(DIVERGENT).threshold)
