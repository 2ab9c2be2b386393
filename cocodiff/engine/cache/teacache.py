"""TeaCache's signal: the first block's timestep-modulated input, and the polynomial that rescales
its relative L1 change into an estimate of the output's change.

The modulated input is what the first block's attention sees: its input normalized and shifted /
scaled by the timestep embedding (`temb`). It changes with the timestep as well as with the latents,
which is why TeaCache watches it: a step whose modulated input barely moved has an output that
barely moved. Read from the block's own modules, computed once more (a normalization and one
linear layer of the embedding, small beside the block):

- FLUX's and SD3's blocks: `norm1(hidden_states, emb=temb)` (AdaLayerNormZero), its first output;
- Chroma's blocks: the same, with the image's six modulation rows of their `temb` (`temb[:, :6]`,
  as the block splits it: the text's six follow);
- Qwen-Image's blocks: `img_norm1` then `_modulate` with the first half of `img_mod(temb)`;
- any other block: its plain input (documented: no modulation found).

The polynomial: TeaCache4FLUX's published fit for FLUX.1 (19 double- and 38 single-stream blocks,
width 3072). No fit is published for SD3 or Qwen-Image in the TeaCache repository, and a fit from
FLUX.1's weights does not carry to the tiny presets (random or small trained weights): those use
the identity (the change itself), which puts the threshold on the scale of the relative L1 change.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..families import class_name

__all__ = ["FLUX_POLYNOMIAL", "modulated_input", "rescaler"]

FLUX_POLYNOMIAL = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)
"""TeaCache4FLUX's coefficients, highest power first (ali-vilab/TeaCache)."""


def rescaler(transformer: torch.nn.Module) -> tuple[str, Callable[[float], float]]:
    """(its name, the polynomial) for `transformer`: FLUX.1's fit on a FLUX.1-sized FLUX model,
    the identity otherwise."""
    config = getattr(transformer, "config", {})
    flux1 = (class_name(transformer) == "FluxTransformer2DModel" and config.get("num_layers") == 19
             and config.get("num_single_layers") == 38
             and config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0) == 3072)
    if not flux1:
        return "identity", lambda x: x

    def flux(x: float) -> float:
        value = 0.0
        for c in FLUX_POLYNOMIAL:
            value = value * x + c
        return max(value, 0.0)  # an estimate of a change: never negative

    return "FLUX.1", flux


def modulated_input(block: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                    hidden: torch.Tensor) -> torch.Tensor:
    """The first block's modulated image input for this call (see the module docstring)."""
    temb = kwargs.get("temb")
    if temb is None:
        try:
            temb = inspect.signature(forward).bind_partial(*args, **kwargs).arguments.get("temb")
        except TypeError:
            temb = None
    if temb is None:
        return hidden
    with torch.no_grad():
        norm1 = getattr(block, "norm1", None)
        if callable(norm1) and "emb" in inspect.signature(norm1.forward).parameters:
            if class_name(block) == "ChromaTransformerBlock":  # its temb: the image's 6 rows, then the text's
                temb = temb[:, :6]
            out = norm1(hidden, emb=temb)
            return out[0] if isinstance(out, tuple) else out
        if all(hasattr(block, a) for a in ("img_mod", "img_norm1", "_modulate")):
            shift_scale_gate = block.img_mod(temb).chunk(2, dim=-1)[0][: hidden.shape[0]]  # the image stream's rows
            return block._modulate(block.img_norm1(hidden), shift_scale_gate)[0]
    return hidden
