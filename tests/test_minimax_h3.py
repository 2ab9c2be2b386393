"""MiniMax-H3 (`tiny-minimax-h3`): video and stereo sound from one packed sequence, through diffusers'
modular pipeline (models/minimax_h3.py), its transformer split by its own `_cp_plan` with 7 heads
(as its 56: no power of two divides them)."""

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
    run = cocodiff("verify", "--model", "tiny-minimax-h3", *args, "--steps", "2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(figures.read_text())


def test_minimax_h3_is_exact_with_its_soundtrack_and_writes_it_into_the_mp4(tmp_path):
    """Ulysses over 2 ranks (4 heads and 3) times a ring of 2: the clip and its soundtrack are one
    process's; `generate` writes its 124 frames (5 s at its 24 fps) with the stereo waveform as the
    MP4's AAC stream at the audio VAE's rate."""
    result = _verified(tmp_path, "--nproc", "4", "--plan", "u2r2")
    assert result["ok"] is True and result["plan"] == "u2r2" and result["frames"] == 124
    assert result["audio"]["scale"] > 0 and result["audio"]["max_rel_diff"] <= result["tolerance"]
    out, figures = tmp_path / "clip.mp4", tmp_path / "generate.json"
    run = cocodiff("generate", "--model", "tiny-minimax-h3", "--steps", "2", "--nproc", "1", "--out", str(out),
                   "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    sound = json.loads(figures.read_text())["audio"]
    assert sound["sample_rate"] == 8000 and sound["channels"] == 2 and sound["seconds"] == pytest.approx(124 / 24, abs=0.02)
    assert read_audio(out).samples.shape[0] == 2 and len(read_frames(out)) == 124
    with av.open(str(out)) as container:
        assert container.streams.video[0].average_rate == 24


def test_minimax_h3_loop_passes_its_layout_through_a_wrapped_forward(tmp_path):
    """Its denoising loop passes the packed layout (token tags, positions, row indices) only under
    the names its transformer's forward takes; a batch group's forward (one clip: run whole on each
    group) and a pipeline stage's keep the class's signature, so the loop still finds them. Its
    blocks take one stream and its row tables positionally: the stage hands the stream on (bytes on
    the stage axis) and the last stage both samples back (video and audio), exact."""
    result = _verified(tmp_path, "--nproc", "2", "--plan", "b2")
    assert result["ok"] is True and result["plan"] == "b2u1"
    result = _verified(tmp_path, "--nproc", "4", "--plan", "p2u2")
    assert result["ok"] is True and result["plan"] == "p2u2" and sum(result["bytes_by_axis"]["stage"].values()) > 0
    assert result["audio"]["scale"] > 0 and result["audio"]["max_rel_diff"] <= result["tolerance"]


def test_minimax_h3_animates_from_a_first_and_a_last_frame_exactly(tmp_path):
    """`tiny-minimax-h3-i2v` (its keyframe workflow): the first and the last frame's rows packed ahead
    of the noise at their own timestep, anchored at the first and the last of its 37 latent frames
    (read from the transformer's input), exact on u2r2; without an image, one line."""
    from PIL import Image

    first, last = tmp_path / "first.png", tmp_path / "last.png"
    Image.new("RGB", (32, 32), (200, 40, 30)).save(first)
    Image.new("RGB", (32, 32), (20, 40, 220)).save(last)
    figures = tmp_path / "i2v.json"
    run = cocodiff("verify", "--model", "tiny-minimax-h3-i2v", "--nproc", "4", "--plan", "u2r2", "--image", str(first),
                   "--last-frame", str(last), "--steps", "2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["conditioned_frames"] == [0, 36]
    assert result["audio"]["scale"] > 0 and result["audio"]["max_rel_diff"] <= result["tolerance"]


@pytest.mark.parametrize("args, says", [
    (["--nproc", "2", "--plan", "c2"], "tiny-minimax-h3: its pipeline call runs without classifier-free guidance"),
    (["--nproc", "2", "--batch", "2"], "tiny-minimax-h3: MiniMax-H3 packs one clip per call into one sequence"),
    (["--nproc", "4", "--plan", "p2u2", "--pipe-patches", "2"],
     "MiniMaxH3Transformer3DModel: its call is one packed sequence of video, audio and text rows"),
    (["--nproc", "2", "--frames", "125"], "--frames 125: tiny-minimax-h3 makes clips of 17 x k + 5 frames, 124 to 345"),
    (["--nproc", "2", "--frames", "362"], "--frames 362: tiny-minimax-h3 makes clips of 17 x k + 5 frames, 124 to 345"),
    (["--nproc", "2", "--image", "IMG", "--parallel-vae", "on"], "AutoencoderKLMiniMaxH3 does not encode the first frame in bands"),
])
def test_minimax_h3_refuses_in_one_line(args, says, capsys, tmp_path):
    from PIL import Image

    from cocodiff.cli import main

    image = tmp_path / "first.png"
    Image.new("RGB", (32, 32)).save(image)
    model = "tiny-minimax-h3-i2v" if "IMG" in args else "tiny-minimax-h3"
    assert main(["verify", "--model", model, *(str(image) if arg == "IMG" else arg for arg in args)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_minimax_h3_clips_are_whole_chunks_of_5_to_15_seconds_before_any_rank_and_in_serve():
    """Its VAE encodes 17 frames at a time (17 k + 5 frames) and it makes 5 to 15 s at 24 fps: the
    preset's rule (checked by `generate` before any rank) is its pipeline's, the server's admission
    refuses what it refuses (diffusers' own loop would round 125 up to 141 and run that), and the
    longest clip runs."""
    import torch

    from cocodiff.models.presets import PRESETS, load_pipeline
    from cocodiff.serve.admission import Costs, OverLimit
    from cocodiff.serve.scheduler import Work

    pipe, encoder = load_pipeline("tiny-minimax-h3")
    preset = PRESETS["tiny-minimax-h3"]
    assert (pipe.frame_chunk, pipe.frame_limits) == (preset.frame_chunk, preset.frame_limits) == ((17, 5), (124, 345))
    costs = Costs.of(pipe, pixel_multiple=32, ranks=2)
    for frames in (125, 107, 362):
        with pytest.raises(OverLimit, match=f"num_frames={frames}: this model makes 17 x k \\+ 5 frames, 124 to 345"):
            costs.check(Work(prompt="x", width=32, height=32, steps=1, frames=frames))
    costs.check(Work(prompt="x", width=32, height=32, steps=1, frames=345))
    embeds, mask, _ = encoder(["a red circle"])
    latents = pipe(prompt_embeds=embeds[:, :int(mask.sum())], num_frames=345, num_inference_steps=1,
                   generator=torch.Generator().manual_seed(0), output_type="latent").frames
    assert latents.shape[2] == 5 * 20 + 2  # 345 = 17 x 20 + 5 frames: 102 latent frames
