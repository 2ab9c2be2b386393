"""The files the commands write: checked before any rank starts, written whole or not at all.

A run can take hours; its results must not be lost to a path that could never have been
written. So every output path (`--out`, `--json`, `--plot`, `--grid`, `--readme`, train-tiny's
folder) is checked up front (`check_file`, `check_image`, `check_folder`): the path is not a
folder, nor a device or pipe; its nearest existing ancestor is a folder this process can create
things in (probed by creating and removing a temporary folder there, which is what counts for
root too); an image's extension is one PIL writes; a video's (`check_video`) is one of
output/video.py's (`.mp4`, `.webm`), and the PNG of its first frame beside it can be written too. A
failure is one `UsageError` line (exit 2).

Writes go through `replacing(path)`: the content goes to a temporary file in the same folder,
is flushed and fsynced, then `os.replace`d onto the path, so a reader (or `--resume`) sees the
old file or the new one, never half of one.

When the final write still fails (the disk filled up during the run), nothing computed is
dropped where that can be avoided: `save_images` and `save_videos` keep what they could not
write in the system's temporary folder and say where; `write_json` (output/tables.py) prints the JSON on stdout. Either way the
failure is one `RunFailed` line (exit 1), raised once everything else was written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..errors import RunFailed, UsageError
from .atomic import replacing, replacing_folder, write_bytes

__all__ = [
    "batch_paths", "check_file", "check_folder", "check_image", "check_plot", "check_video", "image_format", "lost",
    "replacing", "replacing_folder", "save_figure", "save_images", "save_videos", "write_all", "write_bytes",
    "writes_here",
]

COMMON_IMAGE_EXTENSIONS = (".png", ".jpg", ".webp", ".bmp", ".tiff")
"""Named in the error for an unknown image extension (PIL writes more; all of them are accepted)."""


def writes_here() -> bool:
    """Whether this process writes the outputs: always without a launcher, only rank 0 under one
    (other nodes need not have the output's folder)."""
    return os.environ.get("RANK", "0") == "0"


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def _kind(path: Path) -> str:
    """What a path that is neither a folder nor a regular file is."""
    import stat

    mode = path.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _check_creatable(flag: str, path: Path, folder: Path) -> None:
    """`folder` (where `path` goes) exists as a folder we can write in, or can be created."""
    ancestor = folder
    while not ancestor.exists():
        if ancestor.is_symlink():  # a dangling link: mkdir would fail on it
            raise UsageError(f"{flag} {path}: {ancestor} is a broken symbolic link")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a folder")
    try:  # os.access says yes to root on read-only or virtual file systems (/proc); trying does not
        os.rmdir(tempfile.mkdtemp(prefix=".cocodiff-check-", dir=ancestor))
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write in {ancestor} ({_reason(error)})") from None


def check_file(flag: str, path: Path | None) -> None:
    """`path` can be written as a regular file: no folder, device or pipe there, and its folder is
    (or can be made) writable. None: nothing to check."""
    if path is None or not writes_here():
        return
    target = Path(os.path.realpath(path))  # a symbolic link is written through, not replaced
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if target.exists():
        if not target.is_file():
            raise UsageError(f"{flag} {path} is {_kind(target)}, not a regular file; give a file name")
        if not os.access(target, os.W_OK):
            raise UsageError(f"{flag} {path} exists and is not writable")
    _check_creatable(flag, path, target.parent)


def image_format(path: Path) -> str | None:
    """The PIL format that writes `path` (from its extension), or None."""
    from PIL import Image

    Image.init()
    name = Image.registered_extensions().get(path.suffix.lower())
    return name if name in Image.SAVE else None


def check_image(flag: str, path: Path | None) -> None:
    """`check_file`, and the extension names an image format PIL writes."""
    if path is None:
        return
    if image_format(path) is None:
        what = f"'{path.suffix}' names no image format that can be written" if path.suffix else "no extension names its format"
        known = ", ".join(COMMON_IMAGE_EXTENSIONS)
        raise UsageError(f"{flag} {path}: {what}; end the name with one of {known}, ...")
    check_file(flag, path)


def check_video(flag: str, path: Path | None) -> None:
    """For a video model's output: the extension names a video format (output/video.py's `VIDEO_FORMATS`),
    and both the video and the PNG of its first frame beside it pass `check_file`."""
    if path is None:
        return
    from .video import VIDEO_FORMATS, still_path, video_format

    if video_format(path) is None:
        what = f"'{path.suffix}' names no video format" if path.suffix else "no extension names its format"
        raise UsageError(f"{flag} {path}: the model makes videos and {what}; end the name with "
                         f"{' or '.join(VIDEO_FORMATS)}")
    check_file(flag, path)
    check_file(flag, still_path(path))


def check_plot(flag: str, path: Path | None) -> None:
    """`check_file`, and the extension names a format matplotlib writes (png, pdf, svg, ...; none: png)."""
    if path is None:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix and path.suffix.lower().lstrip(".") not in formats:
        raise UsageError(f"{flag} {path}: '{path.suffix}' names no plot format; end the name with one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")
    check_file(flag, path)


def check_folder(flag: str, path: Path) -> None:
    """`path` is a folder, or can be created as one."""
    if not writes_here():
        return
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a folder")
    _check_creatable(flag, path, path)


def batch_paths(out: Path, count: int) -> list[Path]:
    """Where a batch's images go: `out` for one image, `name-0.png`, `name-1.png`, ... for more."""
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(count)]


def save_figure(fig, path: Path, **kwargs) -> None:
    """A matplotlib figure to `path` atomically, in the format its extension names (png without one)."""
    with replacing(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lower().lstrip(".") or "png", **kwargs)


def _save_image(pixels: np.ndarray, path: Path, fmt: str) -> None:
    from PIL import Image

    with replacing(path) as tmp:
        Image.fromarray((pixels * 255).round().clip(0, 255).astype("uint8")).save(tmp, format=fmt)


def save_images(flag: str, paths: Sequence[Path], images: Sequence[np.ndarray]) -> tuple[list[Path], str | None]:
    """Write each (H, W, 3) float image in [0, 1] to its path.

    Returns the paths the images are at and None, or, when a path could not be written, the
    images that did not go there kept in the system's temporary folder and a one-line account
    of it (to raise as `RunFailed` once the rest is written).
    """
    written: list[Path] = []
    failed: list[tuple[Path, str]] = []
    for path, pixels in zip(paths, images):
        fmt = image_format(path) or "PNG"
        try:
            _save_image(pixels, path, fmt)
            written.append(path)
        except OSError as error:
            kept = Path(tempfile.mkstemp(prefix=f"cocodiff-{path.stem}-", suffix=path.suffix or ".png")[1])
            try:
                _save_image(pixels, kept, fmt)
            except OSError:
                kept.unlink(missing_ok=True)
                failed.append((path, f"{_reason(error)}; not kept elsewhere either"))
                written.append(path)
                continue
            failed.append((path, f"{_reason(error)}; kept at {kept}"))
            written.append(kept)
    if not failed:
        return written, None
    return written, f"{flag} " + ", ".join(f"{path} could not be written ({why})" for path, why in failed)


def save_videos(flag: str, paths: Sequence[Path], videos: Iterable[Any], fps: float,
                audios: Sequence[Any] | None = None) -> tuple[list[Path], str | None]:
    """Write each video (one frame sequence, anything output/video.py's `as_frames` takes: a pipeline's
    `.frames` is a batch of them) to its path, with the PNG of its first frame beside it, and its
    soundtrack (`audios`: one `Audio` per video) as its second stream.

    Returns the paths the videos are at and None, or, when a path could not be written, the
    videos that did not go there kept in a new folder in the system's temporary folder (under
    their own names, the PNG beside each) and a one-line account of it, as `save_images`.
    """
    from .video import write_video

    written: list[Path] = []
    failed: list[tuple[Path, str]] = []
    for n, (path, frames) in enumerate(zip(paths, videos)):
        audio = audios[n] if audios else None
        try:
            write_video(frames, path, fps, audio)
            written.append(path)
        except OSError as error:
            kept = Path(tempfile.mkdtemp(prefix=f"cocodiff-{path.stem}-")) / path.name
            try:
                write_video(frames, kept, fps, audio)
            except OSError:
                import shutil

                shutil.rmtree(kept.parent, ignore_errors=True)
                failed.append((path, f"{_reason(error)}; not kept elsewhere either"))
                written.append(path)
                continue
            failed.append((path, f"{_reason(error)}; kept at {kept}"))
            written.append(kept)
    if not failed:
        return written, None
    return written, f"{flag} " + ", ".join(f"{path} could not be written ({why})" for path, why in failed)


def write_all(*writes: tuple[str, Path | None, Callable[[], object]]) -> None:
    """Run each `(flag, path, write)` whose path is not None, every one even when an earlier one
    fails; then raise the failures as one `RunFailed` line."""
    problems: list[str] = []
    for flag, path, write in writes:
        if path is None:
            continue
        try:
            write()
        except RunFailed as error:
            problems.append(str(error))
        except OSError as error:
            problems.append(f"{flag} {path} could not be written ({_reason(error)})")
    lost(problems)


def lost(problems: Sequence[str]) -> None:
    """Raise the outputs that could not be written as one `RunFailed` line (nothing when none)."""
    if problems:
        raise RunFailed("; ".join(problems))
