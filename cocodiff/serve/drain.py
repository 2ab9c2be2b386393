"""How `cocodiff serve` stops: SIGTERM or SIGINT drains it, within a grace period.

On the first signal every rank starts its drain clock (`Drain`); rank 0 at once stops admitting
and answers the waiting requests 503 (`on_begin`), from a thread that sees the signal as soon as
it arrives, even while the main thread is inside one long operation. The running batch may finish
within `--drain-seconds`; past that, rank 0 answers its requests 503 at once (`on_expire`), and the
ranks leave together at the next step boundary, which rank 0 announces (its stop message), so
no rank leaves while its peers are inside a collective; each rank then exits 0. The clock never
interrupts a rank's main thread: only rank 0's decides, and only between steps.

The signal reaches the main thread's Python handler only between two instructions, so the thread
here reads it from `signal.set_wakeup_fd`, which the interpreter writes when the signal arrives.

In a launcher that spawned the ranks, `forward_signals` passes the first signal on to them; a
second one ends the grace period at once (`NOW_SIGNAL` to the ranks: the running requests get 503
now and the ranks leave at the next step boundary, so every request still gets its answer); a
third exits at once (killing the ranks).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Drain", "NOW_SIGNAL", "forward_signals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NOW_SIGNAL = signal.SIGUSR1
"""From the launcher, on a second stop signal: the drain begins, if it has not, and its grace period ends now."""


class Drain:
    """One rank's drain: the clock started by the first stop signal, and what runs at its start
    and end. Use as a context manager on the main thread; `expired` says whether the grace
    period is over, for rank 0 to read at a step boundary (a rank's own clock ends nothing: mid-step,
    its peers may be inside a collective it would leave)."""

    def __init__(self, seconds: float, on_begin: Callable[[], None] = lambda: None,
                 on_expire: Callable[[bool], None] = lambda _cut_short: None) -> None:
        self.seconds, self.on_begin, self.on_expire = seconds, on_begin, on_expire
        self.begun = threading.Event()
        self._begin_lock = threading.RLock()  # the watcher and the main thread's handler may both begin
        self._expired = threading.Event()
        self._timer: threading.Timer | None = None
        self._reader, self._writer = socket.socketpair()
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

    def __enter__(self) -> Drain:
        self._writer.setblocking(False)
        for sig in (*STOP_SIGNALS, NOW_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="cocodiff-drain", daemon=True).start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._reader.close()  # ends the watching thread
        self._writer.close()

    def begin(self) -> None:
        """Start draining (once): `on_begin`, and the clock."""
        with self._begin_lock:
            if self.begun.is_set():
                return
            self.begun.set()
            self._timer = threading.Timer(self.seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()
        self.on_begin()

    def _watch(self) -> None:
        """The signals as they arrive (the interpreter writes each one's number to the wakeup fd)."""
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if any(number in (*STOP_SIGNALS, NOW_SIGNAL) for number in data):
                self.begin()
            if NOW_SIGNAL in data:
                self.end_now()

    def end_now(self) -> None:
        """The grace period ends now (`NOW_SIGNAL`), not when its clock runs out."""
        if self._timer is not None:
            self._timer.cancel()
        self._expire(cut_short=True)

    def _expire(self, cut_short: bool = False) -> None:
        """The grace period's end (the timer's thread, or `end_now`), once: flag it and answer
        (`on_expire(cut_short)`); the main thread goes on to the step boundary where rank 0 reads the flag."""
        with self._begin_lock:
            if self._expired.is_set():
                return
            self._expired.set()
        self.on_expire(cut_short)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """The main thread's handler: the watcher has usually acted on the signal already."""
        self.begin()  # idempotent
        if signum == NOW_SIGNAL:
            self.end_now()


@contextmanager
def forward_signals() -> Iterator[None]:
    """In a launcher that spawned the ranks: the first SIGTERM/SIGINT/SIGHUP goes on to the ranks
    (they drain and leave, see `Drain`); the second ends their grace period now (`NOW_SIGNAL`:
    every request still answered); a third exits at once (killing the ranks)."""
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if len(received) >= 2:
            raise SystemExit(128 + signum)
        received.append(signum)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM if len(received) == 1 else NOW_SIGNAL)

    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
