"""`cocodiff serve` on a video model: the job routes of videos.py in one process (a fake executor
answers b"mp4"), then the whole service on 2 ranks with tiny-wan (real MP4s)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import patience
from fastapi.testclient import TestClient

from cocodiff.serve.admission import Costs
from cocodiff.serve.api import create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Scheduler

VIDEO = Limits(width=64, height=64, steps=2, size_multiple=16, max_n=4, max_pixels=128 * 128, max_steps=50,
               model="tiny-wan", video=True, frames=9, max_frames=17, fps=16)
WAN_LIKE = {"num_attention_heads": 6, "attention_head_dim": 16, "num_layers": 2}


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _serve_fake(scheduler: Scheduler, go: threading.Event) -> threading.Thread:
    """A fake rank loop: once `go` is set, answers every batch with b"mp4" per video, after
    reporting step 1 of each (so a job is seen in progress when the scheduler holds it)."""

    def loop() -> None:
        while not scheduler.stopped:
            if not go.wait(0.05):
                continue
            if (batch := scheduler.next_batch(0.05)) is not None:
                scheduler.progress.step([w.request_id for w in batch.works], 1)
                scheduler.execute(batch, lambda b: [b"mp4"] * b.images)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def served():
    """(client, scheduler, go): nothing runs until the test sets `go`."""
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    go = threading.Event()
    thread = _serve_fake(scheduler, go)
    costs = Costs(WAN_LIKE, {"base_dim": 8}, family="WanTransformer3DModel", pixel_multiple=16, item_bytes=4,
                  ranks=2, free_bytes=10**9, temporal_factor=4)
    with TestClient(create_app(scheduler, VIDEO, costs=lambda: costs)) as client:
        yield client, scheduler, go
    scheduler.stop()
    thread.join(patience(10))


def _until(client: TestClient, video_id: str, status: str) -> dict:
    deadline = time.monotonic() + patience(30)
    while (job := client.get(f"/v1/videos/{video_id}").json())["status"] != status:
        assert time.monotonic() < deadline, job
        time.sleep(0.01)
    return job


def test_a_job_is_queued_followed_and_its_video_fetched(served):
    client, scheduler, go = served
    created = client.post("/v1/videos", json={"prompt": "a red circle", "size": "80x48", "num_frames": 5, "seed": 3,
                                              "num_inference_steps": 2, "negative_prompt": "blue", "model": "x"})
    assert created.status_code == 200, created.text
    job = created.json()
    assert (job["object"], job["model"], job["status"], job["progress"]) == ("video", "tiny-wan", "queued", 0)
    assert (job["size"], job["num_frames"], job["seconds"], job["seed"]) == ("80x48", 5, "0.3125", 3)
    assert scheduler.depth() == 1
    error = _error(client.get(f"/v1/videos/{job['id']}/content"), 404)
    assert "queued, not completed" in error["message"], error
    scheduler.progress.step([job["id"]], 1)  # as the rank loop reports a step of the running call
    assert client.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
    assert client.get(f"/v1/videos/{job['id']}").json()["progress"] == 50
    go.set()
    done = _until(client, job["id"], "completed")
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert (content.status_code, content.headers["content-type"], content.content) == (200, "video/mp4", b"mp4")
    assert [j["id"] for j in client.get("/v1/videos").json()["data"]] == [job["id"]]
    assert 'cocodiff_requests_total{outcome="ok"} 1.0' in client.get("/metrics").text


def test_what_a_job_asks_reaches_the_queue(served):
    client, scheduler, _go = served
    client.post("/v1/videos", json={"prompt": "p", "width": 80, "height": 48, "seconds": "0.5", "fps": 8,
                                    "guidance_scale": 3.0, "negative_prompt": "n"})
    client.post("/v1/videos", json={"prompt": "q"})
    first, second = (pending.work for pending in scheduler._queue)
    assert (first.width, first.height, first.frames, first.fps, first.guidance, first.negative_prompt) == \
        (80, 48, 5, 8, 3.0, "n")  # 0.5 s x 8 fps + 1
    assert (second.width, second.height, second.frames, second.fps, second.steps, second.n) == (64, 64, 9, 16, 2, 1)


def test_a_length_in_seconds_is_rounded_up_to_one_the_vae_makes(served):
    """OpenAI's `seconds`: seconds x fps + 1 frames, up to the next count the VAE makes (Wan's 4 k + 1;
    a VAE of 17-frame chunks, MiniMax-H3's, 17 k + 5 within its shortest and longest clip), and the
    job reports the seconds it makes; a length it cannot reach is a 400 naming `seconds`."""
    client, scheduler, _go = served
    job = client.post("/v1/videos", json={"prompt": "p", "seconds": "0.3"}).json()  # 0.3 x 16 + 1 = 5.8 -> 6 -> 9
    assert (scheduler._queue[0].work.frames, job["num_frames"], job["seconds"]) == (9, 9, "0.5625")
    assert _error(client.post("/v1/videos", json={"prompt": "p", "num_frames": 6}), 400)["param"] == "num_frames"  # as given
    chunked = Limits(width=64, height=64, steps=2, model="tiny-minimax-h3", video=True, frames=124, max_frames=345, fps=24)
    costs = Costs(WAN_LIKE, {"base_dim": 8}, family="WanTransformer3DModel", pixel_multiple=16, item_bytes=4, ranks=2,
                  free_bytes=10**9, temporal_factor=3, frame_chunk=(17, 5), frame_limits=(124, 345))
    scheduler = Scheduler(max_queue=4, max_batch=1, window_s=0)
    with TestClient(create_app(scheduler, chunked, costs=lambda: costs)) as chunked_client:
        for seconds, frames in (("5", 124), ("8", 209), ("12", 294)):  # 121 -> 124, 193 -> 209, 289 -> 294
            assert chunked_client.post("/v1/videos", json={"prompt": "p", "seconds": seconds}).json()["num_frames"] == frames
        error = _error(chunked_client.post("/v1/videos", json={"prompt": "p", "seconds": "4"}), 400)
        assert error["param"] == "seconds" and error["message"] == \
            "seconds=4: 97 frames at fps 24, and tiny-minimax-h3 makes 17 x k + 5 frames, 124 to 345", error
    scheduler.stop()


def test_a_deleted_job_leaves_the_queue_and_is_forgotten(served):
    client, scheduler, _go = served
    job = client.post("/v1/videos", json={"prompt": "x"}).json()
    deleted = client.delete(f"/v1/videos/{job['id']}")
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert scheduler.depth() == 0
    assert _error(client.get(f"/v1/videos/{job['id']}"), 404)["param"] == "video_id"
    assert _error(client.delete(f"/v1/videos/{job['id']}"), 404)["param"] == "video_id"
    assert 'cocodiff_requests_total{outcome="cancelled"} 1.0' in client.get("/metrics").text
    assert client.get(f"/v1/progress/{job['id']}").json()["state"] == "failed"


def test_unknown_ids_are_404s_in_openais_shape(served):
    client, _scheduler, _go = served
    for path in ("/v1/videos/video_nothing", "/v1/videos/video_nothing/content"):
        error = _error(client.get(path), 404)
        assert "no video 'video_nothing'" in error["message"], error


def test_the_sync_route_answers_the_mp4(served):
    client, _scheduler, go = served
    go.set()
    response = client.post("/v1/videos/sync", json={"prompt": "x", "num_frames": 5})
    assert (response.status_code, response.headers["content-type"], response.content) == (200, "video/mp4", b"mp4")
    assert response.headers["X-Request-Id"].startswith("video_")


@pytest.mark.parametrize(
    ("body", "param", "names"),
    [
        ({"prompt": "x", "size": "80x50"}, "size", "multiple of 16"),
        ({"prompt": "x", "size": "256x256"}, "size", "--max-pixels 16384"),
        ({"prompt": "x", "size": "64x64", "width": 80}, "size", "differs"),
        ({"prompt": "x", "num_frames": 21}, "num_frames", "--max-frames 17"),
        ({"prompt": "x", "seconds": 2}, "seconds", "num_frames=33 (seconds 2 at fps 16)"),
        ({"prompt": "x", "num_frames": 6}, "num_frames", "4 x k + 1"),  # Wan's VAE: 1, 5, 9, ...
        ({"prompt": "x", "num_inference_steps": 51}, "num_inference_steps", "--max-steps 50"),
        ({"prompt": "x", "num_frames": 0}, "num_frames", "greater than or equal to 1"),
        ({"size": "64x64"}, "prompt", "required"),
        ('{"prompt": "x",}', None, "not valid JSON"),
    ],
)
def test_bad_video_requests_get_400_naming_the_limit(served, body, param, names):
    client, scheduler, go = served
    go.set()  # a request let through is answered (and fails the test), not left hanging
    for route in ("/v1/videos", "/v1/videos/sync"):
        raw = {"content": body, "headers": {"Content-Type": "application/json"}}
        sent = raw if isinstance(body, str) else {"json": body}
        error = _error(client.post(route, **sent), 400)
        assert error["param"] == param and names in error["message"], error


def test_each_kind_of_model_points_at_its_own_route(served):
    client, _scheduler, go = served
    go.set()  # a request let through is answered (and fails the test), not left hanging
    error = _error(client.post("/v1/images/generations", json={"prompt": "x"}), 400)
    assert "tiny-wan makes videos" in error["message"] and "POST /v1/videos" in error["message"], error
    images = Limits(width=64, height=64, steps=2, model="tiny-shapes")
    scheduler, answering = Scheduler(), threading.Event()
    answering.set()
    thread = _serve_fake(scheduler, answering)
    with TestClient(create_app(scheduler, images)) as image_client:
        for route in ("/v1/videos", "/v1/videos/sync"):
            error = _error(image_client.post(route, json={"prompt": "x"}), 400)
            assert "tiny-shapes makes images" in error["message"] and error["param"] == "model", error
        assert image_client.get("/health").json()["video"] is False
    assert client.get("/health").json()["video"] is True
    scheduler.stop()
    thread.join(patience(10))


@pytest.mark.filterwarnings("ignore:The Sora API")  # the client warns of OpenAI's own service, not of this one
def test_the_official_openai_client_creates_follows_and_downloads_a_video(served):
    from openai import OpenAI

    client, _scheduler, go = served
    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key="-", http_client=client, max_retries=0)
    job = openai.videos.create(prompt="a red circle", size="80x48", seconds="4",  # multipart form fields
                               extra_body={"fps": 1, "num_inference_steps": 2})  # 4 s x 1 fps + 1 frames
    assert (job.status, job.size, job.model_extra["num_frames"]) == ("queued", "80x48", 5)
    go.set()
    assert _until(client, job.id, "completed")["progress"] == 100
    assert openai.videos.retrieve(job.id).status == "completed"
    assert openai.videos.download_content(job.id).read() == b"mp4"
    assert openai.videos.delete(job.id).deleted
    error = _error(client.post("/v1/videos", files={"input_reference": ("a.png", b"png")}, data={"prompt": "x"}), 400)
    assert error["param"] == "input_reference", error


def test_the_page_makes_videos_on_a_video_model(served):
    client, _scheduler, _go = served
    page = client.get("/").text
    for needle in ('id="frames"', "<video", '"/v1/videos"', "/v1/videos/${job.id}/content", "health.video"):
        assert needle in page, needle


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--model", "tiny-wan", "--max-frames", "0"], "--max-frames 0 must be at least 1"),
        (["--model", "tiny-wan", "--max-frames", "5"], "--max-frames 5 must be at least the default frames 9"),
        (["--model", "tiny-shapes", "--frames", "5"], "--frames 5: tiny-shapes makes images"),
    ],
)
def test_serve_video_flags_are_one_line_before_any_rank_starts(capsys, flags, says):
    from cocodiff.cli import main

    assert main(["serve", "--port", "0", "--nproc", "2", *flags]) == 2  # returns: no rank was spawned
    err = capsys.readouterr().err
    assert err.startswith("cocodiff: error: ") and says in err and err.count("\n") == 1, err


# -- the whole service on 2 ranks: tiny-wan, real MP4s ---------------------------------------------------

def _post(url: str, body: dict) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=patience(120)) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def _delete(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=patience(10)) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.slow
def test_tiny_wan_serves_video_jobs_on_two_ranks(tmp_path):
    from live_server import start_server

    from cocodiff.output.video import count_frames

    server = start_server("--model", "tiny-wan", "--steps", "2", "--max-frames", "9")
    try:
        asked = {"prompt": "a red circle", "size": "80x48", "num_frames": 5, "num_inference_steps": 2, "seed": 1}
        status, _kind, body = _post(f"{server.url}/v1/videos", asked)
        assert status == 200, body
        job = json.loads(body)
        assert (job["status"], job["size"], job["num_frames"]) == ("queued", "80x48", 5)
        deadline = time.monotonic() + patience(120)
        while True:
            content_status = server.get(f"/v1/videos/{job['id']}/content")[0]
            state = json.loads(server.get(f"/v1/videos/{job['id']}")[1])  # read after the content: not done then either
            if state["status"] == "completed":
                break
            assert state["status"] in ("queued", "in_progress") and content_status == 404, (state, content_status)
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        status, mp4 = server.get(f"/v1/videos/{job['id']}/content")
        assert status == 200 and mp4[4:8] == b"ftyp"
        (tmp_path / "job.mp4").write_bytes(mp4)
        assert count_frames(tmp_path / "job.mp4") == 5
        status, kind, again = _post(f"{server.url}/v1/videos/sync", asked)
        assert (status, kind) == (200, "video/mp4") and again == mp4  # the same seed: the same video
        status, _kind, body = _post(f"{server.url}/v1/videos", {**asked, "num_frames": 13})
        assert status == 400 and "--max-frames 9" in json.loads(body)["error"]["message"], body
        status, _kind, body = _post(f"{server.url}/v1/images/generations", {"prompt": "x"})
        assert status == 400 and "POST /v1/videos" in json.loads(body)["error"]["message"], body
        assert _delete(f"{server.url}/v1/videos/{job['id']}") == 200
        assert server.get(f"/v1/videos/{job['id']}/content")[0] == 404
    finally:
        out, err = server.stop()
    assert server.process.returncode == 0, (out, err)
    assert "Traceback" not in err, err
