"""Displaced patch pipelining (`--pipe-patches M`, LOSSY): one image's step cut into M patches
that follow each other through the pipeline stages, in the manner of PipeFusion.

    step t:  stage 0  | patch 0 | patch 1 | patch 2 | patch 3 |
             stage 1            | patch 0 | patch 1 | patch 2 | patch 3 |

The image stream is cut into M contiguous ranges (its rows), and a forward pass runs one of them,
shared among a stage's sequence-parallel ranks as a whole pass shares the stream
(`UlyssesContext.shard`). Patch p's queries attend to the keys and values of the whole sequence: this step's where a patch before p has
already run the layer, the last step's everywhere else (a per-layer K/V buffer of the whole
sequence, the heads of this rank). So stage 0 starts patch p + 1 while stage 1 runs patch p, and
one image without CFG keeps every stage busy; the boundary carries one hidden state per step, in
M pieces. Displaced by one step, the result differs from the exact run: the mode is LOSSY, and
`verify` reports its error.

The first `--pipe-warmup` steps (and any call whose buffers are not filled yet: a new call slot
of a step) run whole, exactly, and fill the buffers. A call's slot is its place among the calls of
its step (a pipeline that calls the transformer once for the text and once without has two), told
from the calls' step values, the same on every rank.

The text stream: `whole` (the default) sends the whole text with every patch: it is recomputed M
times per step, and its keys are always this patch's (fresh text). `patched` cuts it like the
image, so each patch carries 1/M of the text and no token is computed twice, but a text token then
sees the later patches' text one step old. On the trained tiny-shapes, `whole` lands several dB
closer to the exact run (the study in docs/usage.md), so it is the default.

The single-process reference of the schedule is the same code on one stage (`--pipe-patches` with
a plan without `p`, on one process): the patches run one after the other, with the same buffers
and the same staleness, and since a patch is the same tokens on any number of ranks, a staged run
(`p2`, `p2u2`) equals it as exact modes equal one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.sizes import split_sizes

__all__ = ["Patches"]


@dataclass
class Patches:
    """The displaced schedule's state on one rank: which patch is in flight, and the K/V buffers."""

    count: int
    """M: patches per step."""
    warmup: int = 1
    """Steps run whole, exactly, before patches start."""
    text: str = "whole"
    index: int | None = None
    """The patch in flight; None: a whole pass (warm-up), which fills the buffers."""
    slot: int = 0
    """The call's place among its step's calls."""
    full: dict[str, list[int]] = field(default_factory=dict)
    """Each stream's tokens per sequence-parallel rank, whole (the patch's are `UlyssesContext.sizes`)."""
    starts: dict[str, list[int]] = field(default_factory=dict)
    """Where each rank's piece of the patch starts in its stream."""
    _kv: dict[tuple[int, str], list[torch.Tensor | None]] = field(default_factory=dict)
    _filled: set[int] = field(default_factory=set)
    _steps: list[float] = field(default_factory=list)
    _positions: dict[tuple, torch.Tensor] = field(default_factory=dict)
    _output: torch.Tensor | None = None
    peak: int = 0
    """The most bytes the K/V buffers held at a call's end (they are freed after a run's last step)."""

    # -- which calls run in patches ----------------------------------------------------------
    def begin_call(self, value: float) -> bool:
        """A transformer call starts, at step value `value` (`steps.StepClock.value`): True when it
        runs in patches, False when it runs whole (and fills the buffers). A value above the last
        one starts a new run (whatever the previous run's last step or the new one's timesteps)."""
        if self._steps and value > self._steps[-1]:  # values fall through a run: a new run
            self.reset()
        if not self._steps or value != self._steps[-1]:
            self._steps.append(value)
            self.slot = 0
        else:
            self.slot += 1
        self.full.clear()
        self.starts.clear()
        self._output = None
        return len(self._steps) > self.warmup and self.slot in self._filled

    def end_call(self, patched: bool, last_step: bool = False) -> None:
        """The call is done; `last_step`: it was its run's last step, so this call slot's buffers are
        read no more and are freed (not held through the decode and the idle time after)."""
        if not patched:
            self._filled.add(self.slot)
        self.index = None
        self.peak = max(self.peak, self.memory())
        if last_step:
            for key in [key for key in self._kv if key[0] == self.slot]:
                del self._kv[key]
            self._filled.discard(self.slot)

    def reset(self) -> None:
        self._steps.clear()
        self._kv.clear()
        self._filled.clear()
        self._positions.clear()

    # -- the split ----------------------------------------------------------------------------
    def cut(self, stream: str, sizes: list[int]) -> list[int]:
        """Patch `index`'s tokens of `stream` per rank, given each rank's share of the whole pass
        (`sizes`). A patch is a contiguous range of the stream (rows of the image), shared among the
        ranks as a whole pass shares the stream; where each rank's piece starts goes to `starts`. So
        the schedule, and its numbers, do not depend on how many ranks share a stage."""
        assert self.index is not None
        self.full[stream] = sizes
        whole = sum(sizes)
        if stream == "txt" and self.text == "whole":
            start, length = 0, whole
        else:
            parts = split_sizes(whole, self.count)
            start, length = sum(parts[: self.index]), parts[self.index]
        pieces = split_sizes(length, len(sizes))
        self.starts[stream] = [start + sum(pieces[:rank]) for rank in range(len(sizes))]
        return pieces

    def positions(self, streams: tuple[str, ...], patch: dict[str, list[int]], device: torch.device) -> torch.Tensor:
        """Where the patch's gathered tokens of `streams` (joined in this order on every rank, ranks
        in sequence order) sit in the whole pass's gathered sequence."""
        key = (streams, self.index, tuple(tuple(patch[s]) for s in streams), tuple(tuple(self.full[s]) for s in streams))
        cached = self._positions.get(key)
        if cached is not None:
            return cached
        ranks = len(self.full[streams[0]])
        where: dict[str, list[torch.Tensor]] = {s: [] for s in streams}  # a stream's token -> its place, whole
        base = 0
        for rank in range(ranks):
            for s in streams:
                n = self.full[s][rank]
                where[s].append(torch.arange(base, base + n, device=device))
                base += n
        whole = {s: torch.cat(where[s]) for s in streams}
        pieces = [whole[s][self.starts[s][rank] : self.starts[s][rank] + patch[s][rank]]
                  for rank in range(ranks) for s in streams]
        self._positions[key] = torch.cat(pieces)
        return self._positions[key]

    # -- attention ------------------------------------------------------------------------------
    def displace(self, layer: str, streams: tuple[str, ...], patch: dict[str, list[int]], k: torch.Tensor,
                 v: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B, H_r, S, D) K and V (and a (., ., 1, S) key mask) of this call's tokens -> those of the
        whole sequence: a whole pass keeps a copy; a patch writes its own into the copy and takes it."""
        key = (self.slot, layer)
        if self.index is None:
            self._kv[key] = [k.clone(), v.clone(), mask.clone() if mask is not None else None]
            return k, v, mask
        buffers = self._kv.get(key)
        if buffers is None:
            raise RuntimeError(f"--pipe-patches: {layer} has no keys and values of the last step (call {self.slot} of its step)")
        at = self.positions(streams, patch, k.device)
        buffers[0].index_copy_(2, at, k)
        buffers[1].index_copy_(2, at, v)
        if (mask is None) != (buffers[2] is None):
            raise RuntimeError(f"--pipe-patches: {layer}'s key mask came and went between steps")
        if mask is not None:
            if mask.shape[:-1] != buffers[2].shape[:-1]:
                buffers[2] = buffers[2].expand(*mask.shape[:-1], buffers[2].shape[-1]).clone()
            buffers[2].index_copy_(mask.dim() - 1, at, mask)
        return buffers[0], buffers[1], buffers[2]

    # -- the output --------------------------------------------------------------------------------
    def place_output(self, chunk: torch.Tensor, dim: int, stream: str, patch: list[int]) -> torch.Tensor:
        """Patch `index`'s gathered output (ranks' sub-shares in sequence order along `dim`) placed in
        the call's whole output; returned whole (complete once the last patch is placed)."""
        full = self.full[stream]
        dim = dim % chunk.dim()
        if self._output is None:
            shape = list(chunk.shape)
            shape[dim] = sum(full)
            self._output = chunk.new_zeros(shape)
        at = self.positions((stream,), {stream: patch}, chunk.device)
        self._output.index_copy_(dim, at, chunk)
        return self._output

    def memory(self) -> int:
        """Bytes the K/V buffers hold."""
        return sum(t.numel() * t.element_size() for ts in self._kv.values() for t in ts if t is not None)
