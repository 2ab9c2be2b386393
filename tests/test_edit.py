"""Editing with reference images (`--image` repeated on an edit pipeline: FLUX.2, FLUX.1 Kontext):
the references reach the transformer as tokens of its sequence, the run is exact against one
process, and what an edit cannot take is refused in one line before any rank starts."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import command
import pytest
from conftest import RANK_TIMEOUT_S
from PIL import Image

from cocodiff.cli import build_parser, main
from cocodiff.errors import UsageError
from cocodiff.models.presets import load_pipeline
from cocodiff.run.pipeline import run_pipeline
from cocodiff.run.spec import resolve_spec


def write_references(folder, *sizes: tuple[int, int]) -> list[str]:
    """Random RGB pictures of these (height, width)s."""
    rng = np.random.default_rng(1)
    paths = []
    for n, (height, width) in enumerate(sizes):
        path = folder / f"ref{n}-{height}x{width}.png"
        Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(path)
        paths.append(str(path))
    return paths


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "tiny-flux", "--image", "{a}", "--image", "{b}"],
     "tiny-flux: FluxPipeline takes one --image (image-to-image, or inpainting with --mask); several are the "
     "reference images of an edit pipeline (Flux2Pipeline, Flux2KleinPipeline, QwenImageEditPlusPipeline, "
     "ZImageOmniPipeline) (--image given 2 times)"),
    (["--model", "tiny-flux-kontext", "--image", "{a}", "--image", "{b}"],
     "tiny-flux-kontext: FluxKontextPipeline takes at most 1 reference image (--image given 2 times)"),
    (["--model", "tiny-flux2", "--image", "{a}", "--strength", "0.5"],
     "tiny-flux2: Flux2Pipeline edits from reference images: it takes no --strength or --mask (--strength 0.5 given)"),
    (["--model", "tiny-flux-kontext", "--image", "{a}", "--strength", "0.5"],
     "it starts from an image only to repaint it where a --mask is white (FluxKontextInpaintPipeline"),
    (["--model", "tiny-flux-kontext", "--image", "{a}", "--image", "{a}", "--mask", "{a}"],
     "FluxKontextInpaintPipeline repaints one --image where --mask is white (--image given 2 times)"),
    (["--model", "tiny-flux2", "--image", "{a}", "--image", "{small}"],
     "Image too small: 32×32. Both dimensions must be at least 64px (Flux2Pipeline)"),
    (["--model", "tiny-flux2", "--image", "{odd}"], "is 72x64: its height and width must be multiples of 16"),
    (["--model", "tiny-wan", "--image", "{a}", "--image", "{b}"], "tiny-wan is a text-to-video model here"),
    (["--model", "tiny-qwen-image-edit"],
     "tiny-qwen-image-edit edits reference images (QwenImageEditPlusPipeline): give 1 to 3 as --image"),
    (["--model", "tiny-qwen-image-edit", *["--image", "{a}"] * 4],
     "tiny-qwen-image-edit: QwenImageEditPlusPipeline takes at most 3 reference images (--image given 4 times)"),
    (["--model", "tiny-qwen-image-edit", "--image", "{a}", "--batch", "2"],
     "QwenImageEditPlusPipeline makes one picture per call (diffusers refuses a batch of more than 1)"),
    (["--model", "tiny-qwen-image-edit-v1"],
     "tiny-qwen-image-edit-v1 edits a reference image (QwenImageEditPipeline): give it as --image"),
    (["--model", "tiny-qwen-image-edit-v1", "--image", "{a}", "--image", "{b}"],
     "tiny-qwen-image-edit-v1: QwenImageEditPipeline takes at most 1 reference image (--image given 2 times)"),
])
def test_what_an_edit_cannot_take_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    a, b, small, odd = write_references(tmp_path, (64, 64), (64, 64), (32, 32), (64, 72))
    argv = ["generate", *(x.format(a=a, b=b, small=small, odd=odd) for x in args), "--nproc", "2"]
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_references_join_the_sequence_and_steer_the_picture(tmp_path):
    """One process: each reference adds its tokens to the transformer's sequence (16 at 64x64 on
    tiny-flux2), the output keeps the first reference's size, and other references give another picture."""
    a, b, wide = write_references(tmp_path, (64, 64), (64, 64), (64, 128))
    parse = build_parser().parse_args
    pipe, encoder = load_pipeline("tiny-flux2")

    def edit(*images: str) -> tuple:
        argv = ["generate", "--model", "tiny-flux2", "--steps", "2", "--nproc", "1"]
        spec = resolve_spec(parse([*argv, *(x for image in images for x in ("--image", image))]))
        return spec, run_pipeline(spec, pipe, encoder, None)

    spec, one = edit(a)
    assert (spec.height, spec.width) == (64, 64) and one["reference_tokens"] == 16
    _, two = edit(a, wide)
    assert two["reference_tokens"] == 16 + 32
    _, other = edit(b)
    assert one["image"].shape == (64, 64, 3)
    assert np.abs(one["image"] - other["image"]).max() > 1e-3


def test_an_edit_model_without_images_still_makes_pictures_from_text():
    spec = resolve_spec(build_parser().parse_args(["generate", "--model", "tiny-flux-kontext", "--nproc", "1",
                                                   "--steps", "1", "--height", "32", "--width", "32"]))
    pipe, encoder = load_pipeline("tiny-flux-kontext")
    run = run_pipeline(spec, pipe, encoder, None)
    assert run["reference_tokens"] == 0 and run["image"].shape == (32, 32, 3)


def cocodiff(*args: str) -> subprocess.CompletedProcess:
    return command.cocodiff(*args, timeout=RANK_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "sizes", "ranks"), [
    ("tiny-flux2", ((64, 64), (64, 96)), ("--nproc", "4", "--plan", "u2r2", "--ranks-per-node", "2")),
    ("tiny-flux-kontext", ((48, 80),), ("--nproc", "4", "--plan", "u4")),
    ("tiny-flux2-klein", ((64, 64), (64, 96)), ("--nproc", "4", "--plan", "c2u2")),  # its CFG's two calls paired
])
def test_verify_an_edit_is_exact_on_4_ranks(tmp_path, model, sizes, ranks):
    references = write_references(tmp_path, *sizes)
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", model, *(x for r in references for x in ("--image", r)), "--steps", "2",
                   *ranks, "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["nproc"] == 4
    assert result["image_input"]["task"] == "edit" and result["image_input"]["references"] == references
    assert result["reference_tokens"] == sum(h * w for h, w in sizes) // 16 ** 2
    assert (result["height"], result["width"]) == sizes[0]


def test_zimage_omni_edits_exactly_with_its_references_latents_and_siglip_tokens_split(tmp_path):
    """Z-Image-Omni: each reference's latents and SigLIP tokens join [text segments, latents, SigLIP]
    with a per-token timestep (the references' clean) that every layer reads, split with the tokens;
    under classifier-free guidance (a batch of 2 in one call) on Ulysses x ring."""
    references = write_references(tmp_path, (64, 64), (64, 96))
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-zimage-omni", *(x for r in references for x in ("--image", r)),
                   "--steps", "2", "--height", "64", "--width", "64", "--nproc", "4", "--plan", "u2r2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["image_input"]["references"] == references
    processor = load_pipeline("tiny-zimage-omni")[0].siglip_processor
    siglip = sum(int(processor(images=[Image.open(r)], return_tensors="pt").spatial_shapes[0].prod()) for r in references)
    assert result["reference_tokens"] == (64 * 64 + 64 * 96) // 16 ** 2 + siglip and siglip > 0


def test_usage_error_is_raised_for_several_images_on_an_unknown_pipeline(tmp_path):
    from cocodiff.run.inputs import read_image_input

    a, b = write_references(tmp_path, (64, 64), (64, 64))
    with pytest.raises(UsageError, match="takes one --image"):
        read_image_input([a, b])


@pytest.mark.slow
def test_qwen_image_edit_is_exact_with_two_references_and_with_a_mask(tmp_path):
    """Qwen-Image-Edit-2511's layout: each reference encoded at a megapixel joins the sequence (a
    64x64 one: 4096 tokens), modulated at timestep 0 by a per-token index split with the tokens,
    exact on 4 ranks under CFG groups and uneven heads (5 over 2); with a mask, the image is
    repainted by the edit inpaint pipeline, itself the reference, exact on 2 ranks."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions

    references = write_references(tmp_path, (64, 64), (64, 96))
    mask = tmp_path / "mask.png"
    Image.fromarray(np.kron(np.eye(2, dtype=np.uint8) * 255, np.ones((32, 32), np.uint8))).save(mask)
    megapixel = [calculate_dimensions(VAE_IMAGE_SIZE, w / h)[:2] for h, w in ((64, 64), (64, 96))]
    for args, ranks, tokens, task in (
        ([x for r in references for x in ("--image", r)], ("--nproc", "4", "--plan", "c2u2"),
         sum(w * h for w, h in megapixel) // 16 ** 2, "edit"),
        (["--image", references[0], "--mask", str(mask)], ("--nproc", "2"), 4096, "inpaint"),
    ):
        figures = tmp_path / f"{task}.json"
        run = cocodiff("verify", "--model", "tiny-qwen-image-edit", *args, "--steps", "2", *ranks, "--json", str(figures))
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(figures.read_text())
        assert result["ok"] is True and result["image_input"]["task"] == task
        assert result["reference_tokens"] == tokens and (result["height"], result["width"]) == (64, 64)


def test_the_first_qwen_image_edit_is_exact_with_a_batch_split_over_groups(tmp_path):
    """The first Qwen-Image-Edit (QwenImageEditPipeline): its one reference, encoded at a megapixel
    whatever its size (a 64x96 one: 4056 tokens), joins the sequence at the step's timestep (no
    zero_cond_t); unlike 2509's pipeline it takes a batch, here two pictures split over batch groups
    and their sequence over Ulysses (5 heads over 2), exact against one process."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    reference, = write_references(tmp_path, (64, 96))
    width, height, _ = calculate_dimensions(1024 * 1024, 96 / 64)
    figures = tmp_path / "v1.json"
    run = cocodiff("verify", "--model", "tiny-qwen-image-edit-v1", "--image", reference, "--batch", "2", "--steps", "2",
                   "--nproc", "4", "--plan", "b2u2", "--json", str(figures))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["plan"] == "b2u2"
    assert all(sum(result["bytes_by_axis"][axis].values()) > 0 for axis in ("cfg/batch", "ulysses"))
    assert result["image_input"]["task"] == "edit" and result["reference_tokens"] == width * height // 16 ** 2


def test_a_qwen_image_edit_checkpoint_refuses_a_batch_before_it_loads(tmp_path):
    """The pipeline class a checkpoint names tells, before any weight loads, that it makes one picture
    per call: `--batch 2` is one line (and a server runs its requests one by one)."""
    from cocodiff.models.presets import refusal

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    assert refusal(str(tmp_path), {"batch"}) == (f"{tmp_path}: QwenImageEditPlusPipeline makes one picture per call "
                                                 f"(diffusers refuses a batch of more than 1); run requests one by "
                                                 f"one, or split the sequence (--plan uN or rN)")
    assert refusal(str(tmp_path), {"cfg"}) is None
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline"}))
    assert refusal(str(tmp_path), {"batch"}) is None
