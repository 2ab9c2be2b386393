"""A `cocodiff serve` started by a test (forked: tests/command.py): its ranks behind a free port, used once /health is 200."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from command import Command, start
from conftest import RANK_TIMEOUT_S, patience

__all__ = ["LiveServer", "start_server"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def app_in_thread(app, **config) -> Iterator[int]:
    """An ASGI `app` served by uvicorn in a thread of this process on a free port (yielded), with
    `config` for `uvicorn.Config`; stopped on the way out."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + patience(30)
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        thread.join(patience(10))


@dataclass
class LiveServer:
    process: Command | subprocess.Popen
    url: str
    """Its base URL, e.g. http://127.0.0.1:PORT."""
    pids: list[int]
    """Its ranks' process ids, by rank."""

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=patience(10)) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def stop(self) -> tuple[str, str]:
        """SIGTERM (a clean stop), then SIGKILL if it has not left within a minute; its output."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.communicate(timeout=patience(60))
            except subprocess.TimeoutExpired:
                pass
        self.process.kill()
        return self.process.communicate()


def start_server(*flags: str, nproc: int = 2, tries: int = 3) -> LiveServer:
    """`cocodiff serve --nproc NPROC --model tiny-shapes FLAGS...` on a free port, once healthy. The port is
    free when chosen, not held: another process (the server's own ranks' connections among them) may take
    it before the server binds it; then it starts again on another, up to `tries` times."""
    try:
        return _start_server(flags, nproc)
    except _PortTaken:
        if tries <= 1:
            raise
        return start_server(*flags, nproc=nproc, tries=tries - 1)


class _PortTaken(AssertionError):
    pass


def _start_server(flags: tuple[str, ...], nproc: int) -> LiveServer:
    port = _free_port()
    process = start("serve", "--nproc", str(nproc), "--port", str(port), "--model", "tiny-shapes",
                    "--timeout", str(RANK_TIMEOUT_S), *flags, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    server = LiveServer(process, f"http://127.0.0.1:{port}", [])
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while True:
        if process.poll() is not None:
            output = process.communicate()
            if "[Errno 98]" in output[1] or "Address already in use" in output[1]:  # taken after it was chosen
                raise _PortTaken(f"port {port} taken: {output}")
            raise AssertionError(f"the server exited with {process.returncode}: {output}")
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError("the server did not become healthy")
        try:
            status, body = server.get("/health")
        except OSError:  # not listening yet
            status = None
        if status == 200:
            server.pids = json.loads(body)["pids"]
            return server
        time.sleep(0.5)
