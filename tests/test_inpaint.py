"""Image-to-image and inpainting: the stock pipelines of each family, bad input, exactness under
sequence parallelism, and `bench quality --task inpaint` on a small case set."""

import json
import subprocess

import numpy as np
import command
import pytest
import torch
from conftest import RANK_TIMEOUT_S
from PIL import Image

from cocodiff.bench.inpaint import MASK_MARGIN, _against_truth, _summary, heldout_cases
from cocodiff.cli import main
from cocodiff.run.inputs import ImageInput, read_image_input
from cocodiff.models.presets import load_pipeline
from cocodiff.engine.families.pipelines import uses_cfg
from cocodiff.run.pipeline import run_pipeline
from cocodiff.run.spec import GenerateSpec
from cocodiff.models.shapes.data import _coverage, heldout_captions

RUNS_LONG = 2  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)

FAMILIES = {
    "tiny-flux": ("FluxImg2ImgPipeline", "FluxInpaintPipeline"),
    "tiny-sd3": ("StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    "tiny-qwen-image": ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
    "tiny-shapes": ("FluxImg2ImgPipeline", "FluxInpaintPipeline"),
}
HEIGHT, WIDTH = 48, 80  # 3 x 5 image tokens after the x8 VAE and 2x2 patches of the random-weight presets: odd


def cocodiff(*args: str) -> subprocess.CompletedProcess:
    return command.cocodiff(*args, timeout=RANK_TIMEOUT_S)


def write_inputs(folder, height: int = HEIGHT, width: int = WIDTH) -> tuple[str, str]:
    """A random RGB image and a mask of a box in it (white: repaint)."""
    rng = np.random.default_rng(0)
    image, mask = folder / "in.png", folder / "mask.png"
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(image)
    box = np.zeros((height, width), dtype=np.uint8)
    box[height // 4 : height // 2, width // 4 : width // 2] = 255
    Image.fromarray(box).save(mask)
    return str(image), str(mask)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_each_family_loads_its_img2img_and_inpaint_pipeline_from_the_same_parts(model):
    text, _ = load_pipeline(model)
    for task, name in zip(("img2img", "inpaint"), FAMILIES[model]):
        pipe, encoder = load_pipeline(model, task=task)
        assert type(pipe).__name__ == name and encoder is not None
        assert uses_cfg(pipe) == uses_cfg(text)  # the family's guidance, whatever the task
        # the same weights as the text-to-image pipeline of the same seed
        assert torch.equal(next(pipe.transformer.parameters()), next(text.transformer.parameters()))


def test_inpainting_keeps_the_unmasked_latents_and_redraws_the_masked_ones():
    """Two seeds: the final latents outside the mask are the image's (the pipeline puts them back
    at every step); inside they are drawn anew, so the seeds differ there."""
    rng = np.random.default_rng(1)
    image = (rng.random((64, 64, 3)) * 255).astype(np.uint8)
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[16:32, 16:32] = 255  # aligned to tiny-shapes' 4x4-pixel tokens: tokens 4..7 of rows 4..7
    source = ImageInput(image=image, mask=mask, strength=1.0)
    spec = GenerateSpec(model="tiny-shapes", steps=2, source=source, prompt="a red circle")
    pipe, encoder = load_pipeline("tiny-shapes", task="inpaint")
    pipe.set_progress_bar_config(disable=True)
    runs = [run_pipeline(GenerateSpec(model="tiny-shapes", steps=2, source=source, seed=seed), pipe, encoder, None)
            for seed in (0, 1)]
    assert spec.height == spec.width == 64
    tokens = [run["latents"].reshape(16, 16, -1) for run in runs]  # (1, 256, 16) packed -> (16, 16, 16)
    inside = np.zeros((16, 16), dtype=bool)
    inside[4:8, 4:8] = True
    # Not bitwise: the pipeline samples the encoder's posterior with each seed, and tiny-shapes'
    # posterior is a point only up to its floor (std 3e-7, see presets._point_posterior).
    assert torch.allclose(tokens[0][~inside], tokens[1][~inside], rtol=0, atol=1e-5)
    assert (tokens[0][inside] - tokens[1][inside]).abs().max() > 0.1


def test_img2img_starts_from_the_image():
    """The same seed and prompt from two different images: different outputs."""
    images = [np.full((64, 64, 3), level, dtype=np.uint8) for level in (40, 200)]
    pipe, encoder = load_pipeline("tiny-shapes", task="img2img")
    pipe.set_progress_bar_config(disable=True)
    outputs = [run_pipeline(GenerateSpec(model="tiny-shapes", steps=2, source=ImageInput(image=i, mask=None, strength=0.5)),
                            pipe, encoder, None)["image"] for i in images]
    assert outputs[0].mean() < outputs[1].mean() - 0.2  # a dark and a light start stay dark and light


def test_strength_defaults_by_task(tmp_path):
    image, mask = write_inputs(tmp_path)
    assert read_image_input(image).strength == 0.6 and read_image_input(image).task == "img2img"
    assert read_image_input(image, mask).strength == 1.0 and read_image_input(image, mask).task == "inpaint"
    assert read_image_input(image, mask, 0.3).strength == 0.3


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize(
    "args, message",
    [
        (["--image", "{missing}"], "no such file"),
        (["--image", "{bad}"], "not a readable image"),
        (["--image", "{image64}", "--mask", "{mask}"], "is 80x48 but --image"),
        (["--image", "{image30}"], "is 30x30: its height and width must be multiples of 4 (VAE factor x patch size of tiny-shapes)"),
        (["--model", "tiny-flux", "--image", "{image30}"], "must be multiples of 16 (VAE factor x patch size of tiny-flux)"),
        (["--image", "{image64}", "--strength", "0"], "--strength 0 must be above 0 and at most 1"),
        (["--image", "{image64}", "--strength", "1.5"], "--strength 1.5 must be above 0 and at most 1"),
        (["--mask", "{mask}"], "--mask needs --image"),
        (["--strength", "0.5"], "--strength needs --image"),
        (["--image", "{image64}", "--height", "32"], "--height 32 differs from the height of --image"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "verify"])
def test_bad_image_input_is_one_line_and_exit_2(tmp_path, capsys, command, args, message):
    _, mask = write_inputs(tmp_path)  # 80x48
    files = {"missing": tmp_path / "nope.png", "bad": tmp_path / "bad.png", "mask": mask,
             "image64": tmp_path / "in64.png", "image30": tmp_path / "in30.png"}
    files["bad"].write_text("not an image")
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(files["image64"])
    Image.fromarray(np.zeros((30, 30, 3), dtype=np.uint8)).save(files["image30"])
    argv = [command, *(a.format(**files) for a in args), "--nproc", "2"]
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "inpaint", "--model", "tiny-flux"], "--task inpaint runs on tiny-shapes"),
        (["--task", "inpaint", "--cases", "0"], "--cases 0 must be at least 1"),
        (["--cases", "3"], "--cases needs --task inpaint"),
    ],
)
def test_bad_inpaint_bench_input_is_one_line_and_exit_2(capsys, args, message):
    assert exit_status(["bench", "quality", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_heldout_cases_mask_one_whole_object_of_a_heldout_scene():
    cases = heldout_cases(6)
    heldout = set(heldout_captions())
    for case in cases:
        assert case.caption in heldout
        assert case.masked == case.index % 2
        x0, y0, x1, y1 = case.box
        assert set(np.unique(case.mask)) == {0, 255} and (case.mask > 0).sum() == (x1 - x0) * (y1 - y0)
    assert [c.caption for c in heldout_cases(6)] == [c.caption for c in cases]  # a pure function of the index
    # the box holds the whole object and MASK_MARGIN pixels around it (inside the image)
    from cocodiff.models.shapes.data import ShapesDataset

    scene, _ = ShapesDataset(0, split="heldout").sample(0)
    ys, xs = np.nonzero(_coverage(scene.objects[0]) > 0)
    assert cases[0].box == (xs.min() - MASK_MARGIN, ys.min() - MASK_MARGIN, xs.max() + 1 + MASK_MARGIN, ys.max() + 1 + MASK_MARGIN)


def test_ground_truth_against_itself_is_perfect_and_summaries_say_identical():
    case = heldout_cases(1)[0]
    truth = case.image.astype(np.float32) / 255.0
    figures = _against_truth(case, truth)
    assert figures["psnr_gt"] == figures["psnr_gt_masked"] == float("inf")
    assert figures["ssim_gt"] == pytest.approx(1.0) and figures["mse_gt"] == 0.0
    rows = [{"psnr": float("inf"), "mse": 0.0}, {"psnr": 30.0, "mse": 1e-3}, {"psnr": 40.0, "mse": 1e-4}]
    summary = _summary(rows)
    assert summary["psnr"] == 35.0 and summary["identical_cases"] == 1  # the mean over the cases that differ
    assert _summary(rows[:1])["psnr"] == float("inf")


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FAMILIES))
def test_verify_inpainting_is_exact_on_4_ranks(tmp_path, model):
    size = ["--steps", "2"] if model == "tiny-shapes" else ["--steps", "3"]
    image, mask = write_inputs(tmp_path, *((64, 64) if model == "tiny-shapes" else (HEIGHT, WIDTH)))
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", model, "--image", image, "--mask", mask, "--strength", "0.8", *size,
                   "--nproc", "4", "--ranks-per-node", "2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["nproc"] == 4
    assert result["image_input"]["task"] == "inpaint" and result["image_input"]["strength"] == 0.8


@pytest.mark.slow
def test_verify_img2img_is_exact_on_4_ranks(tmp_path):
    image, _ = write_inputs(tmp_path)
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-qwen-image", "--image", image, "--steps", "3", "--nproc", "4",
                   "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["image_input"]["task"] == "img2img"


@pytest.mark.slow
def test_bench_inpaint_exact_schedule_equals_the_exact_run(tmp_path):
    """2 cases, 2 steps: `off` (TAPA, no V-Major) is the exact run, so its figures against the
    ground truth are the exact run's and it saves nothing; `linear` saves bytes and says LOSSY."""
    figures = tmp_path / "q.json"
    run = cocodiff("bench", "quality", "--task", "inpaint", "--cases", "2", "--steps", "2", "--schedules", "off,linear",
                   "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["cases"] == 2 and result["model"] == "tiny-shapes" and result["task"] == "inpaint"
    off, linear, exact = result["schedules"]["off"], result["schedules"]["linear"], result["exact"]
    for key in ("psnr_gt", "ssim_gt", "mse_gt", "psnr_gt_masked", "object_found_rate", "colour_found_rate"):
        assert off[key] == exact[key], key
    assert off["psnr"] == float("inf") and off["identical_cases"] == 2 and off["psnr_gt_delta"] == 0.0
    assert off["inter_node_bytes_saved"] == 0.0 and off["lossy"] is False
    assert linear["lossy"] is True and 0 < linear["inter_node_bytes_saved"] < 1
    assert {"psnr", "ssim", "mse", "inter_node_bytes_saved", "cache_bytes", "lossy", "psnr_gt", "ssim_gt"} <= set(linear)
    assert "LOSSY" in run.stdout
    assert (tmp_path / "q.png").stat().st_size > 0  # the grid, next to the JSON
