"""CoCoDiff: distributed inference for Diffusion Transformers with Ulysses sequence parallelism.

    from cocodiff import ParallelConfig, parallelize

`parallelize` (and diffusers behind it) and `Topology` (and torch behind it) are imported on
first use, so the collectives and the launcher start quickly in processes that never touch a
model, and commands that need neither (`simulate`, `cluster`) never load torch.
"""

from typing import Any

from .config.parallel import ParallelConfig
from .errors import UsageError

__all__ = ["ParallelConfig", "Parallelized", "Topology", "UsageError", "parallelize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("parallelize", "Parallelized"):
        from .engine import parallelize as module

        return getattr(module, name)
    if name == "Topology":
        from .distributed.topology import Topology

        return Topology
    raise AttributeError(f"module 'cocodiff' has no attribute {name!r}")
