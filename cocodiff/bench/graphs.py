"""`cocodiff bench graphs`: how whole `--compile` sees each transformer block, per exchange.

Runs in this process as rank 0 of torch's `fake` process group (the collectives move nothing;
only what dynamo traces matters), on the CPU: one eager forward records each repeated block's
inputs, then `torch._dynamo.explain` traces every block class once with the exchange as
`--compile` runs it (functional collectives) and as eager runs it (c10d's async works), and
reports graphs, graph breaks and their first reasons. A block that compiles whole has 1 graph
and 0 breaks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config.parallel import ParallelConfig
from ..config.levels import parse_levels
from ..config.plan import parse_plan

__all__ = ["GraphsSpec", "graph_breaks"]


@dataclass(frozen=True, kw_only=True)
class GraphsSpec:
    model: str = "tiny-flux"
    ranks: int = 4
    """Ranks of the fake world: two nodes of ranks/2 (TAPA's two phases)."""
    cases: tuple[tuple[str, str], ...] = (("u4", "flat"), ("u4", "tapa"), ("u2r2", "flat"))
    """(plan, exchange) pairs to trace."""
    functional: tuple[bool, ...] = (True, False)
    """The collectives to trace each case with: functional (as `--compile` runs), c10d's works (eager)."""


def _block_inputs(transformer: torch.nn.Module, blocks: dict[str, torch.nn.Module], inputs: dict) -> dict[str, tuple]:
    """(args, kwargs) of the first call of each block in one eager forward."""
    seen: dict[str, tuple] = {}

    def keep(name: str):
        def hook(_module, args, kwargs):
            seen.setdefault(name, (args, kwargs))
        return hook

    handles = [block.register_forward_pre_hook(keep(name), with_kwargs=True) for name, block in blocks.items()]
    try:
        with torch.no_grad():
            transformer(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def graph_breaks(spec: GraphsSpec, inputs_for: Any) -> list[dict[str, Any]]:
    """One row per (plan, exchange, collectives, block class); `inputs_for(model, transformer)`
    gives a forward's arguments. Initializes and destroys a fake default process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..engine.families import family_of, repeated_block_names
    from ..engine.parallelize import parallelize
    from ..models.presets import load_pipeline
    from ..distributed.topology import Topology

    rows = []
    transformer = load_pipeline(spec.model, seed=0)[0].transformer  # parallelized per case, then restored
    family = family_of(transformer)
    names = repeated_block_names(transformer, family)
    blocks = {type(m).__name__: m for m in transformer.modules() if type(m).__name__ in names}
    inputs = inputs_for(spec.model, transformer)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec.ranks)
    try:
        levels = parse_levels(f"node=2,rank={spec.ranks // 2}") if spec.ranks > 2 else None
        topology = Topology.from_env(levels=levels, device=torch.device("cpu"))
        for plan, comm in spec.cases:
            for functional in spec.functional:
                parallel = parallelize(transformer, ParallelConfig(comm=comm, plan=parse_plan(plan)), topology)
                parallel.ctx.exchange.functional = functional  # as --compile runs it, or as eager does
                parallel.ctx.stats.timed = not functional
                for name, (args, kwargs) in _block_inputs(transformer, blocks, inputs).items():
                    torch._dynamo.reset()
                    with torch.no_grad(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # dynamo warns once per break; the rows list them
                        explained = torch._dynamo.explain(blocks[name])(*args, **kwargs)
                    reasons = sorted({str(b.reason).splitlines()[0][:160] for b in explained.break_reasons})
                    rows.append({"plan": plan, "comm": comm, "collectives": "functional" if functional else "c10d works",
                                 "block": name, "graphs": explained.graph_count, "breaks": explained.graph_break_count,
                                 "reasons": reasons[:5]})
                parallel.undo()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    return rows
