"""Rank 0's bound on a served step that stops making progress, the same on every backend.

On gloo a peer that stops answering makes rank 0's pending collective raise at the process
group's timeout, and rank 0 answers the requests 503 (ranks.py). On NCCL nothing raises: the
collective waits on the device, rank 0's thread waits at its next host read, and at the process
group's timeout NCCL's own watchdog ends the process without a word to the clients. So rank 0
watches its own progress instead: while the ranks run a step (or a per-request call), every
transformer block that starts is a beat; when no beat comes for `--timeout` seconds, the watchdog
answers the running and waiting requests 503, says so in one line and ends rank 0 (the launcher,
or torchrun, ends the other ranks). The process group's timeout is `--timeout` plus
`GROUP_MARGIN_S` on a server's ranks (`group_timeout_s`), so this answer comes first on every
backend.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["GROUP_MARGIN_S", "StepWatch", "beating", "group_timeout_s"]

GROUP_MARGIN_S = 10.0
"""Added to `--timeout` for a server's process group, at the least: the time rank 0's watchdog has
to answer the clients before a backend's own timeout ends a rank."""


def group_timeout_s(timeout_s: float) -> float:
    """A server's process-group timeout for `--timeout timeout_s`: its watchdog fires first."""
    return timeout_s + max(GROUP_MARGIN_S, timeout_s / 2)


class StepWatch:
    """A thread that calls `on_stall(what)` once when a watched stretch of work makes no progress
    for `timeout_s` seconds. `on_stall` is expected not to return (it ends the process)."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        self.timeout_s, self._on_stall = timeout_s, on_stall
        self._what: str | None = None
        self._beat = time.monotonic()
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="cocodiff-step-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, what: str, pipe: Any = None) -> Iterator[None]:
        """The stretch `what` (a step, a call): the clock runs, and each block of `pipe`'s models
        that starts beats it (`beating`)."""
        hooks = [block.register_forward_pre_hook(self._on_block) for block in beating(pipe)]
        with self._changed:
            self._what, self._beat = what, time.monotonic()
            self._changed.notify_all()
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            with self._changed:
                self._what = None

    def beat(self) -> None:
        """Progress: the clock starts again (a plain store; no lock in a layer's path)."""
        self._beat = time.monotonic()

    def _on_block(self, _module: torch.nn.Module, _args: Any) -> None:
        self._beat = time.monotonic()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if self._what is None:
                    self._changed.wait()
                    continue
                late = time.monotonic() - self._beat
                if late < self.timeout_s:
                    self._changed.wait(self.timeout_s - late)
                    continue
                what = self._what
                break
            else:
                return
        self._on_stall(what)


TRANSFORMERS = ("transformer", "transformer_2")
OTHERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "vae")
"""A pipeline's models that run in a served call besides its transformers: encoding a prompt or an
image, and decoding (parallel VAE has collectives of its own)."""


def beating(pipe: Any) -> list[torch.nn.Module]:
    """The modules of `pipe` whose start is a beat: each transformer and every block of its block
    lists (a step's progress at the grain of one layer); in the encoders and the VAE, every module
    of a list at any depth (their layers, a decoder's up-blocks)."""
    found: list[torch.nn.Module] = []
    for name in TRANSFORMERS + OTHERS:
        model = getattr(pipe, name, None)
        if not isinstance(model, torch.nn.Module):
            continue
        found.append(model)
        lists = model.children() if name in TRANSFORMERS else model.modules()
        for child in lists:
            if isinstance(child, torch.nn.ModuleList):  # a list may hold None (a stage's cut-away blocks)
                found.extend(block for block in child if isinstance(block, torch.nn.Module))
    return found
