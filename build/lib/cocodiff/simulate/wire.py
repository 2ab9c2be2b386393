"""Wire formats (LOSSY, `--wire`, `+fp8`) in the cost model: packed bytes and pack/unpack time.

A message between two ranks crosses the link of the outermost level at which they differ: `node`
between nodes, else the system's level names (aurora: xe-link, tile-link), as the engine's
config.wire.Wire names them. Where that level has a format, each value of the message travels in

    exact   the run's dtype (item bytes)          bf16   2 bytes
    fp8     1 byte + 4 / block (one fp32 scale)   int8   1 byte + 4 / block

with block = head_dim for the exchanges and ring hops (one scale per token and head), the
output's channels for the CFG / batch gathers (one scale per row of the last dim). K travels at
bf16 at least (Wire.k_format). Packed: every Ulysses exchange's pieces (flat and TAPA's phases,
each pair by its own link), ring hops, the data groups' gathers; not packed: V-Major's int32
indices and the output's sequence gather (as the engine).

Each phase pays the packing before its send and the unpacking after its receive, on the slowest
rank (not hidden):  max over ranks (values it packs / pack rate) + max over ranks (values it
unpacks / unpack rate). Rates (`codec_rates`):

    cpu      measured (`cocodiff bench pack`, one thread, fp32 in, docs/results/pack-cpu.json): fp8
             608 M values/s to pack, 282 M/s to unpack; int8 922 / 293; bf16 3378 / 1777
    memory   GPUs, ASSUMED memory-bandwidth bound: one read of the values and one write of the
             packed bytes at the device's HBM rate (aurora tile 1638 GB/s: 540 G values/s bf16 -> fp8, head_dim 128)

bf16 on a 2-byte run is the values' own bytes: no cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config.wire import EXACT, Wire
from .network import Routing
from .system import System

__all__ = ["CPU_RATES", "NODE", "WireCost", "codec_rates", "level_names", "value_bytes", "wire_cost"]

NODE = "node"
"""The level name of the links between nodes (the engine's outermost level)."""
CPU_RATES = {"fp8": (608e6, 282e6), "int8": (922e6, 293e6), "bf16": (3378e6, 1777e6)}
"""(pack, unpack) values/s of one CPU thread from fp32, measured by `cocodiff bench pack` (docs/results/pack-cpu.json)."""
SCALE_BYTES = 4


def value_bytes(fmt: str, block: int, item: int) -> float:
    """Bytes per value in `fmt` with one fp32 scale per `block` values (`item`: the run's dtype)."""
    return {EXACT: float(item), "bf16": 2.0, "fp8": 1.0 + SCALE_BYTES / block, "int8": 1.0 + SCALE_BYTES / block}[fmt]


def level_names(system: System) -> list[str]:
    """The run's levels outermost first: `node`, then the system's own from the outside in."""
    return [NODE] + [level.name for level in reversed(system.levels)]


def codec_rates(system: System, fmt: str, item: int, block: int) -> tuple[float, float]:
    """(pack, unpack) values per second of one rank for `fmt` (see the module: cpu or memory)."""
    if fmt == EXACT or (fmt == "bf16" and item == 2):
        return (np.inf, np.inf)
    if system.device.codec == "cpu":
        return CPU_RATES[fmt]
    rate = system.device.memory_GBps * 1e9 / (item + value_bytes(fmt, block, item))
    return (rate, rate)


@dataclass(frozen=True, eq=False)
class WireCost:
    """Per ordered rank pair, for a message of exact bytes T: packed bytes T x ratio, pack
    seconds T x pack_s, unpack seconds T x unpack_s."""

    ratio: np.ndarray
    pack_s: np.ndarray
    unpack_s: np.ndarray

    def apply(self, traffic: np.ndarray) -> tuple[np.ndarray, float]:
        """(packed traffic matrix, the phase's pack + unpack seconds on its slowest ranks)."""
        codec = float((traffic * self.pack_s).sum(1).max(initial=0.0) + (traffic * self.unpack_s).sum(0).max(initial=0.0))
        return traffic * self.ratio, codec


def wire_cost(wire: Wire, system: System, route: Routing, item: int, block: int,
              tensors: dict[str, float]) -> WireCost:
    """The cost of messages whose values are `tensors` ({'q' | 'k' | 'v' | 'o': share of the
    values}, shares summing to 1) in the run's dtype of `item` bytes, blocks of `block` values."""
    classes = [NODE if name == "network" else name for name in route.lat_classes]
    per_class = []
    for name in classes:
        ratio = pack = unpack = 0.0
        for tensor, share in tensors.items():
            fmt = wire.format_for(name, NODE, tensor)
            p, u = codec_rates(system, fmt, item, block)
            ratio += share * value_bytes(fmt, block, item) / item
            pack += share / (item * p)
            unpack += share / (item * u)
        per_class.append((ratio, pack, unpack))
    table = np.array(per_class + [(1.0, 0.0, 0.0)])  # index -1: a rank to itself
    pick = table[route.msg_class]
    return WireCost(ratio=pick[..., 0], pack_s=pick[..., 1], unpack_s=pick[..., 2])
