"""Shared test set-up: quiet libraries, one thread per process (ranks share 2 cores)."""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import signal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# A process that starts with SIGINT ignored keeps ignoring it, and so do the commands it starts
# (POSIX; Python then installs no handler of its own). pytest-xdist's workers and a shell's
# background jobs start so: the commands the tests interrupt with SIGINT need it as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TIME_SCALE = float(os.environ.get("COCODIFF_TEST_TIME_SCALE", "4"))
"""How much slower than a quiet 2-core machine a test may run before a guard calls it hung. Guards
catch hangs; they are not speed limits: with a load of 10 on 2 cores the suite ran 2.5x slower."""


def patience(seconds: float) -> float:
    """A guard of `seconds` on a quiet machine, stretched by TIME_SCALE."""
    return seconds * TIME_SCALE


# Every multi-process test runs under this limit: a hung collective fails the test instead of CI.
RANK_TIMEOUT_S = patience(120)


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone (in-process checks of code that calls collectives)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting ranks fails the test at once: a refusal under test must come before them."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr("cocodiff.run.launch.run_ranks", refuse)


def pytest_configure(config) -> None:
    """Workers take whole files in the order `pytest_collection_modifyitems` leaves (the longest
    first), not pytest-xdist's own (files with more tests first, which put the matrix's one-test
    files last, one after the other on one worker: a slow half of 47 minutes where its tests
    add up to 79 over two workers)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list) -> None:
    """pytest-timeout's limit per test (pyproject's `timeout`, a quiet machine's bound) stretched
    like every other guard, unless a test sets its own. The files that take minutes come first, the
    longest first (their module's `RUNS_LONG`: about how many): with workers (`pytest -n 2 --dist
    loadfile`, as CI runs) the short files fill in beside them at the end, instead of a long one
    running alone while the other worker waits."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(patience(float(item.config.getini("timeout")))))
    items.sort(key=lambda item: -getattr(item.module, "RUNS_LONG", 0))  # stable: each file's own order kept
