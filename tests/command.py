"""A command as the shell runs it (`python -m cocodiff ARGS`: its own process, its exit status,
standard output and error), forked from the test process instead of started afresh: the libraries
the command imports (torch, diffusers, transformers: about 7 s of CPU) are imported here already.

The child is made to look like a fresh interpreter where the command could tell: the standard
streams are its own pipes, the environment is the one given, the signal handlers, warning filters
and root logger are Python's defaults, and nothing this process registered (exit handlers,
multiprocessing's finalizers and children, its rank server) is the child's. The tests of what only
a fresh process shows (signals before the libraries are imported, torchrun, the emulated cluster)
start one (`subprocess`), as does a command whose environment changes how an interpreter starts."""

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

_PYTHONPATH = os.environ.get("PYTHONPATH")
"""This process's, as it started: what the forked command's modules come from."""
_FILTERS = list(warnings.filters)
"""The warning filters as the libraries leave them at import, before pytest's own for each test."""


def cocodiff(*args: str, timeout: float = RANK_TIMEOUT_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cocodiff ARGS` in a forked process; `subprocess.run(..., capture_output=True, text=True)`'s
    result, and its `TimeoutExpired` past `timeout` (the command and its ranks killed)."""
    command = start(*args, env=env)
    try:
        out, err = command.communicate(timeout=timeout)
    finally:
        if command.poll() is None:
            command.kill()  # its rank server, and so its ranks, go with it
            command.communicate()
    return subprocess.CompletedProcess(command.args, command.returncode, out, err)


def start(*args: str, env: dict[str, str] | None = None) -> Command | subprocess.Popen:
    """`cocodiff ARGS` started: forked (`Command`), or afresh (`subprocess.Popen`) where the
    environment changes what an interpreter does as it starts (a `PYTHONPATH` other than this
    process's: a `sitecustomize` that a test plants, say)."""
    env = dict(os.environ if env is None else env)
    if env.get("PYTHONPATH") != _PYTHONPATH:
        return subprocess.Popen([sys.executable, "-m", "cocodiff", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    return Command(*args, env=env)


class Command:
    """`subprocess.Popen([python, "-m", "cocodiff", *ARGS], stdout=PIPE, stderr=PIPE, text=True, env=ENV)`
    as far as the tests use it (`poll`, `wait`, `send_signal`, `kill`, `communicate`, `pid`,
    `returncode`), the command forked from this process."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.args = [sys.executable, "-m", "cocodiff", *args]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            _child(list(args), env, out_w, err_w, (out_r, err_r))
        os.close(out_w)
        os.close(err_w)
        self.returncode: int | None = None
        self._pipes = (out_r, err_r)
        self._chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self._open = {out_r, err_r}

    def poll(self) -> int | None:
        if self.returncode is None:
            done, raw = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(raw)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its standard output and error once it has exited and closed them (its rank server holds
        them a moment longer), as `Popen.communicate`: `TimeoutExpired` past `timeout`, the command
        left running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for fd in self._open:
                selector.register(fd, selectors.EVENT_READ)
            while self.poll() is None or self._open:
                left = 0.2 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(min(left, 0.2)):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        self._chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                        self._open.discard(key.fd)
                        os.close(key.fd)
        out, err = (b"".join(self._chunks[fd]).decode("utf-8", errors="replace") for fd in self._pipes)
        return out, err


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

        rank_server._used = rank_server._stop_registered = False
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
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                       write_through=bool(env.get("PYTHONUNBUFFERED")))
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
        from cocodiff.models.presets import load_plugins

        load_plugins()  # the environment's, as a fresh interpreter imports them with the presets
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
