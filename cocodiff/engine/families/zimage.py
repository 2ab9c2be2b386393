"""Z-Image (`ZImageTransformer2DModel`): dispatcher-based, with no `_cp_plan` of its own.

Its refiners run whole on every rank (image tokens alone, text alone: 2 + 2 of its 34 layers);
the split is at the main layers, whose input is one sequence [image, text] (each part padded to a
multiple of 32), split as one stream with its RoPE table and key mask (None when every item has
the same length). The final layer's output is gathered whole, so unpatchify finds the image
tokens at the front as in one process.

Its editing pipeline (`ZImageOmniPipeline`) joins [text segments, latents of each reference and of
the noise, each reference's SigLIP tokens] in that sequence, each token with its own timestep: a
(batch, tokens) `noise_mask` (1: the noise's, 0: a clean reference's) that every layer and the
final layer read, split with the tokens.
"""

from __future__ import annotations

from typing import Any

from .base import Family, Gather, ModulePlan, Split

__all__ = ["FAMILY"]


def _reference_tokens(kwargs: dict[str, Any]) -> int | None:
    """Tokens of the first item's references in an omni call (its `x`: a list per item, each
    reference's latents (C, 1, H, W) before the noise's; `siglip_feats`: each reference's (H, W, C)
    SigLIP tokens, then None), before the padding to 32; None: a call of text-to-image's shape."""
    x = kwargs.get("x")
    if not (isinstance(x, list) and x and isinstance(x[0], list)):
        return None
    patch = kwargs.get("patch_size", 2) ** 2 * kwargs.get("f_patch_size", 1)
    latents = sum(t.shape[-3] * t.shape[-2] * t.shape[-1] // patch for t in x[0][:-1])
    siglip = kwargs.get("siglip_feats") or [None]
    return latents + sum(t.shape[0] * t.shape[1] for t in (siglip[0] or []) if t is not None)

FAMILY = Family(
    plan={
        "layers.0": ModulePlan(inputs={"x": Split(-2, "img")}),
        "layers.*": ModulePlan(inputs={"attn_mask": Split(-1, "img", dims=2), "freqs_cis": Split(-2, "img"),
                                       "noise_mask": Split(-1, "img", dims=2)}),
        "all_final_layer.*": ModulePlan(inputs={"noise_mask": Split(-1, "img", dims=2)}, output=Gather(-2, "img")),
    },
    local=("noise_refiner", "context_refiner", "siglip_refiner"),
    reference_tokens=_reference_tokens,
    refuses={"data_groups": "its forward takes a list of latents, one per image, which CFG and batch groups do not split "
                            "(use Ulysses and ring: --plan uN or uNrM)",
             "step_cache": "its layers take one joined sequence (x, attn_mask, freqs_cis), not the hidden_states and "
                           "encoder_hidden_states whose residuals the step caches keep",
             "stages": "its layers take one joined sequence (x, attn_mask, freqs_cis), not the hidden_states and "
                       "encoder_hidden_states that a pipeline stage hands on (use Ulysses and ring: --plan uN or uNrM)"},
)
"""Z-Image's `ZImageTransformer2DModel`."""
