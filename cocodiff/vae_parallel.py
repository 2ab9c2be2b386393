"""Patch-parallel VAE decode: each rank decodes a horizontal band of the latent, exactly.

Every rank holds the whole final latent (the pipelines end with it on every rank), so no
latent moves: rank r decodes its own rows `own_r` (`split_sizes` of the latent's rows) plus a
halo of `halo` rows above and below (clipped at the image's edges), crops the halo off its
output, and one all-gather puts the bands together on every rank:

    latent (B, C, h, w) -> rows [lo_r - halo, hi_r + halo) -> decoder -> (B, 3, 8 (hi_r - lo_r), 8 w)
                        -> all-gather -> (B, 3, 8 h, 8 w)

Why it equals the whole decode (up to the order in which sums are added):
- Convolutions: a row of the output depends on the latent rows within the decoder's receptive
  radius; `receptive_halo` adds up every convolution's radius in latent rows (a 3x3 convolution at
  8x the latent's resolution reaches 1/8 of a latent row) plus one for nearest upsampling. Rows
  of the band further than that from its cut edge are the whole decode's; the halo keeps the
  cut edges that far from the rows a rank owns.
- GroupNorm normalizes with statistics over the whole image, not the band: during the decode
  every GroupNorm of the decoder takes its mean and variance from the owned rows of every rank
  (two all-reduces of (B, G) sums, in float64) and normalizes the band, halo included, with them.
  By induction over the layers the owned rows are exact at every layer, so the statistics are.
- The mid-block's self-attention (the FLUX.1 / SD3 VAEs have one; the tiny presets do not) sees
  every position: each rank computes Q for its band and attends to K and V of the owned rows of
  every rank, gathered (`_GatheredKVProcessor`).

Peak memory per rank follows the band's rows (own + up to 2 x halo) instead of the image's.
Supported: diffusers' 2D `Decoder` behind `post_quant_conv` (AutoencoderKL, AutoencoderKLFlux2).
The Wan video VAE splits into bands too, exchanging halo rows per convolution instead
(vae_parallel_video.py); the other 3D VAEs (LTX-Video, HunyuanVideo 1.5, Qwen-Image's) decode whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm.ulysses import all_reduce, bounded
from .errors import UsageError
from .sizes import split_sizes

__all__ = ["PARALLEL_VAE_CHOICES", "decode_split", "gather_rows", "latent_rows", "parallel_decode", "receptive_halo",
           "supports", "use_parallel_vae"]

PARALLEL_VAE_CHOICES = ("auto", "on", "off")


def supports(vae: Any) -> bool:
    """Whether `vae` decodes through diffusers' 2D `Decoder` (what `parallel_decode` splits)."""
    from diffusers.models.autoencoders.vae import Decoder

    return isinstance(getattr(vae, "decoder", None), Decoder) and hasattr(vae, "post_quant_conv")


def receptive_halo(vae: Any) -> int:
    """Latent rows a band needs beyond its own on each side for its own rows to be exact.

    Found by decoding a 4x4 latent with a hook on every convolution: the sum over convolutions of
    their radius (dilation x (kernel - 1) / 2 rows at their input's resolution) in latent rows,
    rounded up, plus one row for nearest upsampling's alignment. Cached on the VAE.
    """
    cached = getattr(vae, "_cocodiff_halo", None)
    if cached is not None:
        return cached
    reach: list[float] = []

    def hook(conv: nn.Conv2d, args: tuple[torch.Tensor, ...]) -> None:
        radius = conv.dilation[0] * (conv.kernel_size[0] - 1) // 2
        reach.append(radius * 4 / args[0].shape[-2])  # in latent rows: the probe latent has 4

    convs = [m for m in vae.decoder.modules() if isinstance(m, nn.Conv2d)]
    hooks = [conv.register_forward_pre_hook(hook) for conv in convs]
    try:
        parameter = next(vae.decoder.parameters())
        probe = torch.zeros(1, vae.config.latent_channels, 4, 4, dtype=parameter.dtype, device=parameter.device)
        with torch.no_grad():
            vae.decoder(probe)
    finally:
        for handle in hooks:
            handle.remove()
    vae._cocodiff_halo = math.ceil(sum(reach)) + 1
    return vae._cocodiff_halo


def latent_rows(vae: Any, height: int) -> int:
    """The latent's rows for pictures `height` pixels high, for the VAEs this module or
    vae_parallel_video splits (2D: 2 ** (levels - 1) pixels a row; Wan: its spatial factor)."""
    from . import vae_parallel_video

    if vae_parallel_video.supports(vae):
        return vae_parallel_video.latent_rows(vae, height)
    return height // 2 ** (len(getattr(vae.config, "block_out_channels", ())) - 1)


def use_parallel_vae(choice: str, vae: Any, latent_rows: int, world: int) -> bool:
    """`--parallel-vae` for a run: `on` where supported (an error where it cannot split), `off`
    never, `auto` on where supported and every band's own rows are at least twice its halo
    (smaller bands would mostly decode their neighbours' rows). The Wan video VAE's halo is the
    one row each convolution borrows from a neighbour (vae_parallel_video.py)."""
    from . import vae_parallel_video

    if choice == "off" or world < 2:
        return False
    video = vae_parallel_video.supports(vae)
    if not supports(vae) and not video:
        if choice == "on":
            raise UsageError(f"--parallel-vae on: {type(vae).__name__} is not split (only 2D AutoencoderKL-style VAEs "
                             f"and the Wan video VAE, AutoencoderKLWan); use auto or off")
        return False
    if choice == "on":
        if latent_rows < world:
            raise UsageError(f"--parallel-vae on: the image has {latent_rows} latent rows, fewer than the {world} ranks")
        return True
    halo = vae_parallel_video.HALO_ROWS if video else receptive_halo(vae)
    return latent_rows // world >= 2 * halo


@dataclass(frozen=True)
class _Band:
    """This rank's rows of the latent: `rows` decoded from `start`, of which [top, top + own) are its own."""

    start: int
    rows: int
    top: int
    own: int
    group: dist.ProcessGroup | None

    def owned(self, x: torch.Tensor) -> torch.Tensor:
        """x's owned rows (dim -2), x at any of the decoder's resolutions."""
        scale = x.shape[-2] // self.rows
        return x[..., self.top * scale:(self.top + self.own) * scale, :]


def _band_group_norm(norm: nn.GroupNorm, band: _Band, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` with the mean and variance of the whole image: the owned rows of every rank."""
    batch, groups = x.shape[0], norm.num_groups
    own = band.owned(x).reshape(batch, groups, -1).double()  # (B, G, n_r)
    totals = torch.stack([own.sum(-1), torch.full_like(own[..., 0], own.shape[-1])])  # (2, B, G)
    all_reduce(totals, band.group, "vae norm (all-reduce)")
    mean = totals[0] / totals[1]
    squares = ((own - mean[..., None]) ** 2).sum(-1)  # (B, G)
    all_reduce(squares, band.group, "vae norm (all-reduce)")
    rstd = torch.rsqrt(squares / totals[1] + norm.eps)
    y = (x.reshape(batch, groups, -1).float() - mean[..., None].float()) * rstd[..., None].float()
    y = y.reshape(x.shape)
    if norm.affine:
        shape = (1, -1) + (1,) * (x.ndim - 2)
        y = y * norm.weight.float().reshape(shape) + norm.bias.float().reshape(shape)
    return y.to(x.dtype)


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Every rank's `x` (uneven along `dim`) concatenated in rank order, on every rank."""
    world = dist.get_world_size(group)
    sizes = torch.tensor([x.shape[dim]], device=x.device)
    everyone = [torch.empty_like(sizes) for _ in range(world)]
    bounded(dist.all_gather(everyone, sizes, group=group, async_op=True), "vae gather")
    lengths = [int(s.item()) for s in everyone]
    padded = F.pad(x, [0, 0] * (x.ndim - 1 - dim % x.ndim) + [0, max(lengths) - x.shape[dim]]).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(world)]
    bounded(dist.all_gather(pieces, padded, group=group, async_op=True), "vae gather")
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, lengths)], dim=dim)


class _GatheredKVProcessor:
    """The VAE mid-block's self-attention over the whole image: Q of this band, K and V of the
    owned rows of every rank (diffusers' AttnProcessor2_0 for a 4D input, K/V gathered)."""

    def __init__(self, band: _Band) -> None:
        self.band = band

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, temb: Any = None, **_: Any) -> torch.Tensor:
        residual = hidden_states
        batch, channels, height, width = hidden_states.shape
        h = attn.group_norm(hidden_states) if attn.group_norm is not None else hidden_states  # (B, C, H_b, W)
        own = self.band.owned(h)  # (B, C, own, W)
        h, own = (t.flatten(2).transpose(1, 2) for t in (h, own))  # (B, H_b W, C), (B, own W, C)
        heads = attn.heads
        query = attn.to_q(h)
        key = gather_rows(attn.to_k(own), self.band.group, 1)  # (B, H W, C): the whole image's rows, in order
        value = gather_rows(attn.to_v(own), self.band.group, 1)
        query, key, value = (t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value)  # (B, heads, H_b W, D)
        out = out.transpose(1, 2).reshape(batch, -1, channels).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(1, 2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


@contextlib.contextmanager
def _band_modules(decoder: nn.Module, band: _Band) -> Iterator[None]:
    """Within the block, the decoder's GroupNorms and attentions work on `band` (instance attributes)."""
    from diffusers.models.attention_processor import Attention

    norms = [m for m in decoder.modules() if isinstance(m, nn.GroupNorm)]
    attentions = [m for m in decoder.modules() if isinstance(m, Attention)]
    processors = [a.processor for a in attentions]
    for norm in norms:
        norm.forward = lambda x, norm=norm: _band_group_norm(norm, band, x)
    for attention in attentions:
        attention.processor = _GatheredKVProcessor(band)
    try:
        yield
    finally:
        for norm in norms:
            del norm.forward
        for attention, processor in zip(attentions, processors):
            attention.processor = processor


def parallel_decode(vae: Any, latents: torch.Tensor, group: dist.ProcessGroup | None,
                    halo: int | None = None) -> torch.Tensor:
    """`vae`'s decode of `latents` (B, C, h, w), each rank of `group` decoding a band; the
    whole (B, 3, f h, f w) on every rank. `halo`: latent rows beyond a band (default
    `receptive_halo`, exact; smaller ones are for measuring what they cost)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = latents.shape[-2]
    if rows < world:
        raise ValueError(f"{rows} latent rows cannot be split over {world} ranks")
    halo = receptive_halo(vae) if halo is None else halo
    sizes = split_sizes(rows, world)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    start, stop = max(0, lo - halo), min(rows, hi + halo)
    band = _Band(start=start, rows=stop - start, top=lo - start, own=hi - lo, group=group)
    z = latents[..., start:stop, :]
    with _band_modules(vae.decoder, band):
        if vae.post_quant_conv is not None:
            z = vae.post_quant_conv(z)  # 1x1: row by row
        decoded = band.owned(vae.decoder(z))  # (B, 3, f own, f w)
    return gather_rows(decoded, band.group, -2)


@contextlib.contextmanager
def decode_split(vae: Any, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Within the block, `vae.decode` (as the pipelines call it) is `parallel_decode` over `group`
    (the Wan video VAE's: `vae_parallel_video.decode_split`)."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    from . import vae_parallel_video

    if vae_parallel_video.supports(vae):
        with vae_parallel_video.decode_split(vae, group):
            yield
        return

    def decode(z: torch.Tensor, return_dict: bool = True, generator: Any = None) -> Any:
        sample = parallel_decode(vae, z, group)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    vae.decode = decode
    try:
        yield
    finally:
        del vae.decode
