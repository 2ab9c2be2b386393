"""`cocodiff serve` on 2 spawned ranks: clients that leave are taken out of the queue and of the
running batch (counted `cancelled`), and SIGTERM drains within --drain-seconds even while one
long step runs (its request gets 503, the server exits 0)."""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest

from conftest import RANK_TIMEOUT_S
from live_server import LiveServer, start_server
from test_serve_faults import _post, _wait_for

pytestmark = pytest.mark.slow


def _send(server: LiveServer, body: dict) -> socket.socket:
    """POST `body` on a raw connection, left open (closing it is the client leaving)."""
    data = json.dumps(body).encode()
    connection = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    connection.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return connection


def _until(server: LiveServer, path: str, check, what: str) -> bytes:
    deadline, body = time.monotonic() + RANK_TIMEOUT_S, b""
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.process.communicate()
        status, body = server.get(path)
        if check(status, body):
            return body
        time.sleep(0.1)
    raise AssertionError(f"{what}; last {path}: {body.decode(errors='replace')}")


@pytest.fixture(scope="module")
def server():
    server = start_server("--steps", "2", "--max-batch", "1", "--batch-window-ms", "0", "--max-steps", "1000",
                          "--drain-seconds", "2")
    yield server
    server.stop()


def test_clients_that_leave_are_cancelled_in_the_queue_and_in_the_running_batch(server: LiveServer):
    # 1000 steps at 256x256: far longer than this test waits, unless it leaves the batch
    running = _send(server, {"prompt": "a red circle", "size": "256x256", "steps": 1000, "request_id": "leaves-running"})
    _wait_for(server, "leaves-running", "running", step=1)
    queued = _send(server, {"prompt": "a blue square", "size": "64x64", "request_id": "leaves-queued"})
    _wait_for(server, "leaves-queued", "queued")
    queued.close()
    _until(server, "/metrics", lambda _s, text: b'outcome="cancelled"} 1.0' in text, "the queued one was not cancelled")
    running.close()
    _until(server, "/metrics", lambda _s, text: b'outcome="cancelled"} 2.0' in text, "the running one was not cancelled")
    # it left the batch at a step boundary on both ranks: the server is idle, and answers the next request
    _until(server, "/health", lambda s, body: s == 200 and json.loads(body)["status"] == "ok", "still busy")
    state = json.loads(server.get("/v1/progress/leaves-running")[1])
    assert state["state"] == "failed" and state["step"] < 1000, state
    answers: dict = {}
    _post(server, {"prompt": "a green triangle", "size": "64x64", "request_id": "after"}, answers).join(RANK_TIMEOUT_S)
    assert answers["after"][0] == 200, answers
    text = server.get("/metrics")[1].decode()
    assert 'outcome="ok"} 1.0' in text and 'outcome="cancelled"} 2.0' in text, text


def test_a_request_past_a_limit_is_refused_before_it_queues(server: LiveServer):
    """Over --max-pixels, and (with steps measured by now) over --max-request-seconds: 400 at once."""
    answers: dict = {}
    for request_id, body in (("huge", {"size": "2048x2048", "steps": 1}), ("slow", {"size": "1024x1024", "steps": 1000})):
        _post(server, {"prompt": "a red circle", "request_id": request_id, **body}, answers).join(RANK_TIMEOUT_S)
    assert answers["huge"][0] == 400 and "--max-pixels 1048576" in answers["huge"][1]["error"]["message"], answers
    assert answers["slow"][0] == 400 and "--max-request-seconds 600" in answers["slow"][1]["error"]["message"], answers


def test_sigterm_abandons_a_step_that_outlives_the_drain_and_exits_0(server: LiveServer):
    answers: dict = {}
    # One step at 512x512 takes tens of seconds here, far past --drain-seconds 2.
    threads = [_post(server, {"prompt": "a red circle", "size": "512x512", "steps": 1, "request_id": "long"}, answers)]
    _wait_for(server, "long", "running")
    threads.append(_post(server, {"prompt": "a blue square", "size": "64x64", "request_id": "waits"}, answers))
    _wait_for(server, "waits", "queued")
    server.process.send_signal(signal.SIGTERM)
    _until(server, "/health", lambda s, body: s == 503 and json.loads(body)["status"] == "draining", "not draining")
    for thread in threads:
        thread.join(RANK_TIMEOUT_S)
    server.process.wait(timeout=RANK_TIMEOUT_S)
    _stdout, stderr = server.process.communicate()
    assert server.process.returncode == 0, stderr
    for request_id, says in (("long", "--drain-seconds"), ("waits", "shutting down")):
        status, body = answers[request_id]
        assert status == 503 and body["error"]["type"] == "server_error" and says in body["error"]["message"], answers


def test_a_second_sigterm_ends_the_drain_now_and_still_answers_every_request():
    """Two SIGTERMs 0.3 s apart (or a Ctrl-C under `timeout`): the second ends the grace period at
    once, so a request that would have run for minutes gets its 503 now, the queued one too; exit 0."""
    server = start_server("--steps", "2", "--max-batch", "1", "--batch-window-ms", "0", "--max-steps", "1000",
                          "--drain-seconds", "600")
    try:
        answers: dict = {}
        threads = [_post(server, {"prompt": "a red circle", "size": "256x256", "steps": 1000, "request_id": "long"}, answers)]
        _wait_for(server, "long", "running", step=1)
        threads.append(_post(server, {"prompt": "a blue square", "size": "64x64", "request_id": "waits"}, answers))
        _wait_for(server, "waits", "queued")
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=RANK_TIMEOUT_S)  # not the 600 s of --drain-seconds
        for thread in threads:
            thread.join(RANK_TIMEOUT_S)
        stderr = server.process.communicate()[1]
        assert server.process.returncode == 0, stderr
        for request_id, says in (("long", "a second stop signal ended the grace period"), ("waits", "shutting down")):
            status, body = answers[request_id]
            assert status == 503 and says in body["error"]["message"], answers
    finally:
        server.stop()
