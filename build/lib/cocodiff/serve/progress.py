"""Where each request of `cocodiff serve` stands: queued, step i of N, done or failed.

One `Progress` per server, owned by the scheduler. The HTTP layer opens a request's record when
it enqueues it (`queued`) and closes it with the answer (`finished`); whoever runs the denoising
loop reports each step with `step(request_ids, i)`: the rank loop calls it from the pipeline's
`callback_on_step_end` on rank 0, for every request of the running batch. A scheduler that moves
requests at different steps calls the same hook once per request. `GET /v1/progress/{id}` reads
`get`.

Records are written by the rank loop's thread and read by the HTTP thread, so every access takes
one lock. Finished records stay readable for the last `keep` requests, then are forgotten.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

__all__ = ["Progress", "RequestState"]

State = Literal["queued", "running", "done", "failed"]


@dataclass(frozen=True, kw_only=True)
class RequestState:
    """One request's progress, as `GET /v1/progress/{id}` answers it."""

    id: str
    state: State
    step: int = 0
    """Denoising steps done (0 while queued)."""
    steps: int
    """Denoising steps of the request."""
    error: str | None = None
    """Why a failed request failed."""
    cache: dict[str, Any] | None = None
    """A request with a step cache (LOSSY), once done: its spec, steps computed and skipped."""

    def as_dict(self) -> dict[str, Any]:
        """Its fields; `cache` only for a request that ran with one."""
        fields = asdict(self)
        if fields["cache"] is None:
            del fields["cache"]
        return fields


class Progress:
    """Every recent request's `RequestState`, by request id."""

    def __init__(self, keep: int = 1024) -> None:
        if keep < 1:
            raise ValueError(f"keep {keep} must be at least 1")
        self.keep = keep
        self._active: dict[str, RequestState] = {}
        self._finished: OrderedDict[str, RequestState] = OrderedDict()
        self._lock = threading.Lock()

    def queued(self, request_id: str, steps: int) -> bool:
        """Open `request_id`'s record; False (and nothing changes) if that id is queued or running."""
        with self._lock:
            if request_id in self._active:
                return False
            self._finished.pop(request_id, None)
            self._active[request_id] = RequestState(id=request_id, state="queued", steps=steps)
            return True

    def step(self, request_ids: Iterable[str], step: int) -> None:
        """The hook of the denoising loop: each of `request_ids` has done `step` of its steps.

        Step 0 marks a request running before its first step ends. Ids without an open record
        (finished, or never queued) are ignored.
        """
        with self._lock:
            for request_id in request_ids:
                if (state := self._active.get(request_id)) is not None:
                    self._active[request_id] = replace(state, state="running", step=min(step, state.steps))

    def cache(self, request_id: str, report: dict[str, Any]) -> None:
        """`request_id` ran with a step cache: what it computed and skipped (`RequestState.cache`)."""
        with self._lock:
            if (state := self._active.get(request_id)) is not None:
                self._active[request_id] = replace(state, cache=report)

    def finished(self, request_id: str, error: str | None = None) -> None:
        """Close `request_id`'s record: done, or failed with `error`."""
        with self._lock:
            state = self._active.pop(request_id, None)
            if state is None:
                return
            if error is None:
                state = replace(state, state="done", step=state.steps)
            else:
                state = replace(state, state="failed", error=error)
            self._finished[request_id] = state
            while len(self._finished) > self.keep:
                self._finished.popitem(last=False)

    def get(self, request_id: str) -> RequestState | None:
        """`request_id`'s state, or None if it is unknown (never seen, or long finished)."""
        with self._lock:
            return self._active.get(request_id) or self._finished.get(request_id)
