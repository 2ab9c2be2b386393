"""Patch-parallel VAE decode: each rank decodes a horizontal band of the latent, exactly.

Every rank holds the whole final latent (the pipelines end with it on every rank), so no
latent moves: rank r decodes its own rows [lo_r, hi_r) (`split_sizes` of the latent's rows), no
row decoded twice, and one all-gather puts the bands together on every rank:

    latent (B, C, h, w) -> rows [lo_r, hi_r) -> decoder -> (B, 3, 8 (hi_r - lo_r), 8 w)
                        -> all-gather -> (B, 3, 8 h, 8 w)

Why it equals the whole decode (up to the order in which sums are added), module by module:
- Convolutions (every 3x3 `Conv2d` of the decoder, stride 1): instead of zero-padding its band's
  rows, each one takes its `padding` rows (one) from each neighbouring band, point to point
  (`bands.band_conv`; zeros at the image's edges, as the padding there). The 1x1 ones
  (post_quant_conv, the resnets' shortcuts) work row by row: stock.
- Nearest 2x upsampling: an upsampled band's rows are its own rows doubled, the same rows of the
  whole upsampled image; the convolution after it borrows its row at the new resolution.
- GroupNorm normalizes with statistics over the whole image, not the band: every GroupNorm of the
  decoder combines the mean and variance of every rank's band (two all-reduces of (B, G) values,
  in float64) and normalizes its band with them.
- The mid-block's self-attention (the FLUX.1 / SD3 VAEs have one; the tiny presets do not) sees
  every position: each rank computes Q for its band and attends to K and V of every rank's band,
  gathered (`_GatheredKVProcessor`).
SiLU and the residual additions look at their own pixel only.

The encode of an image input (image-to-image, inpainting: `encode_split`, `parallel_encode`) is
split the same way, the other way round: each rank encodes a band of the image's pixel rows on
multiples of the VAE's downsampling f (`split_sizes` of the latent rows, so every band is whole
latent rows), and one all-gather joins the latent distribution's moments:

    image (B, 3, f h, f w) -> rows [f lo_r, f hi_r) -> encoder, quant_conv -> (B, 2 C, hi_r - lo_r, w)
                           -> all-gather -> (B, 2 C, h, w) -> DiagonalGaussianDistribution

Its 3x3 convolutions, GroupNorms and mid-block attention are the decode's; diffusers' Downsample2D
(pads one zero row below and one zero column right, then a 3x3 convolution of stride 2 without
padding) reads rows 2 i .. 2 i + 2 for its row i: a band of an even number of rows needs only the
first row of the band below (zeros below the image's last row, as that padding), `_band_downsample`.

Peak memory per rank follows the band's rows (h / N, plus one borrowed row each side per
convolution) instead of the image's. The Wan, LTX-Video and HunyuanVideo 1.5 VAEs are split the
same way (wan.py, ltx.py, hunyuanvideo15.py beside this module; the shared pieces are in
bands.py; the router is the package's `__init__`). Supported: diffusers' 2D `Decoder`
behind `post_quant_conv` and its 2D `Encoder` before `quant_conv` (AutoencoderKL,
AutoencoderKLFlux2, whose latent batch norm and patchify are the pipeline's, after the encode);
Qwen-Image's 3D VAE decodes whole, and every 3D VAE encodes whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocodiff.config.sizes import split_sizes
from cocodiff.distributed.comm.halo import halo_rows
from cocodiff.distributed.comm.ulysses import all_reduce

from .bands import (
    decode_replaced,
    band_conv,
    check_conv,
    forwards_replaced,
    gather_rows,
)

__all__ = ["contiguous_inputs", "decode_split", "encode_split", "gather_rows", "parallel_decode", "parallel_encode",
           "supports", "supports_encode"]



def supports(vae: Any) -> bool:
    """Whether `vae` decodes through diffusers' 2D `Decoder` (what `parallel_decode` splits)."""
    from diffusers.models.autoencoders.vae import Decoder

    return isinstance(getattr(vae, "decoder", None), Decoder) and hasattr(vae, "post_quant_conv")


def supports_encode(vae: Any) -> bool:
    """Whether `vae` encodes through diffusers' 2D `Encoder` (what `parallel_encode` splits)."""
    from diffusers.models.autoencoders.vae import Encoder

    return isinstance(getattr(vae, "encoder", None), Encoder) and hasattr(vae, "quant_conv")


def _contiguous(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0].contiguous(), *args[1:])


def contiguous_inputs(vae: Any) -> None:
    """`vae`'s 2D encoder and decoder take their input in the contiguous (NCHW) memory format, in
    one process and in bands alike (a forward pre-hook each, once).

    The pipelines' image processors give an image as a (B, 3, H, W) view of (B, H, W, 3) pixels:
    channels-last strides, which every convolution of the encoder keeps. On the CPU, PyTorch's
    GroupNorm of a channels-last tensor takes the variance as E[x^2] - E[x]^2 summed in float32,
    which cancels where a group's mean is large against its spread (a flat background, the masked
    image's zeros): the whole encode's moments come out ~3e-4 of their scale off the float64 ones,
    and different for each thread count, where the contiguous kernel and `_band_group_norm` are
    within ~1e-6. Same values in, another kernel: the stock encode becomes the exact one that the
    band encode equals."""
    for module in (getattr(vae, "encoder", None), getattr(vae, "decoder", None)):
        if isinstance(module, nn.Module) and not getattr(module, "_contiguous_inputs", False):
            module.register_forward_pre_hook(_contiguous)
            module._contiguous_inputs = True


def own_dtype_inputs(vae: Any) -> None:
    """`vae`'s 2D encoder takes its pixels in its own dtype (a forward pre-hook, once).
    ZImageOmniPipeline hands it its references in bfloat16 whatever the VAE's dtype (its
    `prepare_image_latents`: `vae.encode(image.bfloat16())`), which a float32 VAE refuses; cast
    here, the pixels keep the bfloat16 rounding the pipeline gave them. Another dtype's input
    passes unchanged."""
    encoder = getattr(vae, "encoder", None)
    if isinstance(encoder, nn.Module) and not getattr(encoder, "_own_dtype_inputs", False):
        encoder.register_forward_pre_hook(lambda module, args: (args[0].to(next(module.parameters()).dtype), *args[1:]))
        encoder._own_dtype_inputs = True


def _band_group_norm(norm: nn.GroupNorm, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` of a band x (B, C, h_r, W) with the mean and variance of the whole image: every
    rank's band. Each band's own mean and variance (float32 reductions, no copy of the band) are
    combined in float64 as Chan et al.'s parallel variance: M2 = sum_r M2_r + n_r (mean_r - mean)^2."""
    batch, groups = x.shape[0], norm.num_groups
    band = x.reshape(batch, groups, -1).float()  # (B, G, n_r)
    var_r, mean_r = (t.double() for t in torch.var_mean(band, dim=-1, correction=0))  # (B, G) each
    n_r = band.shape[-1]
    totals = torch.stack([torch.full_like(mean_r, n_r), n_r * mean_r])  # (2, B, G)
    all_reduce(totals, group, "vae norm (all-reduce)")
    mean = totals[1] / totals[0]
    m2 = n_r * var_r + n_r * (mean_r - mean) ** 2  # (B, G): this band's squares about the whole mean
    all_reduce(m2, group, "vae norm (all-reduce)")
    rstd = torch.rsqrt(m2 / totals[0] + norm.eps).float()[..., None]  # (B, G, 1)
    y = (band - mean.float()[..., None]).mul_(rstd).reshape(x.shape)  # the only band-sized tensor made
    if norm.affine:
        shape = (1, -1) + (1,) * (x.ndim - 2)
        y = y.mul_(norm.weight.float().reshape(shape)).add_(norm.bias.float().reshape(shape))
    return y.to(x.dtype)


class _GatheredKVProcessor:
    """The VAE mid-block's self-attention over the whole image: Q of this band, K and V of every
    rank's band (diffusers' AttnProcessor2_0 for a 4D input, K/V gathered)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, temb: Any = None, **_: Any) -> torch.Tensor:
        residual = hidden_states
        batch, channels, height, width = hidden_states.shape
        h = attn.group_norm(hidden_states) if attn.group_norm is not None else hidden_states  # (B, C, h_r, W)
        h = h.flatten(2).transpose(1, 2)  # (B, h_r W, C)
        heads = attn.heads
        query = attn.to_q(h)
        key = gather_rows(attn.to_k(h), self.group, 1)  # (B, H W, C): the whole image's rows, in order
        value = gather_rows(attn.to_v(h), self.group, 1)
        query, key, value = (t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value)  # (B, heads, h_r W, D)
        out = out.transpose(1, 2).reshape(batch, -1, channels).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(1, 2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def _band_downsample(down: nn.Module, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """diffusers' `Downsample2D` of an encoder (zero row below, zero column right, 3x3 convolution
    of stride 2 without padding) on a band (B, C, h_r, W) of an even number of rows starting on an
    even row: its row i reads rows 2 i .. 2 i + 2, so the band's last row reads the first row of the
    band below (zeros on the last rank: the padding row) -> (B, C', h_r / 2, W / 2)."""
    _, below = halo_rows(x, 1, group)  # (B, C, 1, W); the row sent up is not needed here
    rows, width = x.shape[-2:]
    out = x.new_zeros((*x.shape[:-2], rows + 1, width + 1))  # (B, C, h_r + 1, W + 1)
    out[..., :rows, :width] = x
    out[..., rows:, :width] = below
    return down.conv(out)


def _check_downsample(down: nn.Module) -> None:
    """A ValueError unless `down` is the encoder's Downsample2D that `_band_downsample` splits."""
    conv = getattr(down, "conv", None)
    if not (down.use_conv and down.padding == 0 and down.norm is None and isinstance(conv, nn.Conv2d)
            and conv.kernel_size == (3, 3) and conv.stride == (2, 2) and conv.padding == (0, 0)):
        raise ValueError(f"a Downsample2D with padding {down.padding} and {conv} cannot encode in bands")


@contextlib.contextmanager
def _band_modules(decoder: nn.Module, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Within the block, the decoder's (or encoder's) row-padding convolutions, GroupNorms,
    attentions and downsamplers work on bands of `group` (instance attributes)."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.downsampling import Downsample2D

    forwards: dict[nn.Module, Callable[..., torch.Tensor]] = {}
    for module in decoder.modules():
        if isinstance(module, nn.Conv2d) and module.padding[0]:  # 1x1 ones stay stock: row by row
            check_conv(module, module.padding[0])
            forwards[module] = lambda x, conv=module: band_conv(conv, group, x)
        elif isinstance(module, nn.GroupNorm):
            forwards[module] = lambda x, norm=module: _band_group_norm(norm, group, x)
        elif isinstance(module, Downsample2D):  # its convolution pads nothing: left stock
            _check_downsample(module)
            forwards[module] = lambda x, down=module: _band_downsample(down, group, x)
    attentions = [m for m in decoder.modules() if isinstance(m, Attention)]
    processors = [a.processor for a in attentions]
    try:
        for attention in attentions:
            attention.processor = _GatheredKVProcessor(group)
        with forwards_replaced(forwards):
            yield
    finally:
        for attention, processor in zip(attentions, processors):
            attention.processor = processor


def parallel_decode(vae: Any, latents: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`vae`'s decode of `latents` (B, C, h, w), each rank of `group` decoding a band of rows; the
    whole (B, 3, f h, f w) on every rank. Every band has at least one latent row (`h` >= the group's size)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = latents.shape[-2]
    if rows < world:
        raise ValueError(f"{rows} latent rows cannot be split over {world} ranks")
    sizes = split_sizes(rows, world)
    lo = sum(sizes[:rank])
    z = latents[..., lo:lo + sizes[rank], :]  # (B, C, h_r, w)
    with _band_modules(vae.decoder, group):
        if vae.post_quant_conv is not None:
            z = vae.post_quant_conv(z)  # 1x1: row by row
        band = vae.decoder(z)  # (B, 3, f h_r, f w)
    return gather_rows(band, group, -2)


def decode_split(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, `vae.decode` (as the pipelines call it) is `parallel_decode` over `group`."""
    return decode_replaced(vae, lambda z, generator: parallel_decode(vae, z, group))


def parallel_encode(vae: Any, images: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`vae`'s encoder and quant_conv on `images` (B, 3, H, W), each rank of `group` encoding a band
    of rows: the whole moments (B, 2 C, H / f, W / f) on every rank, f the encoder's downsampling.
    H is a multiple of f with at least one latent row per rank."""
    from diffusers.models.downsampling import Downsample2D

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    factor = 2 ** sum(isinstance(m, Downsample2D) for m in vae.encoder.modules())
    height = images.shape[-2]
    if height % factor or height // factor < world:
        raise ValueError(f"an image of {height} rows cannot be encoded in bands of whole latent rows "
                         f"({factor} pixel rows each) on {world} ranks")
    sizes = split_sizes(height // factor, world)
    lo = factor * sum(sizes[:rank])
    x = images[..., lo:lo + factor * sizes[rank], :]  # (B, 3, f h_r, W)
    with _band_modules(vae.encoder, group):
        band = vae.encoder(x)  # (B, 2 C, h_r, W / f)
        if vae.quant_conv is not None:
            band = vae.quant_conv(band)  # 1x1: row by row
    return gather_rows(band, group, -2)


@contextlib.contextmanager
def encode_split(vae: Any, group: dist.ProcessGroup | None) -> Iterator[list[tuple[int, ...]]]:
    """Within the block, `vae.encode` (as the pipelines call it) is `parallel_encode` over `group`,
    returning the stock `AutoencoderKLOutput`. Yields a list that gains the shape of every image
    encoded in bands (an inpainting run encodes the image and the masked image)."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    encoded: list[tuple[int, ...]] = []

    def encode(x: torch.Tensor, return_dict: bool = True) -> Any:
        posterior = DiagonalGaussianDistribution(parallel_encode(vae, x, group))
        encoded.append(tuple(x.shape))
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    vae.encode = encode
    try:
        yield encoded
    finally:
        del vae.encode
