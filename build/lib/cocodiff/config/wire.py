"""Wire formats per link level (LOSSY): which bytes travel how, as plain data. No torch here.

    --wire LEVEL=FORMAT[,LEVEL=FORMAT]        e.g. node=fp8   node=fp8,card=bf16   node=int8
    +fp8 (variant suffix)                     = fp8 on the slowest level (the nodes)

A message between two ranks crosses the link of the outermost level at which they differ
(config/levels.py); where that level has a format, the message's values travel in it, packed into bytes
(distributed/comm/wire.py); every other message is sent as it is, bit for bit. Formats:

    bf16   values rounded to bfloat16: 2 bytes each (exact when the run computes in bfloat16)
    fp8    float8 e4m3 with one fp32 scale per block of head_dim values: 1 byte + 4/head_dim
    int8   int8 with one fp32 scale per block of head_dim values: 1 byte + 4/head_dim

K (the attention's keys) travels at most as lossy as `k_format` (default bf16): softmax
amplifies errors in the keys (see docs/usage.md for the measurement behind the default).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["EXACT", "FORMATS", "PRECISION", "Wire", "parse_wire"]

FORMATS = ("bf16", "fp8", "int8")
"""The formats `--wire` takes."""
EXACT = "exact"
"""The values as they are (what every level without a format sends)."""
PRECISION = {EXACT: 3, "bf16": 2, "fp8": 1, "int8": 1}
"""Higher is closer to the values; `Wire.format_for` keeps K at least at `k_format`'s."""
SLOWEST = "slowest"
"""The level name `+fp8` stands for: the outermost level, whatever the topology names it."""


@dataclass(frozen=True, slots=True)
class Wire:
    """Formats per level name; levels not named send their values exactly."""

    levels: tuple[tuple[str, str], ...]
    """(level, format) pairs as written; the level `slowest` is the outermost one (`+fp8`)."""
    k_format: str = "bf16"
    """K's floor: where a level's format is lossier than this, K travels in this one instead."""

    def __post_init__(self) -> None:
        for level, fmt in self.levels:
            if fmt not in FORMATS:
                raise UsageError(f"--wire {self.text!r}: format {fmt!r} for level {level!r} is not one of {', '.join(FORMATS)}")
        if self.k_format not in (*FORMATS, EXACT):
            raise UsageError(f"wire K format {self.k_format!r} is not one of {', '.join((*FORMATS, EXACT))}")

    @property
    def text(self) -> str:
        """The `--wire` form: 'node=fp8,card=bf16'."""
        return ",".join(f"{level}={fmt}" for level, fmt in self.levels)

    def __str__(self) -> str:
        return self.text

    @property
    def lossy(self) -> bool:
        """Every format rounds values wider than itself; bf16 is exact only for a bf16 run."""
        return bool(self.levels)

    def check(self, level_names: list[str]) -> None:
        """Every level named exists in the run's levels (outermost first); a UsageError otherwise."""
        for level, _ in self.levels:
            if level != SLOWEST and level not in level_names:
                raise UsageError(f"--wire {self.text!r}: level {level!r} is not one of the run's levels "
                                 f"({', '.join(level_names)})")

    def format_for(self, level: str | None, outermost: str, tensor: str = "") -> str:
        """The format of a message over the link of `level` (None: a rank to itself) carrying
        `tensor` ('k' for keys, anything else for the rest); `outermost` is the run's node level."""
        if level is None:
            return EXACT
        named = dict(self.levels)
        fmt = named.get(level, named.get(SLOWEST, EXACT) if level == outermost else EXACT)
        if tensor == "k" and PRECISION[fmt] < PRECISION[self.k_format]:
            return self.k_format
        return fmt


def parse_wire(text: str) -> Wire | None:
    """'node=fp8,card=bf16' -> Wire; '' or 'exact' -> None. A bad item is a one-line UsageError."""
    text = text.strip().lower()
    if text in ("", EXACT, "off"):
        return None
    levels: list[tuple[str, str]] = []
    for item in text.split(","):
        level, eq, fmt = (part.strip() for part in item.partition("="))
        if not eq or not level or not fmt:
            raise UsageError(f"--wire {text!r}: {item.strip()!r} is not LEVEL=FORMAT (e.g. node=fp8,card=bf16)")
        if fmt not in FORMATS:
            raise UsageError(f"--wire {text!r}: format {fmt!r} is not one of {', '.join(FORMATS)}")
        if level in (name for name, _ in levels):
            raise UsageError(f"--wire {text!r}: level {level!r} is given twice")
        levels.append((level, fmt))
    return Wire(tuple(levels))
