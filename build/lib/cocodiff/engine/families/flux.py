"""FLUX.1 (`FluxTransformer2DModel`): double-stream joint attention and single-stream attention.

Mirrors diffusers' `FluxAttnProcessor` step for step on this rank's tokens. Both block kinds see
the joint sequence [text, image]: the double-stream block concatenates its two streams here, the
single-stream block receives them already concatenated. RoPE comes in already sharded, because
the position ids are split with the tokens at the transformer's entry.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from diffusers.models.embeddings import apply_rotary_emb

from ..attention.core import QK, UlyssesProcessor
from .base import Family, Gather, ModulePlan, Split

__all__ = ["FAMILY", "FluxUlyssesProcessor", "overlapped_single_block_forward"]

STREAMS = ("txt", "img")


class FluxUlyssesProcessor(UlyssesProcessor):
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        overlap: Callable[[], None] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise NotImplementedError("FLUX under Ulysses: attention_mask is not supported")
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        heads = (-1, attn.head_dim)  # reshape by head_dim, never by a fixed head count

        def project_v() -> torch.Tensor:
            value = attn.to_v(hidden_states).unflatten(-1, heads)  # (B, S_r, H, D)
            if joint:
                value = torch.cat([attn.add_v_proj(encoder_hidden_states).unflatten(-1, heads), value], dim=1)
            return value

        def project_qk() -> QK:
            query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, heads))
            key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, heads))
            if joint:
                query = torch.cat([attn.norm_added_q(attn.add_q_proj(encoder_hidden_states).unflatten(-1, heads)), query], dim=1)
                key = torch.cat([attn.norm_added_k(attn.add_k_proj(encoder_hidden_states).unflatten(-1, heads)), key], dim=1)
            if image_rotary_emb is not None:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
            return query, key

        out = self.ctx.attention(project_v, project_qk, STREAMS, overlap=overlap, layer=self.layer)
        out = out.flatten(2, 3).to(hidden_states.dtype)  # (B, S_r, H * D)

        if encoder_hidden_states is None:
            return out
        encoder_out, out = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        encoder_out = attn.to_add_out(encoder_out.contiguous())
        return out, encoder_out


def overlapped_single_block_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`FluxSingleTransformerBlock.forward` with its MLP branch run while attention's output travels.

    The same operations as diffusers' forward in the same order per tensor (so the same bits);
    only the MLP branch moves from before the attention call into its `overlap` slot. Installed
    per block instance by `parallelize` when V-First is on, removed by `undo()`.
    """
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp: list[torch.Tensor] = []

    def mlp_branch() -> None:
        mlp.append(self.act_mlp(self.proj_mlp(norm_hidden_states)))

    attn_output = self.attn(
        hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, overlap=mlp_branch, **(joint_attention_kwargs or {})
    )
    if not mlp:  # a processor that does not take `overlap`
        mlp_branch()
    hidden_states = torch.cat([attn_output, mlp[0]], dim=2)
    gate = gate.unsqueeze(1)
    hidden_states = gate * self.proj_out(hidden_states)
    hidden_states = residual + hidden_states
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


def sample_inputs(config: Any, randn: Callable[..., torch.Tensor], timestep: torch.Tensor, context: torch.Tensor,
                  h: int, w: int, text: int, batch: int) -> dict[str, Any]:
    """One forward's made-up arguments: packed latents, text, pooled text and position ids."""
    device, dtype = context.device, context.dtype
    grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
    inputs = {"hidden_states": randn(batch, h * w, config.in_channels), "encoder_hidden_states": context,
              "pooled_projections": randn(batch, config.pooled_projection_dim), "timestep": timestep,
              "img_ids": torch.cat([torch.zeros(h * w, 1), grid.float()], 1).to(device, dtype),
              "txt_ids": torch.zeros(text, 3).to(device, dtype)}
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5).to(device, dtype)
    return inputs


FAMILY = Family(
    # Tokens and their position ids split at the entry, so RoPE is computed per shard.
    plan={
        "": ModulePlan(inputs={
            "hidden_states": Split(-2, "img"), "encoder_hidden_states": Split(-2, "txt"),
            "img_ids": Split(-2, "img"), "txt_ids": Split(-2, "txt"),
        }),
        "proj_out": ModulePlan(output=Gather(-2, "img")),
    },
    processor=FluxUlyssesProcessor,
    # img_ids / txt_ids have no batch dim (positions are shared by the batch).
    batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
    # Single-stream blocks compute an MLP branch from the attention's input: it can run
    # while the attention output is exchanged.
    overlapped_forwards={"FluxSingleTransformerBlock": overlapped_single_block_forward},
    repeated_blocks=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    sample_inputs=sample_inputs,
    activation_factor=17.5,  # FLUX.1-dev's config in bf16 at 1024 pixels square: 17.3 (17.2 at 2048), measured
)
"""FLUX.1's `FluxTransformer2DModel`."""
