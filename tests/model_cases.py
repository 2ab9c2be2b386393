"""Inputs and runs shared by the single-process reference and the ranks (imported by both)."""

from __future__ import annotations

from typing import Any

import torch

from cocodiff import ParallelConfig
from cocodiff.models.presets import load_pipeline, pipeline_inputs

FAMILIES = ["tiny-flux", "tiny-sd3", "tiny-qwen-image"]
# 48 x 80 pixels: 3 x 5 = 15 image tokens after the VAE (x8) and 2x2 patching, odd on purpose.
HEIGHT, WIDTH = 48, 80


def forward_inputs(model: str, transformer: torch.nn.Module, batch: int = 2) -> dict[str, Any]:
    """Transformer forward arguments with odd token counts (15 image, 7 text) and a batch of 2."""
    g = torch.Generator().manual_seed(1)
    h, w, txt = 3, 5, 7
    timestep = torch.tensor([0.7, 0.3][:batch])
    if model == "tiny-flux":
        ids = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
        return {
            "hidden_states": torch.randn(batch, h * w, 64, generator=g),
            "encoder_hidden_states": torch.randn(batch, txt, 64, generator=g),
            "pooled_projections": torch.randn(batch, 32, generator=g),
            "timestep": timestep,
            "img_ids": torch.cat([torch.zeros(h * w, 1), ids.float()], dim=1),
            "txt_ids": torch.zeros(txt, 3),
            "guidance": torch.full((batch,), 3.5),
        }
    if model == "tiny-sd3":
        return {
            "hidden_states": torch.randn(batch, 16, 2 * h, 2 * w, generator=g),
            "encoder_hidden_states": torch.randn(batch, txt, 64, generator=g),
            "pooled_projections": torch.randn(batch, 32, generator=g),
            "timestep": timestep * 1000,
        }
    if model == "tiny-qwen-image":
        mask = torch.ones(batch, txt, dtype=torch.bool)
        mask[0, 2] = mask[0, 5:] = False  # padding, not only at the end
        mask[1, 4:] = False
        return {
            "hidden_states": torch.randn(batch, h * w, 64, generator=g),
            "encoder_hidden_states": torch.randn(batch, txt, 64, generator=g),
            "encoder_hidden_states_mask": mask,
            "timestep": timestep,
            "img_shapes": [[(1, h, w)]] * batch,
        }
    raise KeyError(model)


def run_case(model: str, parallel: ParallelConfig | None) -> dict[str, torch.Tensor]:
    """A bare transformer forward and a 2-step pipeline run, under `parallelize(config)` if given."""
    from cocodiff import parallelize

    pipe, encoder = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    if parallel is not None:  # a pipeline, or (for SD3) the bare transformer: both must work
        bare = model == "tiny-sd3" and parallel.schedule.off  # V-Major follows the pipeline's steps
        parallelize(pipe.transformer if bare else pipe, parallel)
    with torch.no_grad():
        forward = pipe.transformer(**forward_inputs(model, pipe.transformer), return_dict=False)[0]
    final = {}

    def keep_latents(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"].clone()
        return tensors

    image = pipe(
        **pipeline_inputs(pipe, encoder, "a small green star"),
        height=HEIGHT, width=WIDTH, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="pt", callback_on_step_end=keep_latents,
    ).images
    return {"forward": forward, "latents": final["latents"], "image": image}
