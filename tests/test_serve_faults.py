"""`cocodiff serve` when a rank dies: the request in flight and those queued are answered 503, and
the server exits non-zero (within its --timeout, not hanging)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import RANK_TIMEOUT_S, patience
from live_server import LiveServer, start_server
from rank_watch import gone


def _post(server: LiveServer, body: dict, answers: dict[str, tuple[int, dict] | BaseException]) -> threading.Thread:
    """POST `body` in a thread; its answer lands in `answers[body["request_id"]]` (an exception if none came)."""

    def send() -> None:
        request = urllib.request.Request(f"{server.url}/v1/images/generations", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=RANK_TIMEOUT_S) as response:
                answers[body["request_id"]] = (response.status, json.loads(response.read()))
        except urllib.error.HTTPError as error:
            answers[body["request_id"]] = (error.code, json.loads(error.read()))
        except Exception as error:  # no answer at all: lost
            answers[body["request_id"]] = error

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _wait_for(server: LiveServer, request_id: str, state: str, step: int = 0) -> None:
    deadline, body = time.monotonic() + RANK_TIMEOUT_S, b""
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.process.communicate()
        status, body = server.get(f"/v1/progress/{request_id}")
        if status == 200 and (now := json.loads(body))["state"] == state and now["step"] >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{request_id} never was {state} at step {step}; last: {body.decode()}")


@pytest.mark.slow
def test_a_killed_rank_fails_the_running_and_queued_requests_with_503_and_the_server_exits():
    server = start_server("--steps", "2", "--max-batch", "1", "--batch-window-ms", "0", "--max-steps", "500")
    try:
        answers: dict[str, tuple[int, dict] | BaseException] = {}
        threads = [_post(server, {"prompt": "a red circle", "size": "64x64", "steps": 500, "request_id": "running"}, answers)]
        _wait_for(server, "running", "running", step=1)
        for request_id in ("queued-1", "queued-2"):  # --max-batch 1: they wait behind the running one
            threads.append(_post(server, {"prompt": "a blue square", "size": "64x64", "request_id": request_id}, answers))
            _wait_for(server, request_id, "queued")
        os.kill(server.pids[1], signal.SIGKILL)
        for thread in threads:
            thread.join(RANK_TIMEOUT_S)
        server.process.wait(timeout=RANK_TIMEOUT_S)  # no hang: out within the ranks' --timeout
        _stdout, stderr = server.process.communicate()
        assert server.process.returncode not in (0, None), stderr
        for request_id in ("running", "queued-1", "queued-2"):
            answer = answers.get(request_id)
            assert isinstance(answer, tuple), f"{request_id} got no answer: {answer!r}; server: {stderr}"
            status, body = answer
            assert status == 503 and body["error"]["type"] == "server_error", (request_id, answer)
        message = answers["running"][1]["error"]["message"]
        assert "rank 1 of the server stopped" in message and "gloo" not in message, message  # for users, not gloo's
        assert "rank 1 was killed by SIGKILL" in stderr, stderr
        assert gone(server.pids, patience(15)), f"ranks {server.pids} outlived the server"
    finally:
        server.stop()
