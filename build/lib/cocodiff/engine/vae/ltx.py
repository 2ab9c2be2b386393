"""Patch-parallel decode of the LTX-Video VAE (AutoencoderKLLTXVideo: LTX-Video 0.9 to 0.9.7), exactly.

Every rank holds the whole final latent (B, C, F, h, w); rank r decodes rows [lo_r, hi_r) of
every frame (`split_sizes` of the latent's rows) through diffusers' own `_decode` (its decoder,
timestep conditioning and unpatchify untouched) and rank 0 gathers the bands into the clip:

    latent (B, C, F, h, w) -> rows [lo_r, hi_r) -> decoder -> (B, 3, F', f (hi_r - lo_r), f w)
                           -> gather on rank 0 -> (B, 3, F', f h, f w)

Why it equals the whole decode (up to the order in which sums are added), module by module:
- Convolutions (the 3x3x3 `LTXVideoCausalConv3d`s, whose inner Conv3d zero-pads rows and columns
  by one, stride 1): instead of zero-padding its band's rows, each one takes one row from each
  neighbouring band (`bands.band_conv`, `comm.halo.halo_rows`; zeros at the image's edges, as
  the padding there). Their time padding repeats the first (and last) frame: the band's own rows.
- Norms: RMSNorm over channels and the shortcuts' LayerNorm over channels, per pixel; no GroupNorm
  and no attention in the decoder: nothing to do.
- The upsamplers (`LTXVideoUpsampler3d`: a convolution, then depth to space in time, rows and
  columns, plus the 0.9.5 residual, the same shuffle of the input) and the final unpatchify move
  channels of latent row r into rows s r .. s r + s - 1: a band of rows maps to the same band of
  the upsampled image, on multiples of s.
- Timestep conditioning (0.9.1 and later): a per-channel scale and shift from the timestep, the
  same on every row.
- Noise injection (`decoder_inject_noise`, 0.9.1): each resnet draws an (H, W) noise from the
  default generator of the device after its convolutions (the decoder passes no generator). Each
  rank draws the whole frame's noise, as the whole decode does, and adds its band's rows; rank
  0's generator state is broadcast first, so every rank draws what rank 0 decoding alone would
  (`_noise_rows`). The ranks' default generators leave the decode in that state.

Tiling (`use_tiling`) is off within the band decode: its tiles would blend differently per band.
The frame-wise decode (`use_framewise_decoding`) cuts the clip in time only and runs unchanged.
The encoder (image-to-video) runs whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cocodiff.distributed.comm.ulysses import bounded

from .bands import (
    HALO_ROWS,
    band_conv,
    check_conv,
    decode_bands_to,
    decode_replaced,
    forwards_replaced,
)

__all__ = ["HALO_ROWS", "decode_split", "latent_rows", "parallel_decode", "supports"]

_NOISE_SCALES = ("per_channel_scale1", "per_channel_scale2")
"""An `LTXVideoResnetBlock3d`'s noise scales, one after each of its convolutions (`conv1`, `conv2`)."""


def supports(vae: Any) -> bool:
    """Whether `vae` is the LTX-Video VAE (what `parallel_decode` splits)."""
    from diffusers import AutoencoderKLLTXVideo

    return isinstance(vae, AutoencoderKLLTXVideo)


def latent_rows(vae: Any, height: int) -> int:
    """The latent's rows for pictures `height` pixels high (LTX-Video: 32 pixels a row, the tiny preset 16)."""
    return height // vae.spatial_compression_ratio


def _noise_rows(conv: nn.Module, scale: torch.Tensor, lo: int, rows: int, total: int, x: torch.Tensor) -> torch.Tensor:
    """`conv(x)` plus the resnet's noise: the band's rows [s lo, s (lo + rows)) of the whole frame's
    (s H, W) noise, as the stock block adds it after `conv` (s: the band's rows per latent row)."""
    out = type(conv).forward(conv, x)  # (B, C, T, s rows, W)
    factor = out.shape[-2] // rows
    noise = torch.randn((factor * total, out.shape[-1]), device=out.device, dtype=out.dtype)[None]  # (1, s H, W)
    noise = noise[:, factor * lo:factor * (lo + rows)]  # (1, s rows, W)
    return out + (noise * scale)[None, :, None, ...]  # (1, C, 1, s rows, W)


def _same_noise(vae: Any, group: dist.ProcessGroup | None) -> None:
    """Every rank's default generator of the VAE's device in rank 0's state (the noise rank 0 would draw)."""
    device = vae.device
    on = () if device.type == "cpu" else (device,)
    module = torch if device.type == "cpu" else torch.get_device_module(device)
    state = module.get_rng_state(*on).to(device)  # a byte tensor, on the device the backend sends from
    root = 0 if group is None else dist.get_global_rank(group, 0)
    bounded(dist.broadcast(state, src=root, group=group, async_op=True), "vae noise state")
    module.set_rng_state(state.cpu(), *on)


@contextlib.contextmanager
def _band_modules(vae: Any, group: dist.ProcessGroup | None, lo: int, rows: int, total: int) -> Iterator[None]:
    """Within the block, the decoder's row-padding convolutions work on the band of latent rows
    [lo, lo + rows) of `total`, and its resnets add the band's rows of the whole frame's noise."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoResnetBlock3d

    forwards: dict[nn.Module, Callable[..., torch.Tensor]] = {}
    scales: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in vae.decoder.modules():
        if isinstance(module, nn.Conv3d) and module.padding[-2]:  # 1x1x1 shortcuts stay stock: row by row
            check_conv(module, module.padding[-2])
            forwards[module] = lambda x, conv=module: band_conv(conv, group, x)
        if isinstance(module, LTXVideoResnetBlock3d):
            for name, conv in zip(_NOISE_SCALES, (module.conv1, module.conv2)):
                scale = getattr(module, name)
                if scale is not None:
                    forwards[conv] = lambda x, conv=conv, scale=scale: _noise_rows(conv, scale, lo, rows, total, x)
                    scales.append((module, name, scale))
    try:
        for module, name, _ in scales:
            setattr(module, name, None)  # the stock block's own noise (of the band's rows) off
        if scales:
            _same_noise(vae, group)
        with forwards_replaced(forwards, vae):
            yield
    finally:
        for module, name, scale in scales:
            setattr(module, name, scale)


def parallel_decode(vae: Any, latents: torch.Tensor, group: dist.ProcessGroup | None,
                    temb: torch.Tensor | None = None, dst: int = 0) -> torch.Tensor:
    """`vae`'s decode of `latents` (B, C, F, h, w) at timestep `temb` (B,) (0.9.1's timestep
    conditioning; None without it), each rank of `group` decoding a band of rows: the whole clip
    (B, 3, F', f h, f w) on group rank `dst`, this rank's band (B, 3, F', f h_r, f w) elsewhere.
    Every band has at least one latent row (`h` >= the group's size)."""
    total = latents.shape[-2]

    def decode(band: torch.Tensor, lo: int) -> torch.Tensor:
        with _band_modules(vae, group, lo, band.shape[-2], total):
            return vae._decode(band, temb).sample

    return decode_bands_to(latents, group, dst, decode)


def decode_split(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, `vae.decode` (as the LTX pipelines call it, with the decode timestep) is
    `parallel_decode` over `group`: the clip on its rank 0, each other rank's own band (which nobody reads)."""
    return decode_replaced(vae, lambda z, temb: parallel_decode(vae, z, group, temb))
