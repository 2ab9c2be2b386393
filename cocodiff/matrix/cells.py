"""The matrix's columns: every feature, declared once, as the flags a user would type.

A cell is a model (a row: every preset) and a feature (a column). Its expected outcome is
declared here, beside the feature, or beside the family (`Family.refuses`): **exact** (`verify`'s
tolerance against one process), **lossy** (PSNR against the exact run at or above the floor of
its lossy modes, `config/quality.py`, and what it saved), or **refused** (exit 2, one line, before
any rank loads weights). A new feature is one `Feature` line; a new preset or family enters every
column by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FEATURES", "Feature", "IMAGE_TASKS", "cell_args", "cell_size"]

EXACT, LOSSY = "exact", "lossy"


@dataclass(frozen=True)
class Feature:
    name: str
    """The column's name (also `cocodiff matrix --features`)."""
    args: tuple[str, ...]
    """The flags of `verify` that turn it on, beside the cell's model, ranks and size."""
    nproc: int = 2
    ranks_per_node: int | None = None
    """Ranks per emulated node (2 of 4 ranks: two nodes, so the node level is crossed)."""
    kind: str = EXACT
    steps: int = 2
    """Denoising steps: 2, or more where the feature needs them to act (a step cache skips from the third)."""
    saves: str | None = None
    """What a LOSSY feature saves: 'steps' (the cache's skipped steps) or 'bytes' (inter-node bytes
    against the `baseline` column)."""
    baseline: str | None = None
    runs: int = 1
    """Runs of the cell in a row, the last one compared (magcache: the first calibrates its curve)."""
    needs: tuple[str, ...] = ()
    """What of a model it needs, which a family or preset may refuse (`models.presets.refusal`)."""
    refused: dict[str, str] = field(default_factory=dict)
    """model kind ('video', 'image') -> what the one-line refusal says, for features a kind cannot have."""


TAPA = ("--comm", "tapa")
FEATURES: tuple[Feature, ...] = (
    Feature("ulysses", (), nproc=4),
    Feature("ring", ("--plan", "r2")),
    Feature("ulysses x ring", ("--plan", "u2r2"), nproc=4),
    Feature("cfg groups", ("--plan", "c2u1"), needs=("data_groups",)),
    Feature("batch groups", ("--plan", "b2u1", "--batch", "2"), needs=("data_groups",)),
    Feature("batch 2", ("--batch", "2")),
    Feature("stages", ("--plan", "p2", "--batch", "2"), needs=("stages",)),
    Feature("stages x ulysses", ("--plan", "p2u2", "--batch", "2"), nproc=4, ranks_per_node=2,
            needs=("stages",)),
    Feature("stages x cfg", ("--plan", "c2p2"), nproc=4, needs=("data_groups", "stages")),
    Feature("stages x shard", ("--plan", "p2u2", "--shard-weights", "on"), nproc=4, ranks_per_node=2,
            needs=("stages",)),
    Feature("stages x compile", ("--plan", "p2", "--batch", "2", "--compile"), needs=("stages",)),
    Feature("displaced patches", ("--plan", "p2u2", "--pipe-patches", "2"), nproc=4, ranks_per_node=2, kind=LOSSY,
            steps=4, saves="bytes", baseline="tapa+vfirst", needs=("stages",)),
    Feature("tapa", (*TAPA, "--no-v-first"), nproc=4, ranks_per_node=2),
    Feature("tapa+vfirst", (*TAPA, "--v-first"), nproc=4, ranks_per_node=2),
    Feature("tapa-full", ("--comm", "tapa-full", "--levels", "node=2,rank=2"), nproc=4),
    Feature("8 ranks", TAPA, nproc=8, ranks_per_node=4),
    Feature("comm auto", ("--comm", "auto"), nproc=4, ranks_per_node=2, steps=4),
    Feature("plan auto", ("--plan", "auto"), nproc=4, ranks_per_node=2, steps=12),  # every candidate timed, p2u2 last
    Feature("v-major v", (*TAPA, "--v-major", "linear"), nproc=4, ranks_per_node=2, kind=LOSSY, steps=4,
            saves="bytes", baseline="tapa+vfirst"),
    Feature("v-major vqk", (*TAPA, "--v-major", "linear", "--v-major-tensors", "vqk"), nproc=4, ranks_per_node=2,
            kind=LOSSY, steps=4, saves="bytes", baseline="tapa+vfirst"),
    Feature("wire fp8", (*TAPA, "--wire", "node=fp8"), nproc=4, ranks_per_node=2, kind=LOSSY, saves="bytes",
            baseline="tapa+vfirst"),
    Feature("wire int8", (*TAPA, "--wire", "node=int8"), nproc=4, ranks_per_node=2, kind=LOSSY, saves="bytes",
            baseline="tapa+vfirst"),
    *(Feature(spec.split(":")[0], ("--cache", spec), kind=LOSSY, steps=5, saves="steps", runs=1 + spec.startswith("mag"),
              needs=("step_cache",))
      for spec in ("fbcache:1e9", "dbcache:F1B0W1,1e9", "teacache:W1,0.5", "magcache:W1,0.5", "taylorseer:F1B0N2O1W1")),
    Feature("shard weights", ("--shard-weights", "on"), ranks_per_node=2),
    Feature("offload encoders", ("--offload-text-encoders", "on")),
    Feature("parallel vae", ("--parallel-vae", "on"), needs=("parallel_vae",)),
    Feature("compile", ("--compile",)),
    Feature("img2img", ("--image", "{image}", "--strength", "0.6"), needs=("image_input",),
            refused={"video": "is a text-to-video model here; image input is for image models"}),
    Feature("inpaint", ("--image", "{image}", "--mask", "{mask}"), needs=("image_input",),
            refused={"video": "is a text-to-video model here; image input is for image models"}),
)
"""The columns, in the order docs/matrix.md shows them."""

IMAGE_TASKS = ("img2img", "inpaint")


def cell_size(pixel_multiple: int, video: bool) -> tuple[int, int, int | None]:
    """(height, width, frames) of a cell: the smallest picture that gives every rank of 4 tokens
    and VAE rows of its own (64 px, or four of the model's pixel multiples), 5 frames of a clip."""
    side = max(64, 4 * pixel_multiple)
    return side, side, 5 if video else None


def cell_args(model: str, feature: Feature, size: tuple[int, int, int | None], files: dict[str, str]) -> list[str]:
    """`verify`'s command line for one cell (after `verify`)."""
    height, width, frames = size
    args = ["--model", model, "--nproc", str(feature.nproc), "--steps", str(feature.steps),
            "--height", str(height), "--width", str(width), "--seed", "0"]
    if frames is not None:
        args += ["--frames", str(frames)]
    if feature.ranks_per_node is not None:
        args += ["--ranks-per-node", str(feature.ranks_per_node)]
    return args + [a.format(**files) for a in feature.args]
