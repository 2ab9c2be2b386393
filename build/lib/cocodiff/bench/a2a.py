"""`cocodiff bench a2a`: flat vs TAPA all-to-all across message sizes, on this fabric.

Each size is timed `repeat` times, flat and TAPA alternating (A B A B ...) so that drift on a
noisy machine hits both alike; a time is the slowest rank's (max over ranks); medians are
reported with the TAPA/flat speed ratio and the algorithm bandwidth (bytes per rank / time).
"""

from __future__ import annotations

import datetime
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config.env import FABRIC_ENV
from ..config.levels import format_levels
from ..distributed.comm import (
    FlatExchange,
    TapaExchange,
    TapaFullExchange,
    calibrate,
    time_exchanges,
    transport,
)
from ..distributed.comm.tapa import full_depth_differs
from ..distributed.topology import Topology
from ..output.files import save_figure

__all__ = ["A2ASpec", "a2a_job", "fabric_name", "plot", "run_header"]

KiB, MiB = 1024, 1024 * 1024


def fabric_name(topology: Topology) -> str:
    """The fabric as `cocodiff cluster run` names it, or this machine's loopback."""
    return os.environ.get(FABRIC_ENV) or f"local loopback, {topology.nodes}x{topology.ranks_per_node} by rank numbering (no shaping)"


def run_header(gen: Any, topology: Topology) -> dict[str, Any]:
    """The keys every generation benchmark's JSON opens with: when, what model, on which fabric and
    ranks, at what size and steps (`gen` a run.spec.GenerateSpec)."""
    return {
        "date": datetime.date.today().isoformat(),
        "model": gen.model,
        "fabric": fabric_name(topology),
        "nproc": topology.world_size,
        "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node,
        "height": gen.height,
        "width": gen.width,
        **({"frames": gen.frames} if getattr(gen, "frames", None) else {}),  # a video model's clip
        "steps": gen.steps,
    }


@dataclass(kw_only=True)
class A2ASpec:
    min_bytes: int = 64 * KiB
    max_bytes: int = 16 * MiB
    repeat: int = 5
    ranks_per_node: int | None = None
    auto_budget_s: float = 20.0

    def sizes(self) -> list[int]:
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= 2
        return sizes


def a2a_job(spec: A2ASpec) -> dict[str, Any] | None:
    topology = Topology.from_env(spec.ranks_per_node)
    flat = FlatExchange(topology)
    tapa = TapaExchange(topology) if topology.hierarchical else None
    full = [TapaFullExchange(topology)] if full_depth_differs(topology) else []  # one phase per level
    results = []
    for size in spec.sizes():
        flat_s, tapa_s, *full_s = time_exchanges([flat, tapa or flat, *full], size, spec.repeat)
        flat_ms, tapa_ms = statistics.median(flat_s) * 1e3, statistics.median(tapa_s) * 1e3
        results.append(
            {
                "bytes_per_rank": size,
                "flat_ms": flat_ms,
                "tapa_ms": tapa_ms,
                "speedup": flat_ms / tapa_ms,
                "flat_algbw_MBps": size / flat_ms / 1e3,
                "tapa_algbw_MBps": size / tapa_ms / 1e3,
                "flat_all_ms": [t * 1e3 for t in flat_s],
                "tapa_all_ms": [t * 1e3 for t in tapa_s],
                **({"tapa_full_ms": statistics.median(full_s[0]) * 1e3,
                    "tapa_full_speedup": flat_ms / (statistics.median(full_s[0]) * 1e3),
                    "tapa_full_all_ms": [t * 1e3 for t in full_s[0]]} if full_s else {}),
            }
        )
    choices = calibrate(topology, spec.auto_budget_s)
    if topology.rank != 0:
        return None
    return {
        "date": datetime.date.today().isoformat(),
        "fabric": fabric_name(topology),
        "nproc": topology.world_size,
        "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node,
        "levels": format_levels(topology.levels),
        "backend": dist.get_backend(),
        "transport": transport(dist.get_backend()),
        "repeat": spec.repeat,
        "tapa_is_flat": tapa is None,
        "auto_choice": {"buckets": [asdict(c) for c in choices]},
        "results": results,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["bytes_per_rank"] / MiB for r in result["results"]]
    fig, (ax_time, ax_ratio) = plt.subplots(1, 2, figsize=(10, 4))
    ax_time.plot(sizes, [r["flat_ms"] for r in result["results"]], "o-", label="flat")
    ax_time.plot(sizes, [r["tapa_ms"] for r in result["results"]], "s-", label="TAPA")
    ax_time.set(xscale="log", yscale="log", xlabel="MiB per rank", ylabel="median ms", title="all-to-all time")
    ax_time.legend()
    ax_ratio.plot(sizes, [r["speedup"] for r in result["results"]], "o-", color="C2")
    ax_ratio.axhline(1.0, color="grey", lw=0.8)
    ax_ratio.set(xscale="log", xlabel="MiB per rank", ylabel="flat time / TAPA time", title="TAPA speedup")
    fig.suptitle(f"{result['fabric']}: {result['nproc']} ranks, {result['nodes']} nodes x {result['ranks_per_node']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
