"""Errors a user can fix: bad flags, bad shapes, missing prerequisites.

The CLI prints them as one line and exits with code 2; everything else is a bug and keeps its
traceback.
"""

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Bad input, with a message that names the value and the limit."""
