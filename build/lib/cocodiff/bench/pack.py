"""`cocodiff bench pack`: how fast this machine packs and unpacks each wire format (distributed/comm/wire.py).

On a CPU run of `--wire` / `+fp8` the packing is host work on the ranks' own cores, and it is the
part that decides whether fewer bytes on a slow link pay (docs/usage.md); the simulator's `cpu`
codec uses these rates (simulate/wire.py). Each format packs and unpacks the same message - 1 Mi
values in blocks of 128 (a head_dim), fp32 and bf16 in - on one thread, the formats alternated
round by round; the figure is the median round's values per second.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..distributed.comm.wire import pack, unpack

__all__ = ["pack_rates"]

FORMATS = ("fp8", "int8", "bf16")
BLOCK = 128


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pack_rates(values: int = 1 << 20, rounds: int = 9) -> list[dict[str, Any]]:
    """Rows of (input dtype, format, M values/s to pack, to unpack), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(values, generator=torch.Generator().manual_seed(0)).to(dtype)
            packed = {fmt: pack(x, (fmt,), BLOCK) for fmt in FORMATS}  # also the warm-up
            times: dict[str, tuple[list[float], list[float]]] = {fmt: ([], []) for fmt in FORMATS}
            for _ in range(rounds):
                for fmt in FORMATS:
                    times[fmt][0].append(_seconds(lambda: pack(x, (fmt,), BLOCK)))
                    times[fmt][1].append(_seconds(lambda: unpack(packed[fmt], (fmt,), values, BLOCK, dtype)))
            for fmt, (packs, unpacks) in times.items():
                rows.append({"dtype": str(dtype).removeprefix("torch."), "format": fmt,
                             "pack_mvalues_per_s": values / statistics.median(packs) / 1e6,
                             "unpack_mvalues_per_s": values / statistics.median(unpacks) / 1e6})
    finally:
        torch.set_num_threads(threads)
    return rows
