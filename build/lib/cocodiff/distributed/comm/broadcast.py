"""Broadcast of a nested result (tuples, lists, dicts of tensors and plain values) from one rank.

The structure travels as a pickled skeleton whose tensors are replaced by their shape and dtype
(`broadcast_object_list`); the tensors then travel one `broadcast` each, on the group's device,
bit for bit. The source keeps its own tree; the others get its tensors on the host where the
source's were there, else on their own device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from .ulysses import bounded

__all__ = ["broadcast_tree"]


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the skeleton: its shape, dtype and whether it was on the host."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_host: bool


def broadcast_tree(tree: Any, src: int, group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """`tree` as the global rank `src` holds it, on every rank of `group` (others pass None).

    Tensors travel on `device` (the one the group's backend broadcasts on); plain leaves pickled.
    """
    source = dist.get_rank() == src
    if source:
        leaves, spec = tree_flatten(tree)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        skeleton = [_Slot(tuple(leaf.shape), leaf.dtype, leaf.device.type == "cpu") if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        message: list[Any] = [(skeleton, spec)]
    else:
        message = [None]
    dist.broadcast_object_list(message, src=src, group=group, device=device)
    skeleton, spec = message[0]
    if source:
        received = [t.to(device).contiguous() for t in tensors]
    else:
        received = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in skeleton if isinstance(s, _Slot)]
    for tensor in received:  # one message each, in the skeleton's order
        bounded(dist.broadcast(tensor, src=src, group=group, async_op=True), "broadcast")
    if source:
        return tree
    values = iter(received)
    leaves = [(next(values).cpu() if s.on_host else next(values)) if isinstance(s, _Slot) else s for s in skeleton]
    return tree_unflatten(leaves, spec)
