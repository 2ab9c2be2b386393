"""Parts the tiny presets share: a seeded stand-in text encoder and a small KL autoencoder."""

from __future__ import annotations

import zlib

import torch
from torch import nn

__all__ = ["TEXT_TOKENS", "TinyTextEncoder", "vae_kl"]

TEXT_TOKENS = 11


class TinyTextEncoder(nn.Module):
    """Words -> embeddings, a stand-in for a real text encoder with no download.

    Each word maps (by CRC32, stable across processes) to a row of a seeded table; the sequence
    is padded to `max_length` with a learned pad row and comes with its padding mask. The pooled
    vector is a projection of the mean of the real tokens.
    """

    def __init__(self, dim: int, pooled_dim: int, max_length: int = TEXT_TOKENS, vocab: int = 1024) -> None:
        super().__init__()
        self.max_length = max_length
        self.vocab = vocab
        self.table = nn.Embedding(vocab + 1, dim)  # last row: padding
        self.position = nn.Parameter(torch.randn(max_length, dim) * 0.1)
        self.pool = nn.Linear(dim, pooled_dim)

    @torch.no_grad()
    def forward(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prompts -> embeds (B, L, dim), mask (B, L) bool, pooled (B, pooled_dim)."""
        ids = torch.full((len(prompts), self.max_length), self.vocab, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().split()[: self.max_length]
            ids[row, : len(words)] = torch.tensor([zlib.crc32(w.encode()) % self.vocab for w in words], dtype=torch.long)
        mask = ids != self.vocab
        embeds = self.table(ids) + self.position
        counts = mask.sum(1, keepdim=True).clamp(min=1)
        pooled = self.pool((embeds * mask[..., None]).sum(1) / counts)
        return embeds, mask, pooled


def vae_kl(latent_channels: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16, 16, 16),  # 3 down-samplings: VAE factor 8, as in the real models
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        mid_block_add_attention=False,
        shift_factor=0.0609,
        scaling_factor=1.5305,
    )
