"""A command as the shell runs it (`python -m cocodiff ARGS`: its own process, its exit status,
standard output and error), forked from the test process instead of started afresh: the libraries
the command imports (torch, diffusers, transformers: about 7 s of CPU) are imported here already.

The child is made to look like a fresh interpreter where the command could tell: the standard
streams are its own pipes, the environment is the one given, the signal handlers, warning filters
and root logger are Python's defaults, and nothing this process registered (exit handlers,
multiprocessing's finalizers and children, its rank server) is the child's. The tests of what only
a fresh process shows (signals before the libraries are imported, torchrun, the emulated cluster)
start one (`subprocess`)."""

from __future__ import annotations

import atexit
import io
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing import forkserver, process, util

from conftest import RANK_TIMEOUT_S

_FILTERS = list(warnings.filters)
"""The warning filters as the libraries leave them at import, before pytest's own for each test."""


def cocodiff(*args: str, timeout: float = RANK_TIMEOUT_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cocodiff ARGS` in a forked process; `subprocess.run(..., capture_output=True, text=True)`'s
    result, and its `TimeoutExpired` past `timeout` (the command and its ranks killed)."""
    env = dict(os.environ if env is None else env)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(list(args), env, out_w, err_w, (out_r, err_r))
    os.close(out_w)
    os.close(err_w)
    argv = [sys.executable, "-m", "cocodiff", *args]
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    status = None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            # Until the command has exited and its pipes are closed (its rank server holds them a moment longer).
            while status is None or selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in selector.select(min(left, 0.2)):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                if status is None:
                    done, raw = os.waitpid(pid, os.WNOHANG)
                    if done:
                        status = os.waitstatus_to_exitcode(raw)
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)  # its rank server, and so its ranks, go with it
            os.waitpid(pid, 0)
        os.close(out_r)
        os.close(err_r)
    text = [b"".join(chunks[fd]).decode("utf-8", errors="replace") for fd in (out_r, err_r)]
    return subprocess.CompletedProcess(argv, status, text[0], text[1])


def _child(argv: list[str], env: dict[str, str], out_w: int, err_w: int, unused: tuple[int, ...]) -> None:
    code: object = 1
    try:
        atexit._clear()  # this process's, not the command's
        util._finalizer_registry.clear()
        process._children.clear()
        server = forkserver._forkserver  # this process's rank server, if a test started one, is not the child's
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
        from cocodiff.run import rank_server

        rank_server._used = rank_server._early = False
        for fd in unused:
            os.close(fd)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                       errors="backslashreplace", line_buffering=True)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        warnings.resetwarnings()
        warnings.filters[:] = _FILTERS
        warnings.showwarning = warnings._showwarning_orig
        root = logging.getLogger()
        for handler in list(root.handlers):
            if type(handler).__module__.startswith("_pytest"):
                root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None
        sys.argv = ["cocodiff", *argv]
        from cocodiff.cli import main

        code = main()
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        util._exit_function()
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)
