"""Text encoders once: the prompt is encoded on one rank and the embeddings broadcast.

Every rank runs the same pipeline call with the same prompt (the plans split the transformer's
work, not the prompts), so one encoding serves them all: `encode_once` wraps the pipeline's
prompt encoding for the length of a `with` block so that rank `src` runs the text encoder(s)
and every other rank receives the result (`comm.broadcast.broadcast_tree`), bit for bit what it
would have computed itself.

Many prompts at once (`SPLIT_FROM` or more in one call of a preset's `prompt_encoder`, e.g.
`pipe([...])` with a list), where every rank holds its text encoder (not offloaded: engine/offload.py
frees them on the ranks that do not encode), are split instead: each rank encodes a contiguous
share and broadcasts it, so every rank holds every embedding, the same bits on every rank. They
equal one rank's encoding of the whole list within rounding, not bit for bit: the encoder's
matmuls over a share's rows round differently from one over all of them (the presets' encoders
pad every prompt to a fixed length, so nothing else depends on the share). A prompt and its
negative, what `generate` encodes, stay on rank `src`: bit for bit as before. A checkpoint's `encode_prompt` is not split: its results are not all batched by
prompt (FLUX's `text_ids`), so rank `src` encodes them all.

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

from ..distributed.comm.broadcast import broadcast_tree

__all__ = ["SPLIT_FROM", "encode_once", "encoding_attribute", "on_one_rank", "split_over_ranks"]

SPLIT_FROM = 4
"""Prompts in one encoder call from which they are split across ranks: below it (a prompt and its
negative) one rank encodes them faster than the ranks exchange their shares."""


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


def split_over_ranks(fn: Callable[[list[str]], Any], src: int, group: dist.ProcessGroup | None,
                     device: torch.device) -> Callable[[list[str]], Any]:
    """`fn(prompts)` (a tuple of tensors batched by prompt) with `SPLIT_FROM` or more prompts split
    into contiguous shares, one per rank of `group` in rank order, each encoded on its rank and
    broadcast to the rest; fewer prompts: `on_one_rank`."""
    whole = on_one_rank(fn, src, group, device)

    def split(prompts: list[str]) -> Any:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(prompts) < SPLIT_FROM or len(ranks) < 2:
            return whole(prompts)
        bounds = [len(prompts) * i // len(ranks) for i in range(len(ranks) + 1)]  # contiguous, sizes differ by 1 at most
        shares = []
        for rank, start, end in zip(ranks, bounds, bounds[1:]):
            mine = fn(prompts[start:end]) if dist.get_rank() == rank and end > start else None
            if end > start:
                shares.append(broadcast_tree(mine, rank, group, device))
        return tuple(torch.cat(parts) for parts in zip(*shares))  # each (share, ...) -> (len(prompts), ...)

    split.__wrapped__ = fn  # type: ignore[attr-defined]
    return split


@contextlib.contextmanager
def encode_once(pipe: Any, group: dist.ProcessGroup | None, device: torch.device, src: int = 0,
                split: bool = False) -> Iterator[None]:
    """Within the block, `pipe`'s prompts are encoded on rank `src` alone (see the module's doc);
    `split` (every rank of `group` holds the text encoder): many prompts split across the ranks.

    Every rank of `group` must make the same pipeline calls inside it (one broadcast per encoding,
    or per share).
    """
    name = encoding_attribute(pipe)
    if name is None or not dist.is_initialized():
        yield
        return
    own = name in vars(pipe)  # an instance attribute (a preset's encoder) to put back, else the class's method
    original = getattr(pipe, name)
    wrap = split_over_ranks if split and name == "prompt_encoder" else on_one_rank
    setattr(pipe, name, wrap(original, src, group, device))
    try:
        yield
    finally:
        if own:
            setattr(pipe, name, original)
        else:
            delattr(pipe, name)
