"""What the 2D and the Wan video band decodes share (vae_parallel.py, vae_parallel_video.py).

Each rank of a group decodes a horizontal band of the latent's rows (rank order = top to bottom),
no rows decoded twice: every convolution that pads rows takes them from the neighbouring bands
instead (`padded`, one row of each for a 3x3 convolution: `HALO_ROWS`), and the bands are put
together in rank order at the end (`gather_rows`, uneven bands included):

    band (..., h_r, W) -> padded -> (..., p + h_r + p, q + W + q) -> convolution without padding -> (..., h_r, W')
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm.halo import halo_rows
from .comm.ulysses import bounded

__all__ = ["HALO_ROWS", "band_conv2d", "check_conv", "gather_rows", "padded"]

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


def band_conv2d(conv: nn.Conv2d, group: dist.ProcessGroup | None, x: torch.Tensor) -> torch.Tensor:
    """`conv(x)` on a band (B, C, h_r, W): the neighbours' rows instead of zero rows. The stock
    convolution (zero rows at the band's edges) gives every row but the first and last `p`; those
    are computed again from the neighbours' rows and the band's first or last 2 p: no padded copy
    of the band is made (a band of fewer rows is padded whole)."""
    p, q = conv.padding
    if x.shape[-2] < 2 * p or conv.dilation[0] != 1 or conv.kernel_size[0] != 2 * p + 1:
        x = padded(x, p, q, 0, group)  # (B, C, h_r + 2 p, W + 2 q)
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)
    above, below = halo_rows(x, p, group)  # (B, C, p, W) each
    out = conv._conv_forward(x, conv.weight, conv.bias)  # (B, C', h_r, W'): edge rows over zeros

    def rows(window: torch.Tensor) -> torch.Tensor:  # (B, C, 3 p, W) -> (B, C', p, W')
        return F.conv2d(window, conv.weight, conv.bias, conv.stride, (0, q), conv.dilation, conv.groups)

    out[..., :p, :] = rows(torch.cat([above, x[..., :2 * p, :]], dim=-2))
    out[..., -p:, :] = rows(torch.cat([x[..., -2 * p:, :], below], dim=-2))
    return out
