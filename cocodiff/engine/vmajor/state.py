"""V-Major's per-layer state: the step, the cache ratio in force, and the caches on both sides.

At each denoising step a fraction r of the tokens a rank sends over inter-node links is not sent:
the receiver reuses what it holds from earlier steps. Which tokens is decided by the sender by
how much each changed since it last sent it; how many is a fixed count from the schedule, so
both sides of every exchange know every message size in advance, and every rank takes the same
branch whatever its data (no local threshold can change the collective pattern).

Change is measured as the squared L2 distance, per token, between the new projection and the
copy the receiver holds (the sender keeps a mirror of it). For V this is the right measure: an
attention output is a convex combination of value rows, so its error is bounded by the largest
distance of a reused row from the truth; measuring against the receiver's copy (not the previous
step) keeps staleness from accumulating unseen over several reused steps.

`adaptive:EPS` holds an error target instead of following a fixed curve: after each step the
ranks sum, with one all-reduce, the squared error of the V rows receivers hold and the squared
norm of the truth; if the relative L2 error sqrt(err / norm) exceeded EPS the ratio drops by two
linear increments (2 / steps), else it rises by one (1 / steps), within [0, 1 - 1/steps]. The
sums are all-reduced, so every rank sets the same ratio. The first step, and a step after the
scheduler's timestep jumps by more than twice the previous jump, always send in full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from cocodiff.config.vmajor import Schedule
from cocodiff.errors import UsageError

__all__ = ["VMajor", "select_tokens"]


@dataclass
class VMajor:
    """Schedule, step, caches and their memory for one parallelized transformer (rank-local tensors,
    rank-consistent decisions)."""

    schedule: Schedule
    tensors: str = "v"
    """'v': only V is selective; 'vqk': Q and K of the tokens V did not send are skipped too."""
    max_memory: int | None = None
    """Bytes of cache per rank (mean over ranks, from the global layout); layers past it send in full."""
    step: int = 0
    steps: int = 1
    call: int = 0
    """Transformer call within the step (CFG pipelines may call it twice per step)."""
    full_step: bool = True
    mirrors: dict = field(default_factory=dict)
    """sender side: key -> what the receiver holds, per piece"""
    caches: dict = field(default_factory=dict)
    """receiver side: key -> the last values received, per piece"""
    indices: dict = field(default_factory=dict)
    """key -> (tokens in V's piece, the tokens V sent) at this call, reused for Q/K of as many tokens with 'vqk'"""
    admitted: dict = field(default_factory=dict)
    """layer key -> whether it fits under max_memory (decided once, in call order)"""
    planned_bytes: int = 0
    errors: dict = field(default_factory=dict)
    """step -> [squared error of what receivers hold, squared norm of the truth] over V pieces sent selectively"""
    agree: Callable[[torch.Tensor], list[float]] | None = None
    """Sums values over all ranks (an all-reduce); adaptive schedules need it."""
    ratios: list = field(default_factory=list)
    """the cache ratio of every step so far"""
    _adaptive_ratio: float = 0.0
    _seen: bool = False
    _prev_t: float | None = None
    _prev_jump: float | None = None

    def __post_init__(self) -> None:
        if self.tensors not in ("v", "vqk"):
            raise UsageError(f"--v-major-tensors {self.tensors!r} is not one of v, vqk")
        if self.max_memory is not None and self.max_memory < 0:
            raise UsageError(f"--v-major-max-memory {self.max_memory} must be at least 0")

    # -- step tracking (called at every transformer entry, identical on every rank) -------------
    def begin_call(self, step: int, steps: int, timestep: float, same_step: bool = False) -> None:
        """Note the denoising step of this transformer call (`step` within its run, from the step
        clock; `same_step`: the clock says the previous call was of this step too)."""
        if self._seen and same_step:
            self.call += 1  # classifier-free guidance: another call in the same step
            return
        if step == 0 or step < self.step:  # a new generation: nothing held is valid
            self.clear()
        elif self.schedule.kind == "adaptive":
            self._adapt(steps)
        jump = None if self._prev_t is None else abs(timestep - self._prev_t)
        large = jump is not None and self._prev_jump is not None and jump > 2 * self._prev_jump
        self._prev_t, self._prev_jump, self._seen = timestep, jump, True
        self.step, self.steps, self.call = step, steps, 0
        self.full_step = step == 0 or large or self.ratio == 0.0
        self.ratios.append(0.0 if self.full_step else self.ratio)

    def _adapt(self, steps: int) -> None:
        """adaptive:EPS - the next ratio from the previous step's error, summed over all ranks."""
        if self.agree is None:
            raise RuntimeError("adaptive V-Major needs `agree` (an all-reduce over the ranks)")
        sums = self.errors.get(self.step)  # read once per step, the schedule's one host sync
        err, norm = self.agree(sums if sums is not None else torch.zeros(2, dtype=torch.float64))
        relative = (err / norm) ** 0.5 if norm > 0 else 0.0
        increment = 1.0 / max(steps, 1)
        if relative > self.schedule.ratio:
            self._adaptive_ratio = max(0.0, self._adaptive_ratio - 2 * increment)
        else:
            self._adaptive_ratio = min(1.0 - increment, self._adaptive_ratio + increment)

    @property
    def ratio(self) -> float:
        if self.schedule.kind == "adaptive":
            return self._adaptive_ratio if self.step > 0 else 0.0
        return self.schedule.ratio_at(self.step, self.steps)

    def keep(self, tokens: int) -> int:
        """Tokens of a piece that are sent this call (the same number on both sides)."""
        if self.full_step:
            return tokens
        return tokens - math.floor(self.ratio * tokens)

    def selective(self, kind: str) -> bool:
        return kind == "v" or (kind in ("qk", "q", "k") and self.tensors == "vqk")

    def admit(self, layer_key: tuple, cost_bytes: Callable[[], int]) -> bool:
        """Whether a layer's tensor may cache, decided at its first call; `cost_bytes()` must be
        rank-independent (it is only evaluated then)."""
        if layer_key not in self.admitted:
            cost = cost_bytes()
            fits = self.max_memory is None or self.planned_bytes + cost <= self.max_memory
            self.admitted[layer_key] = fits
            if fits:
                self.planned_bytes += cost
        return self.admitted[layer_key]

    def record_error(self, truth: torch.Tensor, held: torch.Tensor) -> None:
        """Accumulate how far the receiver's copy of a V piece is from the truth this step, on
        the device (no host sync inside a layer: `_adapt` and `step_errors` read it per step)."""
        sums = torch.stack([(truth - held).float().square().sum(), truth.float().square().sum()]).double()
        if self.step in self.errors:
            self.errors[self.step] += sums
        else:
            self.errors[self.step] = sums

    def step_errors(self) -> list[float]:
        """Relative L2 error of the V rows receivers use, per step (0 where all was sent)."""
        sums = [self.errors[step].tolist() for step in sorted(self.errors)]
        return [(e / n) ** 0.5 if n > 0 else 0.0 for e, n in sums]

    def cache_bytes(self) -> int:
        """Bytes this rank holds in mirrors and caches."""
        return sum(t.numel() * t.element_size() for store in (self.mirrors, self.caches) for t in store.values())

    def clear(self) -> None:
        self.mirrors.clear()
        self.caches.clear()
        self.indices.clear()
        self.admitted.clear()
        self.errors.clear()
        self.ratios.clear()
        self.planned_bytes = 0
        self._adaptive_ratio = 0.0
        self._seen, self._prev_t, self._prev_jump = False, None, None


def select_tokens(pieces: list[torch.Tensor], mirrors: list[torch.Tensor], keeps: list[int]) -> list[torch.Tensor]:
    """Per piece, (N, B, M, D) new and held values and a count -> its `keep` most-changed token
    indices (sorted, int64): one top-k and one sort for all the pieces of an exchange.

    Each piece's per-token change fills a row of one (pieces, width) matrix: its M changes, then
    k - keep slots of +inf (k the largest keep), then -inf. A row's top k are its +inf slots and its
    `keep` most changed tokens; sorted, the tokens come first (the slots lie past M), so the first
    `keep` are the piece's choice, the same tokens a top-`keep` of the piece alone picks."""
    k = max(keeps)
    width = max(piece.shape[2] + k - keep for piece, keep in zip(pieces, keeps))
    change = torch.full((len(pieces), width), -math.inf, dtype=torch.float32, device=pieces[0].device)
    for row, (piece, mirror, keep) in enumerate(zip(pieces, mirrors, keeps)):
        tokens = piece.shape[2]
        torch.sum((piece - mirror).float().square(), dim=(0, 1, 3), out=change[row, :tokens])  # (M,)
        if keep < k:
            change[row, tokens : tokens + k - keep] = math.inf
    chosen = change.topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # (pieces, k)
    return [chosen[row, :keep] for row, keep in enumerate(keeps)]
