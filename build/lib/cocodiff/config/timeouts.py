"""The bound on every wait on a peer: `--timeout`'s default, shared by the launchers and the ranks."""

from __future__ import annotations

__all__ = ["DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0
"""`--timeout`'s default: the longest a rank waits on a peer before the run fails."""
