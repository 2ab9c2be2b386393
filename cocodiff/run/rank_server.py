"""The rank server: `multiprocessing`'s forkserver, which imports torch, diffusers, transformers
and this package once (`PRELOAD`) so that each local rank forks from it ready (run/launch.py).

Torch-free, so that a command that will start ranks can start the server first (`start_early`):
its imports then run on another core while the command imports the same libraries and checks its
flags, instead of after them. A server started early that no rank came from is stopped when the
command exits (a refusal, `--help`).
"""

from __future__ import annotations

import atexit
import glob
import multiprocessing
import os
import signal
from multiprocessing import forkserver

from ..config.env import DEVICE_ENV, PLUGINS_ENV
from ..errors import UsageError

__all__ = ["PRELOAD", "RANK_COMMANDS", "forked_from", "start", "start_early", "under_launcher"]

PRELOAD = ("cocodiff.run.quiet", "torch", "torch.distributed", "diffusers", "transformers", "cocodiff.run.jobs", "cocodiff.cli")
"""What the rank server imports once, for every CPU rank it forks: what a rank of any command
imports first (the pipeline runner and everything below it, the command line above it)."""
RANK_COMMANDS = ("generate", "verify", "serve", "bench", "matrix")
"""The commands that start local ranks (with `--nproc`, outside a launcher)."""

_used = False
_early = False


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server running (or starting: its imports take seconds). Started
    outside `held_signals` (the server would keep the stop signals blocked), and without the
    plugins of this launch: each rank imports its own (`launch._worker`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    plugins = os.environ.pop(PLUGINS_ENV, None)
    try:
        forkserver.ensure_running()
    except OSError as error:  # its socket lives in the temporary folder, whose path a socket's name caps
        if "path too long" not in str(error):
            raise
        import tempfile

        folder = tempfile.gettempdir()
        raise UsageError(f"the temporary folder {folder} ({len(folder)} characters) is too long a path for the ranks' "
                         f"local socket (at most about 70): set TMPDIR to a shorter folder") from None
    finally:
        if plugins is not None:
            os.environ[PLUGINS_ENV] = plugins
    return context


def forked_from() -> int | None:
    """The server's pid, now that ranks are forked from it."""
    global _used
    _used = True
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _no_accelerator() -> bool:
    """No device a rank would take (the ranks are then spawned, not forked: `launch._rank_context`),
    judged without importing torch: `COCODIFF_DEVICE=cpu`, or no NVIDIA or Intel GPU device node."""
    if os.environ.get(DEVICE_ENV, "").lower() == "cpu":
        return True
    return not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/dev/dri/renderD*")


def start_early(argv: list[str]) -> None:
    """Start the server now when `argv` is a command that starts local ranks on the CPU (not under
    a launcher, which starts each rank itself)."""
    if not argv or argv[0] not in RANK_COMMANDS or "--help" in argv or "-h" in argv:
        return
    if under_launcher() or not _no_accelerator():
        return
    global _early
    start()
    if not _early:
        _early = True
        atexit.register(_stop_unused)


def _stop_unused() -> None:
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not _used and pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
