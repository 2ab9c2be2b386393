"""TaylorSeer: the middle blocks' residual on a skipped step, extrapolated from the steps computed.

The residual is a function of the step index; after each computed step its value R_k and its
divided differences over the last O + 1 computed steps are kept: f[k] = R_k, f[k, k'] = (R_k -
R_k') / (k - k'), f[k, k', k''] = (f[k, k'] - f[k', k'']) / (k - k''), ... (Newton's table, along
its newest diagonal). On a skipped step s the residual is the expansion about the last computed step

    R(s) = f[k] + f[k, k'] (s - k) + f[k, k', k''] (s - k)(s - k') + ...

the polynomial of order O through those steps: its j-th term estimates the j-th derivative's
Taylor term (as TaylorSeer's finite differences do), and it is exact on residuals that are
polynomials of order O, with computed steps evenly spaced or not (TaylorSeer's published
backward-difference form, `sum_j d_j (s - k)^j / j!` with d_j a difference of differences over one
gap, is the same at order 1 and overshoots at order 2). Order 0 is the plain reuse of the last
residual (fbcache, dbcache), returned as the same tensors. A change of shape (a plan that shards
the tokens differently) starts the table again from order 0.

Each residual is a pair (image tokens, text tokens or None: the text left the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["Residual", "TaylorResidual"]

Residual = tuple[torch.Tensor, torch.Tensor | None]
"""What the middle blocks added: (image, text; None when the text left the blocks)."""


@dataclass
class TaylorResidual:
    """The middle's residual over the computed steps of one call of a step, and its extrapolation."""

    order: int
    """Highest divided difference kept (0: the last residual only)."""
    factors: list[Residual] = field(default_factory=list)
    """f[k], f[k, k'], ...: the last residual, then its divided differences (fewer after few computed steps)."""
    steps: list[int] = field(default_factory=list)
    """The step indices of the computed residuals the table spans, newest first."""

    def __bool__(self) -> bool:
        return bool(self.factors)

    @property
    def last(self) -> Residual:
        """The last computed residual (f[k])."""
        return self.factors[0]

    def update(self, step: int, residual: Residual) -> None:
        """A computed step's residual: the divided differences against the steps before it, up to the order."""
        new = [residual]
        if self.order and self.steps and step > self.steps[0]:
            for j, previous in enumerate(self.factors[: self.order]):
                if not _same_shapes(previous, new[-1]):
                    break
                gap = step - self.steps[j]
                new.append(_combine(new[-1], previous, lambda a, b: (a - b) / gap))
        self.factors, self.steps = new, [step, *self.steps][: len(new)]

    def predict(self, step: int) -> Residual:
        """The residual at a skipped `step`: the expansion about the last computed step."""
        if len(self.factors) == 1:
            return self.factors[0]
        image, text = self.factors[0]
        weight = 1.0
        for j, (d_image, d_text) in enumerate(self.factors[1:]):
            weight *= step - self.steps[j]  # (s - k)(s - k')...
            image = image + d_image * weight
            text = text + d_text * weight if text is not None and d_text is not None else text
        return image, text

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor kept (for the cache's memory)."""
        return [t for pair in self.factors for t in pair if t is not None]


def _same_shapes(a: Residual, b: Residual) -> bool:
    return a[0].shape == b[0].shape and (a[1] is None) == (b[1] is None) and (a[1] is None or a[1].shape == b[1].shape)


def _combine(a: Residual, b: Residual, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Residual:
    return op(a[0], b[0]), (op(a[1], b[1]) if a[1] is not None and b[1] is not None else None)
