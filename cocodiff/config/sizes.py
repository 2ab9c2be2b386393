"""Sizes, free of torch (the simulator and the HTTP layer share them): how the engine splits n
items (tokens, heads) over ranks, and how an image size is written ("WIDTHxHEIGHT")."""

import re

__all__ = ["digits", "parse_image_size", "split_sizes"]

_IMAGE_SIZE = re.compile(r"([0-9]{1,9})[xX]([0-9]{1,9})")
"""ASCII digits only: `str.isdigit` and `int` would also take full-width and other scripts' digits."""


def digits(text: str) -> bool:
    """Whether `text` is a run of ASCII digits, what `int` reads as a count: `str.isdigit` also
    takes superscripts ('²') and other scripts' digits, some of which `int` refuses."""
    return text.isascii() and text.isdigit()


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `torch.tensor_split(range(n), parts)`: the first n % parts parts get one more."""
    base, extra = n // parts, n % parts  # not divmod: a compiled graph's symbolic sizes take these only
    return [base + (1 if i < extra else 0) for i in range(parts)]


def parse_image_size(text: str) -> tuple[int, int] | None:
    """'64x48' -> (64, 48) (width, height); None unless it is two runs of ASCII digits around an x."""
    match = _IMAGE_SIZE.fullmatch(text)
    return (int(match.group(1)), int(match.group(2))) if match else None
