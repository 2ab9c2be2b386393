"""Qwen-Image 2.1 (`QwenImage21Transformer2DModel`): one block-causal stream, its plan inferred.

Its blocks take one joint sequence [text with condition images, target image]. The attention is
block-causal: each prefix segment's queries (a run of text, or one condition image) attend to the
keys before it and their own, text causally; the target image's attend to everything. Its stock
processor slices those segments from the sequence it holds, so on a rank's share of the tokens they
would be the wrong rows. This processor exchanges Q, K and V first (Ulysses: the whole sequence on
this rank's heads) and then runs the same segments over it, so the plan itself (the split at the
first block with the rotary table and the per-token modulation mask, the gather after the last)
is inferred from the model as for any class with no `_cp_plan` (engine/plan_inference.py).

Its prefix K/V cache (the pipeline's `kv_cache_mode`: the prefix's keys and values stored at the
first step, only the target's queries computed after it) holds this rank's heads of the whole
prefix, so later steps exchange the target's tokens only.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

from ..attention.core import QK, UlyssesProcessor
from .base import Family

__all__ = ["FAMILY", "QwenImage21UlyssesProcessor"]

STREAMS = ("img",)  # the one joint stream, as the inferred plan names it


class QwenImage21UlyssesProcessor(UlyssesProcessor):
    """diffusers' `QwenImage21AttnProcessor` (its exact multi-pass prefill, and the decode over the
    cached prefix) on this rank's tokens, its segments run after the exchange."""

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: Any | None = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        heads = (-1, attn.inner_dim // attn.heads)  # by head_dim: never a fixed head count

        def project_v() -> torch.Tensor:
            return attn.to_v(hidden_states).unflatten(-1, heads)  # (B, S_r, H, D)

        def project_qk() -> QK:
            dtype = hidden_states.dtype  # V's, as the stock processor casts them
            query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, heads)).to(dtype)
            key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, heads)).to(dtype)
            if rotary_emb is not None:
                query = apply_rotary_emb_qwen(query, rotary_emb, use_real=False)
                key = apply_rotary_emb_qwen(key, rotary_emb, use_real=False)
            return query, key

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """(B, H_r, S, D): the whole sequence on this rank's heads."""
            if layer_cache is not None and kv_cache_mode == "extract" and cache_write_slice is not None:
                layer_cache.store(k[:, :, cache_write_slice].clone(), v[:, :, cache_write_slice].clone())
            elif layer_cache is not None and kv_cache_mode == "cached":
                cached_k, cached_v = layer_cache.get()
                k, v = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
            if segments is None:  # the decode: the target's queries over the prefix and itself
                return self.ctx.attend_whole(q, k, v, attention_mask)
            outputs, prefix = [], segments[-1][1] if segments else 0
            for start, end, is_text in segments:  # each prefix segment over the keys up to its end
                mask = None
                if is_text:  # and causal over its own
                    n = end - start
                    mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=q.device),
                                      torch.ones(n, n, dtype=torch.bool, device=q.device).tril()], dim=1)[None, None]
                if key_valid is not None:
                    valid = key_valid[:, None, None, :end]
                    mask = valid if mask is None else mask & valid
                outputs.append(self.ctx.attend_whole(q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask))
            valid = None if key_valid is None else key_valid[:, None, None, :]
            outputs.append(self.ctx.attend_whole(q[:, :, prefix:], k, v, valid))  # the target over every key
            return torch.cat(outputs, dim=2)

        out = self.ctx.attention(project_v, project_qk, STREAMS, layer=self.layer, attend=attend)
        out = out.flatten(2, 3).to(hidden_states.dtype)  # (B, S_r, H * D)
        return attn.to_out[1](attn.to_out[0](out))


FAMILY = Family(
    infer=True,
    processor=QwenImage21UlyssesProcessor,
    refuses={"stages": "its split plan is inferred from its whole forward at the first call, and a pipeline "
                       "stage holds part of it (use Ulysses, CFG and batch groups)",
             "patches": "its prefix keys and values are cached at the first step and only the target's are "
                        "computed after it, so there are no stale patches to displace",
             "ring": "its block-causal attention runs over the whole sequence on each rank's heads, with Ulysses "
                     "alone (--plan uN)",
             "plan_trials": "its prefix cache holds each rank's heads of the text's keys and values from the first "
                            "step, and a plan tried at a later step would split the heads otherwise (give a plan: "
                            "--plan uN, cNuM)",
             "v_major": "its prefix cache already keeps the text's keys and values from the first step, and the "
                        "later steps exchange the image's tokens alone, a sequence of another length than the "
                        "first step's that V-Major would reuse",
             "step_cache": "its blocks take one joint stream [text, image] (no encoder_hidden_states), and the step "
                           "caches read a block's image and text streams apart"},
)
"""Qwen-Image 2.1's `QwenImage21Transformer2DModel`."""
