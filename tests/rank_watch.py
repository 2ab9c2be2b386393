"""Watching rank processes from a test: the steps they publish, and whether they still run."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from conftest import RANK_TIMEOUT_S


def ranks_at_step(folder: Path, pattern: str, launcher: subprocess.Popen, ranks: int, step: int) -> dict[int, int]:
    """Rank -> pid, once `ranks` ranks have published `step` or later in files `pattern` under
    `folder` (their launcher's temporary folder); fails if the launcher exits first."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()
        records = {}
        for path in folder.glob(pattern):
            try:
                records[int(path.stem)] = json.loads(path.read_text())
            except ValueError:  # a record being written
                continue
        if len(records) == ranks and all(r["step"] >= step for r in records.values()):
            return {rank: r["pid"] for rank, r in records.items()}
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not reach step {step}")


def gone(pids, within: float) -> bool:
    """Whether every process of `pids` is gone (or a zombie) within `within` seconds."""
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


def alive(pid: int) -> bool:
    """Running (a zombie, awaiting its reaper, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
