"""`--lossy-budget DB` (LOSSY, opt-in): what `--comm auto` may add to its candidates.

By default `auto` never chooses a lossy wire format. With a budget (`--lossy-budget 40dB`) it
also times each candidate exchange with the wire format below on the slowest level (the nodes),
where that format's PSNR against the exact image on this model, as measured (table below), meets
the budget; the fastest candidate wins, lossy or not. A model with no measured figure is refused
(one line): no guess stands in for a measurement.

Measured on the trained tiny-shapes (20 steps, 64x64, rail 2x2 = 4 ranks of 2 per node, TAPA,
seed 0, K at bf16), `bench quality --wire` (docs/usage.md gives the commands and figures).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError
from .wire import SLOWEST, Wire

__all__ = ["MEASURED_PSNR", "LossyBudget", "lossy_budget"]

MEASURED_PSNR: dict[str, dict[str, float]] = {
    "tiny-shapes": {"int8": 58.9, "fp8": 51.2},
}
"""Per model preset: PSNR (dB) of the image against the exact run with the format on the node level."""


@dataclass(frozen=True)
class LossyBudget:
    """The budget and the wire format it allows on this model (None: none meets it)."""

    db: float
    model: str
    fmt: str | None
    psnr: float | None
    """The format's measured PSNR on the model (dB)."""

    @property
    def wire(self) -> Wire | None:
        """The wire `auto` may try: the format on the slowest level."""
        return Wire(((SLOWEST, self.fmt),)) if self.fmt is not None else None

    def __str__(self) -> str:
        allowed = f"{self.fmt} on the nodes ({self.psnr:g} dB measured)" if self.fmt else "no wire format meets it"
        return f"{self.db:g}dB on {self.model}: {allowed}"


def lossy_budget(model: str, text: str | float | None) -> LossyBudget | None:
    """'40dB' or 40 on `model` -> the budget and what it allows; None: no budget (never lossy)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:db)?\s*", str(text).lower())
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--lossy-budget {text!r} is not a PSNR in dB above 0 (e.g. 40dB)")
    db = float(match.group(1))
    figures = MEASURED_PSNR.get(model)
    if figures is None:
        raise UsageError(f"--lossy-budget {text}: no measured PSNR of a wire format on {model!r} (measured: "
                         f"{', '.join(MEASURED_PSNR)}); name a format with --wire instead")
    allowed = {fmt: psnr for fmt, psnr in figures.items() if psnr >= db}
    fmt = max(allowed, key=allowed.get, default=None)  # the formats cost the same bytes (1 + 4/head_dim): the closest
    return LossyBudget(db, model, fmt, allowed.get(fmt) if fmt else None)
