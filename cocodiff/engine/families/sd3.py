"""SD3 / SD3.5 (`SD3Transformer2DModel`): joint attention with context tokens, QK norm, dual attention.

Mirrors diffusers' `JointAttnProcessor2_0` on this rank's tokens. The joint sequence is
[image, text]; SD3.5's second attention (`attn2`, dual-attention layers) sees image tokens only;
the last block is `context_pre_only` and skips the context output projection.
"""

from __future__ import annotations

import torch

from ..attention.core import QK, UlyssesProcessor

__all__ = ["SD3UlyssesProcessor"]


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
