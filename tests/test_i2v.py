"""Image-to-video (`--image` on an image-to-video model; POST /v1/videos with an `input_reference`):
Wan 2.2 TI2V's layout (`tiny-wan-ti2v`) and LTX-Video's (`tiny-ltx-i2v`), the image encoded as the
first latent frame whose tokens carry their own timestep; Wan 2.2 A14B's (`tiny-wan22-i2v`: two
experts), Wan 2.1's (`tiny-wan21-i2v`: CLIP image features as more cross-attention context) and
HunyuanVideo 1.5's (`tiny-hunyuanvideo15-i2v`: SigLIP image features as more context tokens, its
size a bucket of its target area), the image's latents beside the noise; each split with the
sequence under every plan and exact against one process;
what it cannot take is one line (or a 400) before any rank. The matrix runs every column on it."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from conftest import patience
from fastapi.testclient import TestClient
from PIL import Image
from test_cli import cocodiff, exit_status

from cocodiff.serve.api import create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Scheduler

I2V = {"width": 64, "height": 64, "steps": 2, "model": "tiny-wan-ti2v", "video": True, "frames": 5,
       "pipeline": "WanImageToVideoPipeline"}


def _png(colour: tuple[int, int, int], size: int = 64) -> bytes:
    buffer = io.BytesIO()
    picture = Image.new("RGB", (size, size), colour)
    picture.paste((255, 255, 255), (size // 4, size // 4, size // 2, size // 2))
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    path = tmp_path_factory.mktemp("i2v") / "first.png"
    path.write_bytes(_png((200, 40, 30)))
    return path


@pytest.mark.parametrize(("model", "plan", "nproc"), [("tiny-wan-ti2v", "u2", 2), ("tiny-wan-ti2v", "c2u2", 4),
                                                    ("tiny-ltx-i2v", "c2u2", 4), ("tiny-wan22-i2v", "c2u2", 4),
                                                    ("tiny-wan21-i2v", "u2r2", 4), ("tiny-hunyuanvideo15-i2v", "c2u2", 4)])
def test_verify_animates_the_image_exactly_under_ulysses_and_cfg_groups(tmp_path, frame, model, plan, nproc):
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", model, "--image", str(frame), "--nproc", str(nproc), "--plan", plan,
                   "--steps", "2", "--frames", "5", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert "first frame" in run.stdout and "image-to-video" in run.stdout
    result = json.loads(figures.read_text())
    assert result["ok"] and result["plan"].startswith(plan) and result["frames"] == 5
    assert result["image_input"]["task"] == "i2v" and result["image_input"]["image"] == str(frame)
    assert result["bytes_by_axis"]["ulysses"]["intra_node"] > 0  # the tokens (and their timesteps) were split


@pytest.mark.parametrize(("model", "plan", "batch"), [("tiny-wan21-flf2v", "b2u1", 2), ("tiny-wan22-i2v", "u2", 1)])
def test_wan_animates_from_a_first_to_a_last_frame_exactly(tmp_path, frame, model, plan, batch):
    """`--last-frame`: the last frame's latents beside the noise at the clip's end (and, Wan 2.1
    FLF2V, its CLIP features after the first's: two rows per item, split with the batch)."""
    last, figures = tmp_path / "last.png", tmp_path / "v.json"
    last.write_bytes(_png((20, 40, 220)))
    run = cocodiff("verify", "--model", model, "--image", str(frame), "--last-frame", str(last), "--nproc", "2",
                   "--plan", plan, "--batch", str(batch), "--steps", "2", "--frames", "9", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert "last frame" in run.stdout
    result = json.loads(figures.read_text())
    assert result["ok"] and result["plan"].startswith(plan) and result["image_input"]["last_frame"] == str(last)
    assert result["conditioned_frames"] == [0, 2]  # 9 frames: 3 latent frames, the first and the last given


def test_every_image_to_video_pipeline_takes_the_last_frame_its_preset_says():
    """What a loaded pipeline says of a last frame (a checkpoint's check, on its ranks) is what its
    preset declares before any rank; and a last frame given is the clip's: another, another clip."""
    from cocodiff.engine.families.pipelines import ANIMATE_PIPELINES, last_frame_use
    from cocodiff.models.presets import PRESETS, load_pipeline, refusal
    from cocodiff.serve.calls import Call, run_call

    for model, preset in PRESETS.items():
        if preset.pipeline not in ANIMATE_PIPELINES:
            continue
        pipe = load_pipeline(model)[0]
        use = last_frame_use(pipe)
        assert use == preset.last_frame or f"{model}: {use}" == refusal(model, {"last_frame"}), (model, use)
    pipe = load_pipeline("tiny-wan21-flf2v")[0]
    pipe.set_progress_bar_config(disable=True)
    clips = [run_call(pipe, Call(prompts=["a red circle"], seeds=[1], width=64, height=64, steps=2, guidance=None,
                                 frames=5, references=(_png((200, 40, 30)), _png(colour))))[0]
             for colour in ((200, 40, 30), (20, 40, 220))]
    assert np.abs(clips[0][-1] - clips[1][-1]).max() > 1e-3


@pytest.mark.parametrize("model", ["tiny-wan-ti2v", "tiny-ltx-i2v", "tiny-wan22-i2v", "tiny-wan21-i2v", "tiny-hunyuanvideo15-i2v"])
def test_the_clip_starts_from_its_image(model):
    """Two first frames, the same prompt and seed: two clips (the image is in the latents)."""
    from cocodiff.models.presets import load_pipeline
    from cocodiff.serve.calls import Call, run_call

    pipe = load_pipeline(model)[0]
    pipe.set_progress_bar_config(disable=True)
    clips = [run_call(pipe, Call(prompts=["a red circle"], seeds=[1], width=64, height=64, steps=2, guidance=None,
                                 frames=5, references=(_png(colour),)))[0] for colour in ((200, 40, 30), (20, 40, 220))]
    assert clips[0].shape == (5, 64, 64, 3) and np.abs(clips[0] - clips[1]).max() > 1e-3  # (rounding: 1e-6)


@pytest.mark.parametrize(("model", "extra", "message"), [
    ("tiny-wan-ti2v", [], "tiny-wan-ti2v animates one image: give it as --image"),
    ("tiny-wan-ti2v", ["--image", "{frame}", "--mask", "{frame}"], "tiny-wan-ti2v animates one image"),
    ("tiny-wan-ti2v", ["--image", "{frame}", "--image", "{frame}"], "tiny-wan-ti2v animates one image"),
    ("tiny-ltx-i2v", ["--image", "{frame}", "--strength", "0.5"], "tiny-ltx-i2v animates one image"),
    ("tiny-wan", ["--image", "{frame}"], "tiny-wan is a text-to-video model here; image input is for image models and "
                                         "image-to-video ones (WanImageToVideoPipeline, LTXImageToVideoPipeline, "
                                         "HunyuanVideo15ImageToVideoPipeline, LTX2ImageToVideoPipeline, MiniMaxH3KeyframePipeline)"),
    ("tiny-wan21-flf2v", ["--image", "{frame}"], "tiny-wan21-flf2v animates from a first to a last frame (Wan 2.1 "
                                                 "FLF2V): give both, --image and --last-frame"),
    ("tiny-wan21-i2v", ["--image", "{frame}", "--last-frame", "{frame}"],
     "--last-frame: tiny-wan21-i2v: Wan 2.1 I2V's image embedder takes one frame's CLIP features"),
    ("tiny-wan-ti2v", ["--image", "{frame}", "--last-frame", "{frame}"], "Wan 2.2 TI2V conditions on its first frame alone"),
    ("tiny-ltx-i2v", ["--image", "{frame}", "--last-frame", "{frame}"],
     "LTXImageToVideoPipeline animates from a first frame alone"),
    ("tiny-flux", ["--last-frame", "{frame}"], "--last-frame: tiny-flux: makes images; --last-frame is the last frame"),
    ("tiny-hunyuanvideo15-i2v", ["--image", "{frame}", "--height", "64", "--width", "320"],
     "--height 64 --width 320: tiny-hunyuanvideo15-i2v makes clips in its buckets (sides in multiples of 16 pixels, at "
     "most 4:1), and 320 wide x 64 high is none of them"),
])
def test_what_cannot_animate_is_one_line_before_any_rank(capsys, no_ranks, frame, model, extra, message):
    argv = ["verify", "--model", model, "--nproc", "2", *(a.format(frame=frame) for a in extra)]
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_hunyuanvideo15_makes_the_size_asked_with_the_image_features_as_context():
    """Its pipeline takes no size: the bucket of its target area nearest the image's aspect. A 64 x 64
    image asked for 128 wide x 64 high gives that clip (the image cropped to it), with the SigLIP
    features of the image in the transformer's context; a size no bucket has is a 400."""
    from cocodiff.models.presets import load_pipeline
    from cocodiff.serve.calls import Call, run_call
    from cocodiff.serve.protocol import ApiError

    pipe = load_pipeline("tiny-hunyuanvideo15-i2v")[0]
    pipe.set_progress_bar_config(disable=True)
    features = []
    pipe.transformer.register_forward_pre_hook(lambda _m, _a, kwargs: features.append(kwargs["image_embeds"]),
                                               with_kwargs=True)
    clip = run_call(pipe, Call(prompts=["a red circle"], seeds=[1], width=128, height=64, steps=1, guidance=None,
                               frames=5, references=(_png((200, 40, 30)),)))
    assert clip.shape == (1, 5, 64, 128, 3)
    assert features[0].shape == (1, 16, 16) and features[0].abs().min() > 0  # zeros would be text-to-video
    limits = Limits(**{**I2V, "model": "tiny-hunyuanvideo15-i2v", "pipeline": "HunyuanVideo15ImageToVideoPipeline"})
    assert limits.size("128x64") == (128, 64)
    with pytest.raises(ApiError, match="320 wide x 64 high is none of them"):
        limits.size("320x64")


def test_a_video_job_takes_its_first_frame_as_the_input_reference():
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    with TestClient(create_app(scheduler, Limits(**I2V))) as client:
        response = client.post("/v1/videos", data={"prompt": "a red circle", "seed": "1"},
                               files={"input_reference": ("first.png", _png((200, 40, 30)), "image/png")})
        assert response.status_code == 200, response.text
        (pending,) = scheduler._queue
        picture = Image.open(io.BytesIO(pending.work.references[0]))
        assert picture.size == (64, 64) and picture.getpixel((0, 0)) == (200, 40, 30)
        for body, says in ((dict(json={"prompt": "x"}), "tiny-wan-ti2v animates an image: send it as the input_reference"),
                           (dict(data={"prompt": "x"}, files={"input_reference": ("a.txt", b"text", "text/plain")}),
                            "input_reference (a.txt) is not a readable image")):
            response = client.post("/v1/videos", **body)
            assert response.status_code == 400 and says in response.json()["error"]["message"], response.text
    scheduler.stop()
    text_only = Limits(**{**I2V, "model": "tiny-wan", "pipeline": "WanPipeline"})
    with TestClient(create_app(Scheduler(max_queue=1, max_batch=1, window_s=0), text_only)) as client:
        response = client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", _png((1, 2, 3)))})
        assert "tiny-wan makes videos from text only" in response.json()["error"]["message"], response.text


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-wan-ti2v", "tiny-ltx-i2v"])
def test_two_ranks_serve_image_to_video_jobs(model):
    """2 ranks: /v1/videos/sync with an input_reference answers an MP4 of the frames asked; another
    first frame, another clip."""
    import httpx
    from live_server import start_server

    server = start_server("--model", model, "--steps", "2", "--max-frames", "9")
    try:
        def ask(colour):
            answer = httpx.post(f"{server.url}/v1/videos/sync", data={"prompt": "a red circle", "seed": "1",
                                                                       "num_frames": "5", "size": "64x64"},
                                files={"input_reference": ("f.png", _png(colour), "image/png")}, timeout=patience(120))
            assert answer.status_code == 200 and answer.content[4:8] == b"ftyp", answer.text[:200]
            return answer.content

        red, blue = ask((200, 40, 30)), ask((20, 40, 220))
        assert red != blue and ask((200, 40, 30)) == red  # its own image, and the same image: the same clip
    finally:
        out, err = server.stop()
    assert server.process.returncode == 0 and "Traceback" not in err, (out, err)


def test_a_video_job_takes_a_last_frame_where_the_model_takes_one():
    """The `last_frame` file joins the input_reference as the clip's last frame; a first-last-frame
    model refuses a job without one, any other image-to-video model a job with one (400s naming why)."""
    from cocodiff.serve.ranks import _last_frame

    flf2v = Limits(**{**I2V, "model": "tiny-wan21-flf2v", "last_frame": _last_frame("tiny-wan21-flf2v")})
    scheduler = Scheduler(max_queue=4, max_batch=4, window_s=0)
    first, last = _png((200, 40, 30)), _png((20, 40, 220))
    with TestClient(create_app(scheduler, flf2v)) as client:
        response = client.post("/v1/videos", data={"prompt": "a red circle"},
                               files={"input_reference": ("a.png", first), "last_frame": ("b.png", last)})
        assert response.status_code == 200, response.text
        (pending,) = scheduler._queue
        assert [Image.open(io.BytesIO(png)).getpixel((0, 0)) for png in pending.work.references] == [(200, 40, 30),
                                                                                                    (20, 40, 220)]
        response = client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", first)})
        assert response.status_code == 400, response.text
        assert "tiny-wan21-flf2v animates from a first to a last frame" in response.json()["error"]["message"]
    scheduler.stop()
    for model, says in (("tiny-wan-ti2v", "Wan 2.2 TI2V conditions on its first frame alone"),
                        ("tiny-ltx-i2v", "LTXImageToVideoPipeline animates from a first frame alone")):
        limits = Limits(**{**I2V, "model": model, "last_frame": _last_frame(model)})
        with TestClient(create_app(Scheduler(max_queue=1, max_batch=1, window_s=0), limits)) as client:
            response = client.post("/v1/videos", data={"prompt": "x"},
                                   files={"input_reference": ("a.png", first), "last_frame": ("b.png", last)})
            assert response.status_code == 400 and says in response.json()["error"]["message"], response.text
