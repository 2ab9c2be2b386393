"""The HTTP layer of `cocodiff serve`: validate, enqueue, answer. Nothing here touches a rank.

    POST /v1/images/generations   OpenAI's images request and response (`b64_json` only), plus the
                                  extensions `seed`, `steps`, `guidance`, `request_id` and `cache`
                                  (a step cache, LOSSY: its steps computed and skipped come back
                                  in the answer's `cache` and the progress record)
    GET  /v1/progress/{id}        where a request stands: queued, running (step i of N), done or failed;
                                  the id: the request's `request_id`, or the one its answer's
                                  X-Request-Id header names (the web page polls this every 100 ms)
    GET  /health                  200 once every rank has loaded the model ("ok", or "busy" while requests
                                  wait or run), 503 before ("unavailable") and while stopping ("draining")
    GET  /metrics                 Prometheus text: queue depth, batch sizes, latency, requests by outcome,
                                  bytes rank 0 sent per link class
    GET  /                        a web page: prompt, size, seed, steps, a progress bar (it polls
                                  /v1/progress/{id}) and the image (a video model's: the video)
    POST /v1/videos ...           a video model's jobs (videos.py): create, status, content, delete,
                                  and the blocking /v1/videos/sync

Every request is estimated before it is queued (admission.py): a size over `--max-pixels`, steps
over `--max-steps`, activations over the ranks' free memory or a time over `--max-request-seconds`
(at the server's measured speed) is a 400 naming the limit. A request whose client closes its
connection leaves the queue, or the running batch at its next step boundary, and is counted as
`cancelled`.

Every error, ours or the framework's (404 no such route, 405 wrong method, 500), uses OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (which never
reaches the queue), 429 with Retry-After when the queue is full, 503 while loading, when the
server is stopping or its ranks failed, 500 when the pipeline raised, 404 for a progress id not
known.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from concurrent.futures import Future

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..config.cache import CacheSpec, parse_cache
from ..config.sizes import parse_image_size
from .admission import Costs, OverLimit
from ..errors import UsageError
from .scheduler import QueueFull, Scheduler, Stopped, Work

__all__ = ["ApiError", "ImageRequest", "Limits", "Metrics", "check_port", "create_app"]

OUTCOMES = ("ok", "bad_request", "queue_full", "unavailable", "error", "cancelled")
LINKS = ("intra_node", "inter_node")


class ImageRequest(BaseModel):
    """OpenAI's `images.generate` body; fields it has and we do not use (model, quality, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, max_length=4000)
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, description='"WIDTHxHEIGHT", e.g. "64x64"; default: the model\'s size')
    response_format: str = Field(default="b64_json", description='"b64_json" only')
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="extension: noise seed (default: random)")
    steps: int | None = Field(default=None, ge=1, description="extension: denoising steps (at most --max-steps)")
    guidance: float | None = Field(default=None, ge=0, le=100, description="extension: guidance scale")
    request_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                   description="extension: the id to follow it by at GET /v1/progress/{id} "
                                               "(default: a new one, answered in the X-Request-Id header)")
    cache: str | None = Field(default=None, max_length=200,
                              description="extension, LOSSY: a step cache as `--cache` takes it (dbcache, fbcache:0.1, "
                                          "taylorseer, ...); null or 'off': none; absent: the server's --cache")


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The server's defaults and bounds for a request."""

    width: int
    """Default image size."""
    height: int
    steps: int
    """Default denoising steps."""
    size_multiple: int = 16
    """Width and height must be multiples of this (VAE factor x patch size)."""
    max_side: int = 2048
    max_n: int = 4
    """Images per request: at most one batch."""
    max_pixels: int | None = None
    """Width x height at most (`--max-pixels`); None: only `max_side` and the memory estimate bound it."""
    max_steps: int = 100
    """Denoising steps at most (`--max-steps`)."""
    model: str = "the model"
    """The served model's name, for messages."""
    video: bool = False
    """A video model: it answers POST /v1/videos, and refuses image requests."""
    frames: int | None = None
    """A video's default frames (None: the pipeline's own default)."""
    max_frames: int = 129
    """A video's frames at most (`--max-frames`)."""
    fps: float = 16.0
    """A video's default frame rate."""
    cache: CacheSpec | None = None
    """The server's `--cache`: the step cache of a request that names none."""
    cache_refused: str | None = None
    """Why this server runs no step cache (e.g. its --compile); None: it does."""
    cache_blocks: Callable[[], int | None] = lambda: None
    """The loaded transformer's blocks a cache splits (None: not loaded yet)."""

    def cache_of(self, request: BaseModel) -> CacheSpec | None:
        """The request's step cache: its `cache` field (null or 'off': none), else the server's;
        `ApiError` (400) for a spec that does not parse or does not fit the model."""
        if "cache" not in request.model_fields_set:
            return self.cache
        text = request.cache
        if text is None or text.strip().lower() in ("off", "none", ""):
            return None
        try:
            spec = parse_cache(text)
            if self.cache_refused is not None:
                raise UsageError(f"--cache {spec} does not combine with this server's {self.cache_refused}")
            if (blocks := self.cache_blocks()) is not None:
                spec.block_split(blocks)
        except UsageError as error:
            raise ApiError(400, f"cache: {str(error).removeprefix('--cache ')}", param="cache") from None
        return spec

    def resolve(self, request: ImageRequest) -> Work:
        """The request with every default filled in; `ApiError` (400) for anything out of range."""
        if self.video:
            raise ApiError(400, f"{self.model} makes videos, not images: use POST /v1/videos", param="model")
        if request.response_format != "b64_json":
            raise ApiError(400, f"response_format {request.response_format!r} is not supported: "
                                f"this server returns images inline only, use 'b64_json'", param="response_format")
        if request.n > self.max_n:
            raise ApiError(400, f"n={request.n} is more than this server's {self.max_n} images per request", param="n")
        width, height = self.size(request.size) if request.size is not None else (self.width, self.height)
        self.check_pixels(width, height)
        steps = request.steps if request.steps is not None else self.steps
        if steps > self.max_steps:
            raise ApiError(400, f"steps={steps} is more than this server's --max-steps {self.max_steps}", param="steps")
        return Work(
            prompt=request.prompt, n=request.n, width=width, height=height, steps=steps,
            guidance=request.guidance,
            seed=request.seed if request.seed is not None else secrets.randbits(31),
            request_id=request.request_id or secrets.token_hex(8), cache=self.cache_of(request),
        )

    def check_pixels(self, width: int, height: int) -> None:
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise ApiError(400, f"size {width}x{height} is {width * height} pixels, more than this server's "
                                f"--max-pixels {self.max_pixels}", param="size")

    def size(self, size: str) -> tuple[int, int]:
        """"WIDTHxHEIGHT" as (width, height); `ApiError` (400) unless each side is in range."""
        parsed = parse_image_size(size)
        if parsed is None:
            raise ApiError(400, f"size {size!r} is not WIDTHxHEIGHT in ASCII digits, e.g. '{self.width}x{self.height}'",
                           param="size")
        width, height = parsed
        for value in (width, height):
            if value < self.size_multiple or value > self.max_side or value % self.size_multiple:
                raise ApiError(400, f"size {size!r}: each side must be a multiple of {self.size_multiple} "
                                    f"from {self.size_multiple} to {self.max_side}", param="size")
        return width, height


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (several apps may share a process)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge("cocodiff_queue_depth", "requests waiting for a batch", registry=self.registry)
        self.queue_depth.set_function(scheduler.depth)
        self.batch_size = Histogram("cocodiff_batch_size", "images per pipeline call (per denoising step where batching is step-level)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.latency = Histogram("cocodiff_request_latency_seconds", "time from arrival to answer, answered requests",
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=self.registry)
        self.requests = Counter("cocodiff_requests", "requests by outcome", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome shows, at 0, from the start
        self.comm_bytes = Counter("cocodiff_comm_bytes", "bytes rank 0 sent to other ranks, by link class",
                                  ["link"], registry=self.registry)
        for link in LINKS:
            self.comm_bytes.labels(link)
        self.cache_steps = Counter("cocodiff_cache_steps", "denoising steps of requests with a step cache (LOSSY), "
                                   "computed or skipped (per CFG branch)", ["outcome"], registry=self.registry)
        for outcome in ("computed", "skipped"):
            self.cache_steps.labels(outcome)
        scheduler.on_batch = self.batch_size.observe

    def count_comm(self, intra_node: int, inter_node: int) -> None:
        """Add bytes rank 0 sent to ranks on its own node and on other nodes."""
        self.comm_bytes.labels("intra_node").inc(intra_node)
        self.comm_bytes.labels("inter_node").inc(inter_node)


def create_app(scheduler: Scheduler, limits: Limits, *, ready: Callable[[], bool] = lambda: True,
               health: Callable[[], dict[str, Any]] = dict, costs: Callable[[], Costs | None] = lambda: None,
               running: Callable[[], int] = lambda: 0) -> FastAPI:
    """The service's app around `scheduler` (which someone else drains: the rank loop, or a test).

    `ready` says whether every rank has loaded the model; `health` adds to /health's body;
    `costs` is the loaded model's estimator (None: no memory or time estimate); `running` counts
    the requests in the running batch. The app's metrics are `app.state.metrics`, its video jobs
    (videos.py) `app.state.videos`.
    """
    app = FastAPI(title="cocodiff", description="Image generation on sequence-parallel ranks (OpenAI images API).")
    metrics = app.state.metrics = Metrics(scheduler)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        metrics.requests.labels("bad_request").inc()
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, no field
            where = first.get("loc", ("body", "?"))[-1]
            cause = (first.get("ctx") or {}).get("error", "malformed")
            return ApiError(400, f"the request body is not valid JSON: {cause} at character {where}").response()
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        return ApiError(400, message, param=".".join(where) or None).response()

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """The framework's own errors (no such route, wrong method, ...) in OpenAI's shape."""
        messages = {404: f"there is no {request.url.path} here; see /docs for the routes",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        message = messages.get(error.status_code, str(error.detail))
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return ApiError(error.status_code, message, kind=kind, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def crashed(_request: Request, error: Exception) -> JSONResponse:
        return ApiError(500, f"internal server error ({type(error).__name__})", kind="server_error").response()

    progress = scheduler.progress
    page = (files(__package__) / "static" / "index.html").read_text(encoding="utf-8")

    @app.post("/v1/images/generations")
    async def generations(body: ImageRequest, request: Request, response: Response) -> dict[str, Any]:
        arrived = time.monotonic()
        try:
            work = limits.resolve(body)
            estimate = _estimate(work)
            if not progress.queued(work.request_id, work.steps):
                raise ApiError(400, f"request_id {work.request_id!r} is queued or running already", param="request_id")
        except ApiError as error:
            metrics.requests.labels("bad_request" if error.status == 400 else "unavailable").inc()
            raise
        images, headers = await _answered(work, request, arrived, estimate)
        response.headers.update(headers)
        body = {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode()} for png in images]}
        state = progress.get(work.request_id)
        if state is not None and state.cache is not None:  # extension: a step cache's steps (LOSSY)
            body["cache"] = state.cache
        return body

    async def _answered(work: Work, request: Request, arrived: float, estimate: float | None) -> tuple[list[bytes], dict[str, str]]:
        """Queue `work`, wait for its answer, close its progress record and count it; its files and
        the response headers (its id and estimate)."""
        failure: str | None = "the client closed its connection"  # until the request is answered
        try:
            results = await _answer(work, request)
            failure = None
        except ApiError as error:
            failure = error.message
            raise
        finally:
            progress.finished(work.request_id, failure)
        metrics.requests.labels("ok").inc()
        metrics.latency.observe(time.monotonic() - arrived)
        headers = {"X-Request-Id": work.request_id}
        if estimate is not None:
            headers["X-Estimated-Seconds"] = f"{estimate:.3g}"
        return results, headers

    def _estimate(work: Work) -> float | None:
        """`work`'s estimated seconds (None: not measured yet); `ApiError` over a limit or while loading."""
        if not ready() and not scheduler.stopped:
            raise ApiError(503, "the server is loading its model; retry when GET /health answers 200",
                           kind="server_error", headers={"Retry-After": "5"})
        model = costs()
        if model is None:
            return None
        try:
            return model.check(work).seconds
        except OverLimit as error:
            raise ApiError(400, str(error), param=error.param) from error

    def _submit(work: Work) -> Future:
        """`work` queued; `ApiError` (counted) when the queue is full or the server stops."""
        try:
            return scheduler.submit(work)
        except QueueFull as error:
            metrics.requests.labels("queue_full").inc()
            raise ApiError(429, f"{error}; retry later", kind="rate_limit_error", headers={"Retry-After": "1"}) from error
        except Stopped as error:
            metrics.requests.labels("unavailable").inc()
            raise ApiError(503, str(error), kind="server_error") from error

    async def _answer(work: Work, request: Request) -> list[bytes]:
        """`work`'s PNGs (a video's MP4), through the queue; `ApiError` for every other outcome (counted)."""
        future = _submit(work)
        try:
            return await _unless_gone(future, request)
        except _Gone:
            scheduler.cancel(future)  # out of the queue, or out of the running batch at its next step
            metrics.requests.labels("cancelled").inc()
            raise ApiError(499, "the client closed its connection", kind="cancelled") from None
        except Stopped as error:
            metrics.requests.labels("unavailable").inc()
            raise ApiError(503, str(error), kind="server_error") from error
        except Exception as error:
            metrics.requests.labels("error").inc()
            raise ApiError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error") from error

    @app.get("/v1/progress/{request_id}")
    async def request_progress(request_id: str) -> dict[str, Any]:
        state = progress.get(request_id)
        if state is None:
            raise ApiError(404, f"no request {request_id!r} is queued, running or recently finished", param="request_id")
        return state.as_dict()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health_check() -> JSONResponse:
        queued, in_batch = scheduler.depth(), running()
        if scheduler.stopped:
            status, code = "draining", 503
        elif not ready():
            status, code = "unavailable", 503
        else:
            status, code = ("busy" if queued or in_batch else "ok"), 200
        body = {"status": status, "queued": queued, "running": in_batch, "video": limits.video, **health()}
        return JSONResponse(body, status_code=code)

    from .videos import add_video_routes  # it builds on this module's ApiError and Limits

    app.state.videos = add_video_routes(app, limits, progress=progress, metrics=metrics, admit=_estimate,
                                        submit=_submit, cancel=scheduler.cancel, answer=_answered)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def check_port(host: str, port: int) -> None:
    """`UsageError` unless this machine can listen on `host:port`: bound here once, as the HTTP
    server will bind it, so that a port in use is said before any rank loads the model."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise UsageError(f"--host {host!r} is not an address this machine can listen on ({error.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closing socket is no conflict
        try:
            probe.bind(address)
        except OSError as error:
            raise UsageError(f"--port {port} on {host} cannot be listened on: {error.strerror} "
                             f"(another server on it? choose another --port)") from None


class _Gone(Exception):
    """The client closed its connection before its answer."""


async def _unless_gone(future: Future, request: Request) -> list[bytes]:
    """`future`'s result, or `_Gone` as soon as the client disconnects (ASGI's `http.disconnect`:
    once the body is read, the server's `receive` returns only that)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, gone = asyncio.wrap_future(future), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not answer.done():
        answer.cancel()  # the concurrent future is cancelled by the scheduler, not through this wrapper
        raise _Gone
    return answer.result()
