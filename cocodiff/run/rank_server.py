"""The rank server: `multiprocessing`'s forkserver, holding torch, diffusers, transformers and
this package imported (`PRELOAD`) so that each local rank forks from it ready (run/launch.py).

A command that will start ranks makes it once its flags are read (`fork_ready`): a fork of the
command itself, whose imports are then done, so the server imports nothing the command has (about
7 s of CPU less per command than a fresh interpreter's; the rest of `PRELOAD` it imports beside the
command). It forks only from a process of one thread (a command's, not a test runner's); otherwise
the server is a fresh interpreter, as `multiprocessing` starts it (`start`). A server that no rank
came from is stopped when the command exits (a refusal after its flags).

Torch-free itself: the command line imports it before its libraries.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import connection, forkserver

from ..config.env import DEVICE_ENV, PLUGINS_ENV
from ..errors import UsageError

__all__ = ["NAME", "PRELOAD", "RANK_COMMANDS", "fork_ready", "forked_from", "start", "under_launcher"]

PRELOAD = ("cocodiff.run.quiet", "torch", "torch.distributed", "diffusers", "transformers", "cocodiff.run.jobs", "cocodiff.cli")
"""What the rank server imports once, for every CPU rank it forks: what a rank of any command
imports first (the pipeline runner and everything below it, the command line above it)."""
RANK_COMMANDS = ("generate", "verify", "serve", "bench", "matrix")
"""The commands that start local ranks (with `--nproc`, outside a launcher)."""

NAME = b"cocodiff-ranks"
"""The server's process name (`/proc/PID/comm`) when it is a fork of its command."""
_PR_SET_NAME = 15  # linux/prctl.h

_used = False
_stop_registered = False


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
        with _socket_path_errors():
            forkserver.ensure_running()
    finally:
        if plugins is not None:
            os.environ[PLUGINS_ENV] = plugins
    return context


@contextmanager
def _socket_path_errors() -> Iterator[None]:
    """The server's socket lives in the temporary folder, whose path a socket's name caps: past
    it, one line naming the folder."""
    try:
        yield
    except OSError as error:
        if "path too long" not in str(error):
            raise
        import tempfile

        folder = tempfile.gettempdir()
        raise UsageError(f"the temporary folder {folder} ({len(folder)} characters) is too long a path for the "
                         f"ranks' local socket (at most about 70): set TMPDIR to a shorter folder") from None


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


def fork_ready(command: str, own_process: bool) -> None:
    """Make the server now when `command` starts local ranks on the CPU (not under a launcher,
    which starts each rank itself): a fork of this process when it is the command's own
    (`own_process`: it computed nothing yet, so no thread pool of a computation is lost across the
    fork) and runs one thread; otherwise a fresh one (`start`), as for a command called from Python."""
    if command not in RANK_COMMANDS or under_launcher() or not _no_accelerator():
        return
    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        return
    global _stop_registered
    if not _stop_registered:
        _stop_registered = True
        atexit.register(_stop_unused)
    if not own_process or threading.active_count() > 1 or not hasattr(server, "_forkserver_alive_fd"):
        start()
        return
    with _socket_path_errors():  # one thread: no lock to take (a lock held across the fork stays held there)
        listener = socket.socket(socket.AF_UNIX)
        with listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the server leaves at this pipe's end: when its command goes
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
        if hasattr(server, "_forkserver_authkey"):  # newer Pythons: none, as the server reads none
            server._forkserver_authkey = None


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server: the stop signals as a fresh process has them (the command's handlers
    raise), the rest of `PRELOAD` imported, then `multiprocessing`'s own loop, until its command goes."""
    code = 1
    try:
        os.close(alive_w)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_NAME, NAME)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # lifetime's STOP_SIGNALS (it imports this module)
            signal.signal(signum, signal.SIG_DFL)
        forkserver.main(listener_fd, alive_r, list(PRELOAD))
    except SystemExit:  # its command went
        code = 0
    finally:
        os._exit(code)


def _stop_unused() -> None:
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not _used and pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
