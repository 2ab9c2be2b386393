"""What a request will cost, checked before it is queued: memory from the model's configs, time
from the steps this server has measured.

The memory estimate is `generate`'s (footprint/estimate.py): a rank's activations for the request's size
and image count, times the ranks sharing a CPU machine, against the least free memory any rank
reported when the server started. The time estimate divides the request's FLOPs (footprint/estimate.py's
count, all steps) by the fastest rate (FLOPs per second) of the server's recent steps; until a
step has been measured there is no time estimate and no time limit applies. A request over either
limit is a 400 naming it, like any other bad request, and never reaches the ranks.

Memory is checked twice: for the request alone (over: a 400), then for the batch it would join
(the images waiting or running at its size, its own, at most `--max-batch`: `Scheduler.batch_images`),
since requests admissible alone are batched together; over only together: a 429 (`Busy`), as a
full queue is, to retry once the batch has run.

A video's tokens are its latent frames' (`(frames - 1) / temporal_factor + 1`, the VAE's temporal
compression) times one frame's; a request that gives no frame count is costed at the pipeline's own
default (its `__call__`'s `num_frames`, what it will run), and so is a step of it that is measured. A frame count the VAE cannot make (not `temporal_factor x k + 1`)
is refused here too: the loaded model is what knows its factor.
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..engine.families import class_name
from ..footprint.estimate import Footprint, estimate
from ..models.catalog import TEXT_TOKENS, clip_rule, latent_frames, next_clip
from .scheduler import Work

__all__ = ["Busy", "Costs", "Estimate", "OverLimit", "default_frames"]

RECENT = 16
"""Measured steps kept: the time estimate uses the fastest of them (a refusal needs no doubt)."""


class OverLimit(ValueError):
    """A request over the server's memory or time limit: the message names the limit, `param` the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Busy(OverLimit):
    """A request that fits alone but not with the requests already waiting or running at its size."""


def default_frames(pipe: Any) -> int | None:
    """The frames `pipe` makes when a call names none: its `__call__`'s `num_frames` default
    (None: an image pipeline, or one without such a default)."""
    try:
        parameter = inspect.signature(type(pipe).__call__).parameters.get("num_frames")
    except (TypeError, ValueError):
        return None
    default = None if parameter is None else parameter.default
    return default if isinstance(default, int) and not isinstance(default, bool) and default > 0 else None


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """One request's cost."""

    rank_bytes: int | None
    """Activations on one rank (times the ranks sharing its machine on CPU); None: the configs do not say."""
    seconds: float | None
    """Compute time at the server's measured rate; None: nothing measured yet."""


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e6:.2f} MB"


class Costs:
    """Memory and time of requests on one loaded model; `observe` feeds it measured steps.

    `free_bytes` is the least free memory over the ranks (None: unknown, no memory check);
    `sharing` the ranks that share one machine's memory (the local ranks on CPU, else 1).
    Thread-safe: the rank loop observes, the HTTP thread checks.
    """

    def __init__(self, transformer: Any, vae: Any, *, family: str, pixel_multiple: int, item_bytes: int,
                 ranks: int, sharing: int = 1, free_bytes: int | None = None, text_tokens: int = TEXT_TOKENS,
                 max_request_s: float | None = None, temporal_factor: int = 1, frames: int | None = None,
                 frame_chunk: tuple[int, int] | None = None, frame_limits: tuple[int, int] | None = None) -> None:
        self._configs = (transformer, vae)
        self.temporal_factor = temporal_factor
        """A video VAE's frames per latent frame (4 for Wan's); 1 for images."""
        self.frame_chunk, self.frame_limits = frame_chunk, frame_limits
        """A VAE that encodes in chunks (MiniMax-H3's: 17 frames -> 5 latent frames, `catalog.clip_rule`) in
        place of `temporal_factor`, and the fewest and most frames of a clip; None: none."""
        self.frames = frames
        """The pipeline's own clip length, for a request or a step that names none (None: images)."""
        self._options = dict(pixel_multiple=pixel_multiple, item_bytes=item_bytes, ranks=ranks,
                             text_tokens=text_tokens, family=family)
        self.sharing, self.free_bytes, self.max_request_s = sharing, free_bytes, max_request_s
        self._rates: deque[float] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, pipe: Any, **options: Any) -> Costs:
        """From a loaded pipeline (its transformer's and VAE's configs and dtype)."""
        return cls(pipe.transformer.config, pipe.vae.config, family=class_name(pipe.transformer),
                   item_bytes=pipe.transformer.dtype.itemsize,
                   temporal_factor=getattr(pipe, "vae_scale_factor_temporal", None) or 1,
                   frames=default_frames(pipe), frame_chunk=getattr(pipe, "frame_chunk", None),
                   frame_limits=getattr(pipe, "frame_limits", None), **options)

    def clip_frames(self, frames: int) -> int:
        """The fewest frames, `frames` or more, that this model's VAE makes (a clip of some seconds);
        ValueError (the rule) where that is outside the clips it makes."""
        clip = next_clip(frames, self.temporal_factor, self.frame_chunk)
        rule = clip_rule(clip, self.frame_chunk, self.frame_limits) if self.frame_chunk is not None else None
        if rule is not None:
            raise ValueError(rule)
        return clip

    def footprint(self, width: int, height: int, images: int = 1, steps: int = 1,
                  frames: int | None = None) -> Footprint | None:
        """`images` images (or clips of `frames` frames, default the pipeline's) of this size, `steps` steps."""
        frames = frames if frames is not None else self.frames
        latent = None if frames is None else latent_frames(frames, self.temporal_factor, self.frame_chunk)
        video = {} if frames is None else {"frames": latent, "decode_frames": min(frames, self.temporal_factor)}
        return estimate(*self._configs, height=height, width=width, batch=images, steps=steps, **video, **self._options)

    def observe(self, width: int, height: int, images: int, seconds: float, frames: int | None = None) -> None:
        """One measured denoising step of `images` images (clips of `frames` frames) of this size, on every rank."""
        footprint = self.footprint(width, height, images, frames=frames)
        if footprint is not None and seconds > 0:
            with self._lock:
                self._rates.append(footprint.flops / seconds)

    def rate(self) -> float | None:
        """The fastest recent rate in FLOPs per second (of footprint/estimate.py's count); None before any step."""
        with self._lock:
            return max(self._rates, default=None)

    def check(self, work: Work, batch_images: int | None = None) -> Estimate:
        """`work`'s estimate; `OverLimit` if it needs more memory than is free, or more time than
        `max_request_s` at the measured rate, or frames its VAE cannot make; `Busy` if it fits alone
        but not in a batch of `batch_images` images (default: its own)."""
        if work.frames is not None and self.frame_chunk is not None:
            rule = clip_rule(work.frames, self.frame_chunk, self.frame_limits)
            if rule is not None:
                raise OverLimit(f"num_frames={work.frames}: this model makes {rule}", "num_frames")
        elif work.frames is not None and (work.frames - 1) % self.temporal_factor:
            factor = self.temporal_factor
            raise OverLimit(f"num_frames={work.frames}: this model makes {factor} x k + 1 frames "
                            f"(1, {factor + 1}, {2 * factor + 1}, ...)", "num_frames")
        footprint = self.footprint(work.width, work.height, work.n, work.steps, work.frames)
        if footprint is None:
            return Estimate(rank_bytes=None, seconds=None)
        needed = footprint.rank_bytes * self.sharing
        frames = work.frames if work.frames is not None else self.frames
        size = f"size {work.width}x{work.height}" + (f" with n={work.n}" if work.n > 1 else "")
        size += f", {frames} frames" if frames is not None else ""
        if self.free_bytes is not None and needed > self.free_bytes:
            raise OverLimit(f"{size} needs about {_size(needed)} of activations ({footprint.image_tokens} image tokens), "
                            f"more than the {_size(self.free_bytes)} this server's ranks had free; use a smaller size",
                            "size")
        self._check_batch(work, batch_images, size)
        rate = self.rate()
        seconds = footprint.flops / rate if rate else None
        if seconds is not None and self.max_request_s is not None and seconds > self.max_request_s:
            raise OverLimit(f"{size}, {work.steps} steps would take about {seconds:.0f} s at this server's measured "
                            f"speed, more than its --max-request-seconds {self.max_request_s:g}; use a smaller size "
                            f"or fewer steps", "size")
        return Estimate(rank_bytes=needed, seconds=seconds)

    def _check_batch(self, work: Work, batch_images: int | None, size: str) -> None:
        """`Busy` if the batch `work` would join (`batch_images` images) needs more memory than is free."""
        if self.free_bytes is None or batch_images is None or batch_images <= work.n:
            return
        batch = self.footprint(work.width, work.height, batch_images, work.steps, work.frames)
        needed = batch.rank_bytes * self.sharing if batch is not None else 0
        if needed > self.free_bytes:
            raise Busy(f"{size} fits alone, but batched with the {batch_images - work.n} images waiting or running "
                       f"at this size it needs about {_size(needed)} of activations, more than the "
                       f"{_size(self.free_bytes)} this server's ranks had free; retry when they are done", "size")
