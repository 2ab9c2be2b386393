"""`cocodiff serve` on 2 spawned ranks, from its clients: the web page in Chromium (Playwright), the
official `openai` client, and `cocodiff bench serve`; all against one server."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import pytest
from conftest import patience
from PIL import Image

from cocodiff.cli import main

from live_server import LiveServer, start_server

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
PAGE_STEPS = 10
"""Steps of the page's request: enough for several progress polls (every 100 ms) to see it run."""


@pytest.fixture(scope="module")
def server():
    server = start_server("--steps", "2", "--batch-window-ms", "50")
    yield server
    server.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (Debian: apt-get install chromium)")
def test_the_page_shows_progress_and_the_image_in_chromium(server: LiveServer):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page()
            answers = []  # every progress answer the page got (read once it is done: no waiting in a handler)
            page.on("response", lambda r: answers.append(r) if "/v1/progress/" in r.url and r.ok else None)
            page.goto(server.url)
            page.fill("#prompt", "a red circle")
            page.fill("#size", "64x64")
            page.fill("#seed", "3")
            page.fill("#steps", str(PAGE_STEPS))
            page.click("#generate")
            page.wait_for_selector("#image:not([hidden])", timeout=patience(120) * 1000)
            size = page.eval_on_selector("#image", "img => [img.naturalWidth, img.naturalHeight]")
            bar = page.eval_on_selector("#bar", "bar => [bar.value, bar.max]")
            status = page.inner_text("#status")
            seen = [answer.json() for answer in answers]
        finally:
            browser.close()
    assert size == [64, 64]
    assert status.startswith("done")
    assert bar == [PAGE_STEPS, PAGE_STEPS], bar  # the bar ends full, its length the request's steps
    assert seen and all(s["steps"] == PAGE_STEPS for s in seen), seen
    steps = [s["step"] for s in seen]
    assert steps == sorted(steps) and len(set(steps)) >= 2, seen  # it advanced while the page watched
    assert any(s["state"] in ("queued", "running") for s in seen), seen


@pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (Debian: apt-get install chromium)")
@pytest.mark.parametrize(("model", "shown", "route"), [("tiny-flux2", "#image", "/v1/images/edits"),
                                                       ("tiny-wan21-flf2v", "#video", "/v1/videos")])
def test_the_page_uploads_the_images_a_model_takes(tmp_path, model, shown, route):
    """An edit model's references (two files) and an image-to-video model's first frame (and Wan 2.1
    FLF2V's last, which it refuses a job without) go from the page's file fields to the route
    /health names, as multipart form data, and the answer shows."""
    from playwright.sync_api import sync_playwright

    paths = []
    for n, colour in enumerate(((200, 40, 30), (20, 60, 220))):
        paths.append(tmp_path / f"ref{n}.png")
        Image.new("RGB", (64, 64), colour).save(paths[-1])
    paths = paths if model == "tiny-flux2" else paths[:1]
    live = start_server("--model", model, "--steps", "2", *(["--frames", "5"] if shown == "#video" else []))
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM)
            try:
                page = browser.new_page()
                sent = []
                page.on("request", lambda r: sent.append((r.method, r.url, r.headers.get("content-type", "")))
                        if r.method == "POST" else None)
                page.goto(live.url)
                page.wait_for_selector("#images", state="visible", timeout=patience(10) * 1000)
                page.fill("#prompt", "a red circle")
                page.fill("#size", "64x64")
                page.fill("#seed", "3")
                if shown == "#video":
                    page.fill("#frames", "5")
                page.set_input_files("#images", [str(p) for p in paths])
                if model == "tiny-wan21-flf2v":
                    page.set_input_files("#last-frame", str(tmp_path / "ref1.png"))
                page.click("#generate")
                page.wait_for_selector(f"{shown}:not([hidden])", timeout=patience(120) * 1000)
                status = page.inner_text("#status")
            finally:
                browser.close()
    finally:
        live.stop()
    assert status.startswith("done"), status
    posted = [(method, url.split("://", 1)[1].split("/", 1)[1], kind) for method, url, kind in sent]
    assert any(url == route.lstrip("/") and kind.startswith("multipart/form-data") for _, url, kind in posted), posted


def test_the_official_openai_client_gets_its_image(server: LiveServer):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="not-checked", max_retries=0, timeout=patience(120))
    result = client.images.generate(model="tiny-shapes", prompt="a blue square", size="64x64",
                                    response_format="b64_json")
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.format == "PNG" and image.size == (64, 64)

    # the pipeline calls that made it sent bytes between the two ranks (one node: all intra-node)
    status, text = server.get("/metrics")
    intra = re.search(r'cocodiff_comm_bytes_total\{link="intra_node"\} (\S+)', text.decode())
    assert status == 200 and intra and float(intra.group(1)) > 0
    assert 'cocodiff_comm_bytes_total{link="inter_node"} 0.0' in text.decode()


def test_bench_serve_loses_nothing(server: LiveServer, tmp_path):
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--url", server.url, "--concurrency", "1,3", "--duration", "3", "--size", "64x64",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["server"] == {"model": "tiny-shapes", "plan": "u2", "ranks": 2}  # what answered
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert {"concurrency", "images_per_s", "p50_ms", "p99_ms", "errors", "lost"} <= set(level)
        assert level["lost"] == 0 and level["errors"] == 0 and level["ok"] >= 1, level
        assert level["images_per_s"] > 0 and sum(level["batch_sizes"].values()) >= 1
