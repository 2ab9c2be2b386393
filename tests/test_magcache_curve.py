"""MagCache's calibrated curve is stored once, after the run, by one rank: never from inside the
transformer's forward (where a filesystem error on some ranks would leave the others waiting in
the next collective), under a temporary name no other host's writer picks."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S
from test_cache import toy_cache, toy_run
from test_cache_kinds import toy_inputs

from cocodiff.config.env import CACHE_DIR_ENV
from cocodiff.engine.cache import magcache, steps
from cocodiff.engine.cache.magcache import MagCurve, curve_path, load_curve, store_curve
from cocodiff.run.launch import spawn

STEPS = 6


def test_writers_with_the_same_pid_on_two_hosts_do_not_collide(tmp_path, monkeypatch):
    """Two hosts of a shared filesystem may run writers of the same pid: one writes its temporary
    file while the other is between writing its own and renaming it. Each renames a whole file."""
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    path = tmp_path / "magcache" / "Toy-0.json"
    ours, theirs = MagCurve((1000.0, 990.0), (1.0, 1.1)), MagCurve((1000.0, 990.0), (1.0, 1.2))
    replace = os.replace
    calls = []

    def interleaved(source, target):
        calls.append(source)
        if len(calls) == 1:  # ours is written, not yet renamed: the other host's writer runs whole
            store_curve(path, theirs)
        replace(source, target)

    monkeypatch.setattr(os, "replace", interleaved)
    store_curve(path, ours)
    assert calls[0] != calls[1]
    assert load_curve(path) == ours  # the last rename wins, whole
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_the_curve_is_stored_once_after_the_run_not_inside_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    stored = []
    monkeypatch.setattr(steps, "store_curve", lambda path, curve: stored.append(path) or store_curve(path, curve))
    toy, x, text = toy_inputs()
    cache = toy_cache(toy, "magcache:0.5")
    toy_run(toy, x, text, STEPS)
    assert cache.calibrating and stored == []  # nothing written from inside the forward
    cache.finish()
    cache.finish()
    assert stored == [curve_path(toy)] and load_curve(stored[0]).steps == STEPS
    toy_run(toy, x, text, STEPS)  # the next run uses the curve: nothing to store
    cache.undo()
    assert stored == [curve_path(toy)] and cache.report()["skipped_steps"] >= 1


def test_a_curve_not_yet_stored_is_stored_by_undo(tmp_path, monkeypatch):
    """A cache installed for one pipeline call (`serve`'s per-request batching) is undone at its end."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    toy, x, text = toy_inputs()
    cache = toy_cache(toy, "magcache:0.5")
    toy_run(toy, x, text, STEPS)
    cache.undo()
    assert load_curve(curve_path(toy)).steps == STEPS


def test_a_write_error_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "file" / "cache"))  # under a file: mkdir fails
    toy, x, text = toy_inputs()
    plain = toy_run(toy, x, text, STEPS)
    cache = toy_cache(toy, "magcache:0.5")
    calibrated = toy_run(toy, x, text, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(plain, calibrated))
    with pytest.warns(RuntimeWarning, match="MagCache's calibrated curve was not stored at .*file/cache"):
        cache.finish()
    toy_run(toy, x, text, STEPS)  # the curve measured is used all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.undo()  # tried once: no second warning
    assert not cache.calibrating and cache.report()["skipped_steps"] >= 1


def ranks_store_the_curve(cache_dir: str) -> dict:
    """2 ranks, the toy on each, agreeing through an all-reduce: a calibration run whose store fails
    on rank 0 and the run after it; a new cache's calibration run, stored by rank 0 only after
    rank 1 has looked for the curve as a third cache starts. Who stored, what warned, what was read."""
    os.environ[CACHE_DIR_ENV] = cache_dir
    rank, stored, reads = dist.get_rank(), [], []

    def store(path, curve):
        stored.append(rank)
        if len(stored) == 1:
            raise PermissionError(13, "Permission denied", str(path))
        store_curve(path, curve)

    steps.store_curve = store  # this rank's process alone

    def agree(values: torch.Tensor) -> list[float]:
        total = values.clone()
        dist.all_reduce(total)
        return total.tolist()

    toy, x, text = toy_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = toy_cache(toy, "magcache:0.5", agree)
        toy_run(toy, x, text, STEPS)
        first.finish()  # rank 0's store fails
        toy_run(toy, x, text, STEPS)  # the same cache's next run, on the curve it measured
        report = first.report()
        first.undo()
        second = toy_cache(toy, "magcache:0.5", agree)  # no curve stored: it calibrates
        toy_run(toy, x, text, STEPS)
        if rank == 0:
            dist.recv(torch.zeros(1), src=1)  # rank 1 has looked for the curve
        else:
            def read_and_tell(path):
                curve = load_curve(path)
                reads.append(curve is not None)
                if len(reads) == 1:
                    dist.send(torch.ones(1), dst=0)
                return curve

            magcache.load_curve = read_and_tell
        second.finish()
        second.undo()
        third = toy_cache(toy, "magcache:0.5", agree)
    return {"stored": stored, "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
            "report": report, "reads": reads, "third_calibrating": third.calibrating}


def test_only_rank_0_stores_and_its_error_leaves_the_ranks_together(tmp_path):
    """Every rank holds the same curve (agreed ratios); rank 0 alone writes it. Its first write fails:
    a warning on rank 0, and both ranks go on with the same decisions (a raise inside the forward
    on one rank would have left the other waiting in the next all-reduce). A rank that looks for
    the curve before rank 0 has stored it looks again after the agreement, and finds it."""
    ranks = spawn(ranks_store_the_curve, 2, str(tmp_path), timeout_s=RANK_TIMEOUT_S)
    assert ranks[0]["stored"] == [0, 0] and ranks[1]["stored"] == []
    assert len(ranks[0]["warnings"]) == 1 and "Permission denied" in ranks[0]["warnings"][0]
    assert ranks[1]["warnings"] == []
    assert ranks[0]["report"] == ranks[1]["report"] and ranks[0]["report"]["skipped_steps"] >= 1
    assert ranks[1]["reads"] == [False, True]
    assert not ranks[0]["third_calibrating"] and not ranks[1]["third_calibrating"]
    assert [p.name.startswith(".") for p in (tmp_path / "magcache").iterdir()] == [False]
