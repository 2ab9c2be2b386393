"""`cocodiff serve`'s admission and errors in one process: limits and estimates before the queue,
OpenAI's error shape for every HTTP error, /health's busy and draining, a client that leaves."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from conftest import patience
from fastapi.testclient import TestClient

from cocodiff.errors import UsageError
from cocodiff.serve.admission import Costs
from cocodiff.serve.api import check_port, create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Scheduler
from cocodiff.config.sizes import parse_image_size

from test_serve import _drain

LIMITS = Limits(width=64, height=64, steps=2, size_multiple=4, max_n=4, max_pixels=128 * 128, max_steps=50)
FLUX_LIKE = {"num_attention_heads": 4, "attention_head_dim": 32, "num_layers": 2, "num_single_layers": 4}
VAE = {"block_out_channels": [32]}


def _costs(**options) -> Costs:
    return Costs(FLUX_LIKE, VAE, family="FluxTransformer2DModel", pixel_multiple=4, item_bytes=4, ranks=2,
                 **options)


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture
def client():
    """An app whose queue a fake executor drains (a request let through is answered 200, not left hanging)."""
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    drainer = _drain(scheduler)
    with TestClient(create_app(scheduler, LIMITS, costs=lambda: _costs(free_bytes=10**9, max_request_s=60)),
                    raise_server_exceptions=False) as client:
        yield client
    scheduler.stop()
    drainer.join(10)


def test_sizes_are_ascii_digits_only():
    assert parse_image_size("64x48") == (64, 48) and parse_image_size("64X48") == (64, 48)
    for bad in ("６４x６４", "٦٤x٦٤", "64x64\n", " 64x64", "64x", "x64", "+64x64", "64*64"):
        assert parse_image_size(bad) is None, bad


@pytest.mark.parametrize(
    ("body", "param", "names"),
    [
        ({"prompt": "x", "size": "６４x６４"}, "size", "ASCII"),  # full-width digits
        ({"prompt": "x", "size": "256x256"}, "size", "--max-pixels 16384"),
        ({"prompt": "x", "steps": 51}, "steps", "--max-steps 50"),
        ({"prompt": "x", "steps": 10**6}, "steps", "--max-steps 50"),
    ],
)
def test_requests_over_a_limit_get_400_naming_it(client, body, param, names):
    error = _error(client.post("/v1/images/generations", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param and names in error["message"], error


def test_a_size_beyond_memory_is_refused_before_the_queue():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    drainer = _drain(scheduler)
    costs = _costs(free_bytes=10**6)  # 1 MB: 128x128 needs more
    with TestClient(create_app(scheduler, LIMITS, costs=lambda: costs)) as client:
        error = _error(client.post("/v1/images/generations", json={"prompt": "x", "size": "128x128"}), 400)
        assert error["param"] == "size" and "of activations" in error["message"] and "1.0 MB" in error["message"]
        assert scheduler.depth() == 0
        assert 'cocodiff_requests_total{outcome="bad_request"} 1.0' in client.get("/metrics").text
    scheduler.stop()
    drainer.join(10)


def test_the_time_estimate_comes_from_measured_steps():
    costs = _costs(max_request_s=10.0)
    from cocodiff.serve.scheduler import Work

    long = Work(prompt="x", width=128, height=128, steps=50)
    assert costs.check(long).seconds is None  # nothing measured: no estimate, no time limit
    costs.observe(64, 64, images=1, seconds=1.0)  # one step of one 64x64 image took a second
    short = Work(prompt="x", width=64, height=64, steps=5)
    assert costs.check(short).seconds == pytest.approx(5.0)
    with pytest.raises(ValueError, match="--max-request-seconds 10"):
        costs.check(long)
    costs.observe(64, 64, images=1, seconds=0.1)  # the fastest recent step counts
    assert costs.check(short).seconds == pytest.approx(0.5)


def test_every_http_error_has_openais_shape(client):
    error = _error(client.post("/v1/images/generations", content=b'{"prompt": "x",}',
                               headers={"Content-Type": "application/json"}), 400)
    assert error["param"] is None and error["message"].startswith("the request body is not valid JSON"), error
    assert _error(client.get("/nowhere"), 404)["type"] == "invalid_request_error"
    assert "GET is not allowed" in _error(client.get("/v1/images/generations"), 405)["message"]


def test_an_internal_error_is_a_500_in_openais_shape():
    def broken() -> Costs:
        raise RuntimeError("a bug")

    scheduler = Scheduler()
    drainer = _drain(scheduler)
    with TestClient(create_app(scheduler, LIMITS, costs=broken), raise_server_exceptions=False) as client:
        error = _error(client.post("/v1/images/generations", json={"prompt": "x"}), 500)
        assert error["type"] == "server_error" and "a bug" not in error["message"]
    scheduler.stop()
    drainer.join(10)


def test_health_says_busy_and_draining():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    running = {"n": 0}
    with TestClient(create_app(scheduler, LIMITS, running=lambda: running["n"])) as client:
        assert (client.get("/health").status_code, client.get("/health").json()["status"]) == (200, "ok")
        running["n"] = 1
        assert (client.get("/health").status_code, client.get("/health").json()["status"]) == (200, "busy")
        scheduler.stop()
        response = client.get("/health")
        assert (response.status_code, response.json()["status"]) == (503, "draining")


def test_a_port_in_use_is_one_line_and_exit_2_before_any_rank_starts(capsys):
    from cocodiff.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"--port {port} on 127.0.0.1 cannot be listened on"):
            check_port("127.0.0.1", port)
        assert main(["serve", "--port", str(port), "--nproc", "2"]) == 2  # returns: no rank was spawned
        err = capsys.readouterr().err
        assert err.startswith(f"cocodiff: error: --port {port} on 127.0.0.1") and err.count("\n") == 1, err
    check_port("127.0.0.1", port)  # free again


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + patience(30)
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_client_that_leaves_leaves_the_queue_and_is_counted_cancelled():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)  # nothing drains it
    app = create_app(scheduler, LIMITS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started, "the server did not start")
        body = json.dumps({"prompt": "x", "request_id": "leaver"}).encode()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait(lambda: scheduler.depth() == 1, "the request was never queued")
        _wait(lambda: scheduler.depth() == 0, "the request stayed queued after its client left")
        with TestClient(app) as probe:
            _wait(lambda: 'outcome="cancelled"} 1.0' in probe.get("/metrics").text, "not counted cancelled")
            assert 'outcome="ok"} 0.0' in probe.get("/metrics").text
            assert probe.get("/v1/progress/leaver").json()["state"] == "failed"
    finally:
        scheduler.stop()
        server.should_exit = True
        thread.join(10)
