"""A family the engine has never seen, added as a user would: one preset and one family record,
imported in every rank through `COCODIFF_PLUGINS=toy_family` (tests/ is on the ranks' path).

`ToyTransformer2DModel` is FLUX.1's architecture under a class name of its own: no hand-written
processor, its plan read from the `_cp_plan` it inherits, its stock processors reaching the exchange
through the attention dispatcher. Its record declares that CFG and batch groups are refused.
"""

from __future__ import annotations

from diffusers import FluxTransformer2DModel

from cocodiff.engine.families import FAMILIES, Family
from cocodiff.models import presets

NAME = "tiny-toy"
REASON = "a toy family that declares it cannot have them"


class ToyTransformer2DModel(FluxTransformer2DModel):
    """FLUX.1's blocks, a family of its own."""


def _build():
    pipe, encoder = presets._build_flux()
    pipe.transformer.__class__ = ToyTransformer2DModel
    return pipe, encoder


FAMILIES["ToyTransformer2DModel"] = Family(refuses={"data_groups": REASON})
presets.PRESETS[NAME] = presets.Preset(_build, "ToyTransformer2DModel", "FluxPipeline", pixel_multiple=16, heads=4)
