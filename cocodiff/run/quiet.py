"""Notices that other libraries log on import and that say nothing to a user of this package,
dropped from every process it starts (imported first by the command line and the rank server).
Logged records at import time, where `lifetime.quiet_foreign_warnings` ignores `warnings` in ranks.

- torchao, imported by diffusers wherever it is installed, logs each of its CUDA kernel libraries
  it cannot load on a machine without CUDA (its int8 and float8 weights do not need them), and
  torch logs the way torchao registers its enums.
- transformers, when diffusers' Wan image-to-video module imports `CLIPImageProcessor` without
  torchvision, says it falls back to the PIL processor (which the tiny presets use).

Each is dropped by its exact wording; everything else these loggers say still reaches the user.
"""

from __future__ import annotations

import logging

__all__ = ["DROPPED"]

DROPPED: dict[str, tuple[str, ...]] = {
    "torchao": ("Could not load this library",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
}
"""Logger name -> words of the notices it makes that are dropped."""


class _Drop(logging.Filter):
    def __init__(self, words: tuple[str, ...]) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(word in message for word in self.words)


for _name, _words in DROPPED.items():
    _logger = logging.getLogger(_name)
    if not any(isinstance(f, _Drop) for f in _logger.filters):
        _logger.addFilter(_Drop(_words))
