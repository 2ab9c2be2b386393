"""Packing values into the bytes of a wire format (LOSSY), and back; which format a link uses is
`config.wire.Wire`'s business, what travels where the exchange's.

A message is a flat run of values whose length is a multiple of `block` (the exchanges use
head_dim: every message is whole (token, head) vectors). Packed, it is one uint8 tensor, so that
every backend (gloo included) carries it:

    bf16:  [numel x 2 bytes of bfloat16]
    fp8:   [numel x 1 byte of float8_e4m3fn][numel / block x 4 bytes of fp32 scales]
    int8:  [numel x 1 byte of int8][numel / block x 4 bytes of fp32 scales]

Scales are per block of `block` values (one per token and head): finer than per token (a
message holds a token's values for a share of the heads only, and heads differ in range: QK-norm
and RoPE leave some heads far larger than others) and still cheap, 4 / head_dim bytes per value
(3% at head_dim 128). A block's scale maps its largest finite magnitude to the format's largest
value (448 for e4m3, 127 for int8). Round-trip error per value: fp8 at most 2^-4 of the value
plus 2^-10 of the block's scale (e4m3's subnormal step); int8 at most half the scale; bf16 at
most 2^-8 of the value.

Deliberate cases:
- zeros: a block of zeros gets scale 1 and arrives as zeros, exactly.
- non-finite values (inf, NaN): they arrive as NaN - e4m3fn and int8 have no infinity, and a run
  that produced one is broken; it must stay visible, never become a finite number. The block's
  finite values are scaled by their own maximum and arrive as usual. (bf16 keeps inf and NaN.)
- empty messages pack to zero bytes.
`exact` packs a message's own bytes, unchanged.

`pack(x, formats, block)` with several formats packs interleaved roles: x is rows of
len(formats) blocks (fused Q|K rows: formats = (fp8, bf16) keeps K at bf16), each role packed
on its own, one after the other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cocodiff.config.wire import EXACT

__all__ = ["Formats", "pack", "pack_messages", "packed_bytes", "unpack"]

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)  # 448
_INT8_MAX = 127.0
_NAN_INT8 = -128  # int8's spare code: a non-finite value
_SCALE_BYTES = 4
_TINY = torch.finfo(torch.float32).tiny
_NAN = float("nan")


def _value_bytes(fmt: str, item: int) -> int:
    return {"bf16": 2, "fp8": 1, "int8": 1, EXACT: item}[fmt]


def _one_bytes(numel: int, fmt: str, block: int, item: int) -> int:
    scales = numel // block * _SCALE_BYTES if fmt in ("fp8", "int8") else 0
    return numel * _value_bytes(fmt, item) + scales


def packed_bytes(numel: int, formats: tuple[str, ...], block: int, item: int) -> int:
    """Bytes of `numel` values (of `item` bytes each) packed in `formats` (see the module)."""
    _check(numel, formats, block)
    share = numel // len(formats)
    return sum(_one_bytes(share, fmt, block, item) for fmt in formats)


def _check(numel: int, formats: tuple[str, ...], block: int) -> None:
    if numel % (block * len(formats)):
        raise ValueError(f"{numel} values are not whole rows of {len(formats)} blocks of {block}")


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def _scales(blocks: torch.Tensor, top: float) -> torch.Tensor:
    """(n, block) values -> fp32 scales (n,): each block's largest finite magnitude over `top`; 1 for
    blocks of zeros."""
    magnitude = blocks.abs()
    magnitude.nan_to_num_(0.0, 0.0, 0.0)  # non-finite values do not set the scale
    amax = magnitude.amax(dim=1).float()
    return torch.where(amax > 0, (amax / top).clamp_min(_TINY), 1.0)


def _pack_one(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """A flat run of values -> its bytes in `fmt`."""
    if fmt == EXACT:
        return _to_bytes(x)
    if fmt == "bf16":
        return _to_bytes(x.to(torch.bfloat16))
    blocks = x.reshape(-1, block)  # (n, block): one scale per row
    if fmt == "fp8":
        scale = _scales(blocks, _FP8_MAX)
        y = blocks / scale[:, None]  # fp32
        y.nan_to_num_(_NAN, _NAN, _NAN).clamp_(-_FP8_MAX, _FP8_MAX)  # inf and NaN arrive as NaN; rounding stays <= 448
        values = y.to(_FP8)
    elif fmt == "int8":
        scale = _scales(blocks, _INT8_MAX)
        y = (blocks / scale[:, None]).round_()  # |finite| <= 127: the scale maps the largest to 127
        values = y.nan_to_num_(_NAN_INT8, _NAN_INT8, _NAN_INT8).to(torch.int8)
    else:
        raise ValueError(f"wire format {fmt!r} is not one of bf16, fp8, int8, {EXACT}")
    return torch.cat([_to_bytes(values), _to_bytes(scale)])


def _unpack_one(data: torch.Tensor, fmt: str, numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes in `fmt` -> `numel` values of `dtype`, flat (a new tensor)."""
    if fmt == EXACT:
        return data.clone().view(dtype)
    if fmt == "bf16":
        return data.clone().view(torch.bfloat16).to(dtype)
    values, scale = data[:numel], data[numel:].clone().view(torch.float32)
    if fmt == "fp8":
        y = values.view(_FP8).float()
    else:
        codes = values.view(torch.int8)
        y = torch.where(codes == _NAN_INT8, float("nan"), codes.float())
    return (y.view(-1, block) * scale[:, None]).flatten().to(dtype)


def pack(x: torch.Tensor, formats: tuple[str, ...], block: int) -> torch.Tensor:
    """Values (any shape; rows of len(formats) blocks of `block`) -> uint8 bytes, flat."""
    flat = x.reshape(-1)
    _check(flat.numel(), formats, block)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    if len(formats) == 1:
        return _pack_one(flat, formats[0], block)
    roles = flat.view(-1, len(formats), block)  # (rows, roles, block)
    return torch.cat([_pack_one(roles[:, j], fmt, block) for j, fmt in enumerate(formats)])


def unpack(data: torch.Tensor, formats: tuple[str, ...], numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes from `pack` -> `numel` values of `dtype`, flat, in the order packed."""
    item = torch.empty((), dtype=dtype).element_size()
    if data.numel() != packed_bytes(numel, formats, block, item):
        raise ValueError(f"{data.numel()} bytes are not {numel} values packed as {'|'.join(formats)}")
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=data.device)
    if len(formats) == 1:
        return _unpack_one(data, formats[0], numel, block, dtype)
    share = numel // len(formats)
    sizes = [_one_bytes(share, fmt, block, item) for fmt in formats]
    roles = [_unpack_one(part, fmt, share, block, dtype).view(-1, block) for part, fmt in zip(data.split(sizes), formats)]
    return torch.stack(roles, dim=1).flatten()  # (rows, roles, block) -> flat


Formats = tuple[str, ...]
"""The format of each role of a row (`pack`'s `formats`)."""


def pack_messages(
    send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], formats: list[Formats], block: int
) -> tuple[torch.Tensor, list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
    """One all-to-all's flat send buffer, cut in `send_sizes` values per peer, -> (its bytes,
    bytes per peer sent, bytes per peer received, unpack); `formats[i]` is the format of the
    messages to and from peer i (the link between two ranks is the same both ways). `unpack`
    turns the received bytes into the values the exchange would have received, flat."""
    item, dtype = send.element_size(), send.dtype
    parts = [pack(piece, fmts, block) for piece, fmts in zip(send.split(send_sizes), formats)]
    recv_bytes = [packed_bytes(n, fmts, block, item) for n, fmts in zip(recv_sizes, formats)]

    def unpack_all(recv: torch.Tensor) -> torch.Tensor:
        return torch.cat([unpack(part, fmts, n, block, dtype)
                          for part, fmts, n in zip(recv.split(recv_bytes), formats, recv_sizes)])

    return torch.cat(parts), [p.numel() for p in parts], recv_bytes, unpack_all
