"""`--compile`: regional compilation of a transformer's repeated blocks (`CompiledBlocks`).

Each repeated block's forward is compiled on its own (the exchanges inside it as functional
collectives, so a block compiles whole); the transformer's entry and exit (hooks, gathers) stay
eager. A step cache installed afterwards (engine/cache/steps.py) wraps the compiled forwards, so its
decision stays eager between the blocks.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from ..config.env import COMPILE_BACKEND_ENV
from ..distributed.comm import CommStats
from .families import Family, class_name, repeated_block_names

__all__ = ["COMPILE_BACKEND_ENV", "CompiledBlocks"]



class CompiledBlocks:
    """Regional compilation: `torch.compile` each repeated block's forward (its exchanges included,
    as functional collectives), leaving the transformer's entry and exit (hooks, gathers) eager.

    The compiled forward is the block's own (or V-First's): a step cache installed afterwards wraps
    it (engine/cache/steps.py), so its decision (an all-reduce and a host read) stays eager, outside the
    graph, and a skipped block is never called at all.

    What the exchanges send inside a block is counted on the block's first call of each input
    layout, which runs eagerly: counters mutated in a compiled graph would become its guards (a
    recompilation every call). Later calls of that block and layout run compiled and add the same
    counts: a fixed plan and exchange send the same bytes on every call of one layout, and a block
    the cache skips adds nothing.
    """

    KINDS = ("a2a_in", "a2a_out", "ring")
    """What is sent inside the blocks (the output gather and the CFG/batch gathers are outside)."""

    def __init__(self, transformer: torch.nn.Module, family: Family, stats: CommStats) -> None:
        names = repeated_block_names(transformer, family)
        self.blocks = [m for m in transformer.modules() if class_name(m) in names]
        backend = os.environ.get(COMPILE_BACKEND_ENV, "inductor")
        self.stats = stats
        self.per_layout: dict[tuple, dict[str, Any]] = {}
        """(input layout, block index) -> the counts of one call of that block (from its eager call)."""
        self._layout: tuple = ()
        self._own: list[tuple[torch.nn.Module, Any]] = []
        for index, block in enumerate(self.blocks):
            self._own.append((block, block.__dict__.get("forward")))
            eager = block.forward
            block.forward = self._counted(index, eager, torch.compile(eager, backend=backend))
        self.hooks = [transformer.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True)]

    def _before(self, _module, args, kwargs):
        layout = tuple((i, tuple(a.shape)) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self._layout = layout + tuple((k, tuple(v.shape)) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))
        return args, kwargs

    def _counted(self, index: int, eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(eager)  # its signature: the cache finds the blocks by their arguments
        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (self._layout, index)
            counts = self.per_layout.get(key)
            if counts is not None:
                self.stats.add(counts)
                return compiled(*args, **kwargs)
            start = self.stats.counts(self.KINDS)  # this call runs eagerly and is counted
            output = eager(*args, **kwargs)
            one_call = CommStats()  # the counts now, less those before the call
            one_call.add(self.stats.counts(self.KINDS))
            one_call.add(start, sign=-1)
            self.per_layout[key] = one_call.counts(self.KINDS)
            return output

        return forward

    def undo(self) -> None:
        """Each block's forward as it was (its own, or V-First's)."""
        for block, own in self._own:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._own.clear()
