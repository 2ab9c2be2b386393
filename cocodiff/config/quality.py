"""How far a LOSSY mode may move the output: its floor, a PSNR of the image against the exact run.

A lossy run (a step cache, a wire format, V-Major, displaced patches, quantized weights) passes `verify` and the matrix when its image's
PSNR against the exact one-process image is at or above the floor of each lossy mode it uses; an
exact run passes within `verify`'s relative tolerance. A floor is a stated promise, not a fit to
one measurement: 30 dB is where a difference is hard to see on a photograph, and a mode that
reuses stale values (a step cache skipping whole steps, V-Major skipping tokens) is held to less,
since what it trades is speed for a visible but bounded drift. Measured figures per model and mode
are in docs/matrix.md.
"""

from __future__ import annotations

from .parallel import ParallelConfig

__all__ = ["FLOORS_DB", "lossy_floor"]

FLOORS_DB: dict[str, float] = {
    "wire": 30.0,  # values rounded to 8 bits on the slowest links, K at bf16
    "v_major": 25.0,  # stale V (and Q/K) rows of the least changed tokens between steps
    "cache": 20.0,  # whole steps' middle blocks skipped, their residual reused
    "patches": 30.0,  # displaced patches: the other patches' keys and values one step old
    "quantize": 30.0,  # weights rounded to 8 bits per output channel (--quantize)
}
"""The floor (dB) of each lossy mode."""


def lossy_floor(parallel: ParallelConfig, quantize: str | None = None) -> float | None:
    """The lowest floor of the lossy modes `parallel` uses, and quantized weights (`quantize`, a
    mode of `--quantize`); None: an exact run."""
    used = [FLOORS_DB["wire"] if parallel.wire is not None or (parallel.lossy_budget is not None and parallel.lossy_budget.fmt)
            else None,
            FLOORS_DB["v_major"] if parallel.schedule.lossy else None,
            FLOORS_DB["cache"] if parallel.cache is not None else None,
            FLOORS_DB["patches"] if parallel.pipe_patches is not None else None,
            FLOORS_DB["quantize"] if quantize is not None else None]
    floors = [f for f in used if f is not None]
    return min(floors) if floors else None
