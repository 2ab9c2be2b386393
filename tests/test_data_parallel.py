"""The pairing of true CFG's two calls per step (engine/data_parallel.py), in one process.

The data group is a stand-in whose gather returns this rank's share followed by what its CFG peer
would send (here the peer's share as this process computes it), so the order of calls, the
buffers and the pairing are checked without ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from cocodiff.engine.data_parallel import DataParallelForward


class Affine(torch.nn.Module):
    """A transformer stand-in: output = 2 x hidden + timestep, gathered along the batch when shared."""

    def __init__(self) -> None:
        super().__init__()
        self.context = SimpleNamespace(batch_gather=None)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> tuple[torch.Tensor]:
        out = 2 * hidden_states + timestep
        if self.context.batch_gather is not None:
            out = self.context.batch_gather(out)
        return (out,)


@dataclass
class Peer:
    """CFG index 0 of a group of 2: the peer (index 1) runs the second call, `theirs`."""

    theirs: torch.Tensor | None = None
    size: int = 2
    index: int = 0

    def gather(self, chunk: torch.Tensor, dim: int, sizes: list[int], kind: str = "gather", packed: bool = False) -> torch.Tensor:
        return torch.cat([chunk, self.theirs], dim)


def _step(forward: DataParallelForward, peer: Peer, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of true CFG: the positive call, then the negative one, at timestep t (the step clock's
    value stands in as t: it falls through a run and rises at the next)."""
    forward.step = lambda: t
    timestep = torch.tensor([t])
    positive, negative = torch.ones(1, 3), -torch.ones(1, 3)
    peer.theirs = 2 * negative + t
    first = forward(hidden_states=positive, timestep=timestep)[0]
    second = forward(hidden_states=negative, timestep=timestep)[0]
    return first, second


def _expected(t: float) -> tuple[torch.Tensor, torch.Tensor]:
    return 2 * torch.ones(1, 3) + t, -2 * torch.ones(1, 3) + t


def test_pairs_start_when_plan_auto_switches_to_cfg_groups_mid_run():
    """`--plan auto` tries a plan without data groups, then one with CFG groups: the first paired
    step of the run has a template to shape its buffer (a run shorter than the trials used to
    find none and fail), and a new run does not reuse the last run's template."""
    transformer = Affine()
    peer = Peer()
    forward = DataParallelForward(transformer, data=None, cfg=1, batch_args=("hidden_states", "timestep"),
                                  context=transformer.context)
    for run in range(2):
        forward.use(None, 1)
        for t in (1.0, 0.75):
            assert all(torch.equal(a, b) for a, b in zip(_step(forward, peer, t), _expected(t)))
        forward.use(peer, 2)  # the trials switch to a CFG plan between steps
        for t in (0.5, 0.25):
            assert all(torch.equal(a, b) for a, b in zip(_step(forward, peer, t), _expected(t)))
        assert forward.pairs == 2 * (run + 1)


class Prefixed(Affine):
    """Qwen-Image 2.1's prefix cache in miniature: with `mode` 'extract' (a run's first step) the output
    also holds the prefix's 2 rows before the image's; with 'cached' only the image's."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, mode: str = "cached") -> tuple[torch.Tensor]:
        out = 2 * hidden_states + timestep
        if mode == "extract":
            out = torch.cat([torch.zeros(out.shape[0], 2, out.shape[-1]), out], 1)
        return (out,)


def test_a_pair_is_shaped_by_a_call_of_its_own_mode():
    """The first step's calls return more rows than the later steps' (the text's, while its keys and values
    are stored): the pairs of later steps take their buffer's shape from a call in the same mode, never
    from the first step's; the first step in a new mode runs whole."""
    transformer = Prefixed()
    peer = Peer()
    forward = DataParallelForward(transformer, data=peer, cfg=2, batch_args=("hidden_states", "timestep"),
                                  context=transformer.context, gather_inside=False)
    positive, negative = torch.ones(1, 4, 3), -torch.ones(1, 4, 3)
    for step, t in enumerate((1.0, 0.75, 0.5, 0.25)):
        forward.step = lambda t=t: t
        mode = "extract" if step == 0 else "cached"
        peer.theirs = 2 * negative + t
        first = forward(hidden_states=positive, timestep=torch.tensor([t]), mode=mode)[0]
        second = forward(hidden_states=negative, timestep=torch.tensor([t]), mode=mode)[0]
        rows = slice(2, None) if mode == "extract" else slice(None)
        assert torch.equal(first[:, rows], 2 * positive + t) and torch.equal(second[:, rows], 2 * negative + t)
    assert forward.pairs == 2  # steps 2 and 3: step 1 is the first in 'cached' mode
