"""`cocodiff serve`: the HTTP layer and the scheduler alone (a fake executor), then the whole service on 2 ranks."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from cocodiff.serve.api import create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Batch, Scheduler, Stopped, Work

from conftest import RANK_TIMEOUT_S, patience
from rank_watch import gone

LIMITS = Limits(width=64, height=64, steps=2, size_multiple=4, max_n=4)


def _work(prompt: str = "a red circle", *, size: int = 64, steps: int = 2, guidance: float | None = None, n: int = 1) -> Work:
    return Work(prompt=prompt, n=n, width=size, height=size, steps=steps, guidance=guidance, seed=0)


# -- the HTTP layer: validation and the queue bound, with nothing draining the queue ---------------------

def _drain(scheduler: Scheduler) -> threading.Thread:
    """A fake executor: answers every batch at once, one b"png" per image, until the scheduler stops."""

    def loop() -> None:
        while not scheduler.stopped:
            if (batch := scheduler.next_batch(0.05)) is not None:
                scheduler.execute(batch, lambda b: [b"png"] * b.images)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def client():
    scheduler = Scheduler(max_queue=2, max_batch=4, window_s=0)
    thread = _drain(scheduler)
    with TestClient(create_app(scheduler, LIMITS)) as client:
        yield client
    scheduler.stop()
    thread.join()


def test_a_good_request_gets_its_images(client):
    response = client.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2, "size": "32x64", "model": "x"})
    assert response.status_code == 200, response.text
    assert [base64.b64decode(d["b64_json"]) for d in response.json()["data"]] == [b"png", b"png"]
    assert 'cocodiff_requests_total{outcome="ok"} 1.0' in client.get("/metrics").text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a red circle", "size": "64by64"}, "size"),
        ({"prompt": "a red circle", "size": "63x64"}, "size"),  # not a multiple of the model's 4
        ({"prompt": "a red circle", "n": 0}, "n"),
        ({"prompt": "a red circle", "n": 5}, "n"),  # more than a batch
        ({"prompt": "a red circle", "response_format": "url"}, "response_format"),
        ({"prompt": "a red circle", "response_format": "png"}, "response_format"),
        ({"prompt": "a red circle", "steps": 0}, "steps"),
        ({"prompt": ""}, "prompt"),
        ({"size": "64x64"}, "prompt"),
    ],
)
def test_bad_requests_get_400_in_openai_shape_and_never_reach_the_queue(client, body, param):
    response = client.post("/v1/images/generations", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert 'cocodiff_requests_total{outcome="bad_request"} 1.0' in client.get("/metrics").text


def test_a_url_response_format_says_why(client):
    response = client.post("/v1/images/generations", json={"prompt": "x", "response_format": "url"})
    assert "b64_json" in response.json()["error"]["message"]


def test_a_full_queue_answers_429_with_retry_after():
    scheduler = Scheduler(max_queue=2, max_batch=4, window_s=0)  # nothing drains it
    post = lambda client, prompt: client.post("/v1/images/generations", json={"prompt": prompt})  # noqa: E731
    with TestClient(create_app(scheduler, LIMITS)) as client, ThreadPoolExecutor(3) as pool:
        try:
            waiting = [pool.submit(post, client, f"p{i}") for i in range(2)]
            deadline = time.monotonic() + patience(10)
            while scheduler.depth() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            response = pool.submit(post, client, "one too many").result(timeout=patience(10))
            assert response.status_code == 429, response.text
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
            assert "cocodiff_queue_depth 2.0" in client.get("/metrics").text
        finally:
            scheduler.stop()  # the waiting requests are answered 503, not lost
        assert [f.result(timeout=patience(10)).status_code for f in waiting] == [503, 503]


def test_health_is_503_until_ready():
    ready = threading.Event()
    with TestClient(create_app(Scheduler(), LIMITS, ready=ready.is_set)) as client:
        assert client.get("/health").status_code == 503
        ready.set()
        assert client.get("/health").status_code == 200


# -- the scheduler: batching and answering ----------------------------------------------------------------

def test_compatible_requests_share_a_batch_and_incompatible_ones_do_not():
    scheduler = Scheduler(max_queue=16, max_batch=4, window_s=0)
    works = [_work("a"), _work("b", size=32), _work("c"), _work("d", steps=3), _work("e", guidance=2.0),
             _work("f", n=2), _work("g")]
    futures = [scheduler.submit(w) for w in works]
    batches = []
    while (batch := scheduler.next_batch(0)) is not None:
        batches.append([w.prompt for w in batch.works])
        scheduler.execute(batch, lambda b: [p.encode() for p in b.prompts])
    # "g" does not fit the first batch (a, c, f+f = 4 images) and heads its own.
    assert batches == [["a", "c", "f"], ["b"], ["d"], ["e"], ["g"]]
    assert [f.result(0) for f in futures] == [[b"a"], [b"b"], [b"c"], [b"d"], [b"e"], [b"f", b"f"], [b"g"]]


def test_a_batch_waits_for_compatible_requests_within_its_window():
    scheduler = Scheduler(max_queue=16, max_batch=2, window_s=30.0)
    scheduler.submit(_work("a"))
    threading.Timer(0.2, scheduler.submit, [_work("b")]).start()
    assert [w.prompt for w in scheduler.next_batch(1.0).works] == ["a", "b"]  # b arrived, the batch is full


def test_without_a_window_a_batch_takes_only_what_waits():
    scheduler = Scheduler(max_queue=16, max_batch=2, window_s=0)
    scheduler.submit(_work("a"))
    threading.Timer(0.2, scheduler.submit, [_work("b")]).start()
    assert [w.prompt for w in scheduler.next_batch(1.0).works] == ["a"]
    assert [w.prompt for w in scheduler.next_batch(5.0).works] == ["b"]


def test_a_full_batch_does_not_wait_out_its_window():
    scheduler = Scheduler(max_queue=16, max_batch=2, window_s=60.0)
    for prompt in "ab":
        scheduler.submit(_work(prompt))
    started = time.monotonic()
    assert [w.prompt for w in scheduler.next_batch(1.0).works] == ["a", "b"]
    assert time.monotonic() - started < 30


def test_each_image_gets_its_request_seed():
    batch = Batch((Work(prompt="a", n=2, width=8, height=8, steps=1, seed=7), _work("b")), (None, None))
    assert batch.prompts == ["a", "a", "b"] and batch.seeds == [7, 8, 0]


def test_every_request_is_answered_once_even_when_the_executor_raises():
    scheduler = Scheduler(max_queue=16, max_batch=2, window_s=0)
    futures = [scheduler.submit(_work(str(i))) for i in range(5)]
    calls = []

    def flaky(batch: Batch) -> list[bytes]:
        calls.append(batch.prompts)
        if len(calls) == 2:
            raise RuntimeError("the pipeline broke")
        if len(calls) == 3:
            return []  # too few images: an error too, not a silent loss
        return [p.encode() for p in batch.prompts]

    while (batch := scheduler.next_batch(0)) is not None:
        scheduler.execute(batch, flaky)
    assert calls == [["0", "1"], ["2", "3"], ["4"]]
    assert [f.done() for f in futures] == [True] * 5
    assert futures[0].result(0) == [b"0"] and futures[1].result(0) == [b"1"]
    for future in futures[2:]:
        assert isinstance(future.exception(0), RuntimeError)


def test_stop_answers_every_waiting_request_and_refuses_new_ones():
    scheduler = Scheduler(max_queue=16, max_batch=2, window_s=0)
    futures = [scheduler.submit(_work(str(i))) for i in range(3)]
    assert scheduler.stop() == 3
    assert all(isinstance(f.exception(0), Stopped) for f in futures)
    with pytest.raises(Stopped):
        scheduler.submit(_work())
    assert scheduler.next_batch(0) is None


def test_a_request_whose_client_left_is_dropped_before_running():
    scheduler = Scheduler(max_queue=16, max_batch=4, window_s=0)
    gone, kept = scheduler.submit(_work("gone")), scheduler.submit(_work("kept"))
    assert gone.cancel()
    batch = scheduler.next_batch(0)
    assert [w.prompt for w in batch.works] == ["kept"]
    scheduler.execute(batch, lambda b: [b"x"])
    assert kept.result(0) == [b"x"]


# -- the whole service: 2 spawned ranks, concurrent requests, metrics, SIGTERM -----------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=patience(10)) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=RANK_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_serve_answers_concurrent_requests_on_two_ranks_and_stops_on_sigterm():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "cocodiff", "serve", "--nproc", "2", "--port", str(port), "--model", "tiny-shapes",
         "--steps", "2", "--batch-window-ms", "200", "--timeout", str(RANK_TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while True:
            assert server.poll() is None, server.communicate()
            assert time.monotonic() < deadline, "the service did not become healthy"
            try:
                status, body = _get(f"{base}/health")
            except OSError:  # not listening yet
                status = None
            if status == 200:
                break
            time.sleep(0.5)
        pids = json.loads(body)["pids"]
        assert len(pids) == 2

        prompts = ["a red circle", "a blue square", "a green triangle"]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(
                lambda p: _post(f"{base}/v1/images/generations",
                                {"prompt": p, "size": "64x64", "seed": 1, "response_format": "b64_json"}),
                prompts,
            ))
        for status, body in answers:
            assert status == 200, body
            assert len(body["data"]) == 1
            image = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
            assert image.format == "PNG" and image.size == (64, 64)
        # same seed, different prompts: different pictures (each prompt reached its own image)
        assert len({body["data"][0]["b64_json"] for _, body in answers}) == 3

        status, text = _get(f"{base}/metrics")
        text = text.decode()
        assert status == 200
        assert 'cocodiff_requests_total{outcome="ok"} 3.0' in text
        assert "cocodiff_batch_size_count" in text and "cocodiff_request_latency_seconds_bucket" in text
        assert "cocodiff_queue_depth 0.0" in text
        assert "cocodiff_batch_size_sum 6.0" in text  # step-level batches: three images, each in 2 steps

        server.send_signal(signal.SIGTERM)
        server.wait(timeout=patience(60))
        assert server.returncode == 0, server.communicate()
        assert gone(pids, patience(15)), f"ranks {pids} outlived the server"
    finally:
        server.kill()
        server.communicate()
