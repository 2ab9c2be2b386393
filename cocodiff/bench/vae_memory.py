"""Peak memory of a VAE decode (or encode) per rank, whole on one rank or in bands (--parallel-vae).

    python -m cocodiff.bench.vae_memory [--vae wan|flux1|ltx|hunyuanvideo15] [--encode] [--nproc 4]
                                        [--height 480] [--width 832]
                                        [--frames 5] [--base-dim 96] [--res-blocks 0] [--json PATH]

`--vae flux1`: FLUX.1's AutoencoderKL as published (models/counts.py's config: 16 latent channels,
widths 128 to 512, the mid-block attention; random weights) with `--res-blocks` as its
`layers_per_block` (FLUX.1: 2, the default here) decodes one random image latent (`--frames` and
`--base-dim` unused), in bands through engine/vae/kl2d.py. With `--encode` it encodes one random
image of that size instead (an image input's encode: the moments of the latent distribution).

`--vae ltx` / `--vae hunyuanvideo15`: LTX-Video's (0.9.0) and HunyuanVideo 1.5's video VAEs as
published (diffusers' default configs; `--base-dim` and `--res-blocks` unused) decode one random
clip latent of `--frames` frames (8k+1 / 4k+1) in bands (engine/vae/ltx.py,
engine/vae/hunyuanvideo15.py).

`--vae wan` (the default): an AutoencoderKLWan with Wan 2.1's widths (`base_dim` 96: 384 channels
at the latent's size, 96 at full size) and `res_blocks` residual blocks per level less than the
real 2 (random weights) decodes one random clip latent in bands through engine/vae/wan.py.
The decode runs frame chunk by frame chunk (4 frames after the first), so its peak is a chunk's
and 5 frames (2 latent frames) reach the same peak as 81 but for the clip it returns.

Either decodes once whole in a process of its own and once in bands over `nproc` ranks. Per
rank: the growth of the process's peak resident set over its resident set before the decode (the
CPU's peak cannot be reset, so each measure runs in fresh processes), and rank 0's output against
the whole one.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "measure"]


VIDEO_VAES = {"ltx": ("AutoencoderKLLTXVideo", 128, 32, 8), "hunyuanvideo15": ("AutoencoderKLHunyuanVideo15", 32, 16, 4)}
"""`--vae` -> (diffusers class, latent channels, pixels per latent row, frames per latent frame): the
published configs, diffusers' defaults (LTX-Video 0.9.0, HunyuanVideo 1.5)."""


def _vae(kind: str, base_dim: int, res_blocks: int) -> Any:
    import diffusers
    from diffusers import AutoencoderKL, AutoencoderKLWan

    from ..models.counts import FLUX1_VAE

    torch.manual_seed(0)
    if kind == "flux1":
        config = dict(FLUX1_VAE, layers_per_block=res_blocks)
        return AutoencoderKL(**config, use_quant_conv=False, use_post_quant_conv=False).eval()
    if kind in VIDEO_VAES:  # only the decoder's weights (HunyuanVideo 1.5's VAE is 5 GB in fp32, 3.5 of them the decoder's)
        with torch.device("meta"):
            vae = getattr(diffusers, VIDEO_VAES[kind][0])()
        vae.encoder = None
        vae.to_empty(device="cpu")
        with torch.no_grad():
            for tensor in (*vae.parameters(), *vae.buffers()):
                tensor.normal_(0.0, 0.02) if tensor.is_floating_point() else tensor.zero_()
        for module in vae.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()  # the layers' own initialization, as if built on the CPU
        return vae.eval()
    return AutoencoderKLWan(base_dim=base_dim, z_dim=16, num_res_blocks=res_blocks).eval()


def _bands(kind: str) -> Any:
    """The module that decodes `kind` in bands (its `parallel_decode`)."""
    from ..engine.vae import (
        kl2d as vae_parallel,
        hunyuanvideo15 as vae_parallel_hunyuanvideo15,
        ltx as vae_parallel_ltx,
        wan as vae_parallel_video,
    )

    return {"wan": vae_parallel_video, "ltx": vae_parallel_ltx, "hunyuanvideo15": vae_parallel_hunyuanvideo15}.get(kind, vae_parallel)


def measure(kind: str, split: bool, shape: tuple[int, ...], base_dim: int, res_blocks: int,
            encode: bool = False) -> dict[str, Any]:
    """One rank: build the VAE, decode (whole, or this rank's band), report the peak's growth.
    `encode`: `shape` is an image's, encoded (whole, or this rank's band)."""
    import torch.distributed as dist

    from ..engine.vae import kl2d as vae_parallel
    from ..distributed.memory import resident_bytes

    vae = _vae(kind, base_dim, res_blocks)
    bands = _bands(kind)
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    if encode:
        latents = latents.clamp_(-1, 1)  # an image, in the pipelines' [-1, 1]
    before = resident_bytes()
    with torch.no_grad():
        if encode:
            clip = vae_parallel.parallel_encode(vae, latents, None) if split else vae.encode(latents).latent_dist.parameters
        else:
            clip = bands.parallel_decode(vae, latents, None) if split else vae.decode(latents).sample
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    first = not dist.is_initialized() or dist.get_rank() == 0
    return {"bytes": peak - before, "clip": clip if first else None}


def main(argv: list[str] | None = None) -> int:
    from ..run.launch import spawn

    parser = argparse.ArgumentParser(prog="python -m cocodiff.bench.vae_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--vae", choices=["wan", "flux1", *VIDEO_VAES], default="wan",
                        help="wan: AutoencoderKLWan (video); flux1: FLUX.1's AutoencoderKL (images); ltx, "
                             "hunyuanvideo15: LTX-Video's and HunyuanVideo 1.5's video VAEs as published")
    parser.add_argument("--encode", action="store_true",
                        help="measure the encode of an image (--vae flux1) instead of the decode")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=5, help="frames of the clip (4k+1)")
    parser.add_argument("--base-dim", type=int, default=96, help="the VAE's width (Wan 2.1: 96)")
    parser.add_argument("--res-blocks", type=int, default=None,
                        help="residual blocks per level less one (Wan 2.1: 2, default 0; FLUX.1: 2, the default)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.encode and args.vae != "flux1":
        parser.error("--encode measures the 2D VAE's encode: give --vae flux1")
    if args.res_blocks is None:
        args.res_blocks = 0 if args.vae == "wan" else 2
    if args.encode and args.res_blocks < 1:  # the encoder's down blocks change width in their resnets
        parser.error(f"--res-blocks {args.res_blocks}: the encode needs at least 1 (its resnets change the widths)")
    if args.vae == "wan":
        shape = (1, 16, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)  # (B, C, F, h, w)
        name = f"AutoencoderKLWan(base_dim={args.base_dim}, num_res_blocks={args.res_blocks})"
        size = f"{args.height}x{args.width}x{args.frames}"
    elif args.vae in VIDEO_VAES:
        cls, channels, rows, frames = VIDEO_VAES[args.vae]
        shape = (1, channels, (args.frames - 1) // frames + 1, args.height // rows, args.width // rows)  # (B, C, F, h, w)
        name, size = cls, f"{args.height}x{args.width}x{args.frames}"
    elif args.encode:
        shape = (1, 3, args.height, args.width)  # (B, 3, H, W)
        name, size = f"AutoencoderKL(FLUX.1, layers_per_block={args.res_blocks})", f"{args.height}x{args.width}"
    else:
        shape = (1, 16, args.height // 8, args.width // 8)  # (B, C, h, w)
        name, size = f"AutoencoderKL(FLUX.1, layers_per_block={args.res_blocks})", f"{args.height}x{args.width}"
    part = "encode" if args.encode else "decode"
    whole = spawn(measure, 1, args.vae, False, shape, args.base_dim, args.res_blocks, args.encode)[0]
    ranks = spawn(measure, args.nproc, args.vae, True, shape, args.base_dim, args.res_blocks, args.encode)
    scale = float(whole["clip"].abs().max())
    rel = float((ranks[0]["clip"] - whole["clip"]).abs().max()) / scale
    per_rank = [r["bytes"] for r in ranks]
    result = {
        "vae": name, "height": args.height, "width": args.width, "nproc": args.nproc,
        **({"frames": args.frames} if args.vae != "flux1" else {}),
        f"whole_{part}_bytes": whole["bytes"], f"rank_{part}_bytes": per_rank,
        "ratio": max(per_rank) / whole["bytes"], "max_rel_diff": rel,
    }
    mib = 2 ** 20
    print(f"{name} {size}: {part} peak growth "
          f"{whole['bytes'] / mib:.0f} MiB whole, per rank on {args.nproc}: "
          f"{', '.join(f'{b / mib:.0f}' for b in per_rank)} MiB ({result['ratio']:.2f}x); "
          f"rank 0's output vs whole: {rel:.1e} relative")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
