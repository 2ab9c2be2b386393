"""One pipeline call for a batch of requests (per-request batching, for pipelines the stepper
does not know): what rank 0 broadcasts (`Call`), how every rank runs it (`run_call`), and what
rank 0 answers with (`answers`): PNGs (`pngs`), or for a video model one MP4 per request, encoded
on rank 0 only (`mp4s` for a pipeline's output)."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config.cache import CacheSpec
from ..engine.families.pipelines import animates, check_last_frame, size_arguments
from ..models.lora import use_adapters
from ..models.presets import task_variant
from ..output.video import DEFAULT_FPS
from ..run.pipeline import sample_rate
from .scheduler import Batch

__all__ = ["Call", "answers", "mp4s", "pngs", "run_call"]


@dataclass(frozen=True, kw_only=True)
class Call:
    """One pipeline call: one image (or video) per prompt, each with its own seed."""

    prompts: list[str]
    seeds: list[int]
    width: int
    height: int
    steps: int
    guidance: float | None
    frames: int | None = None
    """A video model's frames per clip; None: an image model, or the pipeline's default clip."""
    negatives: list[str] | None = None
    """One negative prompt per prompt; None: the pipeline's default."""
    cache: CacheSpec | None = None
    """The call's step cache (LOSSY: one decision per step for all its images, as `generate --batch`)."""
    references: tuple[bytes, ...] = ()
    """An edit's reference images (PNG files) for every prompt of the call; (): none."""
    lora: tuple[tuple[str, float], ...] = ()
    """The LoRA adapters the call turns on, (name, scale) (`serve --lora-dir`); (): every one off."""
    mask: bytes | None = None
    """An edit's mask (a greyscale PNG, white: repainted) over its one reference: the model's edit
    inpaint pipeline runs the call (`EDIT_INPAINT`); None: none."""

    @classmethod
    def of(cls, batch: Batch) -> Call:
        width, height, steps, guidance, frames, cache, references, lora, mask = batch.key
        negatives = None
        if any(work.negative_prompt is not None for work in batch.works):
            negatives = [work.negative_prompt or "" for work in batch.works for _ in range(work.n)]
        return cls(prompts=batch.prompts, seeds=batch.seeds, width=width, height=height, steps=steps, guidance=guidance,
                   frames=frames, negatives=negatives, cache=cache, references=references, lora=lora, mask=mask)


def _guidance_argument(pipe: Any) -> str:
    """The pipeline argument a request's `guidance` sets: true CFG where the model uses it."""
    defaults = getattr(pipe, "prompt_defaults", {})
    if "true_cfg_scale" in defaults or type(pipe).__name__.startswith("QwenImage"):
        return "true_cfg_scale"
    return "guidance_scale"


def run_call(pipe: Any, call: Call, on_step: Callable[[int], None] | None = None) -> np.ndarray:
    """Run `call` through `pipe`: images (N, H, W, 3) in [0, 1], one per prompt; a video
    pipeline's clips (N, F, H, W, 3).

    One generator per image: each prompt's initial noise is what it would be alone with its seed.
    `on_step(i)` is called after the i-th denoising step (from 1), through diffusers'
    `callback_on_step_end`.
    """
    use_adapters(pipe, call.lora)  # a server with --lora-dir: this call's own adapters, or none
    options: dict[str, Any] = {} if call.guidance is None else {_guidance_argument(pipe): call.guidance}
    if call.frames is not None:
        options["num_frames"] = call.frames
    if call.negatives is not None:
        options["negative_prompt"] = call.negatives
    if call.references:  # as `generate --image` passes them: one as itself, several as a list
        from PIL import Image

        images = [Image.open(io.BytesIO(png)).convert("RGB") for png in call.references]
        options["image"] = images if len(images) > 1 else images[0]
        if animates(pipe):  # a clip's first frame (and its last, where the request gave one)
            check_last_frame(pipe, type(pipe).__name__, given=len(images) == 2, flag="last_frame")
            options["image"], *last = images
            options.update({"last_image": last[0]} if last else {})
    if call.mask is not None:  # the image repainted where the mask is white, itself the reference
        from PIL import Image

        pipe = task_variant(pipe, "inpaint")
        options.update(mask_image=Image.open(io.BytesIO(call.mask)).convert("L"), strength=1.0)
    options.update(size_arguments(pipe, call.height, call.width, options.get("image")))
    if on_step is not None:
        def step_ended(_pipe: Any, index: int, _timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            on_step(index + 1)
            return tensors  # unchanged

        options["callback_on_step_end"] = step_ended
    output = pipe(
        call.prompts,
        num_inference_steps=call.steps,
        num_images_per_prompt=1,
        generator=[torch.Generator("cpu").manual_seed(seed) for seed in call.seeds],
        output_type="np",
        **options,
    )
    pictures = np.asarray(output.frames if hasattr(output, "frames") else output.images, dtype=np.float32)
    if getattr(output, "audio", None) is None:
        return pictures
    clips = pictures.view(Clips)  # and their soundtracks (LTX-2), each answer's MP4 carries its own
    clips.audio, clips.sample_rate = torch.as_tensor(output.audio).float().cpu().numpy(), sample_rate(pipe)
    return clips


class Clips(np.ndarray):
    """A video pipeline's clips (N, F, H, W, 3) with their soundtracks: `audio` (N, channels, samples)
    at `sample_rate` (None: silent)."""

    audio: np.ndarray | None = None
    sample_rate: int | None = None


def pngs(images: np.ndarray) -> list[bytes]:
    from PIL import Image

    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray((image * 255).round().clip(0, 255).astype("uint8")).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def answers(batch: Batch, pictures: np.ndarray, fps: float = DEFAULT_FPS) -> list[bytes]:
    """What rank 0 answers `batch`'s requests with, one entry per image in order: PNGs for images
    (N, H, W, 3), MP4s for clips (N, F, H, W, 3), each at its request's frame rate (`fps` if it
    gives none)."""
    if pictures.ndim == 4:
        return pngs(pictures)
    from ..output.video import Audio, video_bytes

    rates = [work.fps or fps for work in batch.works for _ in range(work.n)]
    audio = getattr(pictures, "audio", None)
    sounds = [None] * len(rates) if audio is None else [Audio(np.asarray(a), pictures.sample_rate) for a in audio]
    return [video_bytes(np.asarray(clip), fps=rate, audio=sound)
            for clip, rate, sound in zip(pictures, rates, sounds, strict=True)]


def mp4s(output: Any, fps: float) -> list[bytes]:
    """One MP4 per video of a video pipeline's result: `output.frames` is a batch of frame
    sequences, (B, F, H, W, 3) floats in [0, 1] (`output_type="np"`) or B lists of PIL images
    (`"pil"`); each is encoded as `video.write_video` writes a `.mp4` (H.264, yuv420p, odd sides
    padded)."""
    from ..output.video import video_bytes

    return [video_bytes(frames, fps=fps) for frames in output.frames]
