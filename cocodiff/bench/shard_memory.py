"""Memory per rank of a real-width FLUX.1-dev-shaped transformer, weights whole or sharded (FSDP2).

    python -m cocodiff.bench.shard_memory [--nproc 4] [--dtype bfloat16] [--json PATH]

FLUX.1-dev's widths (hidden 3072 = 24 heads x 128, T5 width 4096) at 2 double + 2 single blocks
(about 1.0 B parameters), random weights, one transformer call at 256 x 256 pixels (256 image +
64 text tokens) under Ulysses over every rank, once with whole weights and once with
`--shard-weights on`, each run in its own set of ranks (the CPU's peak resident set cannot be
reset). The sharded model is built on the meta device, sharded, then materialized: a rank never
holds the whole weights (as a checkpoint would be loaded shard by shard).

Per rank it reports the peak resident set (footprint.peak_bytes, the Python runtime and torch's
libraries included), the transformer's parameter bytes at rest, and the largest parameter bytes
held while a block runs (the local shards plus the blocks gathered whole at that moment).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["main", "measure"]

FLUX1_DEV_WIDTHS = dict(patch_size=1, in_channels=64, num_attention_heads=24, attention_head_dim=128,
                        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                        axes_dims_rope=(16, 56, 56))
IMAGE_TOKENS, TEXT_TOKENS = 256, 64  # 256 x 256 pixels: a 16 x 16 latent of 2 x 2 patches


def measure(shard: bool, dtype_name: str) -> dict[str, Any]:
    """One rank: build, (shard,) run one call, report its memory figures."""
    from diffusers import FluxTransformer2DModel

    from ..config import ParallelConfig
    from ..families import family_of
    from ..footprint import peak_bytes
    from ..parallel import parallelize
    from ..shard import local_parameter_bytes, repeated_blocks, shard_weights
    from ..topology import Topology

    dtype = getattr(torch, dtype_name)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(num_layers=2, num_single_layers=2, **FLUX1_DEV_WIDTHS).to(dtype)
    whole_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
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
    held = [0]

    def count(_module, _args) -> None:  # after FSDP's own pre-forward: this block (and the next) gathered whole
        now = 0
        for p in transformer.parameters():
            if isinstance(p, DTensor):
                now += p.to_local().numel() * p.element_size()
            else:  # whole; a sharded one keeps its shard besides
                now += p.numel() * p.element_size() * (1 + (1 / topology.ranks_per_node if shard else 0))
        held[0] = max(held[0], int(now))

    for block in repeated_blocks(transformer, family_of(transformer)):
        block.register_forward_pre_hook(count)
    parallel = parallelize(transformer, ParallelConfig(shard_weights=shard), topology)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, IMAGE_TOKENS, 64, generator=generator).to(dtype),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 4096, generator=generator).to(dtype),
        pooled_projections=torch.randn(1, 768, generator=generator).to(dtype),
        timestep=torch.tensor([0.5], dtype=dtype), guidance=torch.tensor([3.5], dtype=dtype),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(16.0), torch.arange(16.0), indexing="ij"), -1).reshape(-1, 3),
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
    )
    built = peak_bytes(topology.device)
    with torch.no_grad():
        transformer(**inputs)
    return {"rank": topology.rank, "shard_weights": shard, "sharded_over": parallel.sharded.ranks if parallel.sharded else 1,
            "whole_param_bytes": whole_bytes, "param_bytes_at_rest": at_rest, "param_bytes_held_in_block": held[0],
            "peak_rss_built": built, "peak_rss": peak_bytes(topology.device)}


def main(argv: list[str] | None = None) -> int:
    from ..launch import spawn

    parser = argparse.ArgumentParser(prog="python -m cocodiff.bench.shard_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks (one node: all share the weights)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    runs = {name: spawn(measure, args.nproc, shard, args.dtype, timeout_s=1800) for name, shard in (("whole", False), ("sharded", True))}
    gib = 2**30
    print(f"FLUX.1-dev widths, 2 double + 2 single blocks, {args.dtype}, {args.nproc} ranks: max over ranks")
    print(f"{'weights':8} {'params at rest':>15} {'params in a block':>18} {'peak RSS built':>15} {'peak RSS':>10}")
    for name, per_rank in runs.items():
        top = {k: max(r[k] for r in per_rank) for k in ("param_bytes_at_rest", "param_bytes_held_in_block", "peak_rss_built", "peak_rss")}
        print(f"{name:8} {top['param_bytes_at_rest'] / gib:>11.2f} GiB {top['param_bytes_held_in_block'] / gib:>14.2f} GiB "
              f"{top['peak_rss_built'] / gib:>11.2f} GiB {top['peak_rss'] / gib:>6.2f} GiB")
    if args.json is not None:
        args.json.write_text(json.dumps({"dtype": args.dtype, "nproc": args.nproc, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
