"""Typed, validated configuration for sequence-parallel inference.

Parsing a config never starts `torch.distributed`: `ParallelConfig` only checks that its fields
make sense together; the process groups are built later by `Topology`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

__all__ = ["COMM_CHOICES", "DEFAULT_PROMPT", "DTYPE_NAMES", "ParallelConfig"]

COMM_CHOICES = ("flat", "tapa", "auto")
DEFAULT_PROMPT = "a red circle above a blue square"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Compute dtypes by name (runner.DTYPES maps them to torch's)."""

@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How a transformer is split over the ranks of the default process group."""

    comm: str = "flat"
    """All-to-all mechanism: `flat` (one all-to-all over all ranks, the Ulysses baseline) or
    `tapa` (two phases: inside each node, then between nodes among ranks of the same local index)
    or `auto` (both timed on this fabric at start-up, then chosen per message size)."""

    v_first: bool = True
    """V-First: start V's all-to-all before Q and K are projected, normalized and rotated, and
    overlap the attention output's all-to-all with independent work (FLUX's single-stream MLP).
    Lossless: only the schedule changes."""

    fuse_qk: bool = True
    """Send Q and K as one message (one collective instead of two)."""

    v_major: str = "off"
    """V-Major (lossy): on inter-node links send only the tokens whose projections changed most
    since the receiver last got them; the cache ratio per step follows this schedule: `off`,
    `linear`, `constant:R`, `warmup:N,linear`, `adaptive:EPS`. Needs `comm="tapa"` or `"flat"`."""

    v_major_tensors: str = "v"
    """`v`: V only; `vqk`: Q and K of the tokens V did not send are skipped too."""

    v_major_max_memory: int | None = None
    """Cache bytes per rank; layers past it send in full. None: no limit."""

    auto_budget_s: float = 20.0
    """`auto` only: the most time its start-up measurement may take."""

    ranks_per_node: int | None = None
    """Ranks that share a node (fast links). None: taken from the launcher (`LOCAL_WORLD_SIZE`)."""

    @property
    def lossy(self) -> bool:
        from .cache import parse_schedule

        return parse_schedule(self.v_major).lossy

    def __post_init__(self) -> None:
        if self.comm not in COMM_CHOICES:
            raise UsageError(f"--comm {self.comm!r} is not one of {', '.join(COMM_CHOICES)}")
        from .cache import parse_schedule

        if parse_schedule(self.v_major).kind != "off" and self.comm not in ("flat", "tapa"):
            raise UsageError(
                f"--v-major {self.v_major} needs an exchange whose inter-node part is known in advance: "
                f"use --comm tapa or flat, not {self.comm}"
            )
        if self.v_major_tensors not in ("v", "vqk"):
            raise UsageError(f"--v-major-tensors {self.v_major_tensors!r} is not one of v, vqk")
        if self.v_major_max_memory is not None and self.v_major_max_memory < 0:
            raise UsageError(f"--v-major-max-memory {self.v_major_max_memory} must be at least 0")
        if self.auto_budget_s <= 0:
            raise UsageError(f"auto_budget_s {self.auto_budget_s} must be positive")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UsageError(f"--ranks-per-node {self.ranks_per_node} must be at least 1")
