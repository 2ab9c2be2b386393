"""Text encoders once: the prompt is encoded on one rank and the embeddings broadcast.

Every rank runs the same pipeline call with the same prompt (the plans split the transformer's
work, not the prompts), so one encoding serves them all: `encode_once` wraps the pipeline's
prompt encoding for the length of a `with` block so that rank `src` runs the text encoder(s)
and every other rank receives the result (`comm.broadcast.broadcast_tree`), bit for bit what it
would have computed itself.

What is wrapped, as an instance attribute (the class is untouched, the attribute removed after):
- a preset's pipeline (`presets.PromptEncoding`): `prompt_encoder`, the tiny text encoder that
  turns prompts into the stock pipeline's `prompt_embeds` arguments;
- a checkpoint's pipeline: `encode_prompt`, which every diffusers DiT pipeline (FLUX.1/2, SD3,
  Qwen-Image, Wan) calls from its `__call__` with the prompt and returns the embeddings as
  tensors (and `None`s); its CLIP / T5 / Qwen2.5-VL / Mistral / UMT5 run on rank `src` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .comm.broadcast import broadcast_tree

__all__ = ["encode_once", "encoding_attribute", "on_one_rank"]


def encoding_attribute(pipe: Any) -> str | None:
    """The name of the pipeline's prompt-encoding callable that `encode_once` wraps, or None."""
    if getattr(pipe, "prompt_encoder", None) is not None:
        return "prompt_encoder"
    if callable(getattr(pipe, "encode_prompt", None)):
        return "encode_prompt"
    return None


def on_one_rank(fn: Callable[..., Any], src: int, group: dist.ProcessGroup | None,
                device: torch.device) -> Callable[..., Any]:
    """`fn` run on the global rank `src` only, its result broadcast to the rest of `group`."""

    def once(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs) if dist.get_rank() == src else None
        return broadcast_tree(result, src, group, device)

    once.__wrapped__ = fn  # type: ignore[attr-defined]
    return once


@contextlib.contextmanager
def encode_once(pipe: Any, group: dist.ProcessGroup | None, device: torch.device, src: int = 0) -> Iterator[None]:
    """Within the block, `pipe`'s prompts are encoded on rank `src` alone (see the module's doc).

    Every rank of `group` must make the same pipeline calls inside it (one broadcast per encoding).
    """
    name = encoding_attribute(pipe)
    if name is None or not dist.is_initialized():
        yield
        return
    own = name in vars(pipe)  # an instance attribute (a preset's encoder) to put back, else the class's method
    original = getattr(pipe, name)
    setattr(pipe, name, on_one_rank(original, src, group, device))
    try:
        yield
    finally:
        if own:
            setattr(pipe, name, original)
        else:
            delattr(pipe, name)
