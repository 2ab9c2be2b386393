"""`cocodiff serve` in one process: per-request progress, the web page's route, and `bench serve`'s
counting against a real HTTP server whose ranks are a fake executor."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI
from conftest import patience
from live_server import app_in_thread
from fastapi.testclient import TestClient

from cocodiff.bench.serve import (
    ServeBenchSpec,
    _batch_sizes,
    bench_serve,
    parse_concurrency,
    parse_mix,
    run_level,
)
from cocodiff.cli import main
from cocodiff.errors import RunFailed, UsageError
from cocodiff.serve.api import create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.progress import Progress
from cocodiff.serve.scheduler import Batch, Scheduler

LIMITS = Limits(width=64, height=64, steps=3, size_multiple=4, max_n=4)


# -- Progress alone ---------------------------------------------------------------------------------------

def test_a_request_goes_queued_running_done():
    progress = Progress()
    assert progress.queued("a", 3) and progress.get("a").state == "queued"
    progress.step(["a", "unknown"], 0)
    assert (progress.get("a").state, progress.get("a").step) == ("running", 0)
    progress.step(["a"], 2)
    assert progress.get("a").as_dict() == {"id": "a", "state": "running", "step": 2, "steps": 3, "error": None}
    progress.finished("a")
    assert (progress.get("a").state, progress.get("a").step) == ("done", 3)
    progress.step(["a"], 1)  # late: a finished request stays finished
    assert progress.get("a").state == "done"
    assert progress.get("unknown") is None


def test_an_id_in_use_is_refused_and_a_finished_one_reusable():
    progress = Progress()
    assert progress.queued("a", 2)
    assert not progress.queued("a", 5) and progress.get("a").steps == 2
    progress.finished("a", "the ranks failed")
    assert (progress.get("a").state, progress.get("a").error) == ("failed", "the ranks failed")
    assert progress.queued("a", 5) and progress.get("a").state == "queued"


def test_only_the_last_finished_requests_are_kept():
    progress = Progress(keep=2)
    for request_id in "abc":
        progress.queued(request_id, 1)
        progress.finished(request_id)
    assert [progress.get(r) is not None for r in "abc"] == [False, True, True]


# -- the HTTP layer: progress while a batch runs, the page -------------------------------------------------

class SteppingExecutor:
    """A fake rank loop: reports each step of a batch to the scheduler's progress, and stops after
    step `hold` until `go` is set."""

    def __init__(self, scheduler: Scheduler, hold: int) -> None:
        self.scheduler, self.hold = scheduler, hold
        self.held, self.go = threading.Event(), threading.Event()
        self.ran: Counter[int] = Counter()
        """Requests run, by their steps."""
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _run(self, batch: Batch) -> list[bytes]:
        ids = [w.request_id for w in batch.works]
        self.ran.update(w.steps for w in batch.works)
        for step in range(batch.key[2] + 1):
            self.scheduler.progress.step(ids, step)
            if step == self.hold:
                self.held.set()
                assert self.go.wait(30)
        return [b"png"] * batch.images

    def _loop(self) -> None:
        while not self.scheduler.stopped:
            if (batch := self.scheduler.next_batch(0.05)) is not None:
                self.scheduler.execute(batch, self._run)


def test_progress_follows_a_request_from_queue_to_answer():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    executor = SteppingExecutor(scheduler, hold=2)
    try:
        with TestClient(create_app(scheduler, LIMITS)) as client:
            body = {"prompt": "a red circle", "request_id": "r-1", "steps": 3}
            answer = {}
            poster = threading.Thread(target=lambda: answer.update(r=client.post("/v1/images/generations", json=body)))
            poster.start()
            assert executor.held.wait(30)
            assert client.get("/v1/progress/r-1").json() == {"id": "r-1", "state": "running", "step": 2, "steps": 3,
                                                             "error": None}
            again = client.post("/v1/images/generations", json=body)  # its id is in use
            assert again.status_code == 400 and again.json()["error"]["param"] == "request_id"
            executor.go.set()
            poster.join(30)
            assert answer["r"].status_code == 200 and answer["r"].headers["X-Request-Id"] == "r-1"
            assert client.get("/v1/progress/r-1").json()["state"] == "done"
            missing = client.get("/v1/progress/nobody")
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
            # without an id of its own, a request gets one, named in the answer
            generated = client.post("/v1/images/generations", json={"prompt": "x"}).headers["X-Request-Id"]
            assert client.get(f"/v1/progress/{generated}").json()["state"] == "done"
    finally:
        executor.go.set()
        scheduler.stop()


def test_a_failed_request_says_why_in_its_progress():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)  # nothing drains it
    with TestClient(create_app(scheduler, LIMITS)) as client:
        poster = threading.Thread(target=lambda: client.post("/v1/images/generations", json={"prompt": "x", "request_id": "q"}))
        poster.start()
        deadline = time.monotonic() + patience(10)
        while scheduler.depth() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/v1/progress/q").json()["state"] == "queued"
        scheduler.stop("the server is shutting down")
        poster.join(10)
        state = client.get("/v1/progress/q").json()
        assert state["state"] == "failed" and "shutting down" in state["error"]


@pytest.mark.parametrize("request_id", ["", "has space", "x" * 65, "a/b"])
def test_a_bad_request_id_is_400(request_id):
    with TestClient(create_app(Scheduler(), LIMITS)) as client:
        response = client.post("/v1/images/generations", json={"prompt": "x", "request_id": request_id})
        assert response.status_code == 400 and response.json()["error"]["param"] == "request_id"


def test_the_page_is_served_at_the_root():
    with TestClient(create_app(Scheduler(), LIMITS)) as client:
        response = client.get("/")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        for needle in ('id="prompt"', 'id="size"', 'id="seed"', 'id="steps"', "<progress", "/v1/progress/",
                       "/v1/images/generations"):
            assert needle in response.text


def test_metrics_count_bytes_per_link_class():
    app = create_app(Scheduler(), LIMITS)
    app.state.metrics.count_comm(intra_node=100, inter_node=7)
    with TestClient(app) as client:
        text = client.get("/metrics").text
    assert 'cocodiff_comm_bytes_total{link="intra_node"} 100.0' in text
    assert 'cocodiff_comm_bytes_total{link="inter_node"} 7.0' in text


# -- bench serve: its counting, against a real HTTP server -------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_serving():
    """A real uvicorn server on a free port; its scheduler is drained by a fake executor. Gives
    (its URL, the executor)."""
    scheduler = Scheduler(max_queue=64, max_batch=4, window_s=0.01)
    executor = SteppingExecutor(scheduler, hold=-1)
    with app_in_thread(create_app(scheduler, LIMITS), log_level="warning") as port:
        yield f"http://127.0.0.1:{port}", executor
        scheduler.stop()
    executor.thread.join(10)


@pytest.fixture
def fake_server(fake_serving):
    return fake_serving[0]


def test_bench_serve_counts_answers_and_batches(fake_serving, tmp_path):
    fake_server, executor = fake_serving
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--url", fake_server, "--concurrency", "1,3", "--duration", "0.5",
                 "--mix", "steps=1:1,2:1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert {"concurrency", "images_per_s", "p50_ms", "p99_ms", "errors", "lost"} <= set(level)
        assert level["lost"] == 0 and level["errors"] == 0 and level["ok"] == level["requests"] > 0
        assert level["images_per_s"] > 0 and level["p50_ms"] <= level["p99_ms"]
        assert sum(level["batch_sizes"].values()) >= 1
        # Both step counts were requested and each answer counted under its own.
        by_steps = {steps: c["requests"] for steps, c in level["by_steps"].items()}
        assert by_steps["1"] > 0 and by_steps["2"] > 0 and sum(by_steps.values()) == level["ok"], by_steps
        assert all(level["by_steps"][steps]["p50_ms"] is not None for steps in ("1", "2"))
    # What the server ran, by steps, is what the levels counted.
    counted: Counter[int] = Counter()
    for level in result["levels"]:
        counted.update({int(steps): c["requests"] for steps, c in level["by_steps"].items()})
    assert executor.ran == counted


def test_bench_serve_that_got_no_images_fails(fake_server, capsys):
    """Every request refused (400: a size that is not a multiple of 4): nothing measured, exit 1, one line why."""
    assert main(["bench", "serve", "--url", fake_server, "--concurrency", "2", "--duration", "0.3", "--size", "63x64"]) == 1
    out = capsys.readouterr().out
    assert "cocodiff bench serve: no request got its images (" in out and " answered 400): nothing was measured" in out


def test_bench_serve_counts_a_refused_request_as_an_error_and_no_answer_as_lost(fake_server):
    spec = ServeBenchSpec(url=fake_server, concurrency=(2,), duration_s=0.3, size="63x64")  # 400: not a multiple of 4
    level = bench_serve(spec)["levels"][0]
    assert level["errors"] == level["requests"] > 0 and level["lost"] == 0 and level["p50_ms"] is None
    assert level["errors_by_status"] == {"400": level["requests"]}

    with socket.socket() as listener:  # accepts and hangs up: no answer at all
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        stop = threading.Event()

        def hang_up() -> None:
            listener.settimeout(0.1)
            while not stop.is_set():
                try:
                    listener.accept()[0].close()
                except OSError:
                    continue

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with httpx.Client(timeout=patience(10)) as http:  # one level alone: bench_serve refuses a non-server outright
            level = run_level(ServeBenchSpec(url=url, concurrency=(1,), duration_s=0.2), 1, http)
        with pytest.raises(RunFailed, match=f"cannot reach {url}"):
            bench_serve(ServeBenchSpec(url=url, concurrency=(1,), duration_s=0.2))
        stop.set()
        thread.join(5)
    assert level["lost"] == level["requests"] > 0 and level["errors"] == 0 and level["batch_sizes"] is None


def test_bench_serve_against_a_dead_or_foreign_url_stops_at_once_with_one_line(tmp_path, capsys):
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    assert main(["bench", "serve", "--url", dead, "--concurrency", "4", "--duration", "30"]) == 1
    assert capsys.readouterr().err.strip() == f"cocodiff: error: bench serve: cannot reach {dead}: [Errno 111] Connection refused"
    assert main(["bench", "serve", "--url", "localhost:8000", "--duration", "30"]) == 2  # no scheme

    foreign = FastAPI()  # a web server, but not ours: every path is 404
    with app_in_thread(foreign, log_level="warning") as port:
        assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--duration", "30"]) == 1
        assert "is not a cocodiff server" in capsys.readouterr().err


def test_bench_serve_stops_when_the_server_goes_away_mid_level(fake_server, tmp_path, monkeypatch):
    """From its first answer on, the server refuses connections: the clients stop at once (not
    thousands of lost requests a second), the level so far is reported, the run fails in one line."""
    out = tmp_path / "serve.json"
    real_send, answered = httpx.Client.send, threading.Event()

    def send(self, request, **kwargs):
        if request.url.path == "/v1/images/generations":
            if answered.is_set():
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            answered.set()
        return real_send(self, request, **kwargs)

    monkeypatch.setattr(httpx.Client, "send", send)
    assert main(["bench", "serve", "--url", fake_server, "--concurrency", "2,4", "--duration", "30",
                 "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert [level["concurrency"] for level in result["levels"]] == [2]  # stopped in the first level
    level = result["levels"][0]
    assert level["lost"] == 0 and level["ok"] == level["requests"] >= 1, level
    assert "refused a connection during the 2-client level" in result["error"]


def test_bench_serve_options_are_checked():
    assert parse_concurrency("1,4,16") == (1, 4, 16)
    assert parse_mix("steps=4:0.5,20:0.5") == ((4, 0.5), (20, 0.5)) and parse_mix(None) == ()
    for bad in ("0,1", "a", ""):
        with pytest.raises(UsageError):
            parse_concurrency(bad)
    for bad in ("4:0.5", "steps=0:1", "steps=4:-1", "steps=x"):
        with pytest.raises(UsageError):
            parse_mix(bad)
    assert _batch_sizes({"1.0": 1, "2.0": 1, "+Inf": 1}, {"1.0": 3, "2.0": 4, "+Inf": 5}) == {"1": 2, "2": 1, "+Inf": 1}
