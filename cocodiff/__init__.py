"""CoCoDiff: distributed inference for Diffusion Transformers with Ulysses sequence parallelism."""

from .config import ParallelConfig
from .errors import UsageError
from .parallelize import Parallelized, parallelize
from .topology import Topology

__all__ = ["ParallelConfig", "Parallelized", "Topology", "UsageError", "parallelize"]
__version__ = "0.1.0"
