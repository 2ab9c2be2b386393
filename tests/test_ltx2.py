"""LTX-2 (`tiny-ltx2`, `tiny-ltx2-i2v`): a video stream and a stereo audio stream in one
transformer, both split over the ranks (engine/families/ltx2.py), the soundtrack held against one
process as the frames are and written into the MP4 beside them."""

from __future__ import annotations

import json
import subprocess

import av
import command
import pytest
from conftest import RANK_TIMEOUT_S

from cocodiff.output.video import read_audio, read_frames


def cocodiff(*args: str) -> subprocess.CompletedProcess:
    return command.cocodiff(*args, timeout=RANK_TIMEOUT_S)


def _verified(tmp_path, *args: str) -> dict:
    figures = tmp_path / "verify.json"
    run = cocodiff("verify", *args, "--steps", "2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(figures.read_text())


def test_ltx2_is_exact_with_its_soundtrack_and_writes_it_into_the_mp4(tmp_path):
    """On 2 ranks the clip and its soundtrack are one process's (the audio tokens split too: the
    class's own plan leaves them whole, which the engine refuses); `generate` writes the stereo
    waveform as the MP4's AAC stream at the vocoder's rate, the frames at the pipeline's 24 fps."""
    result = _verified(tmp_path, "--model", "tiny-ltx2", "--nproc", "2")
    assert result["ok"] is True and result["plan"] == "u2"
    assert result["audio"]["scale"] > 0 and result["audio"]["max_rel_diff"] <= result["tolerance"]
    out, figures = tmp_path / "clip.mp4", tmp_path / "generate.json"
    run = cocodiff("generate", "--model", "tiny-ltx2", "--steps", "2", "--nproc", "1", "--out", str(out), "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(figures.read_text())["audio"] == {"sample_rate": 8000, "channels": 2, "seconds": 0.33}
    sound = read_audio(out)
    assert sound.rate == 8000 and sound.samples.shape[0] == 2 and sound.samples.shape[1] >= 0.33 * 8000
    assert len(read_frames(out)) == 9
    with av.open(str(out)) as container:
        assert container.streams.video[0].average_rate == 24


def test_ltx2_runs_in_pipeline_stages_and_refuses_displaced_patches_in_one_line(tmp_path, capsys):
    """A stage hands both streams (video and audio) on to the next and the last stage both samples
    back: exact under p2u2 with a batch of two in micro-batches, the soundtrack too; displaced
    patches, which would keep one stream's stale keys and values, are one line."""
    from cocodiff.cli import main

    figures = tmp_path / "stages.json"
    run = cocodiff("verify", "--model", "tiny-ltx2", "--nproc", "4", "--plan", "p2u2", "--ranks-per-node", "2",
                   "--batch", "2", "--steps", "2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["plan"] == "p2u2" and sum(result["bytes_by_axis"]["stage"].values()) > 0
    assert result["audio"]["max_rel_diff"] <= result["tolerance"]
    assert main(["verify", "--model", "tiny-ltx2", "--nproc", "4", "--plan", "p2u2", "--pipe-patches", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "LTX2VideoTransformer3DModel: its blocks hand on two streams (video and audio), and displaced patches" in err


def test_ltx2_runs_its_pipelines_guidance_three_calls_a_step():
    """The presets keep LTX-2's own guidance: each step calls the transformer for classifier-free
    guidance (a batch of 2), then spatio-temporal guidance (its last block perturbed, skipping its
    self-attention), then modality guidance (the streams isolated); every plan above runs them all."""
    from cocodiff.cli import build_parser
    from cocodiff.models.presets import load_pipeline
    from cocodiff.run.pipeline import run_pipeline
    from cocodiff.run.spec import resolve_spec

    pipe, encoder = load_pipeline("tiny-ltx2")
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(kwargs), with_kwargs=True)
    spec = resolve_spec(build_parser().parse_args(["generate", "--model", "tiny-ltx2", "--steps", "2", "--nproc", "1"]))
    run_pipeline(spec, pipe, encoder, None)
    kinds = [("stg" if c.get("spatio_temporal_guidance_blocks") else "modality" if c.get("isolate_modalities") else "cfg",
              c["hidden_states"].shape[0]) for c in calls]
    assert kinds == [("cfg", 2), ("stg", 1), ("modality", 1)] * 2
    assert all(c["spatio_temporal_guidance_blocks"] == [1] for c in calls if c.get("spatio_temporal_guidance_blocks"))


@pytest.mark.slow
@pytest.mark.parametrize(("model", "args"), [
    ("tiny-ltx2", ("--plan", "c2u2")),
    ("tiny-ltx2", ("--plan", "b2u2", "--batch", "2")),
    ("tiny-ltx2-i2v", ("--plan", "u2r2", "--image", "{image}")),
])
def test_ltx2_is_exact_on_4_ranks(tmp_path, model, args):
    """CFG groups (the pipeline's two branches in one batch, each group's share gathered, both
    samples), batch groups, and image-to-video (the video tokens' own timestep split with them)
    under Ulysses x ring."""
    from PIL import Image

    image = tmp_path / "first.png"
    Image.new("RGB", (64, 64), (200, 40, 30)).save(image)
    result = _verified(tmp_path, "--model", model, "--nproc", "4", *(a.format(image=image) for a in args))
    assert result["ok"] is True and result["nproc"] == 4
    assert result["audio"]["scale"] > 0 and result["audio"]["max_rel_diff"] <= result["tolerance"]


def test_a_served_ltx2_video_carries_its_soundtrack_at_the_clips_rate(tmp_path):
    """POST /v1/videos/sync on tiny-ltx2 (its real pipeline in this process, as a rank loop runs it):
    the MP4 holds the soundtrack `generate` makes for the same seed (the same AAC stream) at
    24 fps, the rate the sound keeps pace with; another fps is a 400 naming it."""
    import io

    import numpy as np
    from fastapi.testclient import TestClient

    from cocodiff.engine.families.pipelines import clip_rate
    from cocodiff.models.presets import load_pipeline
    from cocodiff.serve.api import create_app
    from test_serve_edits import _ranks_in_thread
    from cocodiff.serve.protocol import Limits
    from cocodiff.serve.scheduler import Scheduler

    pipe, _ = load_pipeline("tiny-ltx2")
    scheduler = Scheduler(max_queue=4, max_batch=1, window_s=0)

    thread = _ranks_in_thread(scheduler, pipe)  # one process's rank loop through the real pipeline
    rate = clip_rate("LTX2Pipeline")
    limits = Limits(width=64, height=64, steps=2, size_multiple=32, model="tiny-ltx2", video=True, frames=9,
                    fps=rate, sound_fps=rate, pipeline="LTX2Pipeline")
    try:
        with TestClient(create_app(scheduler, limits)) as client:
            served = client.post("/v1/videos/sync", json={"prompt": "a red circle", "seed": 3})
            other = client.post("/v1/videos/sync", json={"prompt": "a red circle", "fps": 16})
    finally:
        scheduler.stop()
        thread.join(30)
    assert served.status_code == 200, served.text
    assert other.status_code == 400 and other.json()["error"]["message"] == (
        "fps=16: tiny-ltx2 makes its soundtrack in pace with 24 fps clips; give fps 24 or none")
    from cocodiff.cli import build_parser
    from cocodiff.output.video import Audio, write_video
    from cocodiff.run.pipeline import run_pipeline
    from cocodiff.run.spec import resolve_spec

    argv = ["generate", "--model", "tiny-ltx2", "--prompt", "a red circle", "--steps", "2", "--seed", "3", "--nproc", "1"]
    expected = run_pipeline(resolve_spec(build_parser().parse_args(argv)), pipe, load_pipeline("tiny-ltx2")[1], None)
    path, out = tmp_path / "served.mp4", tmp_path / "generated.mp4"
    path.write_bytes(served.content)
    write_video(expected["video"], out, fps=expected["fps"], audio=Audio(expected["audios"][0], expected["sample_rate"]))
    with av.open(io.BytesIO(served.content)) as container:
        assert container.streams.video[0].average_rate == 24
    mine, theirs = read_audio(path), read_audio(out)
    assert mine.rate == theirs.rate == 8000 and mine.samples.shape == theirs.samples.shape
    assert np.array_equal(mine.samples, theirs.samples) and np.abs(theirs.samples).max() > 1e-3
