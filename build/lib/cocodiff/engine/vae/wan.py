"""Patch-parallel decode of the Wan video VAE (AutoencoderKLWan: Wan 2.1 and 2.2), exactly.

Every rank holds the whole final latent (B, C, F, h, w); rank r decodes rows [lo_r, hi_r) of
every frame (`split_sizes` of the latent's rows) through diffusers' own `_decode` (its
frame-by-frame loop with the causal time cache, unpatchify and clamp untouched) and rank 0
gathers the bands into the clip:

    latent (B, C, F, h, w) -> rows [lo_r, hi_r) -> decoder, frame by frame -> (B, 3, F', f (hi_r - lo_r), f w)
                           -> gather on rank 0 -> (B, 3, F', f h, f w)

Why it equals the whole decode (up to the order in which sums are added), module by module:
- Convolutions (the causal 3x3x3 `WanCausalConv3d`s and the upsamplers' 3x3 `Conv2d`s, all
  stride 1 along rows): instead of zero-padding its band's rows, each one takes `padding` rows
  from each neighbouring band (`bands.padded`, `comm.halo.halo_rows`; zeros at the image's
  edges, as the padding there). A causal convolution's time cache is its input's last frames of this band; the
  neighbours' caches hold the same frames, so the halo is exchanged after the cache is put in
  front of the chunk, and it covers the cached frames too.
- RMS norms (over channels, per pixel), SiLU, nearest-exact 2x upsampling (a band starts on an
  even row at every resolution), the time convolutions (3x1x1), DupUp3D and unpatchify (Wan 2.2)
  only look at their own row: nothing to do.
- The mid-block's attention is per frame over every position of it: Q of this band, K and V of
  every band's rows gathered (all-gather), in the order of the whole frame.

Why exchange rows rather than decode a halo of latent rows twice: the Wan 2.1 decoder's receptive
field is 19 latent rows (1 + 4 + 11.25 + 7/8 + 1/8, rounded up, + 1), so a 480p clip's 60 latent
rows on 4 ranks would give a middle band 15 + 2 x 19 rows to decode: hardly less than the whole.
Exchanging one row per convolution keeps a band at its own rows plus one on each side, so the
decode's peak per rank falls with the rank count (messages of one row per convolution and frame
chunk to each neighbour). The 2D decode (engine/vae/kl2d.py) does the same; the shared pieces are in
engine/vae/bands.py.

LTX-Video's VAE splits the same way (engine/vae/ltx.py); HunyuanVideo 1.5's and Qwen-Image's
copy of Wan's decode whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .bands import (
    HALO_ROWS,
    band_conv,
    check_conv,
    decode_bands_to,
    decode_replaced,
    forwards_replaced,
    gather_rows,
    padded,
)

__all__ = ["HALO_ROWS", "decode_split", "latent_rows", "parallel_decode", "supports"]

def supports(vae: Any) -> bool:
    """Whether `vae` is the Wan video VAE (what `parallel_decode` splits)."""
    from diffusers import AutoencoderKLWan

    return isinstance(vae, AutoencoderKLWan)


def latent_rows(vae: Any, height: int) -> int:
    """The latent's rows for pictures `height` pixels high (Wan 2.2's 16x VAE included)."""
    return height // (vae.config.scale_factor_spatial or 8)


def _causal_conv(conv: nn.Conv3d, group: dist.ProcessGroup | None, x: torch.Tensor,
                 cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """`WanCausalConv3d.forward` on a band: the neighbours' rows instead of zero rows."""
    padding = list(conv._padding)  # (W left, W right, H top, H bottom, T before, T after): symmetric in H and W
    if cache_x is not None and padding[4] > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)  # (B, C, T_cache + T, h_r, W)
        padding[4] -= cache_x.shape[2]
    x = padded(x, padding[2], padding[0], padding[4], group)  # (B, C, T_pad + T, h_r + 2 p, W + 2 p)
    return nn.Conv3d.forward(conv, x)


def _attention(block: nn.Module, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """`WanAttentionBlock.forward` on a band: each frame's Q of this band, K and V of the whole frame."""
    identity = x
    batch, channels, time, height, width = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, height, width)  # (B T, C, h_r, W)
    qkv = block.to_qkv(block.norm(x))  # (B T, 3 C, h_r, W)
    query = qkv[:, :channels]
    key, value = gather_rows(qkv[:, channels:].contiguous(), group, -2).chunk(2, dim=1)  # (B T, C, H, W) each
    query, key, value = (t.flatten(2).transpose(1, 2).unsqueeze(1) for t in (query, key, value))  # (B T, 1, n, C)
    out = F.scaled_dot_product_attention(query, key, value)  # (B T, 1, h_r W, C): one head, as the stock block
    out = out.squeeze(1).transpose(1, 2).reshape(batch * time, channels, height, width)
    out = block.proj(out).view(batch, time, channels, height, width).permute(0, 2, 1, 3, 4)
    return out + identity


def _band_modules(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, the decoder's convolutions and attentions work on bands (instance attributes)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
    )

    forwards: dict[nn.Module, Callable[..., torch.Tensor]] = {}
    for module in vae.decoder.modules():
        rows = module._padding[2] if isinstance(module, WanCausalConv3d) else getattr(module, "padding", (0,))[0]
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            check_conv(module, rows)
        if isinstance(module, WanCausalConv3d) and rows:  # 1x1 and 3x1x1 ones stay stock: row by row
            forwards[module] = lambda x, cache_x=None, conv=module: _causal_conv(conv, group, x, cache_x)
        elif isinstance(module, nn.Conv2d) and rows:
            forwards[module] = lambda x, conv=module: band_conv(conv, group, x)
        elif isinstance(module, WanAttentionBlock):
            forwards[module] = lambda x, block=module: _attention(block, group, x)
    return forwards_replaced(forwards, vae)


def parallel_decode(vae: Any, latents: torch.Tensor, group: dist.ProcessGroup | None, dst: int = 0) -> torch.Tensor:
    """`vae`'s decode of `latents` (B, C, F, h, w), each rank of `group` decoding a band of rows:
    the whole clip (B, 3, F', f h, f w) on group rank `dst`, this rank's band (B, 3, F', f h_r, f w)
    elsewhere. Every band has at least one latent row (`h` >= the group's size)."""
    with _band_modules(vae, group):
        return decode_bands_to(latents, group, dst, lambda band, _lo: vae._decode(band).sample)


def decode_split(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, `vae.decode` (as the video pipelines call it) is `parallel_decode` over
    `group`: the clip on its rank 0, each other rank's own band (which nobody reads)."""
    return decode_replaced(vae, lambda z: parallel_decode(vae, z, group))
