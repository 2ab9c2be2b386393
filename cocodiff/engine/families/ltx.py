"""LTX-Video (`LTXVideoTransformer3DModel`): dispatcher-based, with diffusers' own `_cp_plan`.

The class's plan splits the tokens at the transformer's entry. Image-to-video adds what it does
not say: the pipeline gives each token its own timestep (a (batch, tokens) tensor: the first
frame's tokens at zero, the conditioning mask), which must split with the tokens; text-to-video's
(batch,) timestep is left whole (a split applies only to a tensor of its number of dims).
"""

from __future__ import annotations

from .base import Family, Split

__all__ = ["FAMILY"]

FAMILY = Family(inputs={"": {"timestep": Split(-1, "img", dims=2)}})
"""LTX-Video's `LTXVideoTransformer3DModel`."""
