"""tiny-shapes: deterministic data, a working checker, the shipped preset sequence-parallel, training.

Full training stays out of the tests: the training tests run a few steps on small batches.
"""

import json

import numpy as np
import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.run.launch import spawn
from cocodiff.models.presets import PRESETS, load_pipeline, pipeline_inputs
from cocodiff.models.shapes import SIZE
from cocodiff.models.shapes.check import check, summarize
from cocodiff.models.shapes.data import (
    VOCABULARY,
    ShapesDataset,
    heldout_captions,
    training_captions,
)
from cocodiff.models.shapes.model import WEIGHTS

RTOL_OF_SCALE = 1e-4  # as in test_models: fp32 rounding compounds to far less, a wrong token to far more
PARALLEL_STEPS = 3


def test_dataset_is_a_pure_function_of_seed_and_index():
    data = ShapesDataset(seed=3)
    image, caption = data[17]
    assert image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8
    again, again_caption = ShapesDataset(seed=3)[17]
    assert np.array_equal(image, again) and caption == again_caption
    images, captions = data.batch(15, 4)  # a batch is its samples, whatever the order they are drawn in
    assert np.array_equal(images[2], image) and captions[2] == caption
    other = ShapesDataset(seed=4).batch(15, 4)[0]
    assert not np.array_equal(images, other)


def test_heldout_captions_are_never_trained_on():
    heldout, training = set(heldout_captions()), set(training_captions())
    assert len(heldout) >= 50 and not heldout & training
    train = ShapesDataset(seed=0)
    assert all(train[i][1] in training for i in range(200))
    assert all(ShapesDataset(seed=0, split="heldout")[i][1] in heldout for i in range(50))
    assert {w for c in heldout | training for w in c.split()} == set(VOCABULARY)


def test_checker_finds_what_ground_truth_shows_and_rejects_what_it_does_not():
    heldout = ShapesDataset(seed=99, split="heldout")
    samples = [heldout[i] for i in range(60)]
    right = summarize([check(image, caption) for image, caption in samples])
    assert right["all_objects_found_rate"] >= 0.98 and right["relation_rate"] >= 0.98
    # the same images against another sample's caption: mostly not found
    wrong = summarize([check(image, samples[(i + 1) % 60][1]) for i, (image, _) in enumerate(samples)])
    assert wrong["all_objects_found_rate"] <= 0.2


def test_shipped_weights_load_with_from_pretrained_and_are_small():
    size = sum(f.stat().st_size for f in WEIGHTS.rglob("*") if f.is_file())
    assert size <= 20 * 2**20
    record = json.loads((WEIGHTS / "training.json").read_text())
    assert record["command"].startswith("cocodiff train-tiny") and record["final_loss"] > 0
    pipe, encoder = load_pipeline("tiny-shapes")
    assert type(pipe.transformer).__name__ == "FluxTransformer2DModel"
    assert pipe.transformer.config.num_attention_heads == PRESETS["tiny-shapes"].heads >= 4
    embeds, mask, pooled = encoder(["a red circle above a blue square", ""])
    assert embeds.shape[:2] == mask.shape and mask[0].sum() == 7 and mask[1].sum() == 0
    assert embeds.shape[-1] == pipe.transformer.config.joint_attention_dim
    assert pooled.shape == (2, pipe.transformer.config.pooled_projection_dim)


def test_checker_works_on_generated_images():
    """The shipped model draws the requested colours (its shapes are still mostly blobs: see README)."""
    from cocodiff.models.shapes.evaluate import generate

    pipe, encoder = load_pipeline("tiny-shapes")
    pool = heldout_captions()
    captions = [pool[i * len(pool) // 8] for i in range(8)] + ["a red circle", "a blue star", "a green triangle", "a yellow square"]
    images = generate(pipe, encoder, captions, seed=0)
    verdicts = [check(image, caption) for image, caption in zip(images, captions)]
    assert all(v.detections for v in verdicts)  # every sample has a coloured object
    figures = summarize(verdicts)
    assert figures["colours_found_rate"] >= 0.6, [(v.caption, v.detections) for v in verdicts]


def shapes_run(parallel: bool) -> dict[str, torch.Tensor]:
    """A bare transformer forward and a short guided pipeline run of the shipped preset."""
    from cocodiff import parallelize

    pipe, encoder = load_pipeline("tiny-shapes")
    pipe.set_progress_bar_config(disable=True)
    if parallel:
        parallelize(pipe)
    inputs = pipeline_inputs(pipe, encoder, "a purple star to the left of a yellow circle", model="tiny-shapes")
    assert inputs["true_cfg_scale"] > 1 and "negative_prompt_embeds" in inputs
    g = torch.Generator().manual_seed(1)
    tokens = (SIZE // 4) ** 2
    ids = torch.stack(torch.meshgrid(torch.arange(SIZE // 4), torch.arange(SIZE // 4), indexing="ij"), -1).reshape(-1, 2)
    with torch.no_grad():
        forward = pipe.transformer(
            hidden_states=torch.randn(2, tokens, 16, generator=g), timestep=torch.tensor([0.8, 0.3]),
            encoder_hidden_states=inputs["prompt_embeds"].expand(2, -1, -1),
            pooled_projections=inputs["pooled_prompt_embeds"].expand(2, -1),
            img_ids=torch.cat([torch.zeros(tokens, 1), ids.float()], 1), txt_ids=torch.zeros(inputs["prompt_embeds"].shape[1], 3),
            return_dict=False,
        )[0]
    final = {}

    def keep_latents(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"].clone()
        return tensors

    image = pipe(
        **inputs, height=SIZE, width=SIZE, num_inference_steps=PARALLEL_STEPS,
        generator=torch.Generator().manual_seed(0), output_type="pt", callback_on_step_end=keep_latents,
    ).images
    return {"forward": forward, "latents": final["latents"], "image": image}


@pytest.mark.parametrize("nproc", [2, 4])
def test_preset_sequence_parallel_equals_one_process(nproc):
    reference = shapes_run(parallel=False)
    for rank, run in enumerate(spawn(shapes_run, nproc, True, timeout_s=RANK_TIMEOUT_S)):
        for name, expected in reference.items():
            got = run[name]
            scale = expected.abs().max().item()
            diff = (got - expected).abs().max().item()
            assert got.shape == expected.shape
            assert diff <= RTOL_OF_SCALE * scale, f"rank {rank}, {name}: max abs diff {diff:.3e} at scale {scale:.3e}"


def _tiny_config(**changes):
    from cocodiff.models.shapes.train import TrainConfig

    base = dict(seed=5, threads=1, ae_steps=3, ae_batch=4, steps=4, batch=4, warmup=1, checkpoint_every=2, sample_grid=False)
    return TrainConfig(**{**base, **changes})


def test_training_smoke_run_lowers_the_loss(tmp_path):
    from cocodiff.models.shapes.model import load_parts
    from cocodiff.models.shapes.train import train_tiny

    record = train_tiny(tmp_path, _tiny_config(ae_steps=20, steps=25, batch=8, lr=2e-3))
    losses = json.loads((tmp_path / "losses.json").read_text())
    for stage in ("autoencoder", "denoiser"):
        assert np.mean(losses[stage][-5:]) < 0.8 * np.mean(losses[stage][:5]), (stage, losses[stage])
    assert record["denoiser_steps"] == 25 and (tmp_path / "loss.png").stat().st_size > 0
    pipe, encoder = load_parts(tmp_path)  # the output loads like the shipped weights
    assert pipe.vae.config.scaling_factor != 1.0


def test_training_is_deterministic_and_resumes_to_the_same_run(tmp_path):
    import shutil

    from cocodiff.models.shapes.train import train_tiny

    def outcome(run):
        losses = json.loads((tmp_path / run / "losses.json").read_text())
        return losses, (tmp_path / run / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()

    train_tiny(tmp_path / "a", _tiny_config())
    train_tiny(tmp_path / "b", _tiny_config())
    assert outcome("a") == outcome("b")
    # a run stopped after its step-2 checkpoint, resumed: the same run
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "c" / "checkpoints")
    (tmp_path / "c" / "checkpoints" / "step-000004.pt").unlink()
    train_tiny(tmp_path / "c", _tiny_config())
    assert outcome("c") == outcome("a")


def test_runs_of_different_lengths_share_every_step_before_their_decay(tmp_path):
    """With decay_share < 1 a shorter run is a longer one's prefix up to its decay, so a run can
    be resumed from a longer run's checkpoint and then given its final length."""
    import shutil

    from cocodiff.models.shapes.train import train_tiny

    def weights(run):
        return (tmp_path / run / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()

    train_tiny(tmp_path / "short", _tiny_config(steps=8, decay_share=0.5))  # decays over steps 4-7
    train_tiny(tmp_path / "long", _tiny_config(steps=12, decay_share=0.5))  # decays over steps 6-11
    shutil.copytree(tmp_path / "long" / "checkpoints", tmp_path / "cut" / "checkpoints")
    for later in sorted((tmp_path / "cut" / "checkpoints").glob("step-*.pt"))[2:]:
        later.unlink()  # keep the long run's step-4 checkpoint: before either run's decay
    train_tiny(tmp_path / "cut", _tiny_config(steps=8, decay_share=0.5))
    assert weights("cut") == weights("short") != weights("long")


def test_a_run_started_from_a_finished_one_keeps_its_autoencoder_and_starts_from_its_weights(tmp_path):
    """`--init DIR`: stage 1 is skipped (the autoencoder is DIR's), and stage 2 starts from DIR's
    transformer and text encoder; with a zero learning rate nothing moves, so the output is DIR's."""
    from cocodiff.models.shapes.train import train_tiny

    def part(run, name):
        return (tmp_path / run / name / "diffusion_pytorch_model.safetensors").read_bytes()

    train_tiny(tmp_path / "first", _tiny_config())
    record = train_tiny(tmp_path / "more", _tiny_config(init=str(tmp_path / "first"), lr=0.0, seed=6))
    for name in ("vae", "transformer", "text_encoder"):
        assert part("more", name) == part("first", name), name
    assert record["autoencoder_steps"] == 0 and record["denoiser_steps"] == 4
    assert record["init_training"]["denoiser_steps"] == 4
