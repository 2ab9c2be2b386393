"""`cocodiff bench quality`: what V-Major's schedules cost in fidelity and save in bytes.

One launch: the exact run (flat all-to-all), then each schedule (TAPA + V-Major) with the same
seed. Per schedule: PSNR, SSIM and MSE of the final image against the exact one (scikit-image),
relative L2 error of the final latents, relative error per step of the V rows that receivers
reused, the share of the exact run's inter-node projection bytes (V, Q, K) saved, and the cache
memory (largest rank). `off` is TAPA without V-Major and must match exactly; every other schedule
is labelled lossy.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from skimage.metrics import mean_squared_error, peak_signal_noise_ratio, structural_similarity

from ..config import ParallelConfig
from ..errors import UsageError
from ..parallel import parallelize
from ..runner import GenerateSpec, load, run_pipeline
from ..topology import Topology
from ..vmajor import Schedule, parse_schedule
from .a2a import fabric_name

__all__ = ["QualitySpec", "grid", "parse_schedules", "quality_job"]


def parse_schedules(text: str) -> list[Schedule]:
    """'off,linear,warmup:1,linear' -> the schedules off, linear, warmup:1,linear (each checked)."""
    names: list[str] = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        if token == "linear" and names and names[-1].startswith("warmup:") and not names[-1].endswith(",linear"):
            names[-1] += ",linear"
        else:
            names.append(token)
    if not names:
        raise UsageError("--schedules is empty")
    return [parse_schedule(name) for name in names]


@dataclass(kw_only=True)
class QualitySpec:
    generate: GenerateSpec
    schedules: list[Schedule]
    tensors: str = "v"


def _all_ranks_sum(value: float, topology: Topology, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=topology.device)
    dist.all_reduce(t, op=op, group=topology.world_group)
    return t.item()


def quality_job(spec: QualitySpec) -> dict[str, Any] | None:
    gen = spec.generate
    pipe, encoder = load(gen)
    topology = Topology.from_env(gen.parallel.ranks_per_node)
    if topology.nodes < 2 or topology.ranks_per_node < 2:
        raise UsageError(
            f"V-Major acts on TAPA's inter-node phase: needs at least 2 nodes of at least 2 ranks, "
            f"not {topology.nodes} x {topology.ranks_per_node} (--nproc, --ranks-per-node)"
        )

    def run(config: ParallelConfig) -> tuple[dict[str, Any], Any]:
        parallel = parallelize(pipe, config, topology)
        result = run_pipeline(replace(gen), pipe, encoder, parallel)
        parallel.undo()
        return result, parallel

    rpn = topology.ranks_per_node
    exact, _ = run(ParallelConfig(comm="flat", ranks_per_node=rpn, v_first=gen.parallel.v_first))
    baseline_bytes = None
    schedules: dict[str, dict[str, Any]] = {}
    images = {"exact (flat)": exact["image"]}
    for schedule in spec.schedules:
        name = str(schedule)  # as written
        config = ParallelConfig(comm="tapa", ranks_per_node=rpn, v_first=gen.parallel.v_first, v_major=schedule,
                                v_major_tensors=spec.tensors)
        result, parallel = run(config)
        proj_bytes = _all_ranks_sum(parallel.stats.other_node_bytes["a2a_in"], topology)
        if schedule.off:
            baseline_bytes = proj_bytes
        vm = parallel.ctx.vmajor
        cache = _all_ranks_sum(vm.cache_bytes() if vm else 0, topology, dist.ReduceOp.MAX)
        image, reference = result["image"], exact["image"]
        latents, ref_latents = result["latents"].double(), exact["latents"].double()
        schedules[name] = {
            "lossy": config.lossy,
            "psnr": float(peak_signal_noise_ratio(reference, image, data_range=1.0)) if not np.array_equal(reference, image) else float("inf"),
            "ssim": float(structural_similarity(reference, image, data_range=1.0, channel_axis=2)),
            "mse": float(mean_squared_error(reference, image)),
            "latent_rel_error": float((latents - ref_latents).norm() / ref_latents.norm()),
            "step_rel_error": vm.step_errors() if vm else [],
            "step_ratio": list(vm.ratios) if vm else [],
            "inter_node_projection_bytes": int(proj_bytes),
            "cache_bytes": int(cache),
        }
        images[f"{name}{' (lossy)' if config.lossy else ''}"] = image
    if baseline_bytes is None:  # no `off` run: measure the exact TAPA bytes for the ratio
        _, parallel = run(ParallelConfig(comm="tapa", ranks_per_node=rpn, v_first=gen.parallel.v_first))
        baseline_bytes = _all_ranks_sum(parallel.stats.other_node_bytes["a2a_in"], topology)
    for figures in schedules.values():
        figures["inter_node_bytes_saved"] = 1.0 - figures["inter_node_projection_bytes"] / baseline_bytes
    if topology.rank != 0:
        return None
    return {
        "date": datetime.date.today().isoformat(),
        "model": gen.model,
        "fabric": fabric_name(topology),
        "nproc": topology.world_size,
        "nodes": topology.nodes,
        "ranks_per_node": rpn,
        "height": gen.height,
        "width": gen.width,
        "steps": gen.steps,
        "seed": gen.seed,
        "tensors": spec.tensors,
        "reference": "flat (exact)",
        "schedules": schedules,
        "images": images,
    }


def grid(images: dict[str, np.ndarray], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(images), figsize=(2.6 * len(images), 3.0), squeeze=False)
    for ax, (name, image) in zip(axes[0], images.items()):
        ax.imshow(np.clip(image, 0, 1))
        ax.set_title(name, fontsize=8)
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
