"""Made-up arguments for one forward of a bare transformer of each family, from its config.

For checks that run a transformer without its pipeline (the CPU stand-ins for a GPU, `bench
graphs`): a batch of `batch` items with h x w image tokens (after patching) and `text` text
tokens, odd on purpose, on `device` in `dtype`; the noise comes from a fixed seed.
"""

from __future__ import annotations

from typing import Any

import torch

from . import FAMILIES, class_name

__all__ = ["forward_inputs"]


def forward_inputs(transformer: torch.nn.Module, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   h: int = 6, w: int = 8, text: int = 7, batch: int = 2) -> dict[str, Any]:
    """Arguments for one forward of `transformer`, made up by its family's `sample_inputs`."""
    config, name = transformer.config, class_name(transformer)
    family = FAMILIES.get(name)
    if family is None or family.sample_inputs is None:
        raise KeyError(f"no made-up inputs for {name}")
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    timestep = torch.full((batch,), 0.7).to(device, dtype)
    context = randn(batch, text, config.joint_attention_dim)
    return family.sample_inputs(config, randn, timestep, context, h, w, text, batch)
