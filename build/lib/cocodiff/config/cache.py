"""`--cache SPEC` parsed into a `CacheSpec`, and the decision rule on the sums of every rank.

    fbcache[:THRESH]                            first-block cache (F1B0, 0.05)
    dbcache[:OPTIONS][,THRESH]                  DBCache; options F<n>B<n> W<n> MC<n> O<n> (F8B0 W8, 0.08)
    taylorseer[:OPTIONS]                        fixed interval; options F<n>B<n> N<n> O<n> W<n> (F0B0 N2 O1 W2)
    teacache[:OPTIONS][,THRESH]                 modulated-input change; options W<n> MC<n> O<n> (0.25)
    magcache[:OPTIONS][,THRESH]                 calibrated magnitude ratios; options W<n> MC<n> O<n> (MC3, 0.06)

Options are letter codes with a number, written together (`F1B0W2MC3O1`, as cache-dit names its
caches): F / B the blocks always computed first / last, W the warm-up steps always computed, MC
the most steps skipped in a row, N TaylorSeer's compute interval (compute one step in N), O the
order of the Taylor expansion of the cached residual on a skipped step (TaylorSeer; 0: reused as
is). `dbcache:F1B0W2O1,0.2` stacks TaylorSeer on DBCache.

No torch here: `ParallelConfig` (and through it `simulate`) parses specs without loading it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["CacheSpec", "GRAMMAR", "parse_cache", "should_skip"]

GRAMMAR = ("fbcache[:THRESH], dbcache[:F<n>B<n>W<n>MC<n>O<n>][,THRESH], taylorseer[:F<n>B<n>N<n>O<n>W<n>], "
           "teacache[:W<n>MC<n>O<n>][,THRESH] or magcache[:W<n>MC<n>O<n>][,THRESH]")
_CODES = re.compile(r"(MC|[A-Z])(\d+)", re.IGNORECASE)
_OPTIONS = {"fbcache": "", "dbcache": "FBWMO", "taylorseer": "FBNOW", "teacache": "WMO", "magcache": "WMO"}
"""The option letters of each kind (M: MC)."""
_DEFAULTS = {  # F, B, threshold, W, MC, N, O
    "fbcache": (1, 0, 0.05, 0, None, 1, 0),  # diffusers' FirstBlockCacheConfig
    "dbcache": (8, 0, 0.08, 8, None, 1, 0),  # cache-dit's BasicCacheConfig
    "taylorseer": (0, 0, None, None, None, 2, 1),  # W: O + 1 (the points a difference of order O needs)
    "teacache": (0, 0, 0.25, 0, None, 1, 0),  # TeaCache4FLUX's example setting (1.5x on FLUX.1-dev)
    "magcache": (0, 0, 0.06, None, 3, 1, 0),  # diffusers' MagCacheConfig; W: 20% of the calibrated steps
}
MAX_ORDER = 3
"""Highest Taylor order: the finite differences of more steps than this amplify noise more than they predict."""


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A step cache's settings, parsed from `--cache SPEC` (`parse_cache`)."""

    kind: str
    """`fbcache`, `dbcache`, `taylorseer`, `teacache` or `magcache`."""
    first: int
    """Fn: blocks always computed first (0: the decision comes before any block)."""
    last: int
    """Bn: blocks always computed last."""
    threshold: float
    """fbcache / dbcache: skip the middle when the relative L1 change of the Fn residual is below
    this; teacache / magcache: when the accumulated (rescaled) change or error is; 0: never skip.
    taylorseer: unused (its interval decides)."""
    warmup: int | None
    """Steps always computed at the start of a run; None: the kind's default (magcache: 20% of the
    calibrated steps)."""
    max_in_a_row: int | None
    """Most steps skipped in a row; None: no limit (taylorseer: N - 1)."""
    first_given: bool = True
    """False when Fn is the default (capped to leave a middle block on a small model)."""
    text: str = ""
    interval: int = 1
    """taylorseer: N, one step computed in N."""
    order: int = 0
    """Order of the Taylor expansion of the middle's residual on a skipped step (0: the last one as is)."""

    def __str__(self) -> str:
        return self.text or f"{self.kind}:F{self.first}B{self.last},{self.threshold:g}"

    @property
    def decides_after_first(self) -> bool:
        """Whether the decision needs the first Fn blocks' output (fbcache, dbcache) rather than
        coming at the middle's entry (the other kinds decide from the step or the block's input)."""
        return self.kind in ("fbcache", "dbcache")

    def block_split(self, blocks: int) -> tuple[int, int]:
        """(Fn, end of the middle) on a model of `blocks` blocks; a UsageError when no middle is left."""
        first = self.first if self.first_given else max(1, min(self.first, blocks - 1 - self.last))
        if first + self.last >= blocks:
            raise UsageError(f"--cache {self}: F{first} + B{self.last} blocks leave none to cache; "
                             f"this transformer has {blocks} (F + B must be below it)")
        return first, blocks - self.last


def _options(written: str, kind: str, part: str) -> dict[str, int] | None:
    """'F1B0W2' -> {'F': 1, 'B': 0, 'W': 2} (MC as 'M'); None when `part` is no run of letter codes."""
    codes = _CODES.findall(part)
    if not codes or "".join(c + n for c, n in codes).upper() != part.upper():
        return None
    found: dict[str, int] = {}
    for code, number in codes:
        letter = code.upper()[0]
        if letter not in _OPTIONS[kind] or letter in found:
            allowed = ", ".join("MC" if c == "M" else c for c in _OPTIONS[kind])
            why = ("is given twice" if letter in found else f"is not an option of {kind} ({allowed})" if allowed
                   else f"is not expected here ({kind} takes a threshold only)")
            raise UsageError(f"--cache {written!r}: {code.upper()}{number} {why}; use {GRAMMAR}")
        found[letter] = int(number)
    return found


def parse_cache(text: str) -> CacheSpec:
    """'dbcache:F8B0,0.08' -> CacheSpec; anything else is a one-line UsageError naming it."""
    written = text.strip()
    kind, _, rest = written.partition(":")
    kind = kind.strip().lower()
    if kind not in _DEFAULTS:
        raise UsageError(f"--cache {written!r} is not a step cache: use {GRAMMAR}")
    first, last, threshold, warmup, in_a_row, interval, order = _DEFAULTS[kind]
    first_given = kind != "dbcache"
    parts = [p.strip() for p in rest.split(",")] if rest.strip() else []
    options: dict[str, int] | None = None
    thresholds = 0
    for part in parts:
        found = _options(written, kind, part) if _CODES.match(part) else None
        if found is not None and options is None:
            options = found
            continue
        if found is not None or thresholds or threshold is None:
            what = "one group of options at most" if found is not None else (
                "taylorseer takes no threshold: N sets its interval" if threshold is None else "one threshold at most")
            raise UsageError(f"--cache {written!r}: {part!r} is not expected here ({what}); use {GRAMMAR}")
        try:
            threshold = float(part)
        except ValueError:
            raise UsageError(f"--cache {written!r}: {part!r} is neither options (letter codes like F1B0W2) "
                             f"nor a threshold; use {GRAMMAR}") from None
        thresholds += 1
    options = options or {}
    if ("F" in options) != ("B" in options) and kind == "dbcache":
        raise UsageError(f"--cache {written!r}: F<n> and B<n> come together (F1B0); use {GRAMMAR}")
    first, last = options.get("F", first), options.get("B", last)
    first_given = first_given or "F" in options
    interval, order = options.get("N", interval), options.get("O", order)
    in_a_row = options.get("M", in_a_row)
    warmup = options.get("W", warmup if warmup is not None or kind == "magcache" else order + 1)
    if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
        raise UsageError(f"--cache {written!r}: the threshold {threshold:g} must be a finite number at least 0")
    if first < 1 and kind == "dbcache":
        raise UsageError(f"--cache {written!r}: F{first} must be at least 1 (the blocks whose residual decides)")
    if in_a_row is not None and in_a_row < 1:
        raise UsageError(f"--cache {written!r}: MC{in_a_row} must be at least 1 (leave it out for no limit)")
    if interval < 1:
        raise UsageError(f"--cache {written!r}: N{interval} must be at least 1 (N1 computes every step)")
    if "O" in options and not 1 <= order <= MAX_ORDER:
        raise UsageError(f"--cache {written!r}: O{order} must be from 1 to {MAX_ORDER} (leave it out to reuse as is)")
    if kind == "taylorseer":
        threshold, in_a_row = 0.0, interval - 1  # skip whenever allowed: N - 1 steps after each computed one
    return CacheSpec(kind=kind, first=first, last=last, threshold=threshold, warmup=warmup, max_in_a_row=in_a_row,
                     first_given=first_given, text=written, interval=interval, order=order)


def should_skip(sums: list[float], threshold: float) -> bool:
    """The decision from the sums over every rank (`local_sums`, all-reduced): skip the middle blocks
    when no rank must compute and the relative L1 change is below `threshold`."""
    numerator, denominator, must_compute = sums[:3]
    return must_compute == 0 and denominator > 0 and numerator / denominator < threshold
