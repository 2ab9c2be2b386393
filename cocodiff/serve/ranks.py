"""The rank loop of `cocodiff serve`: rank 0 decides, every rank runs the same pipeline call.

`serve_job(spec, options)` runs on every rank (spawned locally or under torchrun). Each rank loads
the model and applies `parallelize` once. Rank 0 also serves HTTP (uvicorn in a thread) and
drains the scheduler: for each batch it broadcasts one message on the default group, and every
rank runs the same pipeline call with it, so all ranks issue the same collectives in the same
order. Rank 0 answers the batch's requests.

Messages, broadcast with `dist.broadcast_object_list`: `("run", Call)`, `("idle", None)` (sent
while no request comes, so the other ranks' wait never reaches the process group's timeout) and
`("stop", None)`. SIGTERM or SIGINT on rank 0 stops the service: no new requests, the batch in
flight finishes, waiting requests get 503, then the stop message ends every rank. The other ranks
ignore both signals and leave on that message (spawned locally, the launcher forwards its own
SIGTERM to its ranks, see `forward_signals`; a second signal there kills them at once).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RunFailed
from ..parallel import parallelize
from ..presets import pixel_multiple
from ..runner import GenerateSpec, load
from .scheduler import Batch, Scheduler, Stopped

__all__ = ["Call", "ServeOptions", "forward_signals", "run_call", "serve_job"]

POLL_S = 0.2
"""How often rank 0 looks at its stop flag while the queue is empty."""


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    max_batch: int = 4
    batch_window_ms: float = 20.0
    idle_s: float = 5.0
    """Longest time between two broadcasts; keep it well under the process group's timeout."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """One pipeline call: one image per prompt, each with its own seed."""

    prompts: list[str]
    seeds: list[int]
    width: int
    height: int
    steps: int
    guidance: float | None

    @classmethod
    def of(cls, batch: Batch) -> Call:
        width, height, steps, guidance = batch.key
        return cls(prompts=batch.prompts, seeds=batch.seeds, width=width, height=height, steps=steps, guidance=guidance)


def _guidance_argument(pipe: Any) -> str:
    """The pipeline argument a request's `guidance` sets: true CFG where the model uses it."""
    defaults = getattr(pipe, "prompt_defaults", {})
    if "true_cfg_scale" in defaults or type(pipe).__name__.startswith("QwenImage"):
        return "true_cfg_scale"
    return "guidance_scale"


def run_call(pipe: Any, call: Call) -> np.ndarray:
    """Run `call` through `pipe`: images (N, H, W, 3) in [0, 1], one per prompt.

    One generator per image: each prompt's initial noise is what it would be alone with its seed.
    """
    options = {} if call.guidance is None else {_guidance_argument(pipe): call.guidance}
    output = pipe(
        call.prompts,
        height=call.height,
        width=call.width,
        num_inference_steps=call.steps,
        num_images_per_prompt=1,
        generator=[torch.Generator("cpu").manual_seed(seed) for seed in call.seeds],
        output_type="np",
        **options,
    )
    return np.asarray(output.images, dtype=np.float32)


def _pngs(images: np.ndarray) -> list[bytes]:
    from PIL import Image

    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray((image * 255).round().clip(0, 255).astype("uint8")).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def _broadcast(message: tuple[str, Any] | None) -> tuple[str, Any]:
    box = [message]
    dist.broadcast_object_list(box, src=0)  # default group: every rank
    return box[0]


def serve_job(spec: GenerateSpec, options: ServeOptions) -> None:
    """Every rank: load the model, then run what rank 0 broadcasts until it says stop."""
    rank = dist.get_rank()
    stop = threading.Event()
    _on_signals(stop if rank == 0 else None)
    service = _Service(spec, options, stop) if rank == 0 else None  # /health answers 503 while loading
    try:
        pipe, _encoder = load(spec)
        pipe.set_progress_bar_config(disable=True)
        if dist.get_world_size() > 1:
            parallelize(pipe, spec.parallel)
        pids = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())  # also: every rank has loaded
        if service is None:
            _follow(pipe)
        else:
            service.pids = pids
            service.run(pipe)
    finally:
        if service is not None:
            service.close()


def _on_signals(stop: threading.Event | None) -> None:
    """Rank 0: SIGTERM and SIGINT set `stop`. Other ranks: ignored, they leave on rank 0's word."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if stop is None else lambda _signum, _frame: stop.set())


def _follow(pipe: Any) -> None:
    """A rank other than 0: run each broadcast call until the stop message."""
    while True:
        kind, call = _broadcast(None)
        if kind == "stop":
            return
        if kind == "run":
            try:
                run_call(pipe, call)
            except (RunFailed, dist.DistError):
                raise
            except Exception:  # the same error on rank 0 answers the batch; the ranks go on
                pass


class _Service:
    """Rank 0's side: the HTTP server, the scheduler and the loop that feeds the ranks."""

    def __init__(self, spec: GenerateSpec, options: ServeOptions, stop: threading.Event) -> None:
        import uvicorn

        from .api import Limits, create_app

        self.options, self.stop = options, stop
        self.pids: list[int] | None = None
        self.fatal: Exception | None = None
        self.scheduler = Scheduler(options.max_queue, options.max_batch, options.batch_window_ms / 1e3)
        limits = Limits(width=spec.width, height=spec.height, steps=spec.steps,
                        size_multiple=pixel_multiple(spec.model), max_n=options.max_batch)
        app = create_app(self.scheduler, limits, ready=self._ready, health=self._health)
        config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="cocodiff-http", daemon=True)
        self.thread.start()

    def _ready(self) -> bool:
        return self.pids is not None and not self.stop.is_set()

    def _health(self) -> dict[str, Any]:
        return {"ranks": len(self.pids) if self.pids else None, "pids": self.pids}

    def run(self, pipe: Any) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            if not self.thread.is_alive():
                raise RunFailed(f"the HTTP server on {self.options.host}:{self.options.port} stopped (is the port free?)")
            batch = self.scheduler.next_batch(POLL_S)
            if batch is None:
                if time.monotonic() - last > self.options.idle_s:
                    _broadcast(("idle", None))
                    last = time.monotonic()
                continue
            self.scheduler.execute(batch, lambda b: self._run(pipe, b))
            if self.fatal is not None:
                raise self.fatal
            last = time.monotonic()
        self.scheduler.stop()
        _broadcast(("stop", None))

    def _run(self, pipe: Any, batch: Batch) -> Sequence[bytes]:
        """One batch on every rank. A failed collective is fatal: the batch gets 503 and the loop ends."""
        call = Call.of(batch)
        try:
            _broadcast(("run", call))
            return _pngs(run_call(pipe, call))
        except (RunFailed, dist.DistError) as error:
            self.fatal = error
            raise Stopped(f"the ranks failed: {error}") from error

    def close(self) -> None:
        """Answer whatever is left with 503 and stop the HTTP server."""
        self.scheduler.stop("the server's ranks stopped")
        self.server.should_exit = True
        self.thread.join(timeout=5)


@contextmanager
def forward_signals() -> Iterator[None]:
    """In a launcher that spawned the ranks: the first SIGTERM/SIGINT/SIGHUP goes on to the ranks
    (rank 0 then shuts the service down cleanly); a second one exits at once (killing the ranks)."""
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if received:
            raise SystemExit(128 + signum)
        received.append(signum)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM)

    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
