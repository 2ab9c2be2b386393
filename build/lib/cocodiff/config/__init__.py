"""What a run asks for: every option's grammar and the torch-free rules that check it.

Layer 1, above `errors` only. Nothing here imports torch: `simulate`, `cluster` and the
command-line parser read these modules without loading it.
"""

from .parallel import ParallelConfig

__all__ = ["ParallelConfig"]
