"""V-Major's cache-ratio schedules: how many of its inter-node tokens a rank reuses at each step.

`--v-major` (and `ParallelConfig.v_major`) takes one of:

- `off`: every token is sent (exact);
- `linear`: r = step / steps, 0 at the first step and rising towards 1 (the paper's best);
- `constant:R`: r = R from the second step on;
- `warmup:N,linear`: N full steps, then linear over the rest;
- `adaptive:EPS`: hold a target relative L2 error EPS of the V rows receivers use instead of a
  fixed curve (the ratio itself is set step by step by `VMajor`, from an all-reduced error).

The text is parsed once, into a `Schedule`; `str(schedule)` gives back what the user wrote, so
reports print the schedule as it was asked for. This module needs no torch: `ParallelConfig`
parses its schedule without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from .sizes import digits

__all__ = ["Schedule", "parse_schedule"]

@dataclass(frozen=True)
class Schedule:
    """A parsed `--v-major` schedule."""

    kind: str
    """off | linear | constant | adaptive"""
    ratio: float = 0.0
    """constant: the cache ratio; adaptive: the target relative error EPS"""
    warmup: int = 0
    """linear: full steps before the ratio starts rising"""
    text: str = field(default="", compare=False)
    """What the user wrote (reports print it as written); empty for a schedule built in code."""

    @property
    def off(self) -> bool:
        """True when V-Major is switched off (nothing is cached at all)."""
        return self.kind == "off"

    @property
    def lossy(self) -> bool:
        """True when some step reuses cached tokens (`constant:0` caches but reuses nothing)."""
        return self.kind != "off" and not (self.kind == "constant" and self.ratio == 0.0)

    def ratio_at(self, step: int, steps: int) -> float:
        """Fraction of inter-node tokens reused at `step` (0-based) of `steps` (adaptive: VMajor sets it)."""
        if self.kind in ("off", "adaptive") or step < max(1, self.warmup):
            return 0.0
        if self.kind == "constant":
            return self.ratio
        span = max(1, steps - self.warmup)
        return (step - self.warmup + 1) / (span + 1) if self.warmup else step / steps

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.kind in ("constant", "adaptive"):
            return f"{self.kind}:{self.ratio:g}"
        return f"warmup:{self.warmup},linear" if self.warmup else self.kind


def parse_schedule(text: str) -> Schedule:
    """'linear', 'constant:0.5', 'warmup:2,linear', 'adaptive:0.05', 'off' -> a `Schedule`.

    Raises `UsageError` naming `--v-major` for anything else."""
    spec = text.strip().lower()
    if spec in ("off", "linear"):
        return Schedule(spec, text=text)
    if spec.startswith("constant:"):
        ratio = _number(spec.split(":", 1)[1])
        if not 0.0 <= ratio <= 1.0:
            raise UsageError(f"--v-major {spec!r}: the cache ratio must be a number from 0 to 1")
        return Schedule("constant", ratio, text=text)
    if spec.startswith("adaptive:"):
        eps = _number(spec.split(":", 1)[1])
        if not 0.0 < eps <= 1.0:
            raise UsageError(f"--v-major {spec!r}: the target relative error must be a number above 0, at most 1")
        return Schedule("adaptive", eps, text=text)
    if spec.startswith("warmup:") and spec.endswith(",linear"):
        count = spec[len("warmup:") : -len(",linear")]
        if digits(count):
            return Schedule("linear", warmup=int(count), text=text)
    raise UsageError(f"--v-major {spec!r} is not one of off, linear, constant:R (0<=R<=1), warmup:N,linear, adaptive:EPS")


def _number(text: str) -> float:
    """A float, or -1 (out of every valid range) when `text` is not one."""
    try:
        return float(text)
    except ValueError:
        return -1.0
