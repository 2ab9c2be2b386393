"""Text encoders once: the prompt is encoded on one rank and the embeddings broadcast.

Every rank runs the same pipeline call with the same prompt (the plans split the transformer's
work, not the prompts), so one encoding serves them all: `encode_once` wraps the pipeline's
prompt encoding for the length of a `with` block so that rank `src` runs the text encoder(s)
and every other rank receives the result (`comm.broadcast.broadcast_tree`), bit for bit what it
would have computed itself.

Many prompts at once (`SPLIT_FROM` or more in one call of a preset's `prompt_encoder`, e.g.
`pipe([...])` with a list), where every rank holds its text encoder (not offloaded: engine/offload.py
frees them on the ranks that do not encode), are split instead: every rank encodes a contiguous
share at the same time, then each rank's share is broadcast in turn, so every rank holds every
embedding, the same bits on every rank. They equal one rank's encoding of the whole list within
rounding, not bit for bit: the encoder's matmuls over a share's rows round differently from one
over all of them (the presets' encoders pad every prompt to a fixed length, so nothing else
depends on the share). A prompt and its negative, what `generate` encodes, stay on rank `src`: bit
for bit as before. A checkpoint's `encode_prompt` is not split: its results are not all batched by
prompt (FLUX's `text_ids`), so rank `src` encodes them all.

An encoder that raises on one rank does not leave the others waiting in a broadcast until the
process group's timeout: that rank broadcasts what it raised (one line) in place of its encoding,
so every rank learns of it from the broadcast it is already in, and every rank raises the same
`RunFailed` naming the rank(s) and their errors (the failing rank chained to its own error).

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.comm.broadcast import broadcast_tree
from ..errors import RunFailed

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


@dataclass(frozen=True)
class _Failed:
    """What a rank broadcasts in place of its encoding when its encoder raised."""

    rank: int
    error: str
    """The error in one line: its type and the first line of its message."""


def _encode(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Exception | None]:
    """`fn(*args, **kwargs)` and None, or a `_Failed` naming this rank and the error it raised."""
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - broadcast in its place, raised on every rank after
        lines = str(error).strip().splitlines()
        return _Failed(dist.get_rank(), f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__), error


def _raise_failures(received: list[Any], own: Exception | None) -> None:
    """Raise, on every rank alike, when any of the ranks' broadcasts in `received` was a `_Failed`."""
    failed = [r for r in received if isinstance(r, _Failed)]
    if failed:
        errors = ", ".join(f"rank {f.rank} ({f.error})" for f in failed)
        raise RunFailed(f"encoding prompts failed on {errors}") from own


def on_one_rank(fn: Callable[..., Any], src: int, group: dist.ProcessGroup | None,
                device: torch.device) -> Callable[..., Any]:
    """`fn` run on the global rank `src` only, its result broadcast to the rest of `group`; when it
    raises there, every rank raises `RunFailed` naming `src` as soon as the broadcast arrives."""

    def once(*args: Any, **kwargs: Any) -> Any:
        result, error = _encode(fn, *args, **kwargs) if dist.get_rank() == src else (None, None)
        result = broadcast_tree(result, src, group, device)
        _raise_failures([result], error)
        return result

    once.__wrapped__ = fn  # type: ignore[attr-defined]
    return once


def split_over_ranks(fn: Callable[[list[str]], Any], src: int, group: dist.ProcessGroup | None,
                     device: torch.device) -> Callable[[list[str]], Any]:
    """`fn(prompts)` (a tuple of tensors batched by prompt) with `SPLIT_FROM` or more prompts split
    into contiguous shares, one per rank of `group` in rank order, every rank encoding its own at
    once, then each share broadcast from its rank to the rest; fewer prompts: `on_one_rank`.

    A share whose encoding raised is broadcast as that error, and every rank raises `RunFailed`
    naming the rank(s) once all shares are exchanged (no rank is left in a broadcast)."""
    whole = on_one_rank(fn, src, group, device)

    def split(prompts: list[str]) -> Any:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(prompts) < SPLIT_FROM or len(ranks) < 2:
            return whole(prompts)
        bounds = [len(prompts) * i // len(ranks) for i in range(len(ranks) + 1)]  # contiguous, sizes differ by 1 at most
        shares = [(rank, start, end) for rank, start, end in zip(ranks, bounds, bounds[1:]) if end > start]
        me = dist.get_rank()
        mine, error = None, None
        for rank, start, end in shares:  # every rank its own share, all at once: nothing exchanged yet
            if rank == me:
                mine, error = _encode(fn, prompts[start:end])
        received = [broadcast_tree(mine if rank == me else None, rank, group, device) for rank, _, _ in shares]
        _raise_failures(received, error)
        return tuple(torch.cat(parts) for parts in zip(*received))  # each (share, ...) -> (len(prompts), ...)

    split.__wrapped__ = fn  # type: ignore[attr-defined]
    return split


@contextlib.contextmanager
def encode_once(pipe: Any, group: dist.ProcessGroup | None, device: torch.device, src: int = 0,
                split: bool = False) -> Iterator[None]:
    """Within the block, `pipe`'s prompts are encoded on rank `src` alone (see the module's doc);
    `split` (every rank of `group` holds the text encoder): many prompts split across the ranks.

    Every rank of `group` must make the same pipeline calls inside it (one broadcast per encoding,
    or per share); an encoder that raises on any rank makes the call raise `RunFailed` on every
    rank (see the module's doc).
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
