"""Step caches (LOSSY) in `cocodiff serve`, per request: how a rank's caches agree with the others.

A request's cache is its own `cache` field, or the server's `--cache` when it gives none. With
step-level batching (stepper.py) each request keeps its own cache runs inside the shared batch
(engine/cache/rows.py); with per-request batching one pipeline call runs the requests that share a cache
spec, under one `StepCache` installed for that call only (`Caching.call`), whose decision covers
the call's images (as `generate --batch`). Either way every decision is summed over every rank
before anything is skipped (`agree`), so every rank skips the same blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed.comm.ulysses import all_ranks_sum
from ..engine.cache.steps import StepCache, apply_cache
from ..engine.data_parallel import DataParallelForward
from ..engine.parallelized import Parallelized
from .calls import Call
from .stepper import Stepper

__all__ = ["Caching"]


@dataclass(frozen=True)
class Caching:
    """How this rank's step caches agree with the other ranks (all None: one process)."""

    agree: Callable[[torch.Tensor], list[float]] | None = None
    """Decision values -> their sums over every rank."""
    share: Callable[[], tuple[int, int] | None] | None = None
    """The rows of a call this rank runs under batch / CFG groups."""
    paired: Callable[[], bool] | None = None
    """Whether the pipeline call starting now runs a CFG pair (per-request batching)."""

    @classmethod
    def of(cls, parallel: Parallelized | None) -> Caching:
        if parallel is None:
            return cls()
        data = parallel.transformer.__dict__.get("forward")
        if not isinstance(data, DataParallelForward):
            return cls(all_ranks_sum(parallel.topology))
        return cls(all_ranks_sum(parallel.topology), lambda: data.share, lambda: data._pending is not None)

    def stepper(self, pipe: Any, decode: bool) -> Stepper:
        return Stepper(pipe, decode=decode, agree=self.agree, share=self.share)

    @contextmanager
    def call(self, pipe: Any, call: Call) -> Iterator[StepCache | None]:
        """Per-request batching: `call.cache` on the transformer for this call only (every rank)."""
        if call.cache is None:
            yield None
            return
        cache = apply_cache(pipe.transformer, call.cache, self.agree, self.paired, scheduler=pipe.scheduler)
        try:
            yield cache
        finally:
            cache.undo()
