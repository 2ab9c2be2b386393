"""`auto|on|off`: the one type and parser of the options that take it (`--shard-weights`,
`--offload-text-encoders`, `--parallel-vae`)."""

from __future__ import annotations

from typing import Literal

from ..errors import UsageError
from .plan import AUTO

__all__ = ["CHOICES", "Choice", "parse_choice"]

Choice = Literal["auto", "on", "off"]
CHOICES: tuple[Choice, ...] = ("auto", "on", "off")


def parse_choice(flag: str, value: str) -> bool | str:
    """`on` -> True, `off` -> False, `auto` -> `AUTO` (case and spaces ignored); anything else is
    refused in one line naming `flag` and the value."""
    choice = value.strip().lower()
    if choice not in CHOICES:
        raise UsageError(f"{flag} {value!r} is not one of {', '.join(CHOICES)}")
    return {"on": True, "off": False}.get(choice, AUTO)
