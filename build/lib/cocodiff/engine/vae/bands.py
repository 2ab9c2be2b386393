"""What the band decodes share: the 2D one (engine/vae/kl2d.py) and the video ones (Wan, LTX-Video,
HunyuanVideo 1.5: engine/vae/wan.py, engine/vae/ltx.py, engine/vae/hunyuanvideo15.py).

Each rank of a group decodes a horizontal band of the latent's rows (rank order = top to bottom),
no rows decoded twice: every convolution that pads rows takes them from the neighbouring bands
instead (`padded`, one row of each for a 3x3 convolution: `HALO_ROWS`), and the bands are put
together in rank order at the end (`gather_rows`, uneven bands included):

    band (..., h_r, W) -> padded -> (..., p + h_r + p, q + W + q) -> convolution without padding -> (..., h_r, W')
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocodiff.config.sizes import split_sizes
from cocodiff.distributed.comm.halo import halo_rows
from cocodiff.distributed.comm.ulysses import bounded

__all__ = ["HALO_ROWS", "band_conv", "check_conv", "decode_bands_to", "decode_replaced", "forwards_replaced", "gather_rows", "gather_rows_to", "padded"]

HALO_ROWS = 1
"""Rows a band borrows from each neighbour per convolution (every 3x3 convolution's padding)."""


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Every rank's `x` (uneven along `dim`) concatenated in rank order, on every rank."""
    world = dist.get_world_size(group)
    sizes = torch.tensor([x.shape[dim]], device=x.device)
    everyone = [torch.empty_like(sizes) for _ in range(world)]
    bounded(dist.all_gather(everyone, sizes, group=group, async_op=True), "vae gather")
    lengths = [int(s.item()) for s in everyone]
    padded_x = F.pad(x, [0, 0] * (x.ndim - 1 - dim % x.ndim) + [0, max(lengths) - x.shape[dim]]).contiguous()
    pieces = [torch.empty_like(padded_x) for _ in range(world)]
    bounded(dist.all_gather(pieces, padded_x, group=group, async_op=True), "vae gather")
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, lengths)], dim=dim)


def gather_rows_to(x: torch.Tensor, group: dist.ProcessGroup | None, rows: list[int], dst: int) -> torch.Tensor | None:
    """Every rank's `x` (..., rows[r], W) stacked along rows in rank order on group rank `dst`; None elsewhere."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    even = F.pad(x, [0, 0, 0, max(rows) - x.shape[-2]]).contiguous()  # gather needs one shape
    pieces = [torch.empty_like(even) for _ in range(world)] if rank == dst else None
    root = dst if group is None else dist.get_global_rank(group, dst)
    bounded(dist.gather(even, pieces, dst=root, group=group, async_op=True), "vae gather")
    if pieces is None:
        return None
    return torch.cat([p[..., :n, :] for p, n in zip(pieces, rows)], dim=-2)


def decode_bands_to(latents: torch.Tensor, group: dist.ProcessGroup | None, dst: int,
                    decode: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """A video VAE's decode of `latents` (B, C, F, h, w) in bands: `decode(band, lo)` decodes this
    rank's rows [lo, lo + h_r) (`split_sizes` of h) into (B, 3, F', f h_r, f w); the whole clip
    (B, 3, F', f h, f w) on group rank `dst`, this rank's band elsewhere. Every band has at least
    one latent row (`h` >= the group's size)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = latents.shape[-2]
    if rows < world:
        raise ValueError(f"{rows} latent rows cannot be split over {world} ranks")
    sizes = split_sizes(rows, world)
    lo = sum(sizes[:rank])
    band = decode(latents[..., lo:lo + sizes[rank], :], lo)  # (B, 3, F', f h_r, f w)
    factor = band.shape[-2] // sizes[rank]
    whole = gather_rows_to(band, group, [n * factor for n in sizes], dst)
    return band if whole is None else whole


@contextlib.contextmanager
def decode_replaced(vae: Any, decode_bands: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Within the block, `vae.decode` (called as the pipelines call the stock one, whose signature
    it takes) returns `decode_bands(z, **the stock decode's other arguments)`, `return_dict` aside,
    in the stock `DecoderOutput` or tuple (AutoencoderKL's `generator`, LTX-Video's `temb`)."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    stock = inspect.signature(vae.decode)

    def decode(*args: Any, **kwargs: Any) -> Any:
        call = stock.bind(*args, **kwargs)
        call.apply_defaults()
        arguments = dict(call.arguments)
        return_dict = arguments.pop("return_dict")
        sample = decode_bands(**arguments)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    vae.decode = decode
    try:
        yield
    finally:
        del vae.decode


@contextlib.contextmanager
def forwards_replaced(forwards: dict[nn.Module, Callable[..., Any]], vae: Any = None) -> Iterator[None]:
    """Within the block, each module of `forwards` runs its function there (an instance attribute,
    deleted after), and `vae`'s tiling, where given, is off: the bands replace it (its tiles would
    not match across ranks)."""
    tiling = getattr(vae, "use_tiling", False)
    for module, forward in forwards.items():
        module.forward = forward
    if vae is not None:
        vae.use_tiling = False
    try:
        yield
    finally:
        if vae is not None:
            vae.use_tiling = tiling
        for module in forwards:
            del module.forward


def padded(x: torch.Tensor, rows: int, columns: int, frames: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`x` (..., [T,] h_r, W) zero-padded by `columns` on both sides, `frames` in front (5D), and
    `rows` of each neighbouring band's rows above and below: one new tensor, as F.pad makes."""
    above, below = halo_rows(x, rows, group)  # (..., rows, W) each
    shape = list(x.shape)
    shape[-2] += 2 * rows
    shape[-1] += 2 * columns
    if x.ndim == 5:
        shape[2] += frames
    out = x.new_zeros(shape)  # (..., [frames + T,] rows + h_r + rows, columns + W + columns)
    inner = out[:, :, frames:] if x.ndim == 5 else out
    inner = inner[..., columns:columns + x.shape[-1]]
    inner[..., :rows, :] = above
    inner[..., rows:rows + x.shape[-2], :] = x
    inner[..., rows + x.shape[-2]:, :] = below
    return out


def check_conv(conv: nn.Module, rows: int) -> None:
    """A ValueError unless `conv`, padding `rows` rows, can run on bands (stride 1 along rows, zero padding)."""
    if rows and (conv.stride[-2] != 1 or conv.padding_mode != "zeros"):
        raise ValueError(f"a {type(conv).__name__} of stride {conv.stride} with {conv.padding_mode} "
                         f"padding cannot decode in bands")


def band_conv(conv: nn.Conv2d | nn.Conv3d, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """`conv(x)` on a band (B, C, [T,] h_r, W): the neighbours' rows instead of zero rows. The stock
    convolution (zero rows at the band's edges) gives every row but the first and last `p`; those
    are computed again from the neighbours' rows and the band's first or last 2 p: no padded copy
    of the band is made (a band of fewer rows is padded whole). A 3D convolution pads its frames
    itself, as the stock one."""
    p, q = conv.padding[-2:]
    frames = tuple(conv.padding[:-2])  # (T,) for a Conv3d, () for a Conv2d
    conv_nd = F.conv3d if x.ndim == 5 else F.conv2d

    def unpadded_rows(window: torch.Tensor) -> torch.Tensor:  # no row padding: (..., n, W) -> (..., n - 2 p, W')
        return conv_nd(window, conv.weight, conv.bias, conv.stride, (*frames, 0, q), conv.dilation, conv.groups)

    if x.shape[-2] < 2 * p or conv.dilation[-2] != 1 or conv.kernel_size[-2] != 2 * p + 1:
        return unpadded_rows(padded(x, p, 0, 0, group))  # (B, C, [T,] h_r + 2 p, W) -> (B, C', [T',] h_r, W')
    above, below = halo_rows(x, p, group)  # (B, C, [T,] p, W) each
    out = conv._conv_forward(x, conv.weight, conv.bias)  # (B, C', [T',] h_r, W'): edge rows over zeros
    out[..., :p, :] = unpadded_rows(torch.cat([above, x[..., :2 * p, :]], dim=-2))  # 3 p rows -> p
    out[..., -p:, :] = unpadded_rows(torch.cat([x[..., -2 * p:, :], below], dim=-2))
    return out
