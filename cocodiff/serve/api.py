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

A request body over `--max-body-bytes` (default 1 MiB) is a 413 before it is read: at once when
its Content-Length says so, else as soon as the chunks received pass the limit (`BodyLimit`). A
POST body must be JSON sent as `application/json` (415 otherwise; the video routes also take form
fields). Numbers are taken as JSON types only: `"n": "2"` or `"n": true` is a 400, as is NaN.

Every request is estimated before it is queued (admission.py): a size over `--max-pixels`, steps
over `--max-steps`, activations over the ranks' free memory or a time over `--max-request-seconds`
(at the server's measured speed) is a 400 naming the limit; a request that fits the free memory
alone but not in the batch it would join is a 429 with Retry-After. A request whose client closes its
connection leaves the queue, or the running batch at its next step boundary, and is counted as
`cancelled`.

Every error, ours or the framework's (404 no such route, 405 wrong method, 500, and uvicorn's own
answer to a request it cannot parse: `H11Protocol`), uses OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (which never
reaches the queue), 429 with Retry-After when the queue is full, 503 while loading, when the
server is stopping or its ranks failed, 500 when the pipeline raised, 404 for a progress id not
known.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from importlib.resources import files
from pathlib import Path
from typing import Any

import h11
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornH11

from ..engine.families.pipelines import ANIMATE_PIPELINES, EDIT_PIPELINES, NEEDS_REFERENCE
from ..errors import UsageError
from ..models.lora import LORA_FILE, adapter_listing, find_adapter
from .admission import Busy, Costs, OverLimit
from .edits import EDITS_PATH, read_edit
from .protocol import ApiError, ImageRequest, Limits, LoraLoad, Metrics, outcome, require_json
from .scheduler import QueueFull, Scheduler, Stopped, Work

__all__ = ["ApiError", "BodyLimit", "H11Protocol", "ImageRequest", "Limits", "Metrics", "check_port", "create_app"]


class BodyTooLarge(HTTPException):
    """A body that passed the limit while it streamed in: an `HTTPException`, which FastAPI's body
    reader lets through (any other error there becomes its own 400), answered by `http_error`."""

    def __init__(self, limit: int, flag: str) -> None:
        super().__init__(413, f"the request body is more than this server's {flag} {limit} bytes")


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413 in OpenAI's shape before it is
    read whole. A Content-Length over the limit is answered before a byte of the body is read; a
    body without one (chunked) is counted as it streams and refused at the chunk that passes the
    limit. Not FastAPI's `max_body_size`: its answer to an over-long Content-Length is plain text,
    whatever the app's handlers say. `refused()` is called for each body refused (a metric).
    `uploads`: paths whose bodies carry files (image edits), bounded by `upload_limit` instead."""

    def __init__(self, app: ASGIApp, limit: int, refused: Callable[[], None] = lambda: None,
                 upload_limit: int | None = None, uploads: tuple[str, ...] = ()) -> None:
        self.app, self.limit, self.refused = app, limit, refused
        self.upload_limit, self.uploads = upload_limit, uploads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = self.upload_limit is not None and scope.get("path") in self.uploads
        limit, flag = (self.upload_limit, "--max-upload-bytes") if upload else (self.limit, "--max-body-bytes")
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            self.refused()
            error = ApiError(413, f"the request body is {int(declared)} bytes, more than this server's {flag} {limit}")
            return await error.response()(scope, receive, send)
        received, over = 0, False

        async def limited() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    raise BodyTooLarge(limit, flag)
            return message

        try:
            await self.app(scope, limited, send)
        finally:
            if over:
                self.refused()



def _image_inputs(limits: Limits) -> dict[str, Any] | None:
    """What images the served model takes, for /health (the web page shows a file field for them):
    an edit pipeline's references (POST /v1/images/edits, `image[]`), an image-to-video model's first
    frame (POST /v1/videos, `input_reference`; `last_frame`: whether it takes the clip's last
    frame too, 'required' or 'optional' (a checkpoint whose ranks decide once loaded), else None);
    None: text alone."""
    if limits.pipeline in EDIT_PIPELINES:
        return {"route": EDITS_PATH, "field": "image[]", "max": EDIT_PIPELINES[limits.pipeline]}
    if limits.pipeline in ANIMATE_PIPELINES:
        last = limits.last_frame if limits.last_frame in ("required", "optional") else \
            "optional" if limits.last_frame is None else None
        return {"route": "/v1/videos", "field": "input_reference", "max": 1, "last_frame": last}
    return None


def create_app(scheduler: Scheduler, limits: Limits, *, ready: Callable[[], bool] = lambda: True,
               health: Callable[[], dict[str, Any]] = dict, costs: Callable[[], Costs | None] = lambda: None,
               running: Callable[[], int] = lambda: 0,
               loras: Callable[[], list[dict[str, Any]] | None] = lambda: None,
               lora_admin: Callable[[tuple[str, ...]], Future] | None = None) -> FastAPI:
    """The service's app around `scheduler` (which someone else drains: the rank loop, or a test).

    `ready` says whether every rank has loaded the model; `health` adds to /health's body;
    `costs` is the loaded model's estimator (None: no memory or time estimate); `running` counts
    the requests in the running batch; `loras` lists the LoRA adapters (`AdapterCache.listing`;
    None: not loaded yet); `lora_admin(("load", name, path))` or `(("unload", name))` hands an
    admin route's change of the adapters to the rank loop, whose future answers when every rank made it. The app's metrics are `app.state.metrics`, its video jobs (videos.py)
    `app.state.videos`.
    """
    app = FastAPI(title="cocodiff", description="Image generation on sequence-parallel ranks (OpenAI images API).")
    metrics = app.state.metrics = Metrics(scheduler)
    from .videos import VIDEOS_PATH  # an image-to-video model's first frame travels in its body

    app.add_middleware(BodyLimit, limit=limits.max_body_bytes, refused=metrics.requests.labels("bad_request").inc,
                       upload_limit=limits.max_upload_bytes,
                       uploads=(EDITS_PATH, *((VIDEOS_PATH,) if limits.pipeline in ANIMATE_PIPELINES else ())))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        metrics.requests.labels("bad_request").inc()
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, no field
            where = first.get("loc", ("body", "?"))[-1]
            cause = (first.get("ctx") or {}).get("error", "malformed")
            return ApiError(400, f"the request body is not valid JSON: {cause} at character {where}").response()
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}{_given(first)}"
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

    async def json_only(request: Request) -> None:
        """415 (counted) unless the body is sent as JSON; runs before the body is validated."""
        try:
            require_json(request.headers.get("content-type"))
        except ApiError:
            metrics.requests.labels("bad_request").inc()
            raise

    @app.post("/v1/images/generations", dependencies=[Depends(json_only)])
    async def generations(body: ImageRequest, request: Request, response: Response) -> dict[str, Any]:
        arrived = time.monotonic()
        try:
            if limits.pipeline in NEEDS_REFERENCE:
                one = EDIT_PIPELINES[limits.pipeline] == 1
                raise ApiError(400, f"{limits.model} edits {'a reference image' if one else 'reference images'} "
                                    f"({limits.pipeline}): send {'it' if one else 'them'} to POST {EDITS_PATH}", param="model")
            work = limits.resolve(body)
            estimate = _estimate(work)
            if not progress.queued(work.request_id, work.steps):
                raise ApiError(400, f"request_id {work.request_id!r} is queued or running already", param="request_id")
        except ApiError as error:
            metrics.requests.labels(outcome(error.status)).inc()
            raise
        images, headers = await _answered(work, request, arrived, estimate)
        response.headers.update(headers)
        body = {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode()} for png in images]}
        state = progress.get(work.request_id)
        if state is not None and state.cache is not None:  # extension: a step cache's steps (LOSSY)
            body["cache"] = state.cache
        return body

    @app.post(EDITS_PATH)
    async def edits(request: Request, response: Response) -> dict[str, Any]:
        """OpenAI's images.edit on an edit pipeline (edits.py): the answer is generations'."""
        arrived = time.monotonic()
        try:
            work = await read_edit(request, limits)
            estimate = _estimate(work)
            if not progress.queued(work.request_id, work.steps):
                raise ApiError(400, f"request_id {work.request_id!r} is queued or running already", param="request_id")
        except ApiError as error:
            metrics.requests.labels(outcome(error.status)).inc()
            raise
        images, headers = await _answered(work, request, arrived, estimate)
        response.headers.update(headers)
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode()} for png in images]}

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
            return model.check(work, scheduler.batch_images(work)).seconds
        except Busy as error:
            raise ApiError(429, str(error), param=error.param, kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from error
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

    @app.get("/v1/loras")
    async def lora_list() -> dict[str, Any]:
        """The LoRA adapters a request may name (`serve --lora-dir`), each loaded now or not (at
        most `--max-loras` are; one a request names loads at its turn)."""
        listed = loras()
        if listed is None:
            listed = adapter_listing(limits.loras)
        return {"object": "list", "data": listed, "max_loaded": limits.max_loras}

    def _admin(name: str) -> Callable[[tuple[str, ...]], Future]:
        """The rank loop's door for `name`, once every rank loaded; 400 for a server without adapters
        or a name that is no plain name of --lora-dir."""
        if limits.lora_dir is None:
            raise ApiError(400, "this server loads no LoRA adapters (serve --lora-dir)", param="name")
        if name != Path(name).name or name.startswith(".") or "\\" in name:
            raise ApiError(400, f"name {name!r}: an adapter's name in --lora-dir (a subfolder or a .safetensors "
                                f"file's stem), not a path", param="name")
        if lora_admin is None or not ready():
            raise ApiError(503, "the ranks are still loading the model; try again once /health says ok",
                           kind="server_error")
        return lora_admin

    @app.post("/v1/loras")
    async def lora_load(body: LoraLoad) -> dict[str, Any]:
        """Load adapter `name` of `--lora-dir` on every rank now (one put there after the server
        started, too), in place of the least recently used one no running request needs; a request
        may name it from then on."""
        admin = _admin(body.name)
        try:
            path = find_adapter(limits.lora_dir, body.name)
        except UsageError as error:
            raise ApiError(400, str(error), param="name") from None
        if path is None:
            raise ApiError(404, f"no adapter {body.name!r} in --lora-dir {limits.lora_dir} (a subfolder holding "
                                f"{LORA_FILE}, or {body.name}.safetensors)", param="name")
        await asyncio.wrap_future(admin(("load", body.name, path)))
        return {"id": body.name, "object": "lora", "loaded": True}

    @app.delete("/v1/loras/{name}")
    async def lora_unload(name: str) -> dict[str, Any]:
        """Free adapter `name`'s weights on every rank; a request that names it later loads it again."""
        admin = _admin(name)
        names = limits.lora_choices()
        if name not in names:
            raise ApiError(404, f"no adapter {name!r} on this server (it has: {', '.join(names)})", param="name")
        await asyncio.wrap_future(admin(("unload", name)))
        return {"id": name, "object": "lora", "loaded": False}

    @app.get("/health")
    async def health_check() -> JSONResponse:
        queued, in_batch = scheduler.depth(), running()
        if scheduler.stopped:
            status, code = "draining", 503
        elif not ready():
            status, code = "unavailable", 503
        else:
            status, code = ("busy" if queued or in_batch else "ok"), 200
        body = {"status": status, "queued": queued, "running": in_batch, "video": limits.video,
                "images": _image_inputs(limits), **health()}
        return JSONResponse(body, status_code=code)

    from .videos import (
        add_video_routes,  # it builds on this module's ApiError and Limits
    )

    app.state.videos = add_video_routes(app, limits, progress=progress, metrics=metrics, admit=_estimate,
                                        submit=_submit, cancel=scheduler.cancel, answer=_answered,
                                        clip=lambda frames: model.clip_frames(frames) if (model := costs()) else frames)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


_HUGE_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*[0-9]{21,}[ \t]*\r\n", re.IGNORECASE)
"""A Content-Length of more digits than h11 reads (20: 10^20 bytes and more)."""


class H11Protocol(_UvicornH11):
    """uvicorn's HTTP/1.1 protocol (`uvicorn.Config(http=...)`), answering a request it cannot
    parse (a garbage request line, a bad Content-Length) in OpenAI's error shape instead of plain
    text, and a Content-Length too long to read (a body far over any limit) with 413, as the
    app answers one over `--max-body-bytes`."""

    def data_received(self, data: bytes) -> None:
        self._received = getattr(self, "_received", b"")[-8192:] + data  # where the headers are, for the 413
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        huge = _HUGE_LENGTH.search(getattr(self, "_received", b"")) is not None
        status, message = (413, "the request's Content-Length is larger than any body this server takes") if huge else (
            400, "the request is not valid HTTP/1.1 (its request line or headers cannot be parsed)")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": None}}).encode()
        for event in (h11.Response(status_code=status, headers=[(b"content-type", b"application/json"),
                                                                 (b"content-length", str(len(body)).encode()),
                                                                 (b"connection", b"close")]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


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


def _given(error: dict[str, Any]) -> str:
    """The refused value, for a message (`, got 1e-09`); "" for a missing field or a long value."""
    if error.get("type") == "missing" or "input" not in error:
        return ""
    given = repr(error["input"])
    return f", got {given}" if len(given) <= 40 else ""


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
