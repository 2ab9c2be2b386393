"""diffusers' own Ulysses attention as a `bench e2e` baseline variant (`diffusers-ulysses`).

What users would run instead of CoCoDiff: `transformer.enable_parallelism(
config=ContextParallelConfig(ulysses_degree=P))`, diffusers' context parallelism driven by the
model's `_cp_plan` (inputs split evenly on the sequence, Q, K and V sent by three synchronous
all-to-alls after norm and RoPE, the output by a fourth, the result all-gathered at `proj_out`).

Two things this module adds around it, both only for the benchmark:

- A workaround for CPU ranks. diffusers picks the rank's device as
  `rank % torch.accelerator.device_count()`, which divides by zero on a machine without
  accelerators; while parallelism is enabled, the count reads 1 there (every rank is on `cpu`).
- Counters. diffusers' collectives are timed and their bytes counted into a `CommStats` like
  ours, so the table compares like with like: `_all_to_all_single` (diffusers' Ulysses exchange;
  per call the first three are Q, K and V, the fourth the output, see
  `attention_dispatch.TemplatedUlyssesAttention`) and the output gather of its context-parallel
  hooks. Both are synchronous, so the time inside them is exposed communication.

Like diffusers itself, this needs image and text token counts divisible by P (it has no uneven
split without its `ulysses_anything` mode, which fails on gloo) and a model with a `_cp_plan`
(FLUX and Qwen-Image have one; SD3 has none).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..distributed.clock import Clock
from ..distributed.comm.stats import CommStats
from ..errors import UsageError
from ..distributed.topology import Topology

__all__ = ["DiffusersUlysses", "check_supported", "record_even", "record_gather"]


@contextlib.contextmanager
def _cpu_device_count() -> Iterator[None]:
    """Make `torch.accelerator.device_count()` read 1 where there is no accelerator."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def check_supported(transformer: torch.nn.Module, tokens: dict[str, int], world_size: int) -> None:
    """Raise UsageError where diffusers' Ulysses cannot run this model and sequence on P ranks."""
    name = type(transformer).__name__
    if getattr(transformer, "_cp_plan", None) is None:
        raise UsageError(f"diffusers-ulysses: diffusers has no context-parallel plan (_cp_plan) for {name}")
    uneven = {part: n for part, n in tokens.items() if n % world_size}
    if uneven:
        listed = ", ".join(f"{n} {part} tokens" for part, n in uneven.items())
        raise UsageError(
            f"diffusers-ulysses: diffusers splits the sequence evenly, and {listed} do not divide by {world_size} "
            "ranks (pick a size or preset whose token counts do, e.g. --model tiny-shapes)"
        )


def record_even(stats: CommStats, topology: Topology, kind: str, tensor: torch.Tensor, started: Any) -> None:
    """One even all-to-all of `tensor`, synchronous, begun at `started`: tensor.nbytes / P to each peer."""
    share = tensor.numel() * tensor.element_size() // topology.world_size
    stats.record_send(kind, topology, [share] * topology.world_size)
    stats.waited(kind, started, stats.mark())


def record_gather(stats: CommStats, topology: Topology, tensor: torch.Tensor, started: Any) -> None:
    """One all-gather of this rank's `tensor`, synchronous, begun at `started`: `tensor` to every peer
    (P copies of it, one kept)."""
    share = tensor.numel() * tensor.element_size()
    stats.record_send("gather", topology, [share] * topology.world_size)
    stats.waited("gather", started, stats.mark())


class DiffusersUlysses:
    """diffusers' context parallelism switched on for one run, with counters; `undo()` switches it off."""

    def __init__(self, transformer: torch.nn.Module, topology: Topology) -> None:
        from diffusers import ContextParallelConfig

        self.transformer = transformer
        self.topology = topology
        self.stats = CommStats(clock=Clock(topology.device))
        self.timeline: dict[str, list[dict[str, float]]] = {}  # no per-layer V-First figures here
        self._calls = 0
        self._restore: list[tuple[Any, str, Any]] = []
        with _cpu_device_count():
            transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=topology.world_size))
        self._count_collectives()

    def _count_collectives(self) -> None:
        from diffusers.hooks import context_parallel
        from diffusers.models import attention_dispatch

        exchange = attention_dispatch._all_to_all_single
        gather = context_parallel.funcol.all_gather_tensor

        def counted_exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
            kind = "a2a_out" if self._calls % 4 == 3 else "a2a_in"
            self._calls += 1
            started = self.stats.mark()
            out = exchange(x, group)
            record_even(self.stats, self.topology, kind, x, started)
            return out

        def counted_gather(tensor: torch.Tensor, gather_dim: int, group: Any = None, **kwargs: Any) -> torch.Tensor:
            started = self.stats.mark()
            with warnings.catch_warnings():  # diffusers 0.42 calls the deprecated name; not ours to fix
                warnings.simplefilter("ignore", FutureWarning)
                out = gather(tensor, gather_dim, group=group, **kwargs)
            if hasattr(out, "wait"):
                out = out.wait()
            record_gather(self.stats, self.topology, tensor, started)
            return out

        for owner, attr, replacement in (
            (attention_dispatch, "_all_to_all_single", counted_exchange),
            (context_parallel.funcol, "all_gather_tensor", counted_gather),
        ):
            self._restore.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, replacement)

    def undo(self) -> None:
        """Remove diffusers' context-parallel hooks and the counters; the model runs on one rank again."""
        from diffusers.hooks.context_parallel import remove_context_parallel

        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()
        remove_context_parallel(self.transformer, self.transformer._cp_plan)
        for module in self.transformer.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = None
        self.transformer._parallel_config = None
