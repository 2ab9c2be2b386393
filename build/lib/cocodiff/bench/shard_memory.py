"""Memory per rank of a real-width FLUX.1-dev-shaped transformer, weights whole or sharded (FSDP2).

    python -m cocodiff.bench.shard_memory [--nproc 4] [--dtype bfloat16] [--pixels 1024] [--json PATH]

FLUX.1-dev's widths (hidden 3072 = 24 heads x 128, T5 width 4096) at 2 double + 2 single blocks
(about 1.0 B parameters), random weights, one transformer call at `--pixels` square (4096 image +
512 text tokens at 1024) under Ulysses over every rank, once with whole weights and once with
`--shard-weights on`, each run in its own set of ranks. The sharded model is built on the meta
device, sharded, then materialized: a rank never holds the whole weights (as a checkpoint would
be loaded shard by shard).

Per rank, for the call:
- `tracked_peak`: the largest bytes of live tensors, torch's MemTracker (FSDPMemTracker when
  sharded): what an accelerator's `max_memory_allocated` counts, weights and activations;
- `bound`: what the call may hold: the weights (whole, or 1/N plus the two largest blocks
  gathered whole: the running one and the one arriving) plus the activations tracked with
  whole weights (sharded, the tracker counts the all-gather buffers with them);
- `estimated`: footprint's figure: the same weights plus `plan_activations` for u{N};
- `rss_before`, `rss_peak`: the resident set as the call starts and its peak during the call
  (`VmHWM`, reset at the start; the Python runtime and torch's libraries included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "measure"]

FLUX1_DEV_WIDTHS = dict(patch_size=1, in_channels=64, num_attention_heads=24, attention_head_dim=128,
                        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                        axes_dims_rope=(16, 56, 56))
LAYERS = dict(num_layers=2, num_single_layers=2)
TEXT_TOKENS = 512


def _tracker(transformer: torch.nn.Module, shard: bool) -> Any:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if shard:
        return FSDPMemTracker(transformer)
    tracker = MemTracker()
    tracker.track_external(transformer)
    return tracker


def measure(shard: bool, dtype_name: str, pixels: int) -> dict[str, Any]:
    """One rank: build, (shard,) run one call, report its memory figures."""
    from diffusers import FluxTransformer2DModel

    from ..config.parallel import ParallelConfig
    from ..engine.families import family_of
    from ..footprint.estimate import estimate, plan_activations
    from ..distributed.memory import peak_bytes, reset_peak
    from ..engine.families.sample_inputs import forward_inputs
    from ..engine.parallelize import parallelize
    from ..engine.shard import local_parameter_bytes, repeated_blocks, shard_weights
    from ..distributed.topology import Topology

    dtype = getattr(torch, dtype_name)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**LAYERS, **FLUX1_DEV_WIDTHS).to(dtype)
    whole_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters())
                      for b in repeated_blocks(transformer, family_of(transformer)))
    topology = Topology.from_env()
    if shard:  # sharded while on the meta device: only this rank's shards are ever allocated
        shard_weights(transformer, family_of(transformer), topology)
    transformer.to_empty(device="cpu")
    torch.manual_seed(topology.rank)
    with torch.no_grad():
        for p in transformer.parameters():
            p.normal_(0.0, 0.02)
        for b in transformer.buffers():
            b.zero_()
    at_rest = local_parameter_bytes(transformer)
    latent = pixels // 16  # 8x VAE, 2x2 patches
    inputs = forward_inputs(transformer, "cpu", dtype, h=latent, w=latent, text=TEXT_TOKENS, batch=1)
    parallelize(transformer, ParallelConfig(shard_weights=shard), topology)
    tracker = _tracker(transformer, shard)
    reset_peak(topology.device)
    rss_before = peak_bytes(topology.device)
    with tracker, torch.no_grad():
        transformer(**inputs, return_dict=False)
    rss_peak = peak_bytes(topology.device)
    tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    activations = sum(n for kind, n in tracked.items() if str(kind).endswith(("ACT", "TEMP")))
    n = topology.ranks_per_node if shard else 1
    weights = whole_bytes / n + (2 * block_bytes if shard else 0)
    config = {"_class_name": "FluxTransformer2DModel", **LAYERS, **FLUX1_DEV_WIDTHS}
    footprint = estimate(config, {"block_out_channels": [128]}, height=pixels, width=pixels, pixel_multiple=16,
                         item_bytes=dtype.itemsize, text_tokens=TEXT_TOKENS, call_batch=1)
    parts = plan_activations(footprint, config, family=None, call_batch=1, item_bytes=dtype.itemsize,
                             text_tokens=TEXT_TOKENS, ulysses=topology.world_size)
    return {"rank": topology.rank, "shard_weights": shard, "sharded_over": n, "whole_param_bytes": whole_bytes,
            "block_bytes": block_bytes, "param_bytes_at_rest": at_rest, "tracked_peak": int(tracked["Total"]),
            "tracked_activations": int(activations), "weights_bound": int(weights),
            "estimated": int(weights + sum(parts.values())), "rss_before": rss_before, "rss_peak": rss_peak}


def main(argv: list[str] | None = None) -> int:
    from ..run.launch import spawn

    parser = argparse.ArgumentParser(prog="python -m cocodiff.bench.shard_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (one node: all share the weights)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--pixels", type=int, default=1024, help="image side in pixels (a multiple of 16)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    runs = {name: spawn(measure, args.nproc, shard, args.dtype, args.pixels, timeout_s=1800)
            for name, shard in (("whole", False), ("sharded", True))}
    activations = max(r["tracked_activations"] for r in runs["whole"])
    for per_rank in runs.values():
        for r in per_rank:
            r["bound"] = r["weights_bound"] + activations
    gib = 2**30
    keys = ("param_bytes_at_rest", "tracked_peak", "bound", "estimated", "rss_before", "rss_peak")
    print(f"FLUX.1-dev widths, {LAYERS['num_layers']} double + {LAYERS['num_single_layers']} single blocks, {args.dtype}, "
          f"{args.pixels}x{args.pixels}, {args.nproc} ranks (u{args.nproc}): max over ranks, GiB")
    print(f"{'weights':8} " + " ".join(f"{k:>19}" for k in keys))
    for name, per_rank in runs.items():
        print(f"{name:8} " + " ".join(f"{max(r[k] for r in per_rank) / gib:>19.3f}" for k in keys))
    if args.json is not None:
        args.json.write_text(json.dumps({"dtype": args.dtype, "nproc": args.nproc, "pixels": args.pixels, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
