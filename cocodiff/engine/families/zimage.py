"""Z-Image (`ZImageTransformer2DModel`): dispatcher-based, with no `_cp_plan` of its own.

Its refiners run whole on every rank (image tokens alone, text alone: 2 + 2 of its 34 layers);
the split is at the main layers, whose input is one sequence [image, text] (each part padded to a
multiple of 32), split as one stream with its RoPE table and key mask (None when every item has
the same length). The final layer's output is gathered whole, so unpatchify finds the image
tokens at the front as in one process.
"""

from __future__ import annotations

from .base import Family, Gather, ModulePlan, Split

__all__ = ["FAMILY"]

FAMILY = Family(
    plan={
        "layers.0": ModulePlan(inputs={"x": Split(-2, "img")}),
        "layers.*": ModulePlan(inputs={"attn_mask": Split(-1, "img", dims=2), "freqs_cis": Split(-2, "img")}),
        "all_final_layer.*": ModulePlan(output=Gather(-2, "img")),
    },
    local=("noise_refiner", "context_refiner", "siglip_refiner"),
    refuses={"data_groups": "its forward takes a list of latents, one per image, which CFG and batch groups do not split "
                            "(use Ulysses and ring: --plan uN or uNrM)",
             "step_cache": "its layers take one joined sequence (x, attn_mask, freqs_cis), not the hidden_states and "
                           "encoder_hidden_states whose residuals the step caches keep",
             "stages": "its layers take one joined sequence (x, attn_mask, freqs_cis), not the hidden_states and "
                       "encoder_hidden_states that a pipeline stage hands on (use Ulysses and ring: --plan uN or uNrM)"},
)
"""Z-Image's `ZImageTransformer2DModel`."""
