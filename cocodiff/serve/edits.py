"""POST /v1/images/edits: OpenAI's image edits API on a model whose pipeline edits from reference
images (FLUX.2, FLUX.1 Kontext, Qwen-Image-Edit: `engine/families/pipelines.EDIT_PIPELINES`).

The body is multipart form data, as OpenAI defines it and its `openai` client sends it: one or
several `image` files (`image[]` when the client sends a list), the `prompt`, and optional `n`,
`size` ("WIDTHxHEIGHT" or "auto": the first image's size, floored to the model's multiple) and
`response_format` ("b64_json"), with this server's extensions `seed`, `steps`, `guidance`,
`request_id` and `cache` as in generations. The images are the references in order; each is
decoded and checked before the request is queued (a readable image, each side at most the
server's largest, the pipeline's own limits), and travels to the ranks as a PNG. A `mask` (as
OpenAI defines it: a PNG of the first image's size whose fully transparent pixels are where it is
edited) is taken by a pipeline with an edit inpaint class (`EDIT_INPAINT`: Qwen-Image-Edit's,
FLUX.2 [klein]'s, FLUX.1 Kontext's), over one image, and refused by the others. The whole body is
bounded by `--max-upload-bytes` (the other routes keep `--max-body-bytes`). An edit runs as one
pipeline call for its request (and any queued request with the same references and settings),
never in a step-level batch.
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from PIL import Image, UnidentifiedImageError
from pydantic import ConfigDict, ValidationError
from starlette.datastructures import UploadFile

from ..engine.families.pipelines import (
    EDIT_INPAINT,
    EDIT_PIPELINES,
    check_reference,
    takes_no_start_image,
    too_many_references,
)
from .protocol import ApiError, ImageRequest, Limits, form_lora
from .scheduler import Work

__all__ = ["EDITS_PATH", "EditRequest", "MAX_UPLOAD_BYTES", "read_edit", "read_picture"]

EDITS_PATH = "/v1/images/edits"

MAX_UPLOAD_BYTES = 32 << 20
"""An edit's body at most by default: a few reference images of some megabytes each."""


class EditRequest(ImageRequest):
    """The text fields of an edit: those of `ImageRequest`, read from form fields (text, so not strict)."""

    model_config = ConfigDict(extra="ignore", strict=False, allow_inf_nan=False)


async def read_edit(request: Request, limits: Limits) -> Work:
    """The edit request as `Work` with its references; `ApiError` (or `RequestValidationError`) for
    anything it cannot be, before it is queued."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):  # the latter: fields, no files
        raise ApiError(415, f"the request body must be multipart/form-data, as OpenAI's images.edit sends it, "
                            f"not {kind or 'no Content-Type'}")
    pipeline = limits.pipeline
    if pipeline not in EDIT_PIPELINES:
        raise ApiError(400, f"{limits.model} does not edit from reference images ({pipeline or 'its pipeline'}); "
                            f"edit pipelines: {', '.join(EDIT_PIPELINES)}", param="image")
    limit = EDIT_PIPELINES[pipeline]
    async with request.form(max_files=limit + 2, max_fields=64) as form:
        upload = form.get("mask")
        if upload is not None and pipeline not in EDIT_INPAINT:
            raise ApiError(400, f"mask: {takes_no_start_image(pipeline).replace(' --strength or --mask', ' mask')}",
                           param="mask")
        files = [*form.getlist("image"), *form.getlist("image[]")]
        if not files:
            raise ApiError(400, "image: give one or more reference images as files", param="image")
        if len(files) > limit:
            raise ApiError(400, f"{len(files)} images: {too_many_references(pipeline)}", param="image")
        if upload is not None and len(files) > 1:
            raise ApiError(400, f"mask: {EDIT_INPAINT[pipeline]} repaints one image where the mask is transparent, "
                                f"and {len(files)} were given", param="mask")
        pictures = [await _picture(upload, n, limits) for n, upload in enumerate(files)]
        mask = None if upload is None else await _mask(upload, pictures[0], limits)
        fields: dict[str, Any] = {name: value for name, value in form.items() if isinstance(value, str)}
    for n, picture in enumerate(pictures):
        try:
            check_reference(pipeline, picture)
        except ValueError as error:
            raise ApiError(400, f"image {n}: {error} ({pipeline})", param="image") from None
    if fields.get("size") in (None, "", "auto"):
        fields["size"] = _auto_size(pictures[0], limits)
    form_lora(fields)
    try:
        body = EditRequest.model_validate(fields)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None
    return replace(limits.resolve(body), references=tuple(_png(picture) for picture in pictures), mask=mask)


async def _picture(upload: Any, n: int, limits: Limits) -> Image.Image:
    """Reference `n` decoded to RGB; `ApiError` unless it is an image file within the server's sides."""
    return await _decoded(upload, f"image {n}", "image", limits)


async def _mask(upload: Any, image: Image.Image, limits: Limits) -> bytes:
    """OpenAI's edit mask (transparent where the image is edited) as the pipeline's: a greyscale PNG,
    white where alpha is 0; `ApiError` unless it is an image of the image's size with an alpha channel."""
    picture = await _decoded(upload, "mask", "mask", limits, convert=None)
    if picture.size != image.size:
        raise ApiError(400, f"mask is {picture.width}x{picture.height} but image 0 is {image.width}x{image.height}: "
                            f"they must be the same size", param="mask")
    if "A" not in picture.getbands() and "transparency" not in picture.info:
        raise ApiError(400, f"mask ({upload.filename or 'unnamed'}) has no alpha channel: its fully transparent "
                            f"pixels are where the image is edited", param="mask")
    alpha = picture.convert("RGBA").getchannel("A")
    return _png(alpha.point(lambda a: 255 if a == 0 else 0))


async def read_picture(upload: Any, field: str, limits: Limits) -> bytes:
    """The form field `field`'s image as a PNG file; `ApiError` unless it is an image file within
    the server's sides (a video's `input_reference`)."""
    return _png(await _decoded(upload, field, field, limits))


async def _decoded(upload: Any, what: str, param: str, limits: Limits, convert: str | None = "RGB") -> Image.Image:
    if not isinstance(upload, UploadFile):
        raise ApiError(400, f"{what}: must be a file, not a text field", param=param)
    data = await upload.read()
    try:
        picture = Image.open(io.BytesIO(data))
        width, height = picture.size  # from the header: nothing decoded yet
        if max(width, height) > limits.max_side:
            raise ApiError(400, f"{what} is {width}x{height}: each side at most {limits.max_side} pixels", param=param)
        if convert is None:
            picture.load()
            return picture
        return picture.convert(convert)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise ApiError(400, f"{what} ({upload.filename or 'unnamed'}) is not a readable image "
                            f"({type(error).__name__})", param=param) from None


def _auto_size(picture: Image.Image, limits: Limits) -> str:
    """The first reference's size, each side floored to the model's multiple (and at least one)."""
    m = limits.size_multiple
    width, height = (max(m, side // m * m) for side in picture.size)
    return f"{width}x{height}"


def _png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()
