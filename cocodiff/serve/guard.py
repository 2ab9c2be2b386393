"""What one rank's failure during a served call does to the others, decided the same on every rank.

In a served call every rank runs the same work, and the collectives are inside the transformer's
calls (the layers' exchanges; `serve` encodes the prompts and decodes the latents on every rank
alone). So a rank's failure falls in one of three places:

- **before the first transformer call** (encoding the prompts, drawing the latents): the rank's
  own, and its peers are about to enter the transformer. At the first transformer call every rank
  says whether it got there (`Ready.agree`: one small all-reduce; a rank that failed joins it from
  its error handler instead), and if one did not, the call ends on every rank (`PeerFailed` on the
  others, its own error on the failing rank) and the server goes on with the next request;
- **inside a transformer call**: its peers sit in a collective it will never join, so the ranks
  can no longer work together (`StepFailed`, a `RunFailed`: the server's ranks leave at once);
- **after the transformer** (decoding): the rank's own, and nobody waits on it (rank 0 answers the
  request with the error, the others drop their copy).

`CallGuard` watches a per-request call's transformers with forward hooks and sorts its error so;
the step-level stepper (stepper.py) agrees on its joins the same way (`Ready`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RunFailed

__all__ = ["CallGuard", "PeerFailed", "Ready", "StepFailed", "collective_failed"]


def collective_failed(error: BaseException) -> bool:
    """True when `error` means the ranks can no longer work together: a peer timed out or went away.

    NCCL and the process group raise `DistError`s; gloo reports a peer that closed its connection
    as a plain RuntimeError whose message names gloo's source files.
    """
    return isinstance(error, (RunFailed, dist.DistError)) or (isinstance(error, RuntimeError) and "gloo" in str(error))


class StepFailed(RunFailed):
    """An error inside a step's transformer call (a step of the stepper's batch, or of a
    per-request pipeline call), where every rank issues the layers' collectives: the peers of the
    rank that raised sit in a collective it will never join, so no rank can go on (a RunFailed:
    every rank leaves, and the requests get 503)."""

    def __init__(self, step: int, error: BaseException) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        super().__init__(f"rank {rank}: the transformer call of step {step} failed between its collectives "
                         f"({type(error).__name__}: {error})")


class PeerFailed(Exception):
    """Another rank failed before the collectives of this call began: the call ends on every rank."""


class Ready:
    """Whether every rank is ready to enter the collectives: one all-reduce of two numbers."""

    def __init__(self, agree: Callable[[torch.Tensor], list[float]] | None) -> None:
        """`agree` sums a tensor over every rank (None: one process, nothing to agree)."""
        self._agree = agree

    def agree(self, failed: bool, what: str) -> None:
        """Every rank at once. Raises `PeerFailed` on a rank that did not fail when another did
        (naming it); returns otherwise (the failing rank raises its own error after this)."""
        if self._agree is None:
            return
        rank = dist.get_rank()
        count, ranks = self._agree(torch.tensor([float(failed), float(rank if failed else 0)]))
        if count and not failed:
            who = f"rank {int(ranks)}" if count == 1 else f"{int(count)} ranks"
            raise PeerFailed(f"{who} of the server failed {what} (its error is in the server's log)")


class CallGuard:
    """Around one per-request pipeline call on every rank: sorts an error as the module says.

    The first call of any of `modules` (the pipeline's transformers) first agrees that every rank
    is ready; an error escaping while one of them runs becomes `StepFailed`; an error before the
    first one is agreed on (this rank joins the agreement from here) and then raised as it is.
    """

    def __init__(self, modules: list[torch.nn.Module], agree: Callable[[torch.Tensor], list[float]] | None) -> None:
        self.modules, self.ready = modules, Ready(agree)
        self.agreed = False
        self.steps = 0
        """Denoising steps done so far in this pipeline call (`step_ended`)."""
        self.inside = 0
        """Transformer calls entered and not yet returned (an error now is inside one)."""
        self._hooks: list[Any] = []

    @classmethod
    def of(cls, pipe: Any, agree: Callable[[torch.Tensor], list[float]] | None) -> CallGuard:
        """The guard of `pipe`'s transformers (Wan 2.2's second expert included)."""
        names = ("transformer", "transformer_2")
        return cls([m for m in (getattr(pipe, n, None) for n in names) if isinstance(m, torch.nn.Module)], agree)

    def _enter(self, _module: torch.nn.Module, _args: Any) -> None:
        if not self.agreed:
            self.agreed = True
            self.ready.agree(False, "before its first transformer call")
        self.inside += 1

    def step_ended(self, step: int) -> None:
        """The pipeline's step `step` (from 1) is done: a failure from now on names the next."""
        self.steps = step

    def _leave(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        self.inside -= 1

    def __enter__(self) -> CallGuard:
        for module in self.modules:
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._leave))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 _traceback: TracebackType | None) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if error is None or isinstance(error, PeerFailed) or not isinstance(error, Exception) or collective_failed(error):
            return
        if self.inside:
            raise StepFailed(self.steps + 1, error) from error
        if not self.agreed:  # the peers wait in the agreement of the first transformer call: join it
            self.agreed = True
            self.ready.agree(True, "before its first transformer call")
