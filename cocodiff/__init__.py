"""CoCoDiff: distributed inference for Diffusion Transformers with Ulysses sequence parallelism.

    from cocodiff import ParallelConfig, parallelize

`parallelize` (and diffusers behind it) is imported on first use, so the collectives and the
launcher start quickly in processes that never touch a model.
"""

from typing import Any

from .config import ParallelConfig
from .errors import UsageError
from .topology import Topology

__all__ = ["ParallelConfig", "Parallelized", "Topology", "UsageError", "parallelize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("parallelize", "Parallelized"):
        from . import parallel as module

        return getattr(module, name)
    raise AttributeError(f"module 'cocodiff' has no attribute {name!r}")
