"""Patch-parallel decode of the HunyuanVideo 1.5 VAE (AutoencoderKLHunyuanVideo15), exactly.

Every rank holds the whole final latent (B, C, F, h, w); rank r decodes rows [lo_r, hi_r) of
every frame (`split_sizes` of the latent's rows) through diffusers' own `_decode` and rank 0
gathers the bands into the clip:

    latent (B, C, F, h, w) -> rows [lo_r, hi_r) -> decoder -> (B, 3, F', 16 (hi_r - lo_r), 16 w)
                           -> gather on rank 0 -> (B, 3, F', 16 h, 16 w)

Why it equals the whole decode (up to the order in which sums are added), module by module:
- Convolutions (the 3x3x3 `HunyuanVideo15CausalConv3d`s): the stock one pads by replication
  (frames before, rows and columns on both sides), then convolves without padding. On a band, the
  rows above and below are the neighbouring bands' (point to point, `comm.halo.halo_rows`) and the
  image's own edge rows repeated at its top and bottom; frames and columns are then replicated as
  the stock pad does (its corners repeat the borrowed rows' first frame and edge columns, as the
  whole image's do).
- RMS norms (over channels, per pixel), SiLU, the decoder's channel repeats and the upsamplers'
  depth to space (channels of row r into rows 2 r, 2 r + 1) only look at their own row.
- The mid-block's attention is over every frame and position, causal in frames (frame i sees
  frames 0..i): Q of this band, K and V of every band's rows gathered (all-gather) in the order of
  the whole clip, and the same frame mask built for the band's queries.

Tiling is off within the band decode. The encoder (image-to-video) runs whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocodiff.distributed.comm.halo import halo_rows

from .bands import (
    HALO_ROWS,
    check_conv,
    decode_bands_to,
    decode_replaced,
    forwards_replaced,
    gather_rows,
)

__all__ = ["HALO_ROWS", "decode_items_apart", "decode_split", "latent_rows", "parallel_decode", "supports"]


def supports(vae: Any) -> bool:
    """Whether `vae` is the HunyuanVideo 1.5 VAE (what `parallel_decode` splits)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return isinstance(vae, AutoencoderKLHunyuanVideo15)


def decode_items_apart(vae: Any) -> None:
    """The stock whole decode (one process, or bands not in use) one batch item at a time (its
    `use_slicing`): in diffusers 0.42.1 its mid-block attention's (B, S, S) frame mask broadcasts
    against (B, 1, S, C) queries as (B, B, S, S), so a batch above 1 fails. Items decode apart
    anyway, so each is exactly what it would be alone. The band decode (`_attention`) needs none."""
    vae.use_slicing = True


def latent_rows(vae: Any, height: int) -> int:
    """The latent's rows for pictures `height` pixels high (16 pixels a row)."""
    return height // vae.config.spatial_compression_ratio


def _causal_conv(conv: nn.Module, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """`HunyuanVideo15CausalConv3d.forward` on a band (B, C, T, h_r, W): the neighbours' rows, or
    the image's edge row repeated, instead of the band's own edge row repeated."""
    left, right, top, bottom, before, after = conv.time_causal_padding  # F.pad's order: W, H, T
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    above, below = halo_rows(x, top, group)  # (B, C, T, p, W) each; zeros at the image's edges
    if rank == 0:
        above = x[..., :1, :].expand_as(above)  # the image's top row, replicated
    if rank == world - 1:
        below = x[..., -1:, :].expand_as(below)
    x = torch.cat([above, x, below], dim=-2)  # (B, C, T, p + h_r + p, W)
    x = F.pad(x, (left, right, 0, 0, before, after), mode=conv.pad_mode)  # (B, C, T + 2, h_r + 2 p, W + 2 q)
    return conv.conv(x)


def _check_causal_conv(conv: nn.Module) -> None:
    """A ValueError unless `_causal_conv` splits `conv` (replicated symmetric row padding, unpadded stride-1 rows)."""
    _, _, top, bottom, _, _ = conv.time_causal_padding
    check_conv(conv.conv, top)
    if conv.pad_mode != "replicate" or top != bottom or any(conv.conv.padding):
        raise ValueError(f"a HunyuanVideo15CausalConv3d padding {conv.time_causal_padding} by {conv.pad_mode} "
                         f"cannot decode in bands")


def _attention(block: nn.Module, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """`HunyuanVideo15AttnBlock.forward` on a band: Q of this band's rows of every frame, K and V of
    the whole clip, each query seeing the keys of its frame and the frames before."""
    identity = x
    x = block.norm(x)
    query = block.to_q(x)  # (B, C, F, h_r, W)
    key, value = gather_rows(torch.cat([block.to_k(x), block.to_v(x)], dim=1), group, -2).chunk(2, dim=1)
    batch, channels, frames, rows, width = query.shape
    height = key.shape[-2]  # (B, C, F, H, W) each
    query, key, value = (t.flatten(2).transpose(1, 2).unsqueeze(1) for t in (query, key, value))  # (B, 1, n, C)
    query_frame = torch.arange(frames, device=x.device).repeat_interleave(rows * width)  # (F h_r W,)
    key_frame = torch.arange(frames, device=x.device).repeat_interleave(height * width)  # (F H W,)
    mask = key_frame[None, :] <= query_frame[:, None]  # (F h_r W, F H W): causal in frames, as the stock mask
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # (B, 1, F h_r W, C): one head
    out = out.squeeze(1).reshape(batch, frames, rows, width, channels).permute(0, 4, 1, 2, 3)
    return block.proj_out(out) + identity


def _band_modules(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, the decoder's convolutions and attentions work on bands (instance attributes)."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
        HunyuanVideo15AttnBlock,
        HunyuanVideo15CausalConv3d,
    )

    forwards: dict[nn.Module, Callable[..., torch.Tensor]] = {}
    for module in vae.decoder.modules():
        if isinstance(module, HunyuanVideo15CausalConv3d) and module.time_causal_padding[2]:
            _check_causal_conv(module)
            forwards[module] = lambda x, conv=module: _causal_conv(conv, group, x)
        elif isinstance(module, HunyuanVideo15AttnBlock):
            forwards[module] = lambda x, block=module: _attention(block, group, x)
        elif isinstance(module, nn.Conv3d) and module.padding[-2]:
            raise ValueError(f"a {module} padding rows by itself cannot decode in bands")
    return forwards_replaced(forwards, vae)


def parallel_decode(vae: Any, latents: torch.Tensor, group: dist.ProcessGroup | None, dst: int = 0) -> torch.Tensor:
    """`vae`'s decode of `latents` (B, C, F, h, w), each rank of `group` decoding a band of rows:
    the whole clip (B, 3, F', 16 h, 16 w) on group rank `dst`, this rank's band (B, 3, F', 16 h_r, 16 w)
    elsewhere. Every band has at least one latent row (`h` >= the group's size)."""
    with _band_modules(vae, group):
        return decode_bands_to(latents, group, dst, lambda band, _lo: vae._decode(band))


def decode_split(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, `vae.decode` (as the HunyuanVideo 1.5 pipelines call it) is `parallel_decode`
    over `group`: the clip on its rank 0, each other rank's own band (which nobody reads)."""
    return decode_replaced(vae, lambda z: parallel_decode(vae, z, group))
