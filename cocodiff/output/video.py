"""Videos out: frames to an H.264 MP4 (or VP9 WebM) with a PNG of the first frame beside it.

A video pipeline's `.frames` is a batch of frame sequences; each sequence is written by
`write_video(frames, path, fps)`: `name.mp4` and `name.png` (frame 0 exactly as generated, for
a quick look and for pages that show a still), each written whole or not at all through
`output.atomic.replacing` (temporary file in the same folder, fsync, rename).

Why PyAV (`av`) and not imageio-ffmpeg: both install from PyPI here as wheels that carry their
codecs (libx264, libvpx-vp9) and both encode with no network. PyAV is in-process bindings to
FFmpeg's libraries: frames go to the encoder as arrays, failures are Python exceptions (an
`OSError` with its errno for a full disk or a refused write, so the callers' fallbacks see
them), and it decodes too (`read_frames`, `count_frames`, used by tests and `verify`). imageio-ffmpeg pipes raw
frames to a bundled `ffmpeg` executable in a subprocess, reports failures as the child's stderr,
and its wheel is larger (165 MB against 104 MB unpacked).

Formats, from the extension (`VIDEO_FORMATS`): `.mp4` is H.264 (libx264, CRF 18, no macroblock
tree so the same frames give the same bytes, `+faststart` so a browser can play it while it loads), `.webm` is VP9 (libvpx-vp9, constant quality). Both are
yuv420p, the pixel format every player decodes. GIF is not offered: PyAV's GIF encoder takes only
a fixed 3-3-2 palette without a filter graph for a per-video palette, which bands visibly.

yuv420p stores colour at half resolution, so both sides must be even. An odd side is PADDED by
one row or column repeating the edge (`even_sized`): nothing generated is dropped; the video is
then one pixel wider or taller than the frames, and the PNG keeps the frames' exact size.

Frames are accepted as numpy (F, H, W, 3) floats in [0, 1] (clipped) or uint8, a torch tensor
(F, H, W, 3) or (F, 3, H, W), or a list of PIL images or (H, W, 3) arrays (`as_frames`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .atomic import replacing

__all__ = [
    "DEFAULT_FPS", "Audio", "read_audio", "VIDEO_FORMATS", "VideoFormat", "as_frames", "count_frames", "even_sized", "read_frames", "still_path",
    "video_bytes", "video_format", "write_video",
]


@dataclass(frozen=True)
class VideoFormat:
    """How one extension is written."""

    container: str
    """FFmpeg's muxer name."""
    codec: str
    """FFmpeg's encoder name."""
    options: dict[str, str]
    """Encoder options."""
    container_options: dict[str, str]
    mime: str
    audio_codec: str = "aac"
    """FFmpeg's encoder of a soundtrack (`Audio`) in this container."""
    audio_rate: int | None = None
    """The rate the soundtrack is resampled to (Opus: 48 kHz); None: its own."""


@dataclass(frozen=True)
class Audio:
    """A video's soundtrack (a pipeline that makes sound with its frames: LTX-2)."""

    samples: np.ndarray
    """(channels, samples) float in [-1, 1] (clipped); 1 or 2 channels."""
    rate: int
    """Samples per second."""

    def __post_init__(self) -> None:
        if self.samples.ndim != 2 or self.samples.shape[0] not in (1, 2) or not self.samples.shape[1]:
            raise ValueError(f"a soundtrack is (channels, samples) with 1 or 2 channels, not {self.samples.shape}")
        if not 1000 <= self.rate <= 192_000:
            raise ValueError(f"audio sample rate {self.rate} is out of range (1000 to 192000 Hz)")


DEFAULT_FPS = 16
"""A video's frame rate where nobody says otherwise (`generate`'s files, `serve`'s answers); Wan's
and LTX's pipelines export at 16 and 24."""

VIDEO_FORMATS: dict[str, VideoFormat] = {
    # CRF 18: visually lossless for most content (x264's default, 23, smears fine detail).
    # mbtree off: with it, the same frames gave 4 different files in 400 encodes of a 64x48 clip on a
    # busy machine (x264 single-threaded; the first frame's size differed); off, 1 in 400, so the
    # same seed writes the same file and `video_bytes` is the file `write_video` writes
    ".mp4": VideoFormat("mp4", "libx264", {"crf": "18", "x264-params": "mbtree=0"}, {"movflags": "+faststart"},
                        "video/mp4"),
    # libvpx-vp9 runs at a low fixed bitrate unless b:v is 0; crf 30 is its usual good-quality point
    ".webm": VideoFormat("webm", "libvpx-vp9", {"crf": "30", "b:v": "0"}, {}, "video/webm", audio_codec="libopus",
                         audio_rate=48000),
}
"""The extensions a video is written with, and how."""


def video_format(path: Path | str) -> VideoFormat | None:
    """The format `path`'s extension names (case-insensitive), or None."""
    return VIDEO_FORMATS.get(Path(path).suffix.lower())


def still_path(path: Path) -> Path:
    """Where the PNG of a video's first frame goes: `name.png` beside `name.mp4`."""
    return path.with_suffix(".png")


def _to_uint8(pixels: np.ndarray) -> np.ndarray:
    if pixels.dtype == np.uint8:
        return pixels
    if pixels.dtype == np.bool_ or not np.issubdtype(pixels.dtype, np.number):
        raise TypeError(f"frames of dtype {pixels.dtype}: give floats in [0, 1] or uint8")
    # as output.files.save_images writes images: the same frame gives the same PNG either way
    return (pixels.astype(np.float32) * 255).round().clip(0, 255).astype(np.uint8)


def as_frames(frames: Any) -> np.ndarray:
    """One frame sequence as uint8 (F, H, W, 3).

    numpy or torch (F, H, W, 3) floats in [0, 1] (clipped) or uint8; torch (F, 3, H, W) too;
    a list of PIL images or of (H, W, 3) arrays. `ValueError` for any other shape.
    """
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise ValueError("no frames to write")
        if all(hasattr(frame, "convert") for frame in frames):  # PIL images
            frames = np.stack([np.asarray(frame.convert("RGB")) for frame in frames])
        else:
            frames = np.stack([np.asarray(_numpy(frame)) for frame in frames])
    array = np.asarray(_numpy(frames))
    if array.ndim == 4 and array.shape[-1] != 3 and array.shape[1] == 3 and hasattr(frames, "permute"):
        array = array.transpose(0, 2, 3, 1)  # torch's (F, 3, H, W) -> (F, H, W, 3)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames of shape {tuple(array.shape)}: expected one video, (F, H, W, 3)")
    if 0 in array.shape:
        raise ValueError(f"frames of shape {tuple(array.shape)}: no pixels to write")
    return _to_uint8(array)


def _numpy(value: Any) -> Any:
    """A torch tensor as numpy (on the CPU, float32 unless uint8); anything else unchanged."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        return value.numpy() if str(value.dtype) == "torch.uint8" else value.float().numpy()
    return value


def even_sized(frames: np.ndarray) -> np.ndarray:
    """(F, H, W, 3) padded to even H and W by repeating the last row / column (yuv420p needs even sides)."""
    _, height, width, _ = frames.shape
    if height % 2 == 0 and width % 2 == 0:
        return frames
    return np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")


def _encode(frames: np.ndarray, target: str, fmt: VideoFormat, fps: float, audio: Audio | None = None) -> None:
    """uint8 (F, H, W, 3) frames, sides even, encoded into the file `target` (a path, not a file
    object: MP4's `+faststart` reopens the file by name to move its index to the front), with
    `audio` as a second stream (AAC in MP4, Opus in WebM)."""
    import av

    container = av.open(target, mode="w", format=fmt.container, options=fmt.container_options)
    try:
        stream = container.add_stream(fmt.codec, rate=_rate(fps))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = dict(fmt.options)
        if audio is not None:
            _encode_audio(container, fmt, audio)
        for pixels in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the frames the encoder still holds
    finally:
        container.close()


def _encode_audio(container: Any, fmt: VideoFormat, audio: Audio) -> None:
    """`audio` as the container's audio stream: resampled to the encoder's sample format, rate and
    frame size (AAC takes 1024 samples a frame) and encoded whole."""
    import av

    layout = "stereo" if audio.samples.shape[0] == 2 else "mono"
    stream = container.add_stream(fmt.audio_codec, rate=fmt.audio_rate or audio.rate)
    stream.layout = layout
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(np.clip(audio.samples, -1, 1), dtype=np.float32),
                                       format="fltp", layout=layout)
    frame.sample_rate = audio.rate
    context = stream.codec_context
    resampler = av.AudioResampler(format=context.format.name, layout=layout, rate=stream.rate,
                                  frame_size=context.frame_size or None)
    for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
        container.mux(stream.encode(chunk))
    container.mux(stream.encode(None))


def _rate(fps: float) -> Fraction:
    """The frame rate as the container stores it (23.976 as 2997/125, 29.97 as 2997/100)."""
    return Fraction(fps).limit_denominator(1001)


def _check_fps(fps: float) -> None:
    """`ValueError` unless `fps` is a rate the container stores as given (`_rate`): below 1/1000
    it would round to another, or to 0, which is written as FFmpeg's default 24 fps."""
    if not 1e-3 <= fps <= 1000:
        raise ValueError(f"fps {fps} is out of range: give a frame rate of at least 1/1000 and at most 1000")


def write_video(frames: Any, path: Path | str, fps: float = DEFAULT_FPS, audio: Audio | None = None) -> Path:
    """Write one frame sequence to `path` (format from its extension: `VIDEO_FORMATS`) and its
    first frame to `still_path(path)`, each atomically. Returns the PNG's path.

    `audio`: its soundtrack, a second stream. An odd side is padded in the video (`even_sized`), not in the PNG. `ValueError` for an
    extension that names no video format, frames of the wrong shape or a bad fps; `OSError` when
    a file cannot be written (then neither that file nor a temporary one is left).
    """
    path = Path(path)
    fmt = video_format(path)
    if fmt is None:
        raise ValueError(f"{path}: '{path.suffix}' names no video format; use one of {', '.join(VIDEO_FORMATS)}")
    _check_fps(fps)
    pixels = as_frames(frames)
    with replacing(path) as tmp:
        _encode(even_sized(pixels), str(tmp), fmt, fps, audio)
    still = still_path(path)
    _write_png(pixels[0], still)
    return still


def _write_png(pixels: np.ndarray, path: Path) -> None:
    from PIL import Image

    with replacing(path) as tmp:
        Image.fromarray(pixels).save(tmp, format="PNG")


def video_bytes(frames: Any, fps: float = DEFAULT_FPS, extension: str = ".mp4", audio: Audio | None = None) -> bytes:
    """One frame sequence (and its soundtrack) encoded in memory (for answers over HTTP): the file
    `write_video` would write for a name ending in `extension`."""
    import tempfile

    fmt = VIDEO_FORMATS.get(extension.lower())
    if fmt is None:
        raise ValueError(f"'{extension}' names no video format; use one of {', '.join(VIDEO_FORMATS)}")
    _check_fps(fps)
    pixels = even_sized(as_frames(frames))
    with tempfile.TemporaryDirectory(prefix="cocodiff-video-") as folder:
        path = Path(folder) / f"video{extension.lower()}"
        _encode(pixels, str(path), fmt, fps, audio)
        return path.read_bytes()


@contextlib.contextmanager
def _decoded(path: Path | str) -> Iterator[Any]:
    import av

    with av.open(str(path)) as container:
        yield container.decode(video=0)


def read_frames(path: Path | str) -> np.ndarray:
    """Every frame of the video at `path`, decoded: uint8 (F, H, W, 3) at the stored (even) size."""
    with _decoded(path) as frames:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in frames])


def count_frames(path: Path | str) -> int:
    """How many frames the video at `path` holds, counted by decoding them (a container's header
    may not say, as WebM's does not)."""
    with _decoded(path) as frames:
        return sum(1 for _ in frames)


def read_audio(path: Path | str) -> Audio | None:
    """The soundtrack of the video at `path`, decoded (float, planar; None: it has none)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        chunks = [frame.to_ndarray() for frame in container.decode(audio=0)]
        return Audio(np.concatenate(chunks, axis=1).astype(np.float32), int(stream.rate))
