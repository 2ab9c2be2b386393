"""`cocodiff serve`'s bounds on what a request may send: the body's size (413 before it is read),
a video's frame rate (the one reported is the one written), memory for the batch a request joins,
a video's default clip in the estimate, and JSON types taken as they are."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import patience
from fastapi.testclient import TestClient

from cocodiff.serve.admission import Costs
from cocodiff.serve.api import create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Batch, Scheduler, Work

from test_serve import _drain
from test_serve_video import WAN_LIKE, _error

VIDEO = Limits(width=64, height=64, steps=2, size_multiple=16, max_pixels=128 * 128, max_steps=50,
               model="tiny-wan", video=True, frames=9, max_frames=17, fps=16)
FLUX_LIKE = {"num_attention_heads": 4, "attention_head_dim": 32, "num_layers": 2, "num_single_layers": 4}


@contextlib.contextmanager
def _served(**limits):
    """(client, scheduler) of an image app with `limits`, its queue answered by a fake executor."""
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    drainer = _drain(scheduler)
    with TestClient(create_app(scheduler, Limits(width=64, height=64, steps=2, size_multiple=4, max_n=4, **limits))) as client:
        yield client, scheduler
    scheduler.stop()
    drainer.join(patience(10))


@pytest.fixture
def served():
    with _served() as served:
        yield served


@pytest.fixture
def video():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    drainer = _drain(scheduler)
    with TestClient(create_app(scheduler, VIDEO)) as client:
        yield client
    scheduler.stop()
    drainer.join(patience(10))


# -- the body's size ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: twelve\r\n\r\n", 400),
    (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n", 413),
])
def test_a_request_http_cannot_parse_is_answered_in_openais_shape(raw, status):
    """uvicorn's own answer to what it cannot parse (plain text otherwise); a length of 40 digits is too large."""
    import socket

    from live_server import app_in_thread

    from cocodiff.serve.api import H11Protocol

    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    app = create_app(scheduler, Limits(width=64, height=64, steps=2, size_multiple=4, max_n=4))
    try:
        with app_in_thread(app, log_level="error", http=H11Protocol) as port, \
                socket.create_connection(("127.0.0.1", port), timeout=patience(5)) as client:
            client.sendall(raw)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
    finally:
        scheduler.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ")[1] == str(status).encode(), answer
    assert b"application/json" in head.lower(), answer
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error


def _through(limit: int, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, dict, int]:
    """`BodyLimit` around an app that reads the whole body: (status, body answered, chunks received)."""
    received, sent = [], []

    async def receive():
        chunk = chunks[len(received)]
        received.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": len(received) < len(chunks)}

    async def send(message):
        sent.append(message)

    scheduler = Scheduler()
    app = create_app(scheduler, Limits(width=64, height=64, steps=2, max_body_bytes=limit))
    scope = {"type": "http", "method": "POST", "path": "/v1/images/generations", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("test", 80),
             "client": ("test", 1), "root_path": "", "app": app}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), len(received)


def test_a_declared_length_over_the_limit_is_413_before_a_byte_is_read():
    headers = [(b"content-type", b"application/json"), (b"content-length", b"20971520")]
    status, body, read = _through(1000, headers, [b"x" * 1000] * 3)
    assert (status, read) == (413, 0), body
    assert body["error"]["message"] == ("the request body is 20971520 bytes, more than this server's "
                                        "--max-body-bytes 1000"), body
    assert body["error"]["type"] == "invalid_request_error"


def test_a_chunked_body_is_refused_at_the_chunk_that_passes_the_limit():
    status, body, read = _through(1000, [(b"content-type", b"application/json")], [b" " * 300] * 100)
    assert (status, read) == (413, 4), body  # 1200 bytes: not the other 96 chunks
    assert "more than this server's --max-body-bytes 1000 bytes" in body["error"]["message"], body


@pytest.fixture
def small():
    """An image app taking bodies of 1000 bytes at most."""
    with _served(max_body_bytes=1000) as (client, _scheduler):
        yield client


def test_bodies_over_the_limit_get_413_in_openais_shape_on_every_route(small):
    client, big = small, {"prompt": "x" * 2000}
    for route in ("/v1/images/generations", "/v1/videos", "/v1/videos/sync"):
        assert "--max-body-bytes 1000" in _error(client.post(route, json=big), 413)["message"]

    def chunks():
        yield json.dumps(big).encode()[:600]
        yield json.dumps(big).encode()[600:]

    error = _error(client.post("/v1/images/generations", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert "more than this server's --max-body-bytes 1000 bytes" in error["message"], error
    assert 'cocodiff_requests_total{outcome="bad_request"} 4.0' in client.get("/metrics").text
    assert client.post("/v1/images/generations", json={"prompt": "x" * 900}).status_code == 200


def test_the_default_limit_is_1_mib():
    assert Limits(width=64, height=64, steps=2).max_body_bytes == 1 << 20
    scheduler = Scheduler()
    with TestClient(create_app(scheduler, Limits(width=64, height=64, steps=2))) as client:
        body = json.dumps({"prompt": "x", "padding": "y" * (20 << 20)})
        error = _error(client.post("/v1/images/generations", content=body, headers={"Content-Type": "application/json"}), 413)
    assert "--max-body-bytes 1048576" in error["message"], error
    assert scheduler.depth() == 0


# -- a video's frame rate -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fps", [1e-9, 0.5, 241])
def test_a_frame_rate_out_of_range_is_400_naming_it(video, fps):
    for route in ("/v1/videos", "/v1/videos/sync"):
        error = _error(video.post(route, json={"prompt": "x", "num_frames": 5, "fps": fps}), 400)
        assert error["param"] == "fps" and f"got {fps!r}" in error["message"], error
        assert ("than or equal to 1" if fps < 1 else "less than or equal to 240") in error["message"], error


def test_the_reported_frame_rate_is_the_one_written(video):
    import av

    from cocodiff.output.video import video_bytes
    from cocodiff.serve.calls import answers

    job = video.post("/v1/videos", json={"prompt": "x", "num_frames": 5, "fps": 23.976}).json()
    assert job["fps"] == 23.976
    work = Work(prompt="x", width=16, height=16, steps=1, frames=5, fps=job["fps"])
    (mp4,) = answers(Batch((work,), (None,)), np.zeros((1, 5, 16, 16, 3), dtype=np.float32), fps=24)
    with av.open(io.BytesIO(mp4)) as container:
        assert float(container.streams.video[0].average_rate) == pytest.approx(23.976)
    with pytest.raises(ValueError, match="fps 1e-09 is out of range"):  # it would be written at 24
        video_bytes(np.zeros((5, 16, 16, 3), dtype=np.uint8), fps=1e-9)


# -- admission: the batch a request joins, a video's default clip --------------------------------------------

def _flux_costs(free_bytes: int | None = None) -> Costs:
    return Costs(FLUX_LIKE, {"block_out_channels": [32]}, family="FluxTransformer2DModel", pixel_multiple=4,
                 item_bytes=4, ranks=2, free_bytes=free_bytes)


def _image(n: int = 1, size: int = 256) -> Work:
    return Work(prompt="x", n=n, width=size, height=size, steps=2)


def test_the_batch_a_request_joins_counts_the_waiting_and_running_images_at_its_size():
    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)
    running = [scheduler.submit(_image()) for _ in range(2)]
    assert scheduler.next_batch(0).images == 2  # taken: running now
    scheduler.submit(_image())
    scheduler.submit(_image(size=64))  # another size: another batch
    assert scheduler.batch_images(_image()) == 4 and scheduler.batch_images(_image(size=64)) == 2
    assert scheduler.batch_images(_image(n=3)) == 4  # at most a batch
    for future in running:
        future.set_result([b"png"])
    assert scheduler.batch_images(_image()) == 2
    scheduler.stop()


def test_requests_admissible_alone_are_refused_429_when_their_batch_would_not_fit():
    one = _flux_costs().footprint(256, 256, 1).rank_bytes
    four = _flux_costs().footprint(256, 256, 4).rank_bytes
    costs = _flux_costs(free_bytes=(one + four) // 2)
    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)  # nothing drains it: they stay waiting
    for _ in range(3):
        scheduler.submit(_image())
    limits = Limits(width=64, height=64, steps=2, size_multiple=4, max_n=4)
    with TestClient(create_app(scheduler, limits, costs=lambda: costs)) as client, ThreadPoolExecutor(1) as pool:
        posted = pool.submit(client.post, "/v1/images/generations", json={"prompt": "x", "size": "256x256"})
        try:
            response = posted.result(timeout=patience(10))
        except TimeoutError:
            scheduler.stop()  # it was queued: answer it, then fail
            raise AssertionError("admitted into a batch that does not fit") from None
        error = _error(response, 429)
        assert response.headers["Retry-After"] == "1" and error["param"] == "size", error
        assert "fits alone, but batched with the 3 images waiting or running" in error["message"], error
        assert 'cocodiff_requests_total{outcome="queue_full"} 1.0' in client.get("/metrics").text
    assert scheduler.depth() == 3
    assert costs.check(_image(), batch_images=1).rank_bytes == one
    scheduler.stop()


class WanTransformer3DModel:
    """A stand-in transformer: the configs and dtype admission reads."""

    config = WAN_LIKE
    dtype = torch.float32


class StubVideoPipeline:
    """A video pipeline as admission sees it: its configs, its VAE's factor, its default clip."""

    transformer = WanTransformer3DModel()
    vae = type("Vae", (), {"config": {"base_dim": 8}})()
    vae_scale_factor_temporal = 4

    def __call__(self, prompt=None, height=480, width=832, num_frames=81, num_inference_steps=50):
        raise AssertionError("admission never runs the pipeline")


def test_a_video_without_a_frame_count_is_costed_at_the_pipelines_default_clip():
    costs = Costs.of(StubVideoPipeline(), pixel_multiple=16, ranks=2, free_bytes=10**12)
    assert costs.frames == 81
    work = Work(prompt="x", width=64, height=64, steps=2)
    assert costs.check(work).rank_bytes == costs.check(Work(prompt="x", width=64, height=64, steps=2, frames=81)).rank_bytes
    assert costs.check(work).rank_bytes > costs.check(Work(prompt="x", width=64, height=64, steps=2, frames=1)).rank_bytes
    measured = Costs.of(StubVideoPipeline(), pixel_multiple=16, ranks=2)
    measured.observe(64, 64, 1, 1.0)  # a step of the default clip, as the rank loop reports it
    assert measured.rate() == costs.footprint(64, 64, 1, frames=81).flops


# -- JSON taken as it is --------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ('{"prompt": "x", "n": true}', "n", "valid integer, got True"),
        ('{"prompt": "x", "n": "2"}', "n", "valid integer, got '2'"),
        ('{"prompt": "x", "steps": 2.5}', "steps", "valid integer"),
        ('{"prompt": "x", "guidance": NaN}', "guidance", "finite number, got nan"),
        ('{"prompt": "x", "guidance": "3"}', "guidance", "valid number"),
    ],
)
def test_json_values_are_taken_as_their_json_types(served, body, param, says):
    client, scheduler = served
    error = _error(client.post("/v1/images/generations", content=body, headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and says in error["message"], error
    assert scheduler.depth() == 0


def test_a_body_not_sent_as_json_is_415_saying_so(served):
    client, _scheduler = served
    for route in ("/v1/images/generations", "/v1/videos", "/v1/videos/sync"):
        response = client.post(route, content='{"prompt": "x"}', headers={"Content-Type": "text/plain"})
        error = _error(response, 415)
        assert "must be JSON sent with Content-Type: application/json, not text/plain" in error["message"], error
    ok = client.post("/v1/images/generations", content='{"prompt": "x"}',
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": "x", "num_frames": 5, "seconds": 2}, "seconds", "num_frames=5 and seconds=2 both"),
        ({"prompt": "x", "num_frames": "5"}, "num_frames", "valid integer, got '5'"),
        ({"prompt": "x", "num_frames": True}, "num_frames", "valid integer, got True"),
        ({"prompt": "x", "guidance_scale": float("inf")}, "guidance_scale", "finite number"),
    ],
)
def test_a_video_request_is_taken_as_sent(video, body, param, says):
    error = _error(video.post("/v1/videos", content=json.dumps(body), headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and says in error["message"], error


def test_form_fields_are_text_and_read_as_numbers(video):
    job = video.post("/v1/videos", data={"prompt": "x", "num_frames": "5", "fps": "8"})
    assert job.status_code == 200, job.text
    assert (job.json()["num_frames"], job.json()["fps"]) == (5, 8)
    assert video.post("/v1/videos", json={"prompt": "x", "seconds": "0.5", "fps": 8}).json()["num_frames"] == 5


def test_max_body_bytes_is_a_serve_flag_checked_before_any_rank(capsys, no_ranks):
    from test_cli import exit_status

    from cocodiff.cli import build_parser
    from cocodiff.serve.ranks import ServeOptions

    assert build_parser().parse_args(["serve", "--max-body-bytes", "2048"]).max_body_bytes == 2048
    assert ServeOptions(host="h", port=0, max_queue=1, max_batch=1, batch_window_ms=0, idle_s=1).max_body_bytes == 1 << 20
    assert exit_status(["serve", "--max-body-bytes", "0", "--nproc", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-body-bytes 0 must be at least 1" in err and len(err.strip().splitlines()) == 1
