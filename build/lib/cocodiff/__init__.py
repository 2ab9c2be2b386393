"""CoCoDiff: distributed inference for Diffusion Transformers with Ulysses sequence parallelism.

    from cocodiff import ParallelConfig, parallelize

`parallelize` (and diffusers behind it), `Topology` (and torch behind it), `load_preset` and
`process_device` are imported on first use, so the collectives and the launcher start quickly in
processes that never touch a model, and commands that need neither (`simulate`, `cluster`) never
load torch. The package's layers are described in docs/architecture.md.
"""

from importlib import import_module
from typing import Any

from .config.parallel import ParallelConfig
from .errors import UsageError

__all__ = [
    "ParallelConfig", "Parallelized", "Topology", "UsageError", "load_preset", "parallelize", "process_device",
]
__version__ = "0.1.0"

_LAZY = {
    "parallelize": ".engine.parallelize",
    "Parallelized": ".engine.parallelized",
    "Topology": ".distributed.topology",
    "load_preset": ".models.presets",
    "process_device": ".distributed.devices",
}
"""Public names imported on first use, by the module that defines them."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'cocodiff' has no attribute {name!r}")
