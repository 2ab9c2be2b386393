"""Image input of `generate` and `verify`: `--image`, `--mask` and `--strength`, and the pipeline they call for.

`--image IN.png` alone is image-to-image; with `--mask MASK.png` it is inpainting (white pixels
of the mask are repainted, black ones kept, as in diffusers). Each family's stock diffusers
pipeline runs it, built from the same parts (transformer, VAE, scheduler) as the text-to-image
one (`task_pipeline`), so `parallelize` applies unchanged: the transformer is the same.
All six exist in diffusers 0.42.1:

    family                      img2img                           inpaint
    FluxPipeline                FluxImg2ImgPipeline               FluxInpaintPipeline
    StableDiffusion3Pipeline    StableDiffusion3Img2ImgPipeline   StableDiffusion3InpaintPipeline
    QwenImagePipeline           QwenImageImg2ImgPipeline          QwenImageInpaintPipeline

An edit pipeline (`EDIT_PIPELINES`: FLUX.2, FLUX.1 Kontext) reads `--image` otherwise: each one,
in order, is a reference image whose tokens join the sequence after the latents'; the output
starts from noise, and has the first reference's size unless `--height`/`--width` say otherwise.

The files are read and checked once, before any rank starts (`read_image_input`): a missing or
unreadable file, a mask of another size, a strength outside (0, 1] are one-line `UsageError`s.
The pixels then travel with the `GenerateSpec` to every rank, so all ranks hold the same input.
The image's size is the output's size; it must be a multiple of the model's VAE factor x patch
size (`check_multiple`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..engine.families.pipelines import (
    ANIMATE_PIPELINES,
    EDIT_INPAINT,
    EDIT_PIPELINES,
    PIPELINES,
    TASKS,
    UNROUTED_EDITS,
    animates_one_image,
    check_reference,
    family_of,
    takes_no_start_image,
    takes_one_image,
    task_pipeline,
    too_many_references,
)
from ..errors import UsageError

__all__ = [
    "DEFAULT_STRENGTH", "EDIT_PIPELINES", "PIPELINES", "TASKS", "ImageInput", "family_of", "read_image_input",
    "task_pipeline",
]

DEFAULT_STRENGTH: dict[str, float] = {
    "img2img": 0.6,  # diffusers' default: the image's layout survives, details are redrawn
    "inpaint": 1.0,  # the masked region is drawn anew from noise; the rest is the image's
}


@dataclass(frozen=True)
class ImageInput:
    """An image (and a mask) to start from, read and checked on the command line's side."""

    image: np.ndarray
    """(H, W, 3) uint8 RGB (an edit's first reference)."""
    mask: np.ndarray | None
    """(H, W) uint8, 255 = repaint; None for image-to-image."""
    strength: float | None
    """How far the image is noised before denoising: 1 = from pure noise (in the masked region); None: an edit."""
    image_path: str = ""
    mask_path: str = ""
    references: tuple[np.ndarray, ...] = ()
    """An edit's further reference images, in order."""
    reference_paths: tuple[str, ...] = ()
    animates: bool = False
    """The first frame of an image-to-video clip (`ANIMATE_PIPELINES`), taken as an edit's one image is."""
    last: np.ndarray | None = None
    """An image-to-video clip's last frame (`--last-frame`, `LAST_FRAME_PIPELINES`); None: none."""
    last_path: str = ""

    def __post_init__(self) -> None:
        for pixels, path in zip(self.images, self.paths):
            if pixels.ndim != 3 or pixels.shape[2] != 3:
                raise UsageError(f"{path or 'the image'}: expected RGB pixels, got shape {pixels.shape}")
        if self.edit:
            return
        if self.mask is not None and self.mask.shape != self.image.shape[:2]:
            raise UsageError(
                f"--mask {self.mask_path or ''} is {_size(self.mask)} but --image {self.image_path or ''} is "
                f"{_size(self.image)}: they must be the same size"
            )
        if not 0.0 < self.strength <= 1.0:  # also NaN
            raise UsageError(f"--strength {self.strength:g} must be above 0 and at most 1")

    @property
    def edit(self) -> bool:
        """Images the model's own pipeline takes as they are (an edit's references, an image-to-video
        clip's first frame), not a picture to start from in another task's pipeline."""
        return self.strength is None

    @property
    def images(self) -> tuple[np.ndarray, ...]:
        return (self.image, *self.references)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.image_path, *self.reference_paths)

    @property
    def task(self) -> str:
        return "i2v" if self.animates else "edit" if self.edit else "img2img" if self.mask is None else "inpaint"

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    @property
    def width(self) -> int:
        return int(self.image.shape[1])

    def check_multiple(self, multiple: int, model: str) -> None:
        """Each image's height and width must be multiples of `multiple` (VAE factor x patch size)."""
        for pixels, path in zip(self.images, self.paths):
            if pixels.shape[0] % multiple or pixels.shape[1] % multiple:
                raise UsageError(
                    f"--image {path} is {_size(pixels)}: its height and width must be multiples of "
                    f"{multiple} (VAE factor x patch size of {model})"
                )

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The image arguments of the task's stock pipeline call."""
        if self.edit:  # one reference as itself (FLUX.1 Kontext reads a list as a batch), several as a list
            images = [Image.fromarray(pixels) for pixels in self.images]
            last = {"last_image": Image.fromarray(self.last)} if self.last is not None else {}
            return {"image": images if len(images) > 1 else images[0], **last}
        kwargs: dict[str, Any] = {"image": Image.fromarray(self.image), "strength": self.strength}
        if self.mask is not None:
            kwargs["mask_image"] = Image.fromarray(self.mask)
        return kwargs

    def report(self) -> dict[str, Any]:
        """What a report says of the input (no pixels)."""
        report = {"task": self.task, "image": self.image_path, "mask": self.mask_path or None, "strength": self.strength}
        if self.animates:
            report["last_frame"] = self.last_path or None
        return {**report, "references": list(self.paths)} if self.edit and not self.animates else report


def _size(pixels: np.ndarray) -> str:
    return f"{pixels.shape[1]}x{pixels.shape[0]}"


def _read(path: Path, flag: str, mode: str) -> np.ndarray:
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give an image file")
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert(mode), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise UsageError(f"{flag} {path}: not a readable image ({type(error).__name__})") from None


def read_image_input(image: str | Path | list[str | Path], mask: str | Path | None = None, strength: float | None = None,
                     pipeline: str | None = None, model: str | None = None, last: str | Path | None = None) -> ImageInput:
    """Read and check `--image` (RGB; several: an edit's references) and `--mask` (grey, 255 =
    repaint); `strength` None: the task's default. `pipeline`: the model's pipeline class where it
    is known before loading; an edit pipeline's images are its references. `model`: its name in
    messages. `last`: an image-to-video clip's last frame (`--last-frame`, refused before this where
    the model takes none: `run.spec.image_source`)."""
    images = [Path(p) for p in (image if isinstance(image, list) else [image])]
    name = model or pipeline or "this model"
    if pipeline in ANIMATE_PIPELINES:
        if mask is not None or strength is not None or len(images) > 1:
            raise UsageError(animates_one_image(name))
        return ImageInput(image=_read(images[0], "--image", "RGB"), mask=None, strength=None,
                          image_path=str(images[0]), animates=True,
                          last=_read(Path(last), "--last-frame", "RGB") if last is not None else None,
                          last_path=str(last) if last is not None else "")
    if pipeline in UNROUTED_EDITS:
        raise UsageError(f"{name}: {UNROUTED_EDITS[pipeline]}")
    if pipeline in EDIT_INPAINT and mask is not None and len(images) > 1:
        raise UsageError(f"{name}: {EDIT_INPAINT[pipeline]} repaints one --image where --mask is white "
                         f"(--image given {len(images)} times)")
    if pipeline in EDIT_PIPELINES and not (pipeline in EDIT_INPAINT and mask is not None):
        given = "--mask given" if mask is not None else f"--strength {strength:g} given" if strength is not None else None
        if given:
            raise UsageError(f"{name}: {takes_no_start_image(pipeline)} ({given})")
        if len(images) > EDIT_PIPELINES[pipeline]:
            raise UsageError(f"{name}: {too_many_references(pipeline)} (--image given {len(images)} times)")
        first, *more = (_read(path, "--image", "RGB") for path in images)
        for pixels, path in zip((first, *more), images):
            try:
                check_reference(pipeline, Image.fromarray(pixels))
            except ValueError as error:
                raise UsageError(f"--image {path}: {error} ({pipeline})") from None
        return ImageInput(image=first, mask=None, strength=None, image_path=str(images[0]),
                          references=tuple(more), reference_paths=tuple(str(p) for p in images[1:]))
    if len(images) > 1:
        raise UsageError(f"{name}: {takes_one_image(pipeline or 'its pipeline')} (--image given {len(images)} times)")
    image = images[0]
    pixels = _read(Path(image), "--image", "RGB")
    mask_pixels = _read(Path(mask), "--mask", "L") if mask is not None else None
    task = "img2img" if mask is None else "inpaint"
    return ImageInput(
        image=pixels, mask=mask_pixels, strength=DEFAULT_STRENGTH[task] if strength is None else float(strength),
        image_path=str(image), mask_path=str(mask) if mask is not None else "",
    )


