"""The text encoder of `tiny-shapes`: a word-level tokenizer and a small transformer, trained jointly.

There is no text encoder to download here, and the captions come from a grammar of 17 words, so
the encoder is learned from scratch together with the denoiser: each word of the fixed vocabulary
(plus padding and unknown) is an embedding, learned positions tell "a red circle above a blue
square" from "a blue square above a red circle", and two pre-norm self-attention blocks let each
token see its neighbours (which colour goes with which shape). It plays the role of T5 (token
embeddings, `joint_attention_dim` wide) and CLIP (one pooled vector) in FLUX.

It is a diffusers `ModelMixin` + `ConfigMixin`, so it saves and loads with `save_pretrained` /
`from_pretrained` like the other parts of the pipeline; the vocabulary is part of its config.
Called on a list of prompts it returns what the presets' encoders return:
`(embeds (B, L, dim), mask (B, L) bool, pooled (B, pooled_dim))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

__all__ = ["PAD", "UNK", "ShapesTextEncoder"]

PAD, UNK = 0, 1


class _Block(nn.Module):
    """Pre-norm self-attention and MLP over the (short, fixed-length) token sequence."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.out(attended)
        return x + self.mlp(self.norm2(x))


class ShapesTextEncoder(ModelMixin, ConfigMixin):
    """Prompts -> token embeddings, padding mask and a pooled vector, from a fixed word vocabulary."""

    @register_to_config
    def __init__(
        self,
        vocabulary: tuple[str, ...] | list[str] = (),
        max_length: int = 12,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        pooled_dim: int = 64,
    ) -> None:
        super().__init__()
        self.word_ids = {word: index + 2 for index, word in enumerate(vocabulary)}
        self.embed = nn.Embedding(len(vocabulary) + 2, dim)
        self.position = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.pool = nn.Linear(dim, pooled_dim)
        nn.init.normal_(self.embed.weight, std=0.5)

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """(B, max_length) word ids: lower-cased words, unknown words as UNK, padded with PAD, cut to length."""
        length = self.config.max_length
        ids = torch.full((len(prompts), length), PAD, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().replace(",", " ").replace(".", " ").split()[:length]
            ids[row, : len(words)] = torch.tensor([self.word_ids.get(w, UNK) for w in words], dtype=torch.long)
        return ids

    def encode(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Word ids -> (embeds (B, L, dim), pooled (B, pooled_dim)), differentiable (for training).

        Padding tokens are embedded too (FLUX attends to the text encoder's padding); the pooled
        vector averages the real tokens, or is that of the empty prompt when there are none.
        """
        x = self.embed(ids) + self.position
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        real = (ids != PAD).to(x.dtype)[..., None]
        mean_real = (x * real).sum(1) / real.sum(1).clamp(min=1.0)
        pooled = self.pool(torch.where(real.sum(1) > 0, mean_real, x.mean(1)))
        return x, pooled

    @torch.no_grad()
    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prompts -> embeds (B, L, dim), mask (B, L) bool, pooled (B, pooled_dim)."""
        ids = self.tokenize(prompts).to(self.device)
        embeds, pooled = self.encode(ids)
        return embeds, ids != PAD, pooled
