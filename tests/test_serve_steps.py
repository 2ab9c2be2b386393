"""Step-level continuous batching: admission at step boundaries, and each image equal to its run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import patience

from cocodiff.serve.scheduler import Scheduler, Work
from cocodiff.serve.stepper import Join, JoinsFailed, Stepper


def _work(prompt: str = "a red circle", *, size: int = 64, steps: int = 2, n: int = 1) -> Work:
    return Work(prompt=prompt, n=n, width=size, height=size, steps=steps, seed=0)


def _size(work: Work) -> int:
    return work.width


def test_admission_takes_the_running_key_in_order_up_to_the_room():
    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)
    for work in (_work("a", steps=4), _work("b", steps=20, n=2), _work("c", size=32), _work("d", n=2)):
        scheduler.submit(work)
    joined = scheduler.admit(_size, 64, room=3, timeout_s=0)
    assert [w.prompt for w in joined.works] == ["a", "b"]  # steps differ: still one batch; "d" does not fit
    assert scheduler.admit(_size, 64, room=3, timeout_s=0) is None  # "c" (another size) heads the queue: drain first
    joined = scheduler.admit(_size, None, room=4, timeout_s=0)  # drained: "c" starts the next batch
    assert [w.prompt for w in joined.works] == ["c"]
    assert [w.prompt for w in scheduler.admit(_size, 32, room=3, timeout_s=0) or ()] == []
    assert [w.prompt for w in scheduler.admit(_size, None, room=4, timeout_s=0).works] == ["d"]


def test_a_request_larger_than_the_room_waits_for_the_batch_to_drain():
    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)
    scheduler.submit(_work("big", n=3))
    scheduler.submit(_work("small"))
    assert scheduler.admit(_size, 64, room=2, timeout_s=0) is None  # "small" does not overtake "big"
    assert [w.prompt for w in scheduler.admit(_size, None, room=4, timeout_s=0).works] == ["big", "small"]


def test_an_idle_admission_waits_for_a_request_then_returns_none():
    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)
    assert scheduler.admit(_size, None, room=4, timeout_s=0.01) is None


def test_a_cancelled_request_leaves_the_queue_or_is_listed_for_the_running_batch():
    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)
    running, waiting = scheduler.submit(_work("running")), scheduler.submit(_work("waiting", size=32))
    assert [w.prompt for w in scheduler.admit(_size, None, room=4, timeout_s=0).works] == ["running"]
    scheduler.cancel(waiting)
    assert scheduler.depth() == 0 and waiting.cancelled()
    assert scheduler.take_cancelled() == set()
    scheduler.cancel(running)  # it runs: the rank loop takes it out at the next step boundary
    assert scheduler.take_cancelled() == {running} and scheduler.take_cancelled() == set()


@pytest.fixture(scope="module")
def shapes():
    from cocodiff.models.presets import load_preset

    torch.manual_seed(0)
    pipe = load_preset("tiny-shapes")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_requests_joining_and_leaving_at_steps_each_get_their_image_alone(shapes):
    """Three requests (different prompts, seeds, step counts, guidance and image counts) join a
    running batch at different steps; each image equals the pipeline's own run of that request
    alone within `verify`'s tolerance (batched matmuls round differently, nothing else differs)."""
    from cocodiff.serve.ranks import Call, run_call

    joins = {
        0: Join(prompt="a red circle above a blue square", seeds=(0,), width=64, height=64, steps=6, guidance=None),
        1: Join(prompt="a green triangle", seeds=(5, 6), width=64, height=64, steps=3, guidance=2.0),
        3: Join(prompt="a blue square", seeds=(9,), width=64, height=64, steps=4, guidance=None),
    }
    stepper = Stepper(shapes)
    images, finished_at = {}, {}
    for step in range(8):
        for request, index, image in stepper.step([joins[step]] if step in joins else []):
            images[request, index], finished_at[request] = image, step
    assert stepper.idle
    assert finished_at == {0: 5, 1: 3, 2: 6}  # each leaves after its own last step
    for request, join in enumerate(joins.values()):
        alone = run_call(shapes, Call(prompts=[join.prompt] * len(join.seeds), seeds=list(join.seeds),
                                      width=64, height=64, steps=join.steps, guidance=join.guidance))
        for index in range(len(join.seeds)):
            assert np.abs(images[request, index] - alone[index]).max() < 1e-4, (request, index)


def test_a_request_that_leaves_stops_at_that_step_and_the_others_go_on(shapes):
    stepper = Stepper(shapes, decode=False)
    stepper.step([Join(prompt="a red circle", seeds=(0, 1), width=64, height=64, steps=3, guidance=None),
                  Join(prompt="a blue square", seeds=(2,), width=64, height=64, steps=3, guidance=None)])
    assert stepper.step([], leaves={0}) == [] and {im.request for im in stepper.images} == {1}
    assert [(request, index) for request, index, _ in stepper.step([])] == [(1, 0)]  # its third step: done
    stepper.step([Join(prompt="a red circle", seeds=(0,), width=32, height=32, steps=3, guidance=None)])
    assert stepper.step([], leaves=[2]) == [] and stepper.idle and stepper.running_key is None


def test_a_request_of_another_size_cannot_join_a_running_batch(shapes):
    stepper = Stepper(shapes, decode=False)
    stepper.step([Join(prompt="a red circle", seeds=(0,), width=64, height=64, steps=2, guidance=None)])
    with pytest.raises(JoinsFailed, match="ValueError: a request of .* cannot join"):
        stepper.step([Join(prompt="a red circle", seeds=(0,), width=32, height=32, steps=2, guidance=None)])
    assert [im.request for im in stepper.images] == [0] and stepper.requests == 2  # the running image goes on
    assert len(stepper.step([])) == 1


@pytest.mark.slow
def test_a_short_request_overtakes_a_long_one_and_gets_its_image_alone(tmp_path):
    """On a live 2-rank server: a 2-step request sent while a 60-step one runs joins it at the next
    step and is answered while the long one still runs (no head-of-line blocking); its image is the
    one it gets alone, on an idle server."""
    import base64
    import io
    import json
    import threading
    import time
    import urllib.request

    from PIL import Image

    from live_server import start_server

    server = start_server("--max-batch", "4")

    def post(body: dict) -> dict:
        request = urllib.request.Request(f"{server.url}/v1/images/generations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=patience(300)) as response:
            return json.loads(response.read())

    def pixels(answer: dict) -> np.ndarray:
        png = base64.b64decode(answer["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)

    try:
        long = threading.Thread(target=post, args=({"prompt": "a blue square", "steps": 60, "request_id": "long"},))
        long.start()
        deadline = time.monotonic() + patience(120)
        while json.loads(server.get("/v1/progress/long")[1]).get("step", 0) < 2:  # the long one runs
            assert time.monotonic() < deadline, "the long request never reached its second step"
            time.sleep(0.05)
        short = {"prompt": "a red circle", "steps": 2, "seed": 3}
        joined = pixels(post(short))
        state = json.loads(server.get("/v1/progress/long")[1])
        assert state["state"] == "running" and state["step"] < 60, state  # answered before the long one ends
        long.join(300)
        alone = pixels(post(short))
        assert np.abs(joined - alone).max() <= 1  # the same image, up to 8-bit rounding
    finally:
        server.stop()


def test_a_magcache_join_reads_its_curve_only_once_every_rank_admitted_it(shapes, monkeypatch, tmp_path, one_rank):
    """A MagCache run reads its curve with the other ranks (an all-reduce of 3 numbers). A join whose
    prompt fails to encode on another rank is refused on every rank by `Ready` (2 numbers), and the
    failing rank never reaches the curve's all-reduce: this rank, which encoded it, must not take
    it first (it did: 3 then 2 numbers here against 2 there, a hang on NCCL). Once admitted, it is read."""
    from cocodiff.config.env import CACHE_DIR_ENV
    from cocodiff.engine.cache import parse_cache

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    collectives, peer_failed = [], [True]

    def agree(values: torch.Tensor) -> list[float]:  # the sums over every rank, as this rank gets them
        collectives.append(len(values))
        return [1.0, 1.0] if len(values) == 2 and peer_failed[0] else values.tolist()  # rank 1 failed

    stepper = Stepper(shapes, decode=False, agree=agree)
    join = Join(prompt="a red circle", seeds=(0,), width=64, height=64, steps=3, guidance=None,
                cache=parse_cache("magcache:0.5"))
    with pytest.raises(JoinsFailed, match="rank 1 of the server failed to admit a request"):
        stepper.step([join])
    assert collectives == [2] and stepper.caches is None and stepper.runs == {}
    peer_failed[0] = False
    collectives.clear()
    stepper.step([join])
    assert collectives[:2] == [2, 3] and stepper.caches._curve_read and list(stepper.runs) == [1]
