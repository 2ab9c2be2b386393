"""Atomic writes: a file or folder appears whole under its name or not at all (written beside it,
synced, then renamed over it), so a run that dies mid-write never leaves half an output."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["replacing", "replacing_folder", "write_bytes"]


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path in `path`'s folder to write to; on success it is fsynced and replaces
    `path` (through a symbolic link, the link's target); on failure it is removed.

        with replacing(out / "step-000500.pt") as tmp:
            torch.save(state, tmp)
    """
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        if target.exists():  # keep the permissions of the file being replaced; mkstemp's are 0600
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        else:
            _chmod_default(tmp, 0o666)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def _chmod_default(path: Path, mode: int) -> None:
    """`mode` less the umask: what a newly created file or folder would have had."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


@contextlib.contextmanager
def replacing_folder(path: Path) -> Iterator[Path]:
    """A temporary folder beside `path` to fill; on success its files are fsynced and it takes
    `path`'s place (a folder already there is moved aside, then removed); on failure it is removed."""
    import shutil

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    old: Path | None = None
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb+") as written:
                    os.fsync(written.fileno())
        _chmod_default(tmp, 0o777)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old)  # onto an empty folder: allowed
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_folder(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)
