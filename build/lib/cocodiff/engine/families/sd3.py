"""SD3 / SD3.5 (`SD3Transformer2DModel`): joint attention with context tokens, QK norm, dual attention.

Mirrors diffusers' `JointAttnProcessor2_0` on this rank's tokens. The joint sequence is
[image, text]; SD3.5's second attention (`attn2`, dual-attention layers) sees image tokens only;
the last block is `context_pre_only` and skips the context output projection.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..attention.core import QK, UlyssesProcessor
from .base import Family, Gather, ModulePlan, Split

__all__ = ["FAMILY", "SD3UlyssesProcessor"]


class SD3UlyssesProcessor(UlyssesProcessor):
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # diffusers' JointAttnProcessor2_0 ignores attention_mask as well.
        joint = encoder_hidden_states is not None
        heads = (-1, attn.inner_dim // attn.heads)

        def project_v() -> torch.Tensor:
            value = attn.to_v(hidden_states).unflatten(-1, heads)  # (B, S_r, H, D)
            if joint:
                value = torch.cat([value, attn.add_v_proj(encoder_hidden_states).unflatten(-1, heads)], dim=1)
            return value

        def project_qk() -> QK:
            query = attn.to_q(hidden_states).unflatten(-1, heads)
            key = attn.to_k(hidden_states).unflatten(-1, heads)
            if attn.norm_q is not None:
                query = attn.norm_q(query)
            if attn.norm_k is not None:
                key = attn.norm_k(key)
            if joint:
                context_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, heads)
                context_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, heads)
                if attn.norm_added_q is not None:
                    context_query = attn.norm_added_q(context_query)
                if attn.norm_added_k is not None:
                    context_key = attn.norm_added_k(context_key)
                query = torch.cat([query, context_query], dim=1)
                key = torch.cat([key, context_key], dim=1)
            return query, key

        streams = ("img", "txt") if joint else ("img",)
        out = self.ctx.attention(project_v, project_qk, streams, layer=self.layer)
        out = out.flatten(2, 3).to(hidden_states.dtype)  # (B, S_r, H * D)

        if joint:
            out, encoder_out = out.split_with_sizes([hidden_states.shape[1], encoder_hidden_states.shape[1]], dim=1)
            if not attn.context_pre_only:
                encoder_out = attn.to_add_out(encoder_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, encoder_out) if joint else out


def sample_inputs(config: Any, randn: Callable[..., torch.Tensor], timestep: torch.Tensor, context: torch.Tensor,
                  h: int, w: int, text: int, batch: int) -> dict[str, Any]:
    """One forward's made-up arguments: a latent image (not yet patched), text and pooled text."""
    p = config.patch_size
    return {"hidden_states": randn(batch, config.in_channels, h * p, w * p), "encoder_hidden_states": context,
            "pooled_projections": randn(batch, config.pooled_projection_dim), "timestep": timestep * 1000}


FAMILY = Family(
    # The input is a latent image; it becomes tokens (with learned position embeddings) in
    # pos_embed, so the split happens on pos_embed's output; unpatchify needs the gathered tokens.
    plan={
        "pos_embed": ModulePlan(output=Split(-2, "img")),
        "context_embedder": ModulePlan(output=Split(-2, "txt")),
        "proj_out": ModulePlan(output=Gather(-2, "img")),
    },
    processor=SD3UlyssesProcessor,
    batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
    repeated_blocks=("JointTransformerBlock",),
    sample_inputs=sample_inputs,
    activation_factor=12.5,  # SD3.5 Large's config in bf16 at 1024 pixels square: 12.4, measured
    entry_factor=5.0,  # the patch embedding with its cropped position table runs on the whole image
)
"""SD3 / SD3.5's `SD3Transformer2DModel`."""
