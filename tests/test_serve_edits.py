"""POST /v1/images/edits (serve/edits.py): OpenAI's image edits API on an edit pipeline, checked with
the official `openai` client; what it cannot take is answered 400 (413, 415) before the queue."""

from __future__ import annotations

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import patience
from fastapi.testclient import TestClient
from PIL import Image

from cocodiff.cli import build_parser
from cocodiff.models.presets import load_pipeline, task_variant
from cocodiff.run.pipeline import run_pipeline
from cocodiff.run.spec import resolve_spec
from cocodiff.serve.api import create_app
from cocodiff.serve.calls import Call, answers, run_call
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Scheduler

from live_server import app_in_thread, start_server
from test_serve import _drain

EDITS = "/v1/images/edits"
FLUX2 = {"width": 64, "height": 64, "steps": 2, "size_multiple": 16, "max_n": 4, "model": "tiny-flux2",
         "pipeline": "Flux2Pipeline"}


def png(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def flat_png(height: int, width: int) -> bytes:
    """One colour: a few bytes whatever the size."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.float32) / 255


@pytest.fixture
def refusing():
    """A client of an edit app whose queue a fake executor answers (nothing should reach it)."""
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    drainer = _drain(scheduler)
    with TestClient(create_app(scheduler, Limits(**FLUX2, max_upload_bytes=200_000))) as client:
        yield client
    scheduler.stop()
    drainer.join(patience(10))


@pytest.mark.parametrize(("files", "data", "status", "message"), [
    ({"image": ("a.txt", b"not an image", "text/plain")}, {}, 400, "image 0 (a.txt) is not a readable image"),
    ({}, {}, 400, "image: give one or more reference images as files"),
    ({"image": ("a.png", png(32, 32), "image/png")}, {}, 400,
     "image 0: Image too small: 32×32. Both dimensions must be at least 64px (Flux2Pipeline)"),
    ({"image": ("a.png", png(64, 64), "image/png"), "mask": ("m.png", png(64, 64), "image/png")}, {}, 400,
     "mask: Flux2Pipeline edits from reference images: it takes no mask"),
    ({"image": ("a.png", flat_png(64, 4100), "image/png")}, {}, 400, "image 0 is 4100x64: each side at most 2048 pixels"),
    ({"image": ("a.png", png(64, 64), "image/png")}, {"n": "9"}, 400, "n=9 is more than this server's 4"),
    ({"image": ("a.png", png(64, 64), "image/png")}, {"size": "65x64"}, 400, "each side must be a multiple of 16"),
    ({"image": ("a.png", png(64, 64), "image/png")}, {"prompt": ""}, 400, "prompt: String should have at least 1 character"),
    ({"image": ("a.png", png(300, 300, 1), "image/png")}, {}, 413, "more than this server's --max-upload-bytes 200000"),
])
def test_a_bad_upload_is_answered_before_the_queue(refusing, files, data, status, message):
    response = refusing.post(EDITS, files=files, data={"prompt": "make it red", **data})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_more_references_than_the_pipeline_takes_and_no_edit_pipeline_are_400(refusing):
    eleven = [("image[]", (f"{n}.png", png(64, 64, n), "image/png")) for n in range(11)]
    response = refusing.post(EDITS, files=eleven, data={"prompt": "x"})
    assert response.status_code == 400 and "11 images: Flux2Pipeline takes at most 10 reference images" in response.text
    json_body = refusing.post(EDITS, json={"prompt": "x"})
    assert json_body.status_code == 415 and "multipart/form-data" in json_body.text
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    with TestClient(create_app(scheduler, Limits(**{**FLUX2, "model": "tiny-flux", "pipeline": "FluxPipeline"}))) as plain:
        response = plain.post(EDITS, files={"image": ("a.png", png(64, 64), "image/png")}, data={"prompt": "x"})
    assert response.status_code == 400 and "tiny-flux does not edit from reference images (FluxPipeline)" in response.text


def test_qwen_image_edit_takes_references_only_on_edits_and_one_picture_per_call():
    """Qwen-Image-Edit makes nothing from text alone, and one picture per call (its pipeline refuses
    a batch): generations and n > 1 are 400 before the queue, with the reason; 4 references too."""
    from cocodiff.models.presets import refusal

    one_per_call = refusal("tiny-qwen-image-edit", {"batch"})
    assert "QwenImageEditPlusPipeline makes one picture per call" in one_per_call
    limits = Limits(**{**FLUX2, "model": "tiny-qwen-image-edit", "pipeline": "QwenImageEditPlusPipeline",
                       "max_n": 1, "one_per_call": one_per_call})
    scheduler = Scheduler(max_queue=4, max_batch=1, window_s=0)
    drainer = _drain(scheduler)
    image = ("image[]", ("a.png", png(64, 64), "image/png"))
    with TestClient(create_app(scheduler, limits)) as client:
        text = client.post("/v1/images/generations", json={"prompt": "x"})
        two = client.post(EDITS, files=[image], data={"prompt": "x", "n": "2"})
        four = client.post(EDITS, files=[image] * 4, data={"prompt": "x"})
    scheduler.stop()
    drainer.join(patience(10))
    assert text.status_code == 400 and ("tiny-qwen-image-edit edits reference images (QwenImageEditPlusPipeline): "
                                        "send them to POST /v1/images/edits") in text.text
    assert two.status_code == 400 and f"n=2: {one_per_call}" in two.json()["error"]["message"]
    assert four.status_code == 400 and "4 images: QwenImageEditPlusPipeline takes at most 3 reference images" in four.text


def _ranks_in_thread(scheduler: Scheduler, pipe) -> threading.Thread:
    """One process's rank loop: each batch through the real pipeline (`run_call`), as serve's per-request path."""
    def loop() -> None:
        while not scheduler.stopped:
            if (batch := scheduler.next_batch(0.05)) is not None:
                scheduler.execute(batch, lambda b: answers(b, run_call(pipe, Call.of(b))))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_the_openai_client_edits_with_two_references_as_generate_does(tmp_path):
    """`images.edit` with two images (sent as `image[]`) answers what `generate --image A --image B`
    makes with the same seed; a third reference gives another picture."""
    from openai import OpenAI

    references = [tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"]
    for n, path in enumerate(references):
        path.write_bytes(png(64, 64 if n != 1 else 96, n))
    pipe, encoder = load_pipeline("tiny-flux2")
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    ranks = _ranks_in_thread(scheduler, pipe)
    try:
        with app_in_thread(create_app(scheduler, Limits(**FLUX2))) as port:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=patience(60))

            def edit(paths):
                return client.images.edit(image=[(p.name, p.read_bytes(), "image/png") for p in paths],
                                          prompt="a red circle", response_format="b64_json", extra_body={"seed": 5, "steps": 2})

            two, three = edit(references[:2]), edit(references)
    finally:
        scheduler.stop()
        ranks.join(patience(30))
    argv = ["generate", "--model", "tiny-flux2", "--prompt", "a red circle", "--seed", "5", "--steps", "2",
            "--nproc", "1", "--image", str(references[0]), "--image", str(references[1])]
    spec = resolve_spec(build_parser().parse_args(argv))
    expected = run_pipeline(spec, pipe, encoder, None)["image"]
    served = decoded(two.data[0].b64_json)
    assert served.shape == (64, 64, 3)  # the first reference's size ("auto")
    assert np.abs(served - expected).max() <= 1 / 255 + 1e-6  # one PNG rounding
    assert np.abs(decoded(three.data[0].b64_json) - served).max() > 2 / 255


def test_the_first_qwen_image_edit_answers_n_pictures_in_one_call_as_generate_makes_each(tmp_path):
    """QwenImageEditPipeline takes a batch (2509's does not): `images.edit` with n=2 is one pipeline
    call whose pictures are what `generate --image A --seed S` makes for S = seed and seed + 1; a
    generation is 400, naming where its one reference goes."""
    from openai import OpenAI

    image = tmp_path / "a.png"
    image.write_bytes(png(64, 64))
    pipe, encoder = load_pipeline("tiny-qwen-image-edit-v1")
    scheduler = Scheduler(max_queue=4, max_batch=2, window_s=0)
    calls = []
    run = lambda b: (calls.append(len(b.seeds)), answers(b, run_call(pipe, Call.of(b))))[1]  # noqa: E731

    def loop() -> None:
        while not scheduler.stopped:
            if (batch := scheduler.next_batch(0.05)) is not None:
                scheduler.execute(batch, run)
    ranks = threading.Thread(target=loop, daemon=True)
    ranks.start()
    limits = {**FLUX2, "model": "tiny-qwen-image-edit-v1", "pipeline": "QwenImageEditPipeline", "max_n": 2}
    try:
        with app_in_thread(create_app(scheduler, Limits(**limits))) as port:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=patience(60))
            edited = client.images.edit(image=("a.png", image.read_bytes(), "image/png"), prompt="a red circle", n=2,
                                        response_format="b64_json", extra_body={"seed": 5, "steps": 1})
            import httpx

            text = httpx.post(f"http://127.0.0.1:{port}/v1/images/generations", json={"prompt": "x"})
    finally:
        scheduler.stop()
        ranks.join(patience(30))
    assert calls == [2] and len(edited.data) == 2
    for seed, served in zip((5, 6), edited.data):
        argv = ["generate", "--model", "tiny-qwen-image-edit-v1", "--prompt", "a red circle", "--seed", str(seed),
                "--steps", "1", "--nproc", "1", "--image", str(image)]
        expected = run_pipeline(resolve_spec(build_parser().parse_args(argv)), pipe, encoder, None)["image"]
        assert np.abs(decoded(served.b64_json) - expected).max() <= 1 / 255 + 1e-6  # one PNG rounding
    assert text.status_code == 400 and text.json()["error"]["message"] == (
        "tiny-qwen-image-edit-v1 edits a reference image (QwenImageEditPipeline): send it to POST /v1/images/edits")


def test_the_openai_client_edits_with_a_mask_as_generate_inpaints(tmp_path):
    """Qwen-Image-Edit with OpenAI's mask (transparent where the image is edited): `images.edit`
    answers what `generate --image A --mask M` makes (M white where the alpha is 0), through the edit
    inpaint pipeline; a mask without alpha, of another size, or over two images is 400."""
    from openai import OpenAI

    image = tmp_path / "a.png"
    image.write_bytes(png(64, 64))
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[:32, 32:] = 0  # the top right quarter is edited
    rgba, grey = io.BytesIO(), tmp_path / "mask.png"
    Image.fromarray(np.dstack([np.zeros((64, 64, 3), np.uint8), alpha]), "RGBA").save(rgba, format="PNG")
    Image.fromarray(255 - alpha).save(grey)
    pipe, encoder = load_pipeline("tiny-qwen-image-edit")
    scheduler = Scheduler(max_queue=4, max_batch=1, window_s=0)
    ranks = _ranks_in_thread(scheduler, pipe)
    qwen = {**FLUX2, "model": "tiny-qwen-image-edit", "pipeline": "QwenImageEditPlusPipeline", "max_n": 1}
    try:
        with app_in_thread(create_app(scheduler, Limits(**qwen))) as port:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=patience(60))
            edited = client.images.edit(image=("a.png", image.read_bytes(), "image/png"), mask=("m.png", rgba.getvalue(), "image/png"),
                                        prompt="a red circle", response_format="b64_json", extra_body={"seed": 5, "steps": 1})
            import httpx

            refused = [httpx.post(f"http://127.0.0.1:{port}{EDITS}", data={"prompt": "x"}, files=files) for files in (
                [("image", ("a.png", png(64, 64), "image/png")), ("mask", ("m.png", png(64, 64), "image/png"))],
                [("image", ("a.png", png(64, 64), "image/png")), ("mask", ("m.png", rgba.getvalue(), "image/png")),
                 ("image", ("b.png", png(64, 64, 1), "image/png"))],
                [("image", ("a.png", png(64, 96), "image/png")), ("mask", ("m.png", rgba.getvalue(), "image/png"))])]
    finally:
        scheduler.stop()
        ranks.join(patience(30))
    argv = ["generate", "--model", "tiny-qwen-image-edit", "--prompt", "a red circle", "--seed", "5", "--steps", "1",
            "--nproc", "1", "--image", str(image), "--mask", str(grey)]
    spec = resolve_spec(build_parser().parse_args(argv))
    expected = run_pipeline(spec, task_variant(pipe, "inpaint"), encoder, None)
    assert expected["reference_tokens"] == 4096  # the image is the reference too
    served = decoded(edited.data[0].b64_json)
    assert np.abs(served - expected["image"]).max() <= 1 / 255 + 1e-6  # one PNG rounding
    messages = [(r.status_code, r.json()["error"]["message"]) for r in refused]
    assert messages[0] == (400, "mask (m.png) has no alpha channel: its fully transparent pixels are where the image is edited")
    assert messages[1] == (400, "mask: QwenImageEditInpaintPipeline repaints one image where the mask is transparent, "
                                "and 2 were given")
    assert messages[2] == (400, "mask is 64x64 but image 0 is 96x64: they must be the same size")


@pytest.mark.slow
def test_edits_and_generations_mixed_on_two_ranks_lose_nothing():
    """A served FLUX.2 on 2 ranks: 16 requests at once, edits (one or two references) and
    generations, each answered with its image; an edit equals the same edit asked alone."""
    import httpx

    server = start_server("--model", "tiny-flux2", "--steps", "2", "--batch-window-ms", "20")
    try:
        def ask(n: int) -> tuple[int, str]:
            data = {"prompt": f"shape {n % 3}", "seed": str(n % 4)}
            with httpx.Client(base_url=server.url, timeout=patience(300)) as http:
                if n % 2:
                    files = [("image[]", (f"{k}.png", png(64, 64, k), "image/png")) for k in range(1 + n % 4 // 2)]
                    response = http.post(EDITS, files=files, data=data)
                else:
                    response = http.post("/v1/images/generations", json={**data, "seed": n % 4, "size": "64x64"})
            return response.status_code, response.json()["data"][0]["b64_json"] if response.status_code == 200 else response.text

        with ThreadPoolExecutor(16) as pool:
            answered = list(pool.map(ask, range(16)))
        assert [status for status, _ in answered] == [200] * 16, answered
        again = ask(3)
        assert np.abs(decoded(again[1]) - decoded(answered[3][1])).max() == 0
    finally:
        server.stop()
