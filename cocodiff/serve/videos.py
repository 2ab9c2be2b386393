"""Video jobs of `cocodiff serve`: OpenAI's Videos API (the subset SGLang Diffusion and vLLM-Omni
serve, docs/video-api.md) on a video model, over the same queue, admission and ranks as images.

    POST   /v1/videos                 create a job: answers its object at once, status "queued"
    GET    /v1/videos                 the jobs, newest first (`limit`, default 20)
    GET    /v1/videos/{id}            the job: status queued -> in_progress -> completed | failed,
                                      `progress` 0..100 from the denoising steps done
    GET    /v1/videos/{id}/content    the MP4 (`video/mp4`); 404 until the job is completed
    DELETE /v1/videos/{id}            cancel it (out of the queue; a running call runs to its end and
                                      its video is dropped), then forget it
    POST   /v1/videos/sync            the same request, answered with the MP4 itself once made (for
                                      scripts and benchmarks; the client leaving cancels it)

The body is JSON (`application/json`; its numbers JSON numbers), or form fields as the official
`openai` client sends them (multipart; its values text; an `input_reference` file: the first frame
of an image-to-video model's clip, and our `last_frame` file its last, where the model takes one):
`prompt`, `size` "WIDTHxHEIGHT" (or `width`, `height`), `num_frames` or
`seconds` (not both: a 400; `seconds` x `fps` + 1 frames, a clip of `seconds` whose first frame
is at 0 s, rounded up to the next length the model's VAE makes: Wan's 4 k + 1 frames, MiniMax-H3's
17 k + 5; the job reports the seconds it makes; `num_frames` is held as given), `fps` (1 to
240, the rate the MP4 is written at and reported), `num_inference_steps`,
`guidance_scale`, `negative_prompt`, `seed`. It is checked as an image request is: sizes, the
`--max-pixels`, `--max-steps` and new `--max-frames` limits, and admission's memory and time
estimate (which also refuses a frame count the model's VAE cannot make), all before the queue,
all 400s in OpenAI's error shape. An image model answers these routes 400, naming the model.

A job is one `Work` (n = 1) in the scheduler; its id is also its progress id (progress.py), so
`GET /v1/progress/{id}` answers for it too. The rank loop runs a batch of videos as one pipeline
call on every rank and only rank 0 encodes the MP4s (calls.py `answers`); the MP4 is kept in
memory with its job. Unfinished jobs are never forgotten; finished ones are kept for the last
`keep` jobs (a deleted or forgotten id is a 404).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.families.pipelines import ANIMATE_PIPELINES, needs_last_frame
from .edits import read_picture
from .progress import Progress
from .protocol import ApiError, Limits, LoraChoice, Metrics, form_lora, outcome, require_json
from .scheduler import Stopped, Work

__all__ = ["KEEP", "Job", "Jobs", "VIDEOS_PATH", "VideoRequest", "add_video_routes", "read_request", "resolve_video"]

VIDEOS_PATH = "/v1/videos"

KEEP = 32
"""Finished jobs (and their MP4s) kept for `GET /v1/videos/{id}/content`."""

Status = Literal["queued", "in_progress", "completed", "failed"]


class VideoRequest(BaseModel):
    """OpenAI's `videos.create` body with vLLM-Omni's diffusion fields; the rest (model, ...) is ignored.

    Strict as `ImageRequest` is for JSON (form fields are text, read leniently: `read_request`),
    but for `seconds`, which OpenAI's API sends as a string."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, max_length=4000)
    size: str | None = Field(default=None, description='"WIDTHxHEIGHT", e.g. "80x48"; default: the model\'s size')
    width: int | None = Field(default=None, ge=1, description="instead of size (with height)")
    height: int | None = Field(default=None, ge=1)
    num_frames: int | None = Field(default=None, ge=1, description="frames of the clip (at most --max-frames)")
    seconds: float | None = Field(default=None, gt=0, le=3600, strict=False,
                                  description="instead of num_frames: seconds x fps + 1 frames (OpenAI sends a string)")
    fps: float | None = Field(default=None, ge=1, le=240,
                              description="frame rate of the MP4, written as given (default: the model's)")
    num_inference_steps: int | None = Field(default=None, ge=1, description="denoising steps (at most --max-steps)")
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    negative_prompt: str | None = Field(default=None, max_length=4000)
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="noise seed (default: random)")
    cache: str | None = Field(default=None, max_length=200,
                              description="LOSSY step cache as `--cache` takes it; null or 'off': none; absent: the server's")
    lora: list[LoraChoice] | None = Field(default=None, max_length=8,
                                          description="LoRA adapters of the server's --lora-dir to turn on; absent: none")


async def read_request(request: Request, limits: Limits) -> tuple[VideoRequest, tuple[bytes, ...]]:
    """The body as a `VideoRequest`: JSON, or form fields (multipart, as the `openai` client sends
    `videos.create`), and its images as PNG files: the `input_reference` (an image-to-video model's
    first frame) and our `last_frame` (Wan's last frame), in that order; (): none given.
    `RequestValidationError` (answered 400 as any bad body) if it is not one."""

    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    form = kind in ("multipart/form-data", "application/x-www-form-urlencoded")
    reference = last = None
    if form:
        async with request.form(max_files=3) as fields:
            if (upload := fields.get("input_reference")) is not None:
                if limits.pipeline not in ANIMATE_PIPELINES:
                    raise ApiError(400, f"input_reference: {limits.model} makes videos from text only (image-to-video: "
                                        f"{', '.join(ANIMATE_PIPELINES)})", param="input_reference")
                reference = await read_picture(upload, "input_reference", limits)
            if (upload := fields.get("last_frame")) is not None:
                if limits.last_frame not in (None, "required", "optional"):
                    raise ApiError(400, f"last_frame: {limits.last_frame}", param="last_frame")
                last = await read_picture(upload, "last_frame", limits)
            data: Any = {name: value for name, value in fields.items() if isinstance(value, str)}
            form_lora(data)
    else:
        require_json(kind)
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError as error:  # the shape FastAPI gives a body that is not JSON
            where = getattr(error, "pos", 0)
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", where), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": getattr(error, "msg", str(error))}}]) from None
    if reference is None and limits.pipeline in ANIMATE_PIPELINES:
        raise ApiError(400, f"input_reference: {limits.model} animates an image: send it as the input_reference "
                            f"file (multipart form data)", param="input_reference")
    if last is None and limits.last_frame == "required":
        raise ApiError(400, f"last_frame: {needs_last_frame(limits.model)}: send the last as the last_frame file",
                       param="last_frame")
    references = tuple(png for png in (reference, last) if png is not None)
    try:
        return VideoRequest.model_validate(data, strict=False if form else None), references
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


def resolve_video(limits: Limits, request: VideoRequest, references: tuple[bytes, ...] = (),
                  clip: Callable[[int], int] = lambda frames: frames) -> Work:
    """The request with every default filled in (`references`: an image-to-video model's first frame,
    and its last where given, PNG; `clip`: the fewest frames, n or more, that the model's VAE makes,
    for a length given in seconds, or ValueError naming the lengths it makes); `ApiError` (400) for
    anything out of range."""

    if not limits.video:
        raise ApiError(400, f"{limits.model} makes images, not videos: use POST /v1/images/generations", param="model")
    width, height = _size(limits, request)
    limits.check_pixels(width, height)
    if request.num_frames is not None and request.seconds is not None:
        raise ApiError(400, f"num_frames={request.num_frames} and seconds={request.seconds:g} both give the clip's "
                            f"length; give one of them", param="seconds")
    fps = request.fps if request.fps is not None else limits.fps
    if limits.sound_fps is not None and fps != limits.sound_fps:
        raise ApiError(400, f"fps={fps:g}: {limits.model} makes its soundtrack in pace with {limits.sound_fps:g} fps "
                            f"clips; give fps {limits.sound_fps:g} or none", param="fps")
    frames = request.num_frames
    if frames is None and request.seconds is not None:
        frames = round(request.seconds * fps) + 1
        try:
            frames = clip(frames)
        except ValueError as rule:
            raise ApiError(400, f"seconds={request.seconds:g}: {frames} frames at fps {fps:g}, and {limits.model} "
                                f"makes {rule}", param="seconds") from None
    frames = frames if frames is not None else limits.frames
    if frames is not None and frames > limits.max_frames:
        given = "" if request.num_frames is not None else f" (seconds {request.seconds:g} at fps {fps:g})"
        raise ApiError(400, f"num_frames={frames}{given} is more than this server's --max-frames {limits.max_frames}",
                       param="num_frames" if request.num_frames is not None else "seconds")
    steps = request.num_inference_steps if request.num_inference_steps is not None else limits.steps
    if steps > limits.max_steps:
        raise ApiError(400, f"num_inference_steps={steps} is more than this server's --max-steps {limits.max_steps}",
                       param="num_inference_steps")
    return Work(
        prompt=request.prompt, width=width, height=height, steps=steps, guidance=request.guidance_scale,
        seed=request.seed if request.seed is not None else secrets.randbits(31),
        request_id=f"video_{secrets.token_hex(12)}", frames=frames, fps=fps, negative_prompt=request.negative_prompt,
        cache=limits.cache_of(request), lora=limits.lora_of(request), references=references,
    )


def _size(limits: Limits, request: VideoRequest) -> tuple[int, int]:

    if request.width is None and request.height is None:
        return limits.size(request.size) if request.size is not None else (limits.width, limits.height)
    width = request.width if request.width is not None else limits.width
    height = request.height if request.height is not None else limits.height
    if request.size is not None and limits.size(request.size) != (width, height):
        raise ApiError(400, f"size {request.size!r} differs from width {width} x height {height}; give one of them",
                       param="size")
    return limits.size(f"{width}x{height}")


@dataclass(kw_only=True)
class Job:
    """One video job: its request, and once finished its MP4 or its error."""

    id: str
    model: str
    work: Work
    created_at: int
    status: Status = "queued"
    completed_at: int | None = None
    error: str | None = None
    content: bytes | None = None
    future: Future | None = None
    """Its place in the scheduler, until it is finished."""

    def as_dict(self, progress: Progress) -> dict[str, Any]:
        """The job as OpenAI's video object (plus `prompt`, `num_frames`, `fps`, ... as vLLM-Omni adds)."""
        status, percent = self.status, 100 if self.status == "completed" else 0
        state = progress.get(self.id) if status == "queued" else None
        if state is not None and state.state == "running":  # 100 only once the MP4 is there (decoding comes last)
            status, percent = "in_progress", min(99, int(100 * state.step / state.steps))
        work = self.work
        return {
            "id": self.id, "object": "video", "model": self.model, "status": status, "progress": percent,
            "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None,
            "size": f"{work.width}x{work.height}",
            "seconds": None if work.frames is None else f"{work.frames / work.fps:.4g}",
            "quality": "standard", "remixed_from_video_id": None,
            "error": None if self.error is None else {"code": "generation_failed", "message": self.error},
            "prompt": work.prompt, "negative_prompt": work.negative_prompt, "num_frames": work.frames,
            "fps": work.fps, "num_inference_steps": work.steps, "guidance_scale": work.guidance, "seed": work.seed,
            "media_type": "video/mp4",
        }


class Jobs:
    """Every unfinished job and the last `keep` finished ones, by id; thread-safe (the rank loop
    finishes jobs, the HTTP thread reads them)."""

    def __init__(self, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep {keep} must be at least 1")
        self.keep = keep
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished ids, oldest first
        self._lock = threading.Lock()

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.id] = job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def newest(self, limit: int) -> list[Job]:
        with self._lock:
            return list(reversed(self._jobs.values()))[:limit]

    def forget(self, job_id: str) -> Job | None:
        with self._lock:
            self._finished.pop(job_id, None)
            return self._jobs.pop(job_id, None)

    def finish(self, job_id: str, *, content: bytes | None = None, error: str | None = None) -> bool:
        """Complete `job_id` with its MP4, or fail it with `error`; False if it was forgotten meanwhile."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return False
            failed = error is not None
            job.status, job.content, job.error = ("failed", None, error) if failed else ("completed", content, None)
            job.future = None
            job.completed_at = int(time.time())
            self._finished[job_id] = None
            while len(self._finished) > self.keep:
                old, _ = self._finished.popitem(last=False)
                self._jobs.pop(old, None)
            return True


def add_video_routes(app: FastAPI, limits: Limits, *, progress: Progress, metrics: Metrics,
                     admit: Callable[[Work], float | None], submit: Callable[[Work], Future],
                     cancel: Callable[[Future], None],
                     answer: Callable[[Work, Request, float, float | None], Awaitable[tuple[list[bytes], dict[str, str]]]],
                     clip: Callable[[int], int] = lambda frames: frames, keep: int = KEEP) -> Jobs:
    """Add the video routes to `app` (see the module's docstring); returns their jobs.

    `admit` estimates a request (`ApiError` over a limit), `submit` queues it (`ApiError` when
    the queue is full or the server stops), `cancel` takes a queued or running request out
    (the scheduler's `cancel`), `answer(work, request, arrived, estimate)` queues it, waits for
    its MP4 (cancelling it if the client leaves), closes its progress record and counts it, and
    gives the MP4s and the response headers (api.py's, as for images); each counts its failures
    in `metrics`. `clip` rounds a length given in seconds up to one the model makes (`resolve_video`).
    """

    jobs = Jobs(keep)

    async def resolve(request: Request) -> tuple[Work, float | None]:
        """The request read, checked and estimated, its progress record open; `ApiError` (counted) if refused."""
        try:
            work = resolve_video(limits, *await read_request(request, limits), clip=clip)
            estimate = admit(work)
            progress.queued(work.request_id, work.steps)  # a fresh random id: never taken
        except ApiError as error:
            metrics.requests.labels(outcome(error.status)).inc()
            raise
        return work, estimate

    def settled(job: Job, arrived: float, future: Future) -> None:
        """The job's future is answered (on the rank loop's thread, or at once if it already was)."""
        content, failure, outcome = None, None, "ok"
        if future.cancelled():
            failure, outcome = "cancelled", "cancelled"
        elif isinstance(error := future.exception(), Stopped):
            failure, outcome = str(error), "unavailable"
        elif error is not None:
            failure, outcome = f"generation failed: {type(error).__name__}: {error}", "error"
        else:
            (content,) = future.result()
        progress.finished(job.id, failure)
        if not jobs.finish(job.id, content=content, error=failure):
            return  # deleted before it finished: counted cancelled then
        metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            metrics.latency.observe(time.monotonic() - arrived)

    def known(video_id: str) -> Job:
        job = jobs.get(video_id)
        if job is None:
            raise ApiError(404, f"no video {video_id!r}: never created, deleted, or long finished", param="video_id")
        return job

    @app.post(VIDEOS_PATH)
    async def create_video(request: Request) -> dict[str, Any]:
        arrived = time.monotonic()
        work, _estimate = await resolve(request)
        try:
            future = submit(work)
        except ApiError as error:
            progress.finished(work.request_id, error.message)
            raise
        job = Job(id=work.request_id, model=limits.model, work=work, created_at=int(time.time()), future=future)
        jobs.add(job)
        future.add_done_callback(lambda done: settled(job, arrived, done))
        return job.as_dict(progress)

    @app.get("/v1/videos")
    async def list_videos(limit: int = Query(default=20, ge=1, le=100)) -> dict[str, Any]:
        data = [job.as_dict(progress) for job in jobs.newest(limit)]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(data) == limit}

    @app.get("/v1/videos/{video_id}")
    async def video_status(video_id: str) -> dict[str, Any]:
        return known(video_id).as_dict(progress)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str) -> Response:
        job = known(video_id)
        if job.content is None:
            status = job.as_dict(progress)["status"]
            raise ApiError(404, f"video {video_id!r} is {status}, not completed: its content is there once "
                                f"GET /v1/videos/{video_id} says completed", param="video_id")
        return Response(job.content, media_type="video/mp4",
                        headers={"Content-Disposition": f'inline; filename="{video_id}.mp4"'})

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> dict[str, Any]:
        job = jobs.forget(known(video_id).id)
        future = job.future if job is not None else None  # None once finished (`Jobs.finish`, under its lock)
        if future is not None:  # unfinished when forgotten: out of the queue, or dropped when its call ends
            cancel(future)
            metrics.requests.labels("cancelled").inc()
            progress.finished(video_id, "deleted")
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/sync")
    async def create_video_sync(request: Request) -> Response:
        arrived = time.monotonic()
        work, estimate = await resolve(request)
        (mp4,), headers = await answer(work, request, arrived, estimate)
        return Response(mp4, media_type="video/mp4", headers=headers)

    return jobs
