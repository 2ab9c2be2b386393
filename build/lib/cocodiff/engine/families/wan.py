"""Wan 2.1 / 2.2 (`WanTransformer3DModel`): dispatcher-based, with diffusers' own `_cp_plan`.

The class says where its tokens split; the entry adds only what it does not say. The text stays
whole (its cross-attention is local on every rank: no exchange), and Wan 2.2 A14B's second
expert (`transformer_2`, the low-noise one) is parallelized the same way.
"""

from __future__ import annotations

from .base import Family

__all__ = ["FAMILY"]

FAMILY = Family(
    batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
    experts=("transformer_2",),
)
"""Wan's `WanTransformer3DModel`."""
