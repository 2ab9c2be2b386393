"""Qwen-Image (`QwenImageTransformer2DModel`): double-stream joint attention with a text mask.

Mirrors diffusers' `QwenDoubleStreamAttnProcessor2_0` on this rank's tokens. The joint sequence
is [text, image]; text and image carry separate complex RoPE tables, sharded with their tokens.
The text padding mask arrives whole (the blocks receive it unsharded) and is laid out in the
order of the gathered keys, so padded text tokens stay masked on every rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from ..attention.core import QK, UlyssesProcessor
from .base import Family, Gather, ModulePlan, Split

__all__ = ["FAMILY", "QwenImageUlyssesProcessor"]

STREAMS = ("txt", "img")


class QwenImageUlyssesProcessor(UlyssesProcessor):
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("Qwen-Image attention needs encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError("Qwen-Image attention takes encoder_hidden_states_mask, not attention_mask")
        heads = (-1, attn.inner_dim // attn.heads)

        def project_v() -> torch.Tensor:
            txt = attn.add_v_proj(encoder_hidden_states).unflatten(-1, heads)
            img = attn.to_v(hidden_states).unflatten(-1, heads)
            return torch.cat([txt, img], dim=1)  # (B, S_r, H, D)

        def project_qk() -> QK:
            img_q = attn.to_q(hidden_states).unflatten(-1, heads)
            img_k = attn.to_k(hidden_states).unflatten(-1, heads)
            txt_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, heads)
            txt_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, heads)
            if attn.norm_q is not None:
                img_q = attn.norm_q(img_q)
            if attn.norm_k is not None:
                img_k = attn.norm_k(img_k)
            if attn.norm_added_q is not None:
                txt_q = attn.norm_added_q(txt_q)
            if attn.norm_added_k is not None:
                txt_k = attn.norm_added_k(txt_k)
            if image_rotary_emb is not None:
                img_freqs, txt_freqs = image_rotary_emb
                img_q, img_k = _rope(img_q, img_freqs), _rope(img_k, img_freqs)
                txt_q, txt_k = _rope(txt_q, txt_freqs), _rope(txt_k, txt_freqs)
            return torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1)

        key_mask = self.ctx.gathered_key_mask({"txt": encoder_hidden_states_mask}, STREAMS)
        out = self.ctx.attention(project_v, project_qk, STREAMS, key_mask, layer=self.layer)
        out = out.flatten(2, 3).to(hidden_states.dtype)  # (B, S_r, H * D)

        txt_out, img_out = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        txt_out = attn.to_add_out(txt_out.contiguous())
        return img_out, txt_out


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' complex RoPE, which cannot reshape an empty shard (a rank may hold no text
    token when the ranks outnumber them): an empty shard has nothing to rotate."""
    return apply_rotary_emb_qwen(x, freqs, use_real=False) if x.numel() else x


def sample_inputs(config: Any, randn: Callable[..., torch.Tensor], timestep: torch.Tensor, context: torch.Tensor,
                  h: int, w: int, text: int, batch: int) -> dict[str, Any]:
    """One forward's made-up arguments: packed latents, text with padding in the first item, shapes."""
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[0, text - 2 :] = False  # padding in the first item
    return {"hidden_states": randn(batch, h * w, config.in_channels), "encoder_hidden_states": context,
            "encoder_hidden_states_mask": mask.to(context.device), "timestep": timestep, "img_shapes": [[(1, h, w)]] * batch}


FAMILY = Family(
    # Split at the first block, after the text mask and RoPE tables are built from the full text
    # length; the RoPE tables are split with their tokens; the text mask stays whole (the
    # processor lays it out in the gathered key order).
    plan={
        "transformer_blocks.0": ModulePlan(
            inputs={"hidden_states": Split(-2, "img"), "encoder_hidden_states": Split(-2, "txt")}
        ),
        "transformer_blocks.*": ModulePlan(inputs={"modulate_index": Split(-1, "img")}),
        "pos_embed": ModulePlan(output={0: Split(-2, "img"), 1: Split(-2, "txt")}),
        "proj_out": ModulePlan(output=Gather(-2, "img")),
    },
    streams={"pos_embed.1": "txt"},  # its `_cp_plan`'s second RoPE table is the text's
    processor=QwenImageUlyssesProcessor,
    # img_shapes and txt_seq_lens are per-item lists.
    batch_args=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                "img_shapes", "txt_seq_lens", "guidance"),
    repeated_blocks=("QwenImageTransformerBlock",),
    sample_inputs=sample_inputs,
    activation_factor=14.5,  # Qwen-Image's config in bf16 at 1024 pixels square: 14.2, measured
    plan_values=(5, 5),  # its masked attention's: 4.3-5.8 and 5.2 measured at 1024 and 2048, u8 and u4r2
)
"""Qwen-Image's `QwenImageTransformer2DModel`."""
