"""LoRA per request in `serve` (`--lora-dir`, a request's `lora` field): adapters loaded unfused on
every rank, turned on per call (or per step-level batch), equal to `generate --lora` with the same
adapter; requests of different adapter sets never share a transformer call; bad choices are 400
before the queue."""

from __future__ import annotations

import base64
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import patience
from fastapi.testclient import TestClient
from PIL import Image

from cocodiff.models.lora import Adapter, AdapterCache, apply_adapters, make_adapter, use_adapters
from cocodiff.models.presets import load_pipeline
from cocodiff.serve.api import create_app
from cocodiff.serve.calls import Call, run_call
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Scheduler
from cocodiff.serve.stepper import Join, JoinsFailed, Stepper

from live_server import start_server
from test_serve import _drain

RUNS_LONG = 1


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters of tiny-shapes' transformer in a --lora-dir: a folder and a file."""
    folder = tmp_path_factory.mktemp("loras")
    make_adapter(load_pipeline("tiny-shapes")[0], folder / "style", seed=1, std=0.05)
    made = make_adapter(load_pipeline("tiny-shapes")[0], folder / "made", seed=2, std=0.05)
    made.rename(folder / "other.safetensors")
    (folder / "made").rmdir()
    return folder


def _fused(adapters, scale: float, name: str = "style") -> np.ndarray:
    """`generate --lora DIR/NAME:SCALE`'s picture, one process (scale 0: none)."""
    pipe = load_pipeline("tiny-shapes")[0]
    pipe.set_progress_bar_config(disable=True)
    path = adapters / name if (adapters / name).is_dir() else adapters / f"{name}.safetensors"
    apply_adapters(pipe, (Adapter(str(path), scale),))
    return run_call(pipe, Call(prompts=["a red circle"], seeds=[3], width=64, height=64, steps=2, guidance=None))[0]


def test_a_call_and_a_step_level_batch_turn_on_their_own_adapters(adapters):
    """Unfused and turned on per call (the per-request path) or per batch (the stepper), an adapter
    gives `generate --lora`'s picture; none turned on gives the base model's, bit for bit."""
    pipe = load_pipeline("tiny-shapes")[0]
    pipe.set_progress_bar_config(disable=True)
    base = run_call(pipe, Call(prompts=["a red circle"], seeds=[3], width=64, height=64, steps=2, guidance=None))[0]
    AdapterCache(pipe, {"style": str(adapters / "style"), "other": str(adapters / "other.safetensors")}, 8).start()
    call = dict(prompts=["a red circle"], seeds=[3], width=64, height=64, steps=2, guidance=None)
    styled = run_call(pipe, Call(**call, lora=(("style", 0.8),)))[0]
    plain = run_call(pipe, Call(**call))[0]
    assert np.array_equal(plain, base)  # every adapter off
    fused = _fused(adapters, 0.8)
    assert np.abs(styled - fused).max() < 1e-4 and np.abs(styled - base).max() > 1e-2
    stepper = Stepper(pipe)
    done = {}
    for step in range(4):
        joins = [Join(prompt="a red circle", seeds=(3,), width=64, height=64, steps=2, guidance=None,
                      lora=(("style", 0.8),))] if step == 0 else []
        for request, index, image in stepper.step(joins):
            done[request, index] = image
    assert np.abs(done[0, 0] - fused).max() < 1e-4
    with pytest.raises(JoinsFailed, match="cannot join a running batch"):  # another adapter set: another call
        stepper.step([Join(prompt="a", seeds=(1,), width=64, height=64, steps=3, guidance=None)])
        stepper.step([Join(prompt="b", seeds=(2,), width=64, height=64, steps=3, guidance=None, lora=(("other", 1.0),))])


def test_at_most_max_loras_stay_loaded_the_least_recently_used_leaving_first(adapters, tmp_path):
    """Capacity 2, three adapters: a request's adapter that is not loaded takes the place of the
    least recently used one it does not need, and every picture is still `generate --lora`'s."""
    make_adapter(load_pipeline("tiny-shapes")[0], tmp_path / "third", seed=3, std=0.05)
    paths = {"style": str(adapters / "style"), "other": str(adapters / "other.safetensors"),
             "third": str(tmp_path / "third")}
    pipe = load_pipeline("tiny-shapes")[0]
    pipe.set_progress_bar_config(disable=True)
    loads, switches = [], []
    cache = AdapterCache(pipe, paths, 2, on_load=lambda name, _s: loads.append(name),
                         on_switch=switches.append).start()
    assert list(cache.loaded) == ["style", "third"] and cache.loads == 0  # each checked once; the last two kept
    call = dict(prompts=["a red circle"], seeds=[3], width=64, height=64, steps=2, guidance=None)

    def loaded() -> set[str]:
        return set(pipe.transformer.peft_config)

    other = run_call(pipe, Call(**call, lora=(("other", 0.8),)))[0]  # a miss: style was used least recently
    assert loads[-1:] == ["other"] and list(cache.loaded) == ["third", "other"] and loaded() == {"third", "other"}
    assert np.abs(other - _fused(adapters, 0.8, "other")).max() < 1e-4
    use_adapters(pipe, (("third", 1.0),))  # a hit
    assert len(loads) == 1 and list(cache.loaded) == ["other", "third"]
    styled = run_call(pipe, Call(**call, lora=(("other", 0.5), ("style", 0.8))))[0]  # style in, third out
    assert loads == ["other", "style"] and loaded() == {"other", "style"}
    fused = load_pipeline("tiny-shapes")[0]
    fused.set_progress_bar_config(disable=True)
    apply_adapters(fused, (Adapter(paths["other"], 0.5), Adapter(paths["style"], 0.8)))
    assert np.abs(styled - run_call(fused, Call(**call))[0]).max() < 1e-4
    assert [entry["loaded"] for entry in cache.listing()] == [True, True, False]  # other, style, third
    assert len(switches) == 3


def test_an_adapter_loaded_or_unloaded_mid_batch_leaves_the_batchs_adapters_on(adapters, tmp_path):
    """`/v1/loras` between two steps of a running batch (`AdapterCache.add` and `unload`, as every
    rank makes them): the batch's adapters stay turned on (loading turns the new one on in PEFT),
    the batch's own is never evicted, and an unloaded adapter's weights leave the transformer."""
    make_adapter(load_pipeline("tiny-shapes")[0], tmp_path / "third", seed=3, std=0.05)
    pipe = load_pipeline("tiny-shapes")[0]
    cache = AdapterCache(pipe, {"style": str(adapters / "style"), "other": str(adapters / "other.safetensors")}, 2).start()
    use_adapters(pipe, (("style", 0.8),))  # the running batch's
    cache.add("third", str(tmp_path / "third"), keep=("style",))  # evicts other, not style
    assert set(pipe.transformer.peft_config) == {"style", "third"} and cache.names() == ("style", "other", "third")
    assert pipe.get_active_adapters() == ["style"]
    cache.unload("third")
    assert set(pipe.transformer.peft_config) == {"style"} and pipe.get_active_adapters() == ["style"]
    assert [e["loaded"] for e in cache.listing()] == [False, True, False]  # other, style, third: still named


@pytest.mark.parametrize(("lora", "message"), [
    ([{"name": "style"}, {"name": "other"}], "lora: 2 adapters, and this server keeps at most 1 loaded (serve --max-loras)"),
    ([{"name": "nope"}], "lora: no adapter 'nope' on this server (it has: style, other)"),
    ([{"name": "style"}, {"name": "style", "scale": 0.5}], "lora: adapter 'style' named twice"),
    ([{"name": "style", "scale": 9}], "lora: style's scale 9 is out of range (-4 to 4)"),
    ([{"name": "style", "weight": 1}], "Extra inputs are not permitted"),
])
def test_a_bad_adapter_choice_is_400_before_the_queue(lora, message):
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    drainer = _drain(scheduler)
    limits = Limits(width=64, height=64, steps=2, model="tiny-shapes", loras=("style", "other"),
                    max_loras=1 if "max-loras" in message else 8)
    try:
        with TestClient(create_app(scheduler, limits)) as client:
            response = client.post("/v1/images/generations", json={"prompt": "a", "lora": lora})
            assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
            listed = client.get("/v1/loras").json()  # before the ranks load them: named, none loaded
            assert listed["data"] == [{"id": n, "object": "lora", "loaded": False} for n in ("other", "style")]
            without = Limits(width=64, height=64, steps=2, model="tiny-shapes")
        with TestClient(create_app(Scheduler(max_queue=1, max_batch=1, window_s=0), without)) as client:
            response = client.post("/v1/images/generations", json={"prompt": "a", "lora": [{"name": "style"}]})
            assert "this server loads no LoRA adapters (serve --lora-dir)" in response.json()["error"]["message"]
    finally:
        scheduler.stop()
        drainer.join(patience(10))


@pytest.mark.slow
def test_two_ranks_serve_each_request_its_adapters(adapters, request):
    """tiny-shapes on 2 ranks (step-level batching), one adapter loaded at a time: 16 requests sent
    at once over two adapters and none; each answer is its own picture (`generate --lora`'s with its
    adapter), none lost, though the ranks load and unload the adapters as the requests alternate
    (each rank choosing alike); /v1/loras and /metrics say so. Then an adapter put in --lora-dir is
    loaded by POST /v1/loras and unloaded by DELETE on every rank, and served as `generate --lora`."""
    request.addfinalizer(lambda: shutil.rmtree(adapters / "third", ignore_errors=True))  # put there below
    server = start_server("--lora-dir", str(adapters), "--steps", "2", "--max-batch", "4", "--max-loras", "1")
    choices = [[{"name": "style", "scale": 0.8}], None, [{"name": "other"}], [{"name": "style", "scale": 0.8}]] * 4
    try:
        def ask(lora):
            body = {"prompt": "a red circle", "size": "64x64", "seed": 3, **({"lora": lora} if lora else {})}
            answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=patience(120))
            assert answer.status_code == 200, answer.text
            data = base64.b64decode(answer.json()["data"][0]["b64_json"])
            return np.asarray(Image.open(io.BytesIO(data)), dtype=np.float32) / 255

        with ThreadPoolExecutor(16) as pool:
            pictures = list(pool.map(ask, choices))
        listed = httpx.get(f"{server.url}/v1/loras").json()
        assert listed["max_loaded"] == 1 and sum(entry["loaded"] for entry in listed["data"]) == 1, listed
        loads = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                 if line.startswith("cocodiff_lora_loads_total ")]
        assert loads and float(loads[0].split()[1]) >= 1, loads
        # An adapter put in --lora-dir after the start: loaded on every rank by POST /v1/loras, served,
        # unloaded by DELETE (and loaded again by the next request that names it).
        assert httpx.post(f"{server.url}/v1/loras", json={"name": "third"}).status_code == 404
        make_adapter(load_pipeline("tiny-shapes")[0], adapters / "third", seed=3, std=0.05)
        answer = httpx.post(f"{server.url}/v1/loras", json={"name": "third"}, timeout=patience(60))
        assert answer.status_code == 200 and answer.json() == {"id": "third", "object": "lora", "loaded": True}, answer.text
        listed = {e["id"]: e["loaded"] for e in httpx.get(f"{server.url}/v1/loras").json()["data"]}
        assert listed == {"other": False, "style": False, "third": True}, listed
        third = ask([{"name": "third", "scale": 0.8}])
        answer = httpx.delete(f"{server.url}/v1/loras/third", timeout=patience(60))
        assert answer.status_code == 200 and not answer.json()["loaded"], answer.text
        assert not any(e["loaded"] for e in httpx.get(f"{server.url}/v1/loras").json()["data"])
        again = ask([{"name": "third", "scale": 0.8}])
        for bad, status in ((lambda: httpx.delete(f"{server.url}/v1/loras/nope"), 404),
                            (lambda: httpx.post(f"{server.url}/v1/loras", json={"name": "../style"}), 400)):
            assert bad().status_code == status
    finally:
        server.stop()
    fused_third = _fused(adapters, 0.8, "third")
    assert np.abs(third - fused_third).max() <= 1.5 / 255 and np.abs(again - fused_third).max() <= 1.5 / 255
    expected = {"style": _fused(adapters, 0.8), None: _fused(adapters, 0.0), "other": _fused(adapters, 1.0, "other")}
    assert min(np.abs(expected[a] - expected[b]).max() for a, b in (("style", None), ("other", None))) > 4 / 255
    for choice, picture in zip(choices, pictures, strict=True):
        assert np.abs(picture - expected[choice[0]["name"] if choice else None]).max() <= 1.5 / 255, choice
    assert np.abs(fused_third - expected["style"]).max() > 4 / 255
