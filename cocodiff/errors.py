"""Errors a user can act on, each printed by the CLI as one line, without a traceback.

`UsageError`: bad flags, bad shapes, missing prerequisites (exit code 2).
`RunFailed`: the run broke for a reason outside the code - a peer that stopped answering
(`PeerTimeout`), a rank that died (exit code 1).
`RankError`: a rank raised; the traceback of the first to fail (exit code 1).
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["PeerTimeout", "RankError", "RunFailed", "UsageError"]


class UsageError(ValueError):
    """Bad input, with a message that names the value and the limit."""


class RunFailed(RuntimeError):
    """The run failed for a reason outside the code; the message is one line."""


class RankError(RuntimeError):
    """A rank raised; the message is the traceback of the rank that failed first."""


class PeerTimeout(RunFailed):
    """A rank waited longer than its timeout for its peers' part of a collective.

    Raised by the wait with what it knows (this rank, the peers, the timeout); the collective's
    `kind` (a2a_in, a2a_out, gather), the `layer` and the denoising `step` are filled in by the
    callers that know them, on the way up.
    """

    def __init__(self, rank: int, peers: list[int], timeout_s: float, kind: str = "") -> None:
        super().__init__()
        self.rank, self.peers, self.timeout_s, self.kind = rank, sorted(peers), timeout_s, kind
        self.layer: str | None = None
        self.step: tuple[int, int] | None = None
        """(step, steps), counted from 1."""

    def __str__(self) -> str:
        where = f" of layer {self.layer}" if self.layer else ""
        when = f" at step {self.step[0]} of {self.step[1]}" if self.step else ""
        whom = f"rank{'s' if len(self.peers) > 1 else ''} {', '.join(map(str, self.peers))}" if self.peers else "its peers"
        return (
            f"rank {self.rank}: {self.kind or 'a collective'}{where}{when} timed out after {self.timeout_s:g} s "
            f"waiting for {whom}"
        )
