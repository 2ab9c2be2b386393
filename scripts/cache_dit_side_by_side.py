"""cache-dit's DBCache beside CoCoDiff's `dbcache`, one process, the same pipeline and settings.

cache-dit is not a dependency of cocodiff; install it beside it to run this:

    pip install cache-dit einops
    PYTHONPATH=. python scripts/cache_dit_side_by_side.py --model tiny-flux --steps 28 --size 128 \\
        --spec F1B0W4,0.1 --spec F1B0W4,0.2 --json docs/results/cache-dit-side-by-side-tiny-flux.json

For each `--spec F<n>B<n>W<n>[MC<n>],THRESH`: the uncached run (once), ours (`apply_cache` with
`dbcache:SPEC`, as `--cache` installs it on one rank: a world of one agrees with itself) and
cache-dit's (`cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(Fn_compute_blocks=F,
Bn_compute_blocks=B, residual_diff_threshold=THRESH, max_warmup_steps=W,
max_continuous_cached_steps=MC))`), each from the same seed; the steps each skipped, and PSNR /
SSIM of each image against the uncached one. Both compare the Fn blocks' residual with the one of
the last computed step (relative L1) and skip the middle blocks below the threshold after W warm-up
steps; cache-dit's FLUX adapter runs the double- then the single-stream blocks as one list, as ours does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable

import numpy as np
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from cocodiff.engine.cache import parse_cache
from cocodiff.engine.cache.steps import apply_cache
from cocodiff.models.presets import load_pipeline, pipeline_inputs

__all__ = ["main", "side_by_side"]

PROMPT = "a red circle above a blue square"


def _pipeline(model: str, seed: int) -> tuple[Any, Any]:
    pipe, encoder = load_pipeline(model, seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe, encoder


def _image(pipe: Any, encoder: Any, steps: int, size: int, seed: int,
           after_step: Callable[[int], None] | None = None) -> np.ndarray:
    def callback(_pipe: Any, step: int, _timestep: Any, outputs: dict) -> dict:
        if after_step is not None:
            after_step(step)
        return outputs

    out = pipe(**pipeline_inputs(pipe, encoder, PROMPT), height=size, width=size, num_inference_steps=steps,
               generator=torch.Generator().manual_seed(seed), output_type="np", callback_on_step_end=callback)
    return out.images[0].astype(np.float64)


def _quality(image: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    psnr = float("inf") if np.array_equal(image, exact) else float(peak_signal_noise_ratio(exact, image, data_range=1.0))
    return {"psnr": psnr, "ssim": float(structural_similarity(exact, image, data_range=1.0, channel_axis=2))}


def _cache_dit_config(spec: str) -> Any:
    """`F1B0W4MC2,0.2` as cache-dit's DBCacheConfig."""
    from cache_dit import DBCacheConfig

    parsed = parse_cache(f"dbcache:{spec}")
    return DBCacheConfig(Fn_compute_blocks=parsed.first, Bn_compute_blocks=parsed.last,
                         residual_diff_threshold=parsed.threshold, max_warmup_steps=parsed.warmup,
                         max_continuous_cached_steps=parsed.max_in_a_row if parsed.max_in_a_row is not None else -1,
                         max_cached_steps=-1)


def side_by_side(model: str, steps: int, size: int, specs: list[str], seed: int = 0) -> dict[str, Any]:
    import cache_dit

    for spec in specs:
        if not re.fullmatch(r"F\d+B\d+W\d+(MC\d+)?,[0-9.]+", spec):
            raise SystemExit(f"cache_dit_side_by_side: error: --spec {spec!r} is not F<n>B<n>W<n>[MC<n>],THRESH")
    exact = _image(*_pipeline(model, seed), steps, size, seed)
    rows = []
    for spec in specs:
        # A fresh pipeline (the same seeded weights) for each: on a pipeline cache-dit had been
        # enabled on and disabled again, our cache skipped nothing (seen; not looked into further).
        pipe, encoder = _pipeline(model, seed)
        ours = apply_cache(pipe.transformer, parse_cache(f"dbcache:{spec}"))
        skipped: list[int] = []
        image = _image(pipe, encoder, steps, size, seed, lambda step: skipped.append(step)
                       if ours.skipped_steps > len(skipped) else None)
        report = ours.report()
        row: dict[str, Any] = {"spec": spec, "ours": {"skipped_steps": report["skipped_steps"], "skipped": skipped,
                                                       "computed_steps": report["computed_steps"], **_quality(image, exact)}}
        pipe, encoder = _pipeline(model, seed)
        cache_dit.enable_cache(pipe, cache_config=_cache_dit_config(spec))
        theirs = _image(pipe, encoder, steps, size, seed)
        stats = cache_dit.summary(pipe, logging=False)
        cached = sorted({s for stat in stats for s in stat.cached_steps})
        row["cache_dit"] = {"skipped_steps": len(cached), "skipped": cached,
                            "computed_steps": steps - len(cached), **_quality(theirs, exact)}
        row["same_image"] = bool(np.array_equal(image, theirs))
        rows.append(row)
    return {"model": model, "steps": steps, "height": size, "width": size, "seed": seed, "prompt": PROMPT,
            "torch": torch.__version__, "cache_dit": cache_dit.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spec", action="append", required=True, help="F<n>B<n>W<n>[MC<n>],THRESH (repeat)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    result = side_by_side(args.model, args.steps, args.size, args.spec, args.seed)
    for row in result["rows"]:
        for who in ("ours", "cache_dit"):
            r = row[who]
            print(f"{row['spec']:>16}  {who:<9}  skipped {r['skipped_steps']:>2}/{args.steps}  "
                  f"PSNR {r['psnr']:6.2f} dB  SSIM {r['ssim']:.4f}  steps {r['skipped']}")
        print(f"{'':>16}  the same image: {row['same_image']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
