"""`cocodiff serve` when one rank fails inside a step: every rank treats it as a collective failure
(the requests get a 5xx at once, the ranks leave well within --timeout); every rank resets its
communication counters per step; and a drain expires only at a step boundary that rank 0 announces."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from conftest import RANK_TIMEOUT_S, patience
from live_server import start_server
from rank_watch import gone
from test_serve_faults import _post

from cocodiff.distributed.comm.stats import CommStats
from cocodiff.serve import ranks
from cocodiff.serve.drain import Drain
from cocodiff.serve.watchdog import StepWatch, group_timeout_s

RUNS_LONG = 4  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)

TIMEOUT_S = patience(2.5)
"""The servers' --timeout: 10 s on a quiet machine's scale, stretched like every guard; an answer
must come well before it (a rank that sat in a collective until it fails the test)."""

FAULT = '''
"\"\"A fault for tests: call number AT of class CLASS of module MODULE raises on rank RANK only
(COCODIFF_TEST_FAULT="RANK:AT:MODULE:CLASS"), as an out-of-memory error on one rank would; with
":stall" after it, that call sleeps a minute instead (a rank that hangs); with ":kill", the rank's
process is killed there (SIGKILL: a rank lost to the kernel's OOM killer or a dead node).\"\"\"
import importlib.abc
import importlib.util
import os
import sys

RANK, AT, TARGET, CLASS, *ACTION = os.environ.get("COCODIFF_TEST_FAULT", "0:0:-:-").split(":")


def _break(cls, rank, at):
    original, calls = cls.__call__, [0]

    def call(self, *args, **kwargs):
        import time

        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == rank:
            calls[0] += 1
            if calls[0] == at and ACTION == ["stall"]:
                time.sleep(60)
            elif calls[0] == at and ACTION == ["kill"]:
                os.kill(os.getpid(), 9)
            elif calls[0] == at:
                raise RuntimeError(f"injected fault: out of memory in {cls.__name__} call {at}")
        return original(self, *args, **kwargs)

    cls.__call__ = call


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _break(getattr(module, CLASS), int(RANK), int(AT))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("COCODIFF_TEST_FAULT"):
    sys.meta_path.insert(0, _Finder())
'''

def _first_answer(server: Any) -> tuple[Any, float]:
    """The answer to a first request (the one the fault hits) and the seconds it took."""
    answers: dict[str, Any] = {}
    started = time.monotonic()
    _post(server, {"prompt": "a red circle", "size": "64x64", "request_id": "fails"}, answers).join(RANK_TIMEOUT_S)
    return answers.get("fails"), time.monotonic() - started


FLUX_BLOCK = "diffusers.models.transformers.transformer_flux:FluxTransformerBlock"
SD3_BLOCK = "diffusers.models.attention:JointTransformerBlock"
SHAPES_TEXT = "cocodiff.models.shapes.text:ShapesTextEncoder"
TINY_TEXT = "cocodiff.models.tiny_parts:TinyTextEncoder"


def _inject(monkeypatch, tmp_path, rank: int, at: int, target: str) -> None:
    """Every rank of a command started next imports the fault: `target`'s call `at` raises on
    `rank` (or stalls: `target` ending in ":stall")."""
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    monkeypatch.setenv("COCODIFF_TEST_FAULT", f"{rank}:{at}:{target}")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "block", "rank"), [
    ("tiny-shapes", FLUX_BLOCK, 1),  # step-level batching, a follower failing
    ("tiny-sd3", SD3_BLOCK, 0),  # one pipeline call per batch, rank 0 (the one that answers) failing
])
def test_a_block_failing_on_one_rank_mid_step_answers_5xx_at_once_and_every_rank_leaves(tmp_path, monkeypatch, model,
                                                                                         block, rank):
    _inject(monkeypatch, tmp_path, rank, 2, block)  # the second block call: inside step 1, between collectives
    server = start_server("--model", model, "--steps", "2", "--max-batch", "1", "--batch-window-ms", "0",
                          "--timeout", f"{TIMEOUT_S:g}")
    try:
        answer, took = _first_answer(server)
        assert isinstance(answer, tuple) and answer[0] in (500, 503), answer
        assert took < TIMEOUT_S * 0.8, f"answered after {took:.1f} s: a rank sat in a collective until --timeout"
        server.process.wait(timeout=patience(10))
        _stdout, stderr = server.process.communicate()
        assert server.process.returncode not in (0, None), stderr
        assert f"rank {rank}" in stderr and "step" in stderr, stderr
        assert gone(server.pids, patience(5)), f"ranks {server.pids} outlived the server"
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "encoder", "at", "rank"), [
    # step-level batching: a join's prompt (the encoder's first call measures its tokens, at load)
    ("tiny-shapes", SHAPES_TEXT, 2, 0),
    ("tiny-sd3", TINY_TEXT, 2, 1),  # one pipeline call per batch
])
def test_encoding_failing_on_one_rank_fails_that_request_at_once_and_the_server_goes_on(tmp_path, monkeypatch, model,
                                                                                        encoder, at, rank):
    """Encoding is each rank's own work, before any collective: the ranks agree before the
    transformer, so the peers of the failing rank do not wait in its collectives until --timeout."""
    _inject(monkeypatch, tmp_path, rank, at, encoder)  # the first request's prompt, on one rank only
    server = start_server("--model", model, "--steps", "2", "--max-batch", "1", "--batch-window-ms", "0",
                          "--timeout", f"{TIMEOUT_S:g}")
    try:
        (status, body), took = _first_answer(server)
        message = body["error"]["message"]
        assert status == 500 and (f"rank {rank}" in message or "injected fault" in message), body
        assert took < TIMEOUT_S * 0.8, f"answered after {took:.1f} s: a rank sat in a collective until --timeout"
        answers: dict[str, Any] = {}
        _post(server, {"prompt": "a blue square", "size": "64x64", "request_id": "next"}, answers).join(RANK_TIMEOUT_S)
        assert answers["next"][0] == 200, answers["next"]
        assert server.process.poll() is None
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "block"), [("tiny-shapes", FLUX_BLOCK), ("tiny-sd3", SD3_BLOCK)])
def test_a_rank_that_stops_answering_mid_step_gets_every_request_503_at_timeout(tmp_path, monkeypatch, model, block):
    """Rank 1 hangs inside a block (as a device that stopped, or NCCL's wait on a dead peer, where
    no collective raises): rank 0's watchdog answers at --timeout, before the process group's own
    timeout (a margin later: without the watchdog, gloo's error comes only then), and every rank leaves."""
    _inject(monkeypatch, tmp_path, 1, 2, f"{block}:stall")  # the second block call sleeps a minute
    server = start_server("--model", model, "--steps", "2", "--max-batch", "1", "--batch-window-ms", "0",
                          "--timeout", f"{TIMEOUT_S:g}")
    try:
        answer, took = _first_answer(server)
        assert isinstance(answer, tuple) and answer[0] == 503, answer
        assert "made no progress for --timeout" in answer[1]["error"]["message"], answer
        margin = group_timeout_s(TIMEOUT_S) - TIMEOUT_S
        assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + margin / 2, f"answered after {took:.1f} s (--timeout {TIMEOUT_S:g})"
        server.process.wait(timeout=patience(10))
        _stdout, stderr = server.process.communicate()
        assert server.process.returncode not in (0, None), stderr
        assert "rank 0: a step of request fails made no progress" in stderr or "call of request fails" in stderr, stderr
        assert gone(server.pids, patience(5)), f"ranks {server.pids} outlived the server"
    finally:
        server.stop()


def test_the_step_watch_fires_once_when_no_block_starts_for_its_timeout():
    """Blocks that keep starting hold it off past its timeout; outside a watched stretch it never fires."""
    stalls: list[str] = []
    watch = StepWatch(0.4, stalls.append)
    pipe = type("Pipe", (), {"transformer": torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()] * 2))})()
    blocks = pipe.transformer[0]
    try:
        with watch.watching("a step of request a", pipe):
            for _ in range(8):  # 0.8 s in all, a block every 0.1 s
                blocks[0](torch.zeros(1))
                time.sleep(0.1)
            assert stalls == []
        time.sleep(0.6)
        assert stalls == [], "fired outside a watched stretch"
        with watch.watching("a step of request b", pipe):
            deadline = time.monotonic() + 5
            while not stalls and time.monotonic() < deadline:
                time.sleep(0.05)
        assert stalls == ["a step of request b"]
        assert not blocks[0]._forward_pre_hooks, "its hooks outlived the stretch"
    finally:
        watch.close()


class _DeviceClock:
    """A clock that times on a device: each mark is an event, read only when the counters settle."""

    on_device = True

    def mark(self) -> object:
        return object()

    def seconds(self, _start: object, _end: object) -> float:
        return 0.001

    def sync(self) -> None:
        pass


class _TimedStepper:
    """A step that waits on its peers twice, as a layer's all-to-alls do."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def step(self, _joins: list, leaves: list) -> list:
        for _ in range(2):
            self.stats.waited("a2a_in", self.stats.mark(), self.stats.mark())
        return []


def test_a_follower_resets_its_counters_every_step_so_device_events_stay_bounded(monkeypatch):
    stats = CommStats(clock=_DeviceClock())
    stepper = _TimedStepper(stats)
    messages = iter([("step", ([], []))] * 100 + [("stop", None)])
    pending = []

    def broadcast(_message: Any) -> tuple:
        pending.append(len(stats._marked))
        return next(messages)

    monkeypatch.setattr(ranks, "_broadcast", broadcast)
    monkeypatch.setattr(ranks, "supports_steps", lambda _pipe: True)
    caching = type("FakeCaching", (), {"stepper": lambda self, pipe, decode: stepper})()
    ranks._follow(object(), caching, stats)
    assert max(pending) <= 2, f"events pending on a follower grew to {max(pending)} over 100 steps"


def test_a_drain_never_interrupts_a_rank_mid_step_it_only_flags_the_end_for_rank_0():
    """Rank 0 reads `expired` at a step boundary and announces the stop; a rank's own clock, ending
    while the rank is inside a collective (here: a sleep), must not end that rank there."""
    answered = []
    with Drain(0.05, on_expire=lambda _cut_short: answered.append(True)) as drain:
        drain.begin()
        deadline = time.monotonic() + patience(5)
        while not drain.expired and time.monotonic() < deadline:  # one long step: the grace period ends inside it
            time.sleep(0.01)
        assert drain.expired and answered == [True]
    assert drain.expired
