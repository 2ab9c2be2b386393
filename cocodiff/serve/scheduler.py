"""The serving queue: bounded, first in first out, batching compatible requests at their start.

The HTTP layer `submit`s one `Work` per request and gets a `Future` of its PNGs (a video's MP4);
the rank loop takes `next_batch()` and hands it to `execute`, which runs one pipeline call for the
whole batch and answers each request with its own images, in order. Requests are compatible when
they share (width, height, steps, guidance, frames, step cache): their prompts then go through the pipeline
as one list, each image with its own seed. The batch is formed when its oldest request is taken: compatible
requests waiting then, or arriving within the batch window, join it up to `max_batch` images.

Every request is answered exactly once: with its images, with the executor's error (the whole
batch), or with `Stopped` once the server shuts down. A request whose client went away
(`cancel`) leaves the queue at once; if it already runs, its future is listed for the rank loop
(`take_cancelled`), which takes it out of the running batch at the next step boundary.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from ..config.cache import CacheSpec
from .progress import Progress

__all__ = ["Batch", "QueueFull", "Scheduler", "Stopped", "Work", "settle"]


@dataclass(frozen=True, kw_only=True)
class Work:
    """One request, resolved: every default filled in, every value checked."""

    prompt: str
    n: int = 1
    """Images for this prompt; image i uses seed `seed + i`."""
    width: int
    height: int
    steps: int
    guidance: float | None = None
    """None: the pipeline's own default."""
    seed: int = 0
    request_id: str = ""
    """The id its progress is kept under (see progress.py); "": not tracked."""
    frames: int | None = None
    """A video's frames (None: an image, or a video model's default clip)."""
    fps: float | None = None
    """A video's frame rate: how its MP4 is written, not how it is generated."""
    negative_prompt: str | None = None
    """None: the pipeline's default (the empty prompt)."""
    cache: CacheSpec | None = None
    """Its step cache (LOSSY): the request's own, or the server's `--cache`; None: every step computed."""
    references: tuple[bytes, ...] = ()
    """An edit's reference images, in order, as PNG files (POST /v1/images/edits); (): none."""
    mask: bytes | None = None
    """An edit's mask as a greyscale PNG file (white: repainted), over its one reference; None: none."""
    lora: tuple[tuple[str, float], ...] = ()
    """The LoRA adapters it turns on, (name, scale) in name order (`serve --lora-dir`); (): none."""

    @property
    def key(self) -> tuple:
        """Requests with equal keys can share one pipeline call (one step cache decides for the call's
        images; an edit's references and mask and the adapters turned on are the call's)."""
        return (self.width, self.height, self.steps, self.guidance, self.frames, self.cache, self.references, self.lora,
                self.mask)


class QueueFull(RuntimeError):
    """The queue holds `max_queue` requests already (HTTP 429)."""


class Stopped(RuntimeError):
    """The server is shutting down or its ranks failed (HTTP 503)."""


@dataclass
class _Pending:
    work: Work
    future: Future
    enqueued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Batch:
    """Requests sharing one pipeline call, oldest first."""

    works: tuple[Work, ...]
    futures: tuple[Future, ...]

    @property
    def key(self) -> tuple[int, int, int, float | None, int | None, CacheSpec | None]:
        return self.works[0].key

    @property
    def prompts(self) -> list[str]:
        """One prompt per image, request after request."""
        return [w.prompt for w in self.works for _ in range(w.n)]

    @property
    def seeds(self) -> list[int]:
        """One seed per image, in the order of `prompts`."""
        return [w.seed + i for w in self.works for i in range(w.n)]

    @property
    def images(self) -> int:
        return sum(w.n for w in self.works)


class Scheduler:
    """A bounded FIFO of requests, taken in batches by one consumer thread."""

    def __init__(self, max_queue: int = 64, max_batch: int = 4, window_s: float = 0.02,
                 on_batch: Callable[[int], None] | None = None) -> None:
        if max_queue < 1 or max_batch < 1 or window_s < 0:
            raise ValueError(f"max_queue {max_queue} and max_batch {max_batch} must be >= 1, window {window_s} >= 0")
        self.max_queue, self.max_batch, self.window_s = max_queue, max_batch, window_s
        self.on_batch = on_batch
        """Called with each batch's image count (a metric)."""
        self.progress = Progress()
        """Each request's state: the HTTP layer opens and closes it, the rank loop reports steps."""
        self._queue: deque[_Pending] = deque()
        self._changed = threading.Condition()
        self._stopped = False
        self._cancelled: set[Future] = set()
        self._taken: list[_Pending] = []
        """Requests taken into a batch and not yet answered (what `batch_images` counts as running)."""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def depth(self) -> int:
        """Requests waiting (not counting the batch being run)."""
        return len(self._queue)

    def submit(self, work: Work) -> Future:
        """Enqueue `work`; its future resolves to its PNGs (a list of `work.n` bytes objects)."""
        if work.n > self.max_batch:
            raise ValueError(f"n={work.n} is more than the {self.max_batch} images of a batch")
        with self._changed:
            if self._stopped:
                raise Stopped("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} requests")
            pending = _Pending(work, Future())
            self._queue.append(pending)
            self._changed.notify_all()
        return pending.future

    def batch_images(self, work: Work) -> int:
        """The images of the largest batch `work` could run in: those waiting or running at its size
        (and frames), its own, at most `max_batch`. Admission estimates memory for these: requests
        admissible alone can still meet in one batch. Counting by size alone (not the full key)
        over-counts rather than under-counts, whichever key the rank loop batches by."""
        size = (work.width, work.height, work.frames)
        with self._changed:
            self._taken = [p for p in self._taken if not p.future.done()]
            others = sum(p.work.n for p in (*self._queue, *self._taken)
                         if (p.work.width, p.work.height, p.work.frames) == size)
        return min(self.max_batch, others + work.n)

    def cancel(self, future: Future) -> None:
        """The client of `future`'s request went away: drop it from the queue (its future
        cancelled), or, if it runs already, list it for `take_cancelled`."""
        with self._changed:
            kept = deque(p for p in self._queue if p.future is not future)
            if len(kept) < len(self._queue):
                self._queue = kept
                future.cancel()
                self._changed.notify_all()
            elif not future.done():
                self._cancelled.add(future)

    def take_cancelled(self) -> set[Future]:
        """The running requests whose clients went away since the last call (see `cancel`)."""
        with self._changed:
            taken, self._cancelled = self._cancelled, set()
        return {future for future in taken if not future.done()}

    def next_batch(self, timeout_s: float) -> Batch | None:
        """The next batch, or None when no request arrived within `timeout_s`.

        The oldest request heads the batch; compatible requests join it in arrival order,
        skipping any that would exceed `max_batch` images; the others keep their places.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._queue or self._stopped, timeout=timeout_s) or self._stopped:
                return None
            head = self._queue[0].work
            deadline = time.monotonic() + self.window_s
            while not self._stopped and self._compatible_images(head) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            if self._stopped or not self._queue:
                return None
            taken = self._take(self._queue[0].work)
        if not taken:  # every candidate's client had gone away
            return self.next_batch(0)
        batch = Batch(tuple(p.work for p in taken), tuple(p.future for p in taken))
        if self.on_batch is not None:
            self.on_batch(batch.images)
        return batch

    def admit(self, key: Callable[[Work], Hashable], running: Hashable | None, room: int,
              timeout_s: float) -> Batch | None:
        """Step-level batching: the requests that join the running batch at its next step.

        `running` is the running batch's key (None: nothing runs; then this waits up to
        `timeout_s` for a request, and the batch window for more, as `next_batch` does). Waiting
        requests with that key join in arrival order while they fit in `room` images. If the
        oldest waiting request cannot join (another key, or too many images), none joins: the
        running batch drains first, so no request is overtaken for ever.
        """
        with self._changed:
            if running is None:
                if not self._changed.wait_for(lambda: self._queue or self._stopped, timeout=timeout_s):
                    return None
                deadline = time.monotonic() + self.window_s
                while self._queue and not self._stopped and self._keyed_images(key, key(self._queue[0].work)) < room:
                    if (left := deadline - time.monotonic()) <= 0:
                        break
                    self._changed.wait(left)
            if self._stopped or not self._queue:
                return None
            head = self._queue[0].work
            if (running is not None and key(head) != running) or head.n > room:
                return None
            taken = self._take(head, key, room)
        if not taken:
            return self.admit(key, running, room, 0) if self._queue else None
        return Batch(tuple(p.work for p in taken), tuple(p.future for p in taken))

    def _keyed_images(self, key: Callable[[Work], Hashable], value: Hashable) -> int:
        return sum(p.work.n for p in self._queue if key(p.work) == value)

    def _compatible_images(self, head: Work) -> int:
        return sum(p.work.n for p in self._queue if p.work.key == head.key)

    def _take(self, head: Work, key: Callable[[Work], Hashable] = lambda work: work.key,
              room: int | None = None) -> list[_Pending]:
        """Remove the batch headed by `head` from the queue (lock held): the requests with its `key`
        that fit in `room` images (default `max_batch`), in order; drop cancelled requests."""
        taken, kept, images = [], deque(), 0
        room = self.max_batch if room is None else room
        for pending in self._queue:
            fits = key(pending.work) == key(head) and images + pending.work.n <= room
            if not fits:
                kept.append(pending)
            elif pending.future.set_running_or_notify_cancel():  # False: cancelled, its client left
                taken.append(pending)
                images += pending.work.n
        self._queue = kept
        self._taken = [p for p in self._taken if not p.future.done()] + taken
        return taken

    def execute(self, batch: Batch, run: Callable[[Batch], Sequence[bytes]]) -> None:
        """Run `batch` with `run` (one image per prompt, in order) and answer each of its requests."""
        try:
            images = list(run(batch))
            if len(images) != batch.images:
                raise RuntimeError(f"the pipeline returned {len(images)} images for {batch.images} prompts")
        except BaseException as error:
            for future in batch.futures:
                settle(future, error=error)
            if not isinstance(error, Exception):
                raise
            return
        start = 0
        for work, future in zip(batch.works, batch.futures):
            settle(future, result=images[start : start + work.n])
            start += work.n

    def stop(self, reason: str = "the server is shutting down") -> int:
        """Accept no more requests; answer every waiting one with `Stopped`. Returns how many."""
        with self._changed:
            self._stopped = True
            waiting, self._queue = list(self._queue), deque()
            self._changed.notify_all()
        for pending in waiting:
            if pending.future.set_running_or_notify_cancel():
                pending.future.set_exception(Stopped(reason))
        return len(waiting)


def settle(future: Future, *, result: object = None, error: BaseException | None = None) -> None:
    """Answer `future` unless someone answered it first (a server that stops answers its running
    requests itself, see drain.py)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
