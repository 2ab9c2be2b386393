"""xDiT's own Ulysses as a `bench e2e` baseline variant (`xdit-ulysses`).

What xDiT's users run on FLUX.1: `xFuserFlux1Transformer2DWrapper` (xfuser 0.7), diffusers' FLUX
transformer whose forward splits the image tokens (and the text's, where they divide) evenly over
the ranks, sends Q, K and V of every attention in one all-to-all and the output in a second
(`USP`, `combine_qkv_a2a`), and all-gathers the result. It takes the pipeline's transformer's
weights and stands in its place for the variant's runs.

xDiT is not a dependency of cocodiff; install it beside it to time it (its Ulysses groups come from
yunchang, and its import wants triton):

    pip install --no-deps xfuser==0.7.0 yunchang distvae
    pip install einops sentencepiece beautifulsoup4 pyyaml triton

On a machine without a GPU (the emulated clusters) xDiT stops as it is imported: it asks for the
GPU's CUDA version and its NCCL backend, and looks for yunchang only where CUDA is. `_import` gives
it a CPU's answers (no CUDA version, gloo, yunchang as found) before its package initializes, and
hands its attention layer yunchang's groups; its Ulysses then runs as it is.

Counted like diffusers' baseline (diffusers_cp.py): its all-to-alls (per attention the first is
Q, K and V, the second the output) and the output's all-gather, both synchronous, so the time in
them is exposed communication.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.clock import Clock
from ..distributed.comm.stats import CommStats
from ..distributed.topology import Topology
from ..errors import UsageError
from .diffusers_cp import record_even, record_gather

__all__ = ["XDiTUlysses", "check_installed", "check_supported"]

INSTALL = "pip install --no-deps xfuser==0.7.0 yunchang distvae && pip install einops sentencepiece beautifulsoup4 pyyaml triton"

_WRAPPERS: dict[int, torch.nn.Module] = {}
"""Per pipeline transformer (by id), xDiT's wrapper holding its weights: built once per launch."""


def _import() -> Any:
    """The `xfuser` package, imported so that it also starts on gloo ranks without a GPU."""
    if "xfuser" in sys.modules:
        return sys.modules["xfuser"]
    check_installed()
    spec = importlib.util.find_spec("xfuser")
    assert spec is not None and spec.loader is not None
    if torch.cuda.is_available():
        return importlib.import_module("xfuser")
    package = importlib.util.module_from_spec(spec)  # its __init__ runs below, once its checks have a CPU's answers
    sys.modules["xfuser"] = package
    try:
        envs = importlib.import_module("xfuser.envs")
        envs.get_device_version = lambda: None
        envs.get_torch_distributed_backend = lambda: "gloo"
        envs.PACKAGES_CHECKER.packages_info["has_long_ctx_attn"] = importlib.util.find_spec("yunchang") is not None
        spec.loader.exec_module(package)
        from yunchang.globals import PROCESS_GROUP

        importlib.import_module("xfuser.model_executor.layers.usp").PROCESS_GROUP = PROCESS_GROUP
    except Exception:
        for name in [n for n in sys.modules if n == "xfuser" or n.startswith("xfuser.")]:
            del sys.modules[name]
        raise
    return package


def check_supported(transformer: torch.nn.Module, world_size: int) -> None:
    """Raise UsageError where xDiT's Ulysses cannot run this model on `world_size` ranks (before it is imported)."""
    name = type(transformer).__name__
    if name != "FluxTransformer2DModel":
        raise UsageError(f"xdit-ulysses: the baseline runs xDiT's FLUX.1 transformer, not {name} (e.g. --model tiny-shapes)")
    heads = transformer.config.num_attention_heads
    if heads % world_size:
        raise UsageError(f"xdit-ulysses: xDiT splits the {heads} heads evenly, and {world_size} ranks do not divide them")
    check_installed()


def check_installed() -> None:
    """Raise UsageError where xDiT is not installed (before any rank starts)."""
    if importlib.util.find_spec("xfuser") is None:
        raise UsageError(f"xDiT is not installed ({INSTALL})")


def _start(topology: Topology, text_tokens: int) -> None:
    """xDiT's groups and runtime state for a Ulysses degree of every rank, made once per launch
    (every rank makes its groups in the same order), on the process group that is there."""
    _import()
    from xfuser.config import xFuserArgs
    from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized
    from xfuser.core.distributed import runtime_state

    if not model_parallel_is_initialized():
        init_distributed_environment(rank=topology.rank, world_size=topology.world_size, backend=dist.get_backend())
        initialize_model_parallel(ulysses_degree=topology.world_size)

        class Runtime(runtime_state.ExternalRuntimeState):  # its own runs one rank
            def __init__(self) -> None:
                runtime_state.RuntimeState.__init__(
                    self, xFuserArgs(model="bench", ulysses_degree=topology.world_size).create_config()[0])

        runtime_state._RUNTIME = Runtime()
    # The text tokens a rank holds, which its single-stream processor reads (PipeFusion's split needs them)
    divides = text_tokens % topology.world_size == 0
    runtime_state._RUNTIME.max_condition_sequence_length = text_tokens // topology.world_size if divides else text_tokens


def _wrapper(transformer: torch.nn.Module) -> torch.nn.Module:
    """xDiT's FLUX.1 transformer with `transformer`'s config and weights (built once per transformer)."""
    from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

    if id(transformer) not in _WRAPPERS:
        takes = inspect.signature(xFuserFlux1Transformer2DWrapper.__init__).parameters
        wrapper = xFuserFlux1Transformer2DWrapper(**{k: v for k, v in transformer.config.items() if k in takes})
        wrapper.load_state_dict(transformer.state_dict())
        _WRAPPERS[id(transformer)] = wrapper.to(device=transformer.device, dtype=transformer.dtype).eval()
    return _WRAPPERS[id(transformer)]


class XDiTUlysses:
    """xDiT's FLUX.1 Ulysses in the pipeline's place for one run, with counters; `undo()` puts the pipeline's own back."""

    def __init__(self, pipe: Any, topology: Topology, text_tokens: int) -> None:
        _start(topology, text_tokens)
        self.pipe, self.topology, self.own = pipe, topology, pipe.transformer
        self.stats = CommStats(clock=Clock(topology.device))
        self.timeline: dict[str, list[dict[str, float]]] = {}  # no per-layer figures here
        self._calls = 0
        self._restore: list[tuple[Any, str, Any]] = []
        pipe.transformer = _wrapper(self.own)
        self._count_collectives()

    def _count_collectives(self) -> None:
        from xfuser.core.distributed import get_sp_group
        from xfuser.model_executor.layers import usp

        exchange, group = usp._sdpa_all_to_all_single, get_sp_group()
        gather = group.all_gather

        def counted_exchange(x: torch.Tensor) -> torch.Tensor:
            kind = "a2a_out" if self._calls % 2 else "a2a_in"  # per attention: Q, K and V together, then the output
            self._calls += 1
            started = self.stats.mark()
            out = exchange(x)
            record_even(self.stats, self.topology, kind, x, started)
            return out

        def counted_gather(tensor: torch.Tensor, dim: int = -1, *args: Any, **kwargs: Any) -> torch.Tensor:
            started = self.stats.mark()
            out = gather(tensor, dim, *args, **kwargs)
            record_gather(self.stats, self.topology, tensor, started)
            return out

        self._restore += [(usp, "_sdpa_all_to_all_single", exchange), (group, "all_gather", None)]  # None: its class's
        usp._sdpa_all_to_all_single, group.all_gather = counted_exchange, counted_gather

    def undo(self) -> None:
        """The counters off, and the pipeline's own transformer back in its place."""
        for owner, attr, original in reversed(self._restore):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._restore.clear()
        self.pipe.transformer = self.own
