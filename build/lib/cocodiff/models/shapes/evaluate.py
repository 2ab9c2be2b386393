"""Evidence that `tiny-shapes` learned: the checker on held-out captions, and a sample grid.

    python -m cocodiff.models.shapes.evaluate [--weights DIR] [--out docs] [--seeds 2] [--threads 2]

1. Ground truth: the checker (check.py) on procedurally drawn images of the held-out captions,
   which shows how far the checker itself can be trusted.
2. Generated: every held-out caption (two-object arrangements training never showed) and every
   single-object caption, `--seeds` samples each, generated with the stock `FluxPipeline` and
   `FlowMatchEulerDiscreteScheduler` at the preset's defaults, then checked.
3. The default prompt on seeds 0-3: what `cocodiff generate` draws with no flags (and `--seed`).

Writes `shapes-eval.json` (all figures) and `shapes-samples.png` (a captioned grid, a green title
where the checker found everything asked for, red where not) into `--out`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cocodiff.config.parallel import DEFAULT_PROMPT
from cocodiff.errors import UsageError
from cocodiff.output.files import check_folder, save_figure
from cocodiff.output.atomic import write_bytes
from .check import check, summarize
from .data import COLOURS, SHAPES, SIZE, ShapesDataset, heldout_captions
from .model import CFG_SCALE, DEFAULT_STEPS, WEIGHTS, load_parts

__all__ = ["evaluate", "generate", "save_grid", "sample_grid", "main"]


def generate(
    pipe: Any, encoder: Any, captions: list[str], seed: int = 0, steps: int = DEFAULT_STEPS,
    cfg_scale: float = CFG_SCALE, batch: int = 32,
) -> np.ndarray:
    """(N, SIZE, SIZE, 3) uint8 images, one per caption; chunk k's noise comes from seed + k."""
    pipe.set_progress_bar_config(disable=True)
    images = []
    for k, start in enumerate(range(0, len(captions), batch)):
        chunk = captions[start : start + batch]
        embeds, _, pooled = encoder(chunk)
        negative, _, negative_pooled = encoder([""] * len(chunk))
        out = pipe(
            prompt_embeds=embeds, pooled_prompt_embeds=pooled,
            negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled,
            true_cfg_scale=cfg_scale, height=SIZE, width=SIZE, num_inference_steps=steps,
            generator=torch.Generator().manual_seed(seed + k), output_type="np",
        ).images
        images.append((np.asarray(out) * 255).round().clip(0, 255).astype(np.uint8))
    return np.concatenate(images)


def save_grid(images: np.ndarray, captions: list[str], path: Path, columns: int = 8, marks: list[bool] | None = None) -> None:
    """A grid of images, each titled with its caption (green / red by `marks`, if given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 1.6, rows * 1.95), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for i, (image, caption) in enumerate(zip(images, captions)):
        ax = axes.ravel()[i]
        ax.imshow(image, interpolation="nearest")
        words = caption.split()
        title = " ".join(words[:3]) + ("\n" + " ".join(words[3:]) if len(words) > 3 else "")
        colour = "black" if marks is None else ("darkgreen" if marks[i] else "firebrick")
        ax.set_title(title, fontsize=7, color=colour)
    fig.tight_layout(pad=0.3)
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def sample_grid(weights: Path, path: Path, count: int = 16, seed: int = 0) -> None:
    """Samples of the first `count` held-out captions (spread over the list) from `weights`."""
    pipe, encoder = load_parts(weights)
    pool = heldout_captions()
    captions = [pool[i * len(pool) // count] for i in range(count)]
    images = generate(pipe, encoder, captions, seed=seed)
    save_grid(images, captions, path, marks=[check(im, c).all_found for im, c in zip(images, captions)])


def evaluate(weights: Path = WEIGHTS, seeds: int = 2, ground_truth: int = 500) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """The figures, and the generated held-out images with their captions."""
    started = time.perf_counter()
    heldout = ShapesDataset(seed=1234, split="heldout")
    truth = summarize([check(*heldout[i]) for i in range(ground_truth)])
    pipe, encoder = load_parts(weights)
    results: dict[str, Any] = {"weights": str(weights), "steps": DEFAULT_STEPS, "cfg_scale": CFG_SCALE, "seeds": seeds}
    results["ground_truth_heldout"] = truth
    kept: tuple[np.ndarray, list[str]] = (np.zeros((0, SIZE, SIZE, 3), np.uint8), [])
    for name, captions in (("generated_heldout", heldout_captions()), ("generated_single", [f"a {c} {s}" for c in COLOURS for s in SHAPES])):
        all_captions = captions * seeds
        images = np.concatenate([generate(pipe, encoder, captions, seed=1000 * s) for s in range(seeds)])
        results[name] = summarize([check(im, c) for im, c in zip(images, all_captions)])
        if name == "generated_heldout":
            kept = (images, all_captions)
    default = [check(generate(pipe, encoder, [DEFAULT_PROMPT], seed=seed)[0], DEFAULT_PROMPT) for seed in range(4)]
    results["default_prompt"] = {  # what `cocodiff generate --seed S` draws with no other flag
        "prompt": DEFAULT_PROMPT, "seeds": [0, 1, 2, 3],
        "passed": [bool(v.all_found and v.relation_ok) for v in default],
        "note": "passed: both objects (colour and shape) found and their relation right",
    }
    results["wall_s"] = round(time.perf_counter() - started, 1)
    return results, *kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cocodiff.models.shapes.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=Path, default=WEIGHTS, help="a train-tiny output folder (default: the shipped weights)")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for shapes-eval.json and shapes-samples.png")
    parser.add_argument("--seeds", type=int, default=2, help="samples per caption")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    try:
        check_folder("--out", args.out)  # before the sampling, not after it
    except UsageError as error:
        parser.error(str(error))
    from diffusers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    results, images, captions = evaluate(args.weights, seeds=args.seeds)
    write_bytes(args.out / "shapes-eval.json", (json.dumps(results, indent=2) + "\n").encode())
    pick = np.linspace(0, len(captions) // max(args.seeds, 1) - 1, 32).round().astype(int)
    save_grid(images[pick], [captions[i] for i in pick], args.out / "shapes-samples.png",
              marks=[check(images[i], captions[i]).all_found for i in pick])
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
