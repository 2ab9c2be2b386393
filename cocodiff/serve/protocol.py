"""What the image and video routes share: the request body of an image, the error answered in
OpenAI's shape, the limits every request is checked against before it is queued, and the metrics."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from ..config.cache import CacheSpec, parse_cache
from ..config.sizes import parse_image_size
from ..engine.families.pipelines import SIZED_BY_IMAGE, bucket_target, no_bucket
from ..errors import UsageError
from ..models.lora import SCALE_LIMIT
from ..output.video import DEFAULT_FPS
from .scheduler import Scheduler, Work

OUTCOMES = ("ok", "bad_request", "queue_full", "unavailable", "error", "cancelled")


LINKS = ("intra_node", "inter_node")

MAX_BODY_BYTES = 1 << 20
"""A request body's default limit: a prompt of 4000 characters, every one a JSON escape, is 24 kB."""


def outcome(status: int) -> str:
    """The `cocodiff_requests` outcome a refusal with this HTTP status counts as."""
    return {429: "queue_full"}.get(status, "bad_request" if status < 500 else "unavailable")


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
    one_per_call: str | None = None
    """Why the model makes one image per pipeline call (then `max_n` is 1); None: it takes a batch."""
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
    fps: float = float(DEFAULT_FPS)
    """A video's default frame rate."""
    last_frame: str | None = ""
    """How an image-to-video model takes a video's last frame (the `last_frame` file): 'required',
    'optional', or why it takes none ("": a model of no image-to-video); None: known once it loads (a
    checkpoint of `LAST_FRAME_PIPELINES`: its ranks refuse a request that does not fit)."""
    sound_fps: float | None = None
    """The frame rate a model that makes a soundtrack makes its clips for (LTX-2: 24): every video's
    (`fps` is then it, and another is a 400); None: a model without sound."""
    cache: CacheSpec | None = None
    """The server's `--cache`: the step cache of a request that names none."""
    cache_refused: str | None = None
    """Why this server runs no step cache (e.g. its --compile); None: it does."""
    cache_blocks: Callable[[], int | None] = lambda: None
    """The loaded transformer's blocks a cache splits (None: not loaded yet)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """A request body's bytes at most (`--max-body-bytes`): a larger one is a 413 before it is read."""
    pipeline: str | None = None
    """The served pipeline's class (an edit pipeline answers POST /v1/images/edits)."""
    max_upload_bytes: int = 32 << 20
    """An edit's body (its reference images) at most (`--max-upload-bytes`)."""
    loras: tuple[str, ...] = ()
    """The LoRA adapters a request may name (`--lora-dir`), by name, as the server starts."""
    lora_names: Callable[[], tuple[str, ...]] | None = None
    """Those it may name now, with the ones `POST /v1/loras` added (None: `loras`)."""
    lora_dir: Path | None = None
    """`--lora-dir`, where `POST /v1/loras` finds an adapter by name (None: no adapters)."""
    max_loras: int = 8
    """Adapters loaded at a time (`--max-loras`): a request names at most that many."""

    def lora_choices(self) -> tuple[str, ...]:
        """The adapters a request may name now (`lora_names`, else those of the start)."""
        return self.lora_names() if self.lora_names is not None else self.loras

    def lora_of(self, request: BaseModel) -> tuple[tuple[str, float], ...]:
        """The request's adapters as ((name, scale), ...) in name order; `ApiError` (400) for a
        name this server has not loaded, a name given twice or a scale out of range."""
        given = getattr(request, "lora", None) or []
        names = self.lora_choices()
        if given and not names:
            raise ApiError(400, "lora: this server loads no LoRA adapters (serve --lora-dir)", param="lora")
        chosen: dict[str, float] = {}
        for adapter in given:
            if adapter.name not in names:
                raise ApiError(400, f"lora: no adapter {adapter.name!r} on this server (it has: "
                                    f"{', '.join(names)})", param="lora")
            if adapter.name in chosen:
                raise ApiError(400, f"lora: adapter {adapter.name!r} named twice", param="lora")
            if not abs(adapter.scale) <= SCALE_LIMIT:
                raise ApiError(400, f"lora: {adapter.name}'s scale {adapter.scale:g} is out of range "
                                    f"(-{SCALE_LIMIT:g} to {SCALE_LIMIT:g})", param="lora")
            chosen[adapter.name] = adapter.scale
        if len(chosen) > self.max_loras:
            raise ApiError(400, f"lora: {len(chosen)} adapters, and this server keeps at most {self.max_loras} "
                                f"loaded (serve --max-loras)", param="lora")
        return tuple(sorted(chosen.items()))

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
        if request.n > 1 and self.one_per_call:
            raise ApiError(400, f"n={request.n}: {self.one_per_call}", param="n")
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
            lora=self.lora_of(request),
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
        if self.pipeline in SIZED_BY_IMAGE and bucket_target(height, width, self.size_multiple) is None:
            raise ApiError(400, f"size {size!r}: {no_bucket(self.model, height, width, self.size_multiple)}", param="size")
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
        self.lora_loads = Counter("cocodiff_lora_loads", "LoRA adapters loaded for a request (`--max-loras` "
                                  "misses: one not loaded was needed)", registry=self.registry)
        self.lora_load_seconds = Histogram("cocodiff_lora_load_seconds", "time to load one LoRA adapter on rank 0",
                                           buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=self.registry)
        self.lora_switch_seconds = Histogram("cocodiff_lora_switch_seconds", "time to switch the LoRA adapters turned "
                                             "on (loads included) on rank 0", buckets=(0.001, 0.005, 0.01, 0.05, 0.1,
                                                                                      0.5, 1, 5, 10), registry=self.registry)
        scheduler.on_batch = self.batch_size.observe

    def lora_loaded(self, _name: str, seconds: float) -> None:
        self.lora_loads.inc()
        self.lora_load_seconds.observe(seconds)

    def count_comm(self, intra_node: int, inter_node: int) -> None:
        """Add bytes rank 0 sent to ranks on its own node and on other nodes."""
        self.comm_bytes.labels("intra_node").inc(intra_node)
        self.comm_bytes.labels("inter_node").inc(inter_node)


def require_json(content_type: str | None) -> None:
    """`ApiError` (415) unless `content_type` names JSON. A body sent as text/plain is not read as
    JSON (FastAPI's strict content type): a web page of any origin may POST text/plain without a
    CORS preflight, so reading it would let such a page spend this server's ranks."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise ApiError(415, f"the request body must be JSON sent with Content-Type: application/json, "
                            f"not {kind or 'no Content-Type'}")


def form_lora(fields: dict[str, Any]) -> None:
    """A form's `lora` field (text, as multipart sends every field) read as the JSON list a JSON
    body gives, in place; `ApiError` (400) for text that is not JSON."""
    if isinstance(fields.get("lora"), str):
        try:
            fields["lora"] = json.loads(fields["lora"])
        except ValueError:
            raise ApiError(400, 'lora: give a JSON list, e.g. [{"name": "style", "scale": 0.8}]', param="lora") from None


class LoraChoice(BaseModel):
    """One adapter a request turns on (extension): its name on this server and its scale."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=200)
    scale: float = 1.0


class LoraLoad(BaseModel):
    """`POST /v1/loras`' body: the adapter of `serve --lora-dir` to load on every rank, by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=200, description="a subfolder holding pytorch_lora_weights.safetensors, "
                                                                "or NAME.safetensors, in the server's --lora-dir")


class ImageRequest(BaseModel):
    """OpenAI's `images.generate` body; fields it has and we do not use (model, quality, ...) are ignored.

    Strict: `"n": true` or `"n": "2"` is refused, not read as 1 or 2 (a client that sends them
    has a bug it should hear of); a float must be finite (JSON's NaN and Infinity are refused)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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
    lora: list[LoraChoice] | None = Field(default=None, max_length=8,
                                          description="extension: LoRA adapters of the server's --lora-dir to turn on, "
                                                      "[{\"name\": ..., \"scale\": 1.0}, ...]; absent: none")
