"""Made-up arguments for one forward of a bare transformer of each family, from its config.

For checks that run a transformer without its pipeline (the CPU stand-ins for a GPU, `bench
graphs`): a batch of `batch` items with h x w image tokens (after patching) and `text` text
tokens, odd on purpose, on `device` in `dtype`; the noise comes from a fixed seed.
"""

from __future__ import annotations

from typing import Any

import torch

from . import class_name

__all__ = ["forward_inputs"]


def forward_inputs(transformer: torch.nn.Module, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   h: int = 6, w: int = 8, text: int = 7, batch: int = 2) -> dict[str, Any]:
    config, family = transformer.config, class_name(transformer)
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    timestep = torch.full((batch,), 0.7).to(device, dtype)
    context = randn(batch, text, config.joint_attention_dim)
    if family == "FluxTransformer2DModel":
        grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
        inputs = {"hidden_states": randn(batch, h * w, config.in_channels), "encoder_hidden_states": context,
                  "pooled_projections": randn(batch, config.pooled_projection_dim), "timestep": timestep,
                  "img_ids": torch.cat([torch.zeros(h * w, 1), grid.float()], 1).to(device, dtype),
                  "txt_ids": torch.zeros(text, 3).to(device, dtype)}
        if config.guidance_embeds:
            inputs["guidance"] = torch.full((batch,), 3.5).to(device, dtype)
        return inputs
    if family == "SD3Transformer2DModel":
        p = config.patch_size
        return {"hidden_states": randn(batch, config.in_channels, h * p, w * p), "encoder_hidden_states": context,
                "pooled_projections": randn(batch, config.pooled_projection_dim), "timestep": timestep * 1000}
    if family == "QwenImageTransformer2DModel":
        mask = torch.ones(batch, text, dtype=torch.bool)
        mask[0, text - 2 :] = False  # padding in the first item
        return {"hidden_states": randn(batch, h * w, config.in_channels), "encoder_hidden_states": context,
                "encoder_hidden_states_mask": mask.to(device), "timestep": timestep, "img_shapes": [[(1, h, w)]] * batch}
    raise KeyError(f"no made-up inputs for {family}")
