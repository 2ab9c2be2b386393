"""`--cache SPEC` parsed into a `CacheSpec`, and the decision rule on the sums of every rank.

No torch here: `ParallelConfig` (and through it `simulate`) parses specs without loading it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["CacheSpec", "parse_cache", "should_skip"]

_GRAMMAR = "fbcache[:THRESH] or dbcache[:F<n>B<n>[W<n>][MC<n>][,THRESH]]"
_NOT_HERE = ("teacache", "magcache", "taylorseer")
"""Caches of the contract's family that this engine does not implement (yet)."""
_BLOCKS = re.compile(r"F(\d+)B(\d+)(?:W(\d+))?(?:MC(\d+))?", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A step cache's settings, parsed from `--cache SPEC` (`parse_cache`)."""

    kind: str
    """`fbcache` or `dbcache`."""
    first: int
    """Fn: blocks always computed first; the residual after them decides."""
    last: int
    """Bn: blocks always computed last."""
    threshold: float
    """Skip the middle when the relative L1 change of the Fn residual is below this (0: never)."""
    warmup: int
    """Steps always computed at the start of a run."""
    max_in_a_row: int | None
    """Most steps skipped in a row; None: no limit."""
    first_given: bool = True
    """False when Fn is the default (capped to leave a middle block on a small model)."""
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"{self.kind}:F{self.first}B{self.last},{self.threshold:g}"

    def block_split(self, blocks: int) -> tuple[int, int]:
        """(Fn, end of the middle) on a model of `blocks` blocks; a UsageError when no middle is left."""
        first = self.first if self.first_given else max(1, min(self.first, blocks - 1 - self.last))
        if first + self.last >= blocks:
            raise UsageError(f"--cache {self}: F{first} + B{self.last} blocks leave none to cache; "
                             f"this transformer has {blocks} (F + B must be below it)")
        return first, blocks - self.last


def parse_cache(text: str) -> CacheSpec:
    """'dbcache:F8B0,0.08' -> CacheSpec; anything else is a one-line UsageError naming it."""
    written = text.strip()
    kind, _, rest = written.partition(":")
    kind = kind.strip().lower()
    if kind in _NOT_HERE:
        raise UsageError(f"--cache {written!r}: {kind} is not implemented; use {_GRAMMAR}")
    if kind not in ("fbcache", "dbcache"):
        raise UsageError(f"--cache {written!r} is not a step cache: use {_GRAMMAR}")
    if kind == "fbcache":
        first, last, threshold, warmup, in_a_row, first_given = 1, 0, 0.05, 0, None, True
    else:
        first, last, threshold, warmup, in_a_row, first_given = 8, 0, 0.08, 8, None, False
    parts = [p.strip() for p in rest.split(",")] if rest.strip() else []
    seen: set[str] = set()
    for part in parts:
        blocks = _BLOCKS.fullmatch(part)
        what = "blocks" if blocks else "threshold"
        if what in seen or (blocks and kind == "fbcache"):
            raise UsageError(f"--cache {written!r}: {part!r} is not expected here; use {_GRAMMAR}")
        seen.add(what)
        if blocks:
            first, last = int(blocks[1]), int(blocks[2])
            warmup = int(blocks[3]) if blocks[3] is not None else warmup
            in_a_row = int(blocks[4]) if blocks[4] is not None else None
            first_given = True
            continue
        try:
            threshold = float(part)
        except ValueError:
            raise UsageError(f"--cache {written!r}: {part!r} is neither F<n>B<n>[W<n>][MC<n>] nor a threshold; "
                             f"use {_GRAMMAR}") from None
    if not (math.isfinite(threshold) and threshold >= 0):
        raise UsageError(f"--cache {written!r}: the threshold {threshold:g} must be a finite number at least 0")
    if first < 1:
        raise UsageError(f"--cache {written!r}: F{first} must be at least 1 (the blocks whose residual decides)")
    if in_a_row is not None and in_a_row < 1:
        raise UsageError(f"--cache {written!r}: MC{in_a_row} must be at least 1 (leave it out for no limit)")
    return CacheSpec(kind=kind, first=first, last=last, threshold=threshold, warmup=warmup,
                     max_in_a_row=in_a_row, first_given=first_given, text=written)


def should_skip(sums: list[float], threshold: float) -> bool:
    """The decision from the sums over every rank (`local_sums`, all-reduced): skip the middle blocks
    when no rank must compute and the relative L1 change is below `threshold`."""
    numerator, denominator, must_compute = sums
    return must_compute == 0 and denominator > 0 and numerator / denominator < threshold
