"""The HTTP layer of `cocodiff serve`: validate, enqueue, answer. Nothing here touches a rank.

    POST /v1/images/generations   OpenAI's images request and response (`b64_json` only), plus the
                                  extensions `seed`, `steps`, `guidance` and `request_id`
    GET  /v1/progress/{id}        where a request stands: queued, running (step i of N), done or failed;
                                  the id: the request's `request_id`, or the one its answer's
                                  X-Request-Id header names (the web page polls this every 100 ms)
    GET  /health                  200 once every rank has loaded the model, 503 before and when stopping
    GET  /metrics                 Prometheus text: queue depth, batch sizes, latency, requests by outcome,
                                  bytes rank 0 sent per link class
    GET  /                        a web page: prompt, size, seed, steps, a progress bar (it polls
                                  /v1/progress/{id}) and the image

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(which never reaches the queue), 429 with Retry-After when the queue is full, 503 when the server
is stopping or its ranks failed, 500 when the pipeline raised, 404 for a progress id not known.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from .scheduler import QueueFull, Scheduler, Stopped, Work

__all__ = ["ApiError", "ImageRequest", "Limits", "Metrics", "create_app"]

OUTCOMES = ("ok", "bad_request", "queue_full", "unavailable", "error")
LINKS = ("intra_node", "inter_node")


class ImageRequest(BaseModel):
    """OpenAI's `images.generate` body; fields it has and we do not use (model, quality, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, max_length=4000)
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, description='"WIDTHxHEIGHT", e.g. "64x64"; default: the model\'s size')
    response_format: str = Field(default="b64_json", description='"b64_json" only')
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="extension: noise seed (default: random)")
    steps: int | None = Field(default=None, ge=1, le=1000, description="extension: denoising steps")
    guidance: float | None = Field(default=None, ge=0, le=100, description="extension: guidance scale")
    request_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                   description="extension: the id to follow it by at GET /v1/progress/{id} "
                                               "(default: a new one, answered in the X-Request-Id header)")


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

    def resolve(self, request: ImageRequest) -> Work:
        """The request with every default filled in; `ApiError` (400) for anything out of range."""
        if request.response_format != "b64_json":
            raise ApiError(400, f"response_format {request.response_format!r} is not supported: "
                                f"this server returns images inline only, use 'b64_json'", param="response_format")
        if request.n > self.max_n:
            raise ApiError(400, f"n={request.n} is more than this server's {self.max_n} images per request", param="n")
        width, height = self._size(request.size) if request.size is not None else (self.width, self.height)
        return Work(
            prompt=request.prompt, n=request.n, width=width, height=height,
            steps=request.steps if request.steps is not None else self.steps,
            guidance=request.guidance,
            seed=request.seed if request.seed is not None else secrets.randbits(31),
            request_id=request.request_id or secrets.token_hex(8),
        )

    def _size(self, size: str) -> tuple[int, int]:
        parts = size.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ApiError(400, f"size {size!r} is not WIDTHxHEIGHT, e.g. '{self.width}x{self.height}'", param="size")
        width, height = int(parts[0]), int(parts[1])
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
        scheduler.on_batch = self.batch_size.observe

    def count_comm(self, intra_node: int, inter_node: int) -> None:
        """Add bytes rank 0 sent to ranks on its own node and on other nodes."""
        self.comm_bytes.labels("intra_node").inc(intra_node)
        self.comm_bytes.labels("inter_node").inc(inter_node)


def create_app(scheduler: Scheduler, limits: Limits, *, ready: Callable[[], bool] = lambda: True,
               health: Callable[[], dict[str, Any]] = dict) -> FastAPI:
    """The service's app around `scheduler` (which someone else drains: the rank loop, or a test).

    `ready` says whether every rank has loaded the model; `health` adds to /health's body.
    The app's metrics are `app.state.metrics`.
    """
    app = FastAPI(title="cocodiff", description="Image generation on sequence-parallel ranks (OpenAI images API).")
    metrics = app.state.metrics = Metrics(scheduler)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        metrics.requests.labels("bad_request").inc()
        first = error.errors()[0] if error.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        return ApiError(400, message, param=".".join(where) or None).response()

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    progress = scheduler.progress
    page = (files(__package__) / "static" / "index.html").read_text(encoding="utf-8")

    @app.post("/v1/images/generations")
    async def generations(body: ImageRequest, response: Response) -> dict[str, Any]:
        arrived = time.monotonic()
        try:
            work = limits.resolve(body)
            if not progress.queued(work.request_id, work.steps):
                raise ApiError(400, f"request_id {work.request_id!r} is queued or running already", param="request_id")
        except ApiError:
            metrics.requests.labels("bad_request").inc()
            raise
        failure: str | None = "the client went away"  # until the request is answered
        try:
            images = await _answer(work)
            failure = None
        except ApiError as error:
            failure = error.message
            raise
        finally:
            progress.finished(work.request_id, failure)
        metrics.requests.labels("ok").inc()
        metrics.latency.observe(time.monotonic() - arrived)
        response.headers["X-Request-Id"] = work.request_id
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode()} for png in images]}

    async def _answer(work: Work) -> list[bytes]:
        """`work`'s PNGs, through the queue; `ApiError` for every other outcome (counted)."""
        try:
            future = scheduler.submit(work)
        except QueueFull as error:
            metrics.requests.labels("queue_full").inc()
            raise ApiError(429, f"{error}; retry later", kind="rate_limit_error", headers={"Retry-After": "1"}) from error
        except Stopped as error:
            metrics.requests.labels("unavailable").inc()
            raise ApiError(503, str(error), kind="server_error") from error
        try:
            return await asyncio.wrap_future(future)  # a client that leaves cancels it (dropped if not started)
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
        is_ready = ready()
        return JSONResponse({"status": "ok" if is_ready else "unavailable", **health()}, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
