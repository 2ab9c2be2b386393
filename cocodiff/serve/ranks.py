"""The rank loop of `cocodiff serve`: rank 0 decides, every rank runs the same work.

`serve_job(spec, options)` runs on every rank (spawned locally or under torchrun). Each rank loads
the model and applies `parallelize` once. Rank 0 also serves HTTP (uvicorn in a thread) and
drains the scheduler, broadcasting on the default group what every rank runs next, so all ranks
issue the same collectives in the same order. Rank 0 answers the requests.

Two ways to batch. FLUX pipelines batch at denoising-step granularity (stepper.py): before each
step rank 0 admits the waiting requests that fit and broadcasts `("step", joins)`; every rank runs
that step for every image in flight, and a request leaves the batch when its own last step is
done, so a short request never waits for a long one. Other pipelines batch per request: rank 0
broadcasts `("run", Call)` and every rank runs one pipeline call for the batch. Video models
(videos.py) take that path too: a batch of videos is one call on every rank, and rank 0 alone
encodes the MP4s.

Step caches (LOSSY) are per request (caching.py): the transformer is parallelized without the
server's `--cache`, which is only the default of a request's `cache`; a join carries its spec, and
every rank keeps that request's cache state in the stepper (or installs a per-request batch's
cache for its call), every decision summed over all ranks.

An error inside a transformer call, on any rank, is a collective failure (`StepFailed`,
guard.py): its peers sit in a collective it will not join. A rank other than 0 leaves at once, so that every peer's collective fails now, not at
--timeout; rank 0 answers the running and waiting requests 503 and leaves; the launcher ends the
rest (exit code 1). An error before the collectives (encoding a prompt: each rank encodes its own)
is agreed by every rank before the transformer runs (`Ready`): that call's or that join's requests
get 500 naming the rank, and the server goes on.

Other messages: `("drop", None)` (a step failed outside its transformer call, past or before its
collectives: encoding or decoding; every rank forgets the images in flight),
`("idle", None)` (sent while no request comes, so the other ranks' wait never reaches the process
group's timeout) and `("stop", None)`. A step message is `("step", (leaves, joins))`: the requests
whose clients went away leave the batch at that step boundary on every rank, then the joins join.

SIGTERM or SIGINT drains the service (drain.py): rank 0 stops admitting at once and answers the
waiting requests 503; the running batch may finish within `--drain-seconds`, after which its
requests get 503 at once and the ranks leave together at the next step (or call) boundary, where
rank 0 sends the stop message; exit code 0 either way. Spawned
locally, the launcher forwards its own SIGTERM to its ranks (`forward_signals`); a second signal
there ends the grace period at once (every request still answered), a third kills them.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ..config.plan import parse_plan
from ..config.timeouts import DEFAULT_TIMEOUT_S
from ..distributed.comm.stats import CommStats
from ..distributed.devices import process_device
from ..distributed.memory import available_bytes
from ..engine.cache.steps import cache_blocks
from ..engine.families.pipelines import ANIMATE_PIPELINES, clip_rate
from ..engine.offload import text_tokens
from ..engine.parallelize import parallelize
from ..errors import RunFailed, UsageError
from ..models.lora import AdapterCache, adapter_cache
from ..models.presets import last_frame_of, last_frame_refusal, makes_video, pipeline_class, pixel_multiple, refusal
from ..run.lifetime import alive
from ..run.load import load
from ..run.spec import GenerateSpec
from .admission import Costs
from .caching import Caching
from .calls import Call, answers, pngs, run_call
from .drain import Drain, forward_signals
from .guard import CallGuard, PeerFailed, StepFailed
from .protocol import ApiError
from .scheduler import Batch, Scheduler, Stopped, Work, settle
from .stepper import Join, JoinsFailed, Stepper, supports_steps
from .stepper import collective_failed as _collective_failed
from .watchdog import StepWatch

__all__ = ["Call", "Caching", "ServeOptions", "forward_signals", "run_call", "serve_job"]

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
    max_pixels: int | None = None
    """Width x height at most; None: only the memory estimate (and the largest side) bound it."""
    max_steps: int = 100
    max_frames: int = 129
    """A video's frames at most."""
    max_request_s: float | None = 600.0
    """A request estimated (at the measured speed) to take longer is refused; None: no limit."""
    drain_s: float = 30.0
    """After SIGTERM, how long the running batch may take before it is abandoned."""
    max_body_bytes: int = 1 << 20
    """A request body's bytes at most (413 before it is read whole)."""
    max_upload_bytes: int = 32 << 20
    """An image edit's body (its reference images) at most (413 likewise)."""
    loras: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters a request may name (`--lora-dir`), name -> path: loaded unfused on every rank."""
    lora_dir: Path | None = None
    """`--lora-dir` itself, where `POST /v1/loras` finds adapters put there after the start."""
    max_loras: int = 8
    """Adapters loaded at a time on every rank (`--max-loras`), the least recently used unloaded first."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """`--timeout`: a step (or call) that makes no progress for this long ends the server, every
    request answered 503 (watchdog.py); the ranks' process group waits a margin longer."""


def _broadcast(message: tuple[str, Any] | None) -> tuple[str, Any]:
    box = [message]
    dist.broadcast_object_list(box, src=0)  # default group: every rank
    return box[0]


def serve_job(spec: GenerateSpec, options: ServeOptions) -> None:
    """Every rank: load the model, then run what rank 0 broadcasts until it says stop."""
    rank = dist.get_rank()
    service = _Service(spec, options) if rank == 0 else None  # /health answers 503 while loading
    drain = Drain(options.drain_s, on_begin=service.begin_drain if service else lambda: None,
                  on_expire=service.abandon if service else lambda _cut_short: None)
    try:
        with drain:
            _serve(spec, options, service, drain)
    except Exception as error:
        if not (drain.begun.is_set() and _collective_failed(error)):
            raise
        # draining: a peer that left first ends this rank's collectives too
    finally:
        if service is not None:
            service.close()


def _serve(spec: GenerateSpec, options: ServeOptions, service: _Service | None, drain: Drain) -> None:
    pipe, encoder = load(spec, every_rank_encodes=True)  # serve encodes each request on every rank
    pipe.set_progress_bar_config(disable=True)
    if options.loras:  # unfused, before the hooks; a request turns its own on (loading it if it is not)
        reports = dict(on_load=service.metrics.lora_loaded, on_switch=service.metrics.lora_switch_seconds.observe
                       ) if service is not None else {}
        adapters = AdapterCache(pipe, options.loras, options.max_loras, **reports).start()
        if service is not None:
            service.adapters = adapters
    if spec.parallel.cache is not None:  # every rank: the server's default cache must fit this model
        spec.parallel.cache.block_split(len(cache_blocks(pipe.transformer)))
    # Step caches are per request (the server's --cache is a request's default): none on the transformer itself.
    parallel = parallelize(pipe, replace(spec.parallel, cache=None), time_plans=False) if dist.get_world_size() > 1 else None
    stats = parallel.stats if parallel is not None else None
    if service is not None and parallel is not None:
        service.plan = parallel.plan.short
    caching = Caching.of(parallel)
    device = process_device()
    peers: list[Any] = [None] * dist.get_world_size()
    # also: every rank has loaded
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid(), available_bytes(device)))
    if service is None:
        _follow(pipe, caching, stats)
    else:
        service.start(pipe, peers, encoder, device)
        service.run(pipe, drain, stats, caching)


def _follow(pipe: Any, caching: Caching, stats: CommStats | None = None) -> None:
    """A rank other than 0: run each broadcast call or step until the stop message. Its
    communication counters are reset after each, as rank 0's are when it counts them for
    /metrics: on a device each timed wait holds two events until they are read or reset."""
    stepper = caching.stepper(pipe, decode=False) if supports_steps(pipe) else None
    while True:
        if stats is not None:
            stats.reset()
        kind, message = _broadcast(None)
        if kind == "stop":
            return
        if kind == "drop":  # a step failed on rank 0: its images are gone there, so here too
            stepper.drop()
            continue
        if kind == "lora":
            try:
                _lora_op(pipe, message)
            except UsageError:
                pass  # the same on every rank: rank 0 answers it
            except Exception as error:  # no collective in it: this rank goes on, as rank 0 does
                print(f"cocodiff serve: rank {dist.get_rank()}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            continue
        if kind not in ("run", "step"):
            continue
        try:
            if kind == "run":
                with caching.call(pipe, message), CallGuard.of(pipe, caching.agree) as guard:
                    run_call(pipe, message, on_step=guard.step_ended)
            else:
                stepper.step(message[1], leaves=message[0])
        except StepFailed as error:  # inside a transformer call: the peers wait in its collectives
            _leave(error)
        except (PeerFailed, JoinsFailed):
            pass  # a failure before the collectives, agreed by every rank: rank 0 answers the requests
        except Exception as error:
            if _collective_failed(error):
                raise
            # before the collectives, agreed (rank 0 answers the requests), or after them: this rank's own
            print(f"cocodiff serve: rank {dist.get_rank()}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


def _lora_op(pipe: Any, op: tuple) -> None:
    """One `/v1/loras` change on this rank's adapters: ("load", name, path, keep) or ("unload", name, keep)."""
    cache = adapter_cache(pipe)
    if op[0] == "load":
        cache.add(op[1], op[2], keep=op[3])
    else:
        cache.unload(op[1])


def _leave(error: StepFailed) -> NoReturn:
    """A rank other than 0 failed between a step's collectives: leave at once, without the
    interpreter's teardown. Its connections close now, so every peer's pending collective fails
    at once instead of at --timeout; rank 0 answers its requests 503 naming this rank (the launcher
    gives a rank gone without a word's peers time to answer, and reports its exit)."""
    print(f"cocodiff serve: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _last_frame(model: str) -> str | None:
    """How `model` takes a video's last frame (`Limits.last_frame`)."""
    if pipeline_class(model) not in ANIMATE_PIPELINES:
        return ""
    return last_frame_of(model) or last_frame_refusal(model)  # a Wan checkpoint's: None, known once it loads


class _Service:
    """Rank 0's side: the HTTP server, the scheduler and the loop that feeds the ranks."""

    def __init__(self, spec: GenerateSpec, options: ServeOptions) -> None:
        import uvicorn

        from .api import H11Protocol, create_app
        from .protocol import Limits

        self.options, self.model = options, spec.model
        self.stop = threading.Event()
        self.peers: list[tuple[str, int, int | None]] | None = None
        """(host, pid, free bytes) of every rank, by rank, once all have loaded."""
        self.plan: str | None = None
        """The plan the ranks run (its short form; None on one rank), for /health."""
        self.costs: Costs | None = None
        self.blocks: int | None = None
        """The loaded transformer's blocks a step cache splits (0: none it can cache)."""
        self.fatal: Exception | None = None
        self.adapters: AdapterCache | None = None
        """The LoRA adapters every rank keeps (`--lora-dir`), once loaded."""
        self.admin: queue.SimpleQueue[tuple[tuple[str, ...], Future]] = queue.SimpleQueue()
        """The admin routes' changes of the LoRA adapters (`/v1/loras`), for the rank loop to make on every rank."""
        self.in_flight: tuple[Future, ...] = ()
        """The futures of the running batch's requests (read by the drain's timer thread)."""
        one_per_call = refusal(spec.model, {"batch"})  # a pipeline that takes no batch: one image per call
        max_batch = 1 if one_per_call else options.max_batch
        self.scheduler = Scheduler(options.max_queue, max_batch, options.batch_window_ms / 1e3)
        limits = Limits(width=spec.width, height=spec.height, steps=spec.steps,
                        size_multiple=pixel_multiple(spec.model), max_n=max_batch, one_per_call=one_per_call,
                        **({"fps": rate, "sound_fps": rate} if (rate := clip_rate(pipeline_class(spec.model) or "")) else {}),
                        max_pixels=options.max_pixels, max_steps=options.max_steps, model=spec.model,
                        video=makes_video(spec.model), frames=spec.frames, max_frames=options.max_frames,
                        cache=spec.parallel.cache, cache_refused=_cache_refused(spec), cache_blocks=lambda: self.blocks,
                        max_body_bytes=options.max_body_bytes, pipeline=pipeline_class(spec.model),
                        last_frame=_last_frame(spec.model),
                        max_upload_bytes=options.max_upload_bytes, loras=tuple(options.loras),
                        max_loras=options.max_loras, lora_dir=options.lora_dir,
                        lora_names=lambda: self.adapters.names() if self.adapters is not None else tuple(options.loras))
        self.fps = limits.fps
        app = create_app(self.scheduler, limits, ready=self._ready, health=self._health, costs=lambda: self.costs,
                         running=lambda: len(self.in_flight),
                         loras=lambda: self.adapters.listing() if self.adapters is not None else None,
                         lora_admin=self._lora_admin)
        self.metrics = app.state.metrics
        config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", access_log=False,
                                http=H11Protocol)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="cocodiff-http", daemon=True)
        self.thread.start()
        self.watch = StepWatch(options.timeout_s, self._stalled)

    def start(self, pipe: Any, peers: list[tuple[str, int, int | None]], encoder: Any, device: torch.device) -> None:
        """Every rank has loaded: estimate requests from now on, and answer /health 200."""
        free = [f for _host, _pid, f in peers]
        on_cpu = device.type == "cpu"
        self.costs = Costs.of(
            pipe, pixel_multiple=pixel_multiple(self.model, pipe),
            ranks=len(peers), sharing=int(os.environ.get("LOCAL_WORLD_SIZE", len(peers))) if on_cpu else 1,
            free_bytes=None if None in free else min(free), max_request_s=self.options.max_request_s,
            **({"text_tokens": text_tokens(encoder)} if encoder is not None else {}),
        )
        try:
            self.blocks = len(cache_blocks(pipe.transformer))
        except UsageError:
            self.blocks = 0
        self.peers = peers

    def _lora_admin(self, op: tuple[str, ...]) -> Future:
        """From the HTTP thread: ("load", name, path) or ("unload", name), made on every rank at the
        loop's next turn (between calls, or between steps); the future answers when they made it."""
        future: Future = Future()
        self.admin.put((op, future))
        return future

    def _run_admin(self, pipe: Any, keep: tuple[str, ...] = ()) -> None:
        """Make the waiting `/v1/loras` changes on every rank; `keep`: the adapters the running
        batch has turned on (not unloaded, not evicted)."""
        while True:
            try:
                op, future = self.admin.get_nowait()
            except queue.Empty:
                return
            if op[0] == "unload" and op[1] in keep:
                settle(future, error=ApiError(409, f"adapter {op[1]!r} is turned on for the running batch; unload it "
                                                   f"once that batch is done", param="name"))
                continue
            try:
                with self.watch.watching(f"the LoRA {op[0]} of {op[1]!r}", pipe):
                    _broadcast(("lora", (*op, keep)))
                    _lora_op(pipe, (*op, keep))
            except UsageError as error:  # the same file on every rank: refused on every rank alike
                settle(future, error=ApiError(400, str(error), param="name"))
            except Exception as error:
                if _collective_failed(error):
                    self.fatal = error
                    settle(future, error=Stopped(self._failure(error)))
                    raise
                settle(future, error=error)
            else:
                settle(future, result=None)

    def _ready(self) -> bool:
        return self.peers is not None and not self.stop.is_set()

    def _health(self) -> dict[str, Any]:
        pids = [pid for _host, pid, _free in self.peers] if self.peers else None
        return {"ranks": len(pids) if pids else None, "pids": pids, "model": self.model, "plan": self.plan}

    def begin_drain(self) -> None:
        """The stop signal (from the drain's thread): admit nothing more, answer the waiting requests 503."""
        self.stop.set()
        self.scheduler.stop()

    def abandon(self, cut_short: bool = False) -> None:
        """The grace period is over (from the drain's timer thread, or `cut_short` by a second stop
        signal): answer the running requests 503."""
        when = ("when a second stop signal ended the grace period" if cut_short else
                f"{self.options.drain_s:g} s (--drain-seconds) after the stop signal")
        error = Stopped(f"the server is shutting down: this request was still running {when}")
        for future in self.in_flight:
            settle(future, error=error)

    def run(self, pipe: Any, drain: Drain, stats: CommStats | None = None, caching: Caching = Caching()) -> None:
        """Feed the ranks until stopped; `stats` (rank 0's traffic, None on one rank) feeds /metrics.
        FLUX pipelines batch at step level (`_run_steps`), the others per request (one call per batch)."""
        if supports_steps(pipe):
            return self._run_steps(pipe, drain, stats, caching)
        last = time.monotonic()
        while not self.stop.is_set():
            self._check_http()
            self._run_admin(pipe)
            batch = self.scheduler.next_batch(POLL_S)
            if batch is None:
                last = self._keep_alive(last)
                continue
            self.in_flight = batch.futures
            self.scheduler.execute(batch, lambda b: self._run(pipe, b, stats, caching))
            self.in_flight = ()
            self.scheduler.take_cancelled()  # a call runs to its end: its cancelled requests were counted already
            if self.fatal is not None:
                raise self.fatal
            last = time.monotonic()
        self.scheduler.stop()
        _broadcast(("stop", None))

    def _run(self, pipe: Any, batch: Batch, stats: CommStats | None, caching: Caching) -> Sequence[bytes]:
        """One batch on every rank. A failed collective is fatal: the batch gets 503 and the loop ends."""
        call = Call.of(batch)
        request_ids = [work.request_id for work in batch.works]
        progress = self.scheduler.progress
        progress.step(request_ids, 0)
        try:
            with self.watch.watching(f"the call of {_named(request_ids)}", pipe):
                _broadcast(("run", call))
                started = time.monotonic()
                with caching.call(pipe, call) as cache, CallGuard.of(pipe, caching.agree) as guard:
                    images = run_call(pipe, call, on_step=lambda step: (guard.step_ended(step), progress.step(request_ids, step)))
            if cache is not None:  # one decision per step for the call: every request has its counts
                for request_id in request_ids:
                    self._cache_report(request_id, cache.report() | {"lossy": True})
            if self.costs is not None:
                self.costs.observe(call.width, call.height, batch.images, (time.monotonic() - started) / call.steps,
                                   frames=call.frames)
            return answers(batch, images, self.fps)
        except Exception as error:
            if not _collective_failed(error):
                raise  # the pipeline's own error: the same on every rank, which all go on
            self.fatal = error
            raise Stopped(self._failure(error)) from error
        finally:
            self._count_comm(stats)

    def _run_steps(self, pipe: Any, drain: Drain, stats: CommStats | None, caching: Caching) -> None:
        """Step-level continuous batching (stepper.py). Before each denoising step, the requests
        whose clients left leave the batch and waiting requests that fit join it
        (`Scheduler.admit`); rank 0 broadcasts both, every rank runs the same step; a request is
        answered when its last image's last step is done. On stop: no new requests, the waiting
        ones get 503, the running ones finish within the drain's grace period."""
        stepper = caching.stepper(pipe, decode=True)
        key = lambda work: stepper.key(work.width, work.height, work.guidance, work.lora)  # noqa: E731
        flying: dict[int, _Flying] = {}
        last = time.monotonic()
        while not (self.stop.is_set() and stepper.idle):
            if drain.expired:  # rank 0's clock, read at a step boundary: the stop message below ends every rank's loop
                break
            self._check_http()
            self._run_admin(pipe, keep=tuple(sorted({name for f in flying.values() for name, _ in f.work.lora})))
            gone = self.scheduler.take_cancelled()
            leaves = [number for number, request in flying.items() if request.future in gone]
            for number in leaves:
                flying.pop(number)
            room = self.options.max_batch - sum(1 for im in stepper.images if im.request not in leaves)
            batch = None
            if not self.stop.is_set():
                running = stepper.running_key if len(leaves) < len({im.request for im in stepper.images}) else None
                batch = self.scheduler.admit(key, running, room, POLL_S if stepper.idle else 0)
            if batch is None and not leaves and stepper.idle:
                last = self._keep_alive(last)
                continue
            joins = []
            for work, future in zip(batch.works, batch.futures) if batch else ():
                flying[stepper.requests + len(joins)] = _Flying(work, future, [None] * work.n)
                joins.append(_join(work))
                self.scheduler.progress.step([work.request_id], 0)
            self.in_flight = tuple(f.future for f in flying.values())
            size = (joins[0].width, joins[0].height) if joins else stepper.size  # the batch shares it
            what = f"a step of {_named([f.work.request_id for f in flying.values()])}" if flying else "a step"
            try:
                with self.watch.watching(what, pipe):
                    _broadcast(("step", (leaves, joins)))
                    started = time.monotonic()
                    finished = stepper.step(joins, leaves=leaves)
            except JoinsFailed as error:  # every rank dropped the joins; the images in flight go on
                for number in error.requests:
                    if (request := flying.pop(number, None)) is not None:
                        settle(request.future, error=error)
                self.in_flight = tuple(f.future for f in flying.values())
                continue
            except Exception as error:
                if _collective_failed(error):
                    self.fatal = error
                    _fail(flying.values(), Stopped(self._failure(error)))
                    raise
                _broadcast(("drop", None))  # the same images leave every rank
                stepper.drop()
                _fail(flying.values(), error)
                flying.clear()
                continue
            images = len(stepper.images) + len(finished)
            if self.costs is not None and images and size is not None:
                self.costs.observe(*size, images, time.monotonic() - started)
            self._count(stats, images)
            self._advance(stepper, flying, finished)
            self.in_flight = tuple(f.future for f in flying.values())
            last = time.monotonic()
        if flying:
            self.abandon()
        _broadcast(("stop", None))

    def _failure(self, error: BaseException) -> str:
        """For the users of a server whose ranks can no longer work together: which rank failed."""
        if isinstance(error, RunFailed):  # a peer's timeout: already one line naming the ranks
            return f"the server's ranks failed: {error}"
        dead = _dead_ranks(self.peers or [])
        if dead:
            plan = parse_plan(self.plan) if self.plan is not None else None
            which = ", ".join(plan.rank_name(rank) if plan is not None else f"rank {rank}" for rank in dead)
            return f"{which} of the server stopped; it cannot answer any more requests"
        return "the connection between the server's ranks broke; it cannot answer any more requests"

    def _count(self, stats: CommStats | None, images: int) -> None:
        """Metrics of one step: its batch size and the bytes rank 0 sent."""
        if self.scheduler.on_batch is not None:
            self.scheduler.on_batch(images)
        self._count_comm(stats)

    def _count_comm(self, stats: CommStats | None) -> None:
        """Add the bytes rank 0 sent since the last count to /metrics (None: one rank, nothing sent)."""
        if stats is not None:
            totals = stats.totals()
            self.metrics.count_comm(int(totals["same_node_bytes"]), int(totals["other_node_bytes"]))
            stats.reset()

    def _check_http(self) -> None:
        if not self.thread.is_alive():
            raise RunFailed(f"the HTTP server on {self.options.host}:{self.options.port} stopped (is the port free?)")

    def _keep_alive(self, last: float) -> float:
        """While no work comes: an idle message every `idle_s`, so the other ranks' wait never
        reaches the process group's timeout. Returns when the ranks last heard from rank 0."""
        if time.monotonic() - last <= self.options.idle_s:
            return last
        with self.watch.watching("an idle message to the ranks"):
            _broadcast(("idle", None))
        return time.monotonic()

    def _cache_report(self, request_id: str, report: dict[str, Any]) -> None:
        """A cached request's steps computed and skipped: in its progress record (and so its answer) and /metrics."""
        self.scheduler.progress.cache(request_id, report)
        self.metrics.cache_steps.labels("computed").inc(report["computed_steps"])
        self.metrics.cache_steps.labels("skipped").inc(report["skipped_steps"])

    def _advance(self, stepper: Stepper, flying: dict[int, _Flying], finished: list) -> None:
        """Report each running request's step; answer the requests whose images are all done."""
        for number, report in stepper.reports.items():
            self._cache_report(flying[number].work.request_id, report)
        steps = {im.request: im.step for im in stepper.images}
        for number, index, image in finished:
            flying[number].images[index] = image
            steps.setdefault(number, flying[number].work.steps)
        for number, step in steps.items():
            self.scheduler.progress.step([flying[number].work.request_id], step)
        for number in [n for n, f in flying.items() if all(i is not None for i in f.images)]:
            done = flying.pop(number)
            try:  # rank 0's own work after the collectives: its error is this request's alone
                settle(done.future, result=pngs(np.stack(done.images)))
            except Exception as error:
                settle(done.future, error=error)

    def _stalled(self, what: str) -> NoReturn:
        """From the watchdog's thread, `what` having made no progress for --timeout: the main thread
        sits in a collective or a device wait that may never return. Answer every request 503 and
        end rank 0 without the interpreter's teardown (the launcher ends the other ranks)."""
        message = (f"{what} made no progress for --timeout {self.options.timeout_s:g} s: a rank or its device stopped "
                   f"answering, and the server's ranks cannot go on")
        print(f"cocodiff serve: rank 0: {message}", file=sys.stderr, flush=True)
        self.scheduler.stop(message)
        for future in self.in_flight:
            settle(future, error=Stopped(message))
        self.server.should_exit = True  # uvicorn sends the answers, then stops
        self.thread.join(timeout=5)
        sys.stdout.flush()
        os._exit(1)

    def close(self) -> None:
        """Answer whatever is left with 503 and stop the HTTP server (it sends the answers first)."""
        self.watch.close()
        self.scheduler.stop("the server's ranks stopped")
        self.abandon()
        self.server.should_exit = True
        self.thread.join(timeout=5)


@dataclass
class _Flying:
    """A request in the running batch (step-level batching): its future and its finished images."""

    work: Work
    future: Any
    images: list[np.ndarray | None]


def _join(work: Work) -> Join:
    return Join(prompt=work.prompt, seeds=tuple(work.seed + i for i in range(work.n)), width=work.width,
                height=work.height, steps=work.steps, guidance=work.guidance, cache=work.cache, lora=work.lora)


def _cache_refused(spec: GenerateSpec) -> str | None:
    """What keeps this server from running a request's step cache (ParallelConfig refuses the same,
    and a preset whose transformer has no blocks to cache: `models.presets.refusal`)."""
    if spec.parallel.compile:
        return "--compile"
    if getattr(spec.parallel.plan, "pipe", 1) > 1:  # a cache's decisions are summed over every rank's same blocks
        return f"--plan {spec.parallel.plan.short} (pipeline stages)"
    if (reason := refusal(spec.model, {"step_cache"})) is not None:
        return f"model ({reason})"
    return None if spec.parallel.v_major.off else f"--v-major {spec.parallel.v_major}"


def _named(request_ids: Sequence[str]) -> str:
    """Requests for a one-line message: a few ids, then how many more."""
    shown = ", ".join(request_ids[:3]) + (f" and {len(request_ids) - 3} more" if len(request_ids) > 3 else "")
    return f"request{'s' if len(request_ids) != 1 else ''} {shown}"


def _fail(flying: Any, error: BaseException) -> None:
    for request in flying:
        settle(request.future, error=error)


def _dead_ranks(peers: list[tuple[str, int, int | None]], wait_s: float = 2.0) -> list[int]:
    """The ranks on this machine whose process is gone, waiting up to `wait_s` for one to go
    (a peer's connection closes a moment before its process ends). Ranks elsewhere are not seen."""
    here = socket.gethostname()
    local = [(rank, pid) for rank, (host, pid, _free) in enumerate(peers) if host == here and pid != os.getpid()]
    deadline = time.monotonic() + wait_s
    while True:
        dead = [rank for rank, pid in local if not alive(pid)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)
