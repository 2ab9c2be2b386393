"""The attention kernel (`--attention-backend NAME`): a backend of diffusers' attention dispatcher.

The stock processors reach it through the dispatcher (`set_attention_backend`: the kernel the
routed exchange hands its gathered heads to, dispatch.py); the hand-written processors (FLUX.1,
Qwen-Image, SD3) call it through `dispatch_attention_fn` in place of torch's SDPA (core.py). Ring
blocks keep the ring's own kernel (ring.py), which returns the log-sum-exp that merges them.

A name is checked before any rank starts: one of the dispatcher's, not a kernel that downloads
from the hub at run time, its package installed, and a device that runs it. `auto` is `native`:
torch's SDPA, which on a GPU already takes its fastest fused kernel per call (flash, memory-efficient,
cuDNN); the named backends bring the kernels torch has not (flash-attention 2 and 3, SageAttention,
xFormers) or pin one of torch's. The stock processors split over the ranks need a backend with a
context-parallel path in the dispatcher (`dispatch._check_backends`). What ran is recorded per call
(`UlyssesContext.kernels`), never a silent fallback.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ...distributed.devices import first_device
from ...errors import UsageError

__all__ = ["AUTO", "CPU_BACKENDS", "check_backend", "kernel", "kernel_name", "resolve_backend", "set_backend", "splits_stock_processors"]

AUTO = "auto"
CPU_BACKENDS = ("native", "_native_math", "flex")
"""The dispatcher's backends that run on the CPU; every other needs a GPU."""


def _names() -> list[str]:
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [member.value for member in AttentionBackendName]


def _installed(name: str) -> str | None:
    """None when `name`'s package is there, else what diffusers says is missing (its first line)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ImportError) as error:
        return str(error).strip().splitlines()[0]
    return None


def check_backend(name: str | None, device: torch.device | None = None) -> None:
    """`--attention-backend name` can run on `device` (None: the first GPU if there is one, else
    the CPU: `first_device`), in one line otherwise."""
    if name is None or name == AUTO:
        return
    names = _names()
    if name not in names:
        public = [n for n in names if not n.startswith("_") and not n.endswith("_hub")]
        raise UsageError(f"--attention-backend {name}: no such backend in diffusers' dispatcher (auto, "
                         f"{', '.join(public)}, or one of its _-prefixed kernels)")
    if name.endswith("_hub"):
        raise UsageError(f"--attention-backend {name} downloads its kernel from the hub as a rank starts; install "
                         f"the kernel's package and name its backend ({name.removesuffix('_hub')})")
    missing = _installed(name)
    if missing is not None:
        raise UsageError(f"--attention-backend {name}: {missing}")
    device = device if device is not None else first_device()
    if device.type == "cpu" and name not in CPU_BACKENDS:
        raise UsageError(f"--attention-backend {name} needs a GPU; on the CPU: {', '.join(CPU_BACKENDS)}")


def splits_stock_processors(name: str | None) -> bool:
    """Whether the stock processors can run `name` with their tokens split over the ranks: it has a
    context-parallel path in the dispatcher (None and `auto`: torch's SDPA, which has)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return name in (None, AUTO) or AttentionBackendName(name) in _AttentionBackendRegistry._supports_context_parallel


def resolve_backend(name: str | None) -> str | None:
    """The backend a rank runs: `name`, `native` for `auto`."""
    return "native" if name == AUTO else name


def set_backend(pipe: Any, name: str | None) -> None:
    """Every transformer of `pipe` (and its experts) runs its stock processors' attention on `name`;
    the process's default backend, which diffusers sets too, stays as it was (a later pipeline of
    this process, a matrix cell or a server's, gets no backend it did not ask for). None: the
    processors back on the process's default (`bench e2e`'s variants share a pipeline)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry.get_active_backend()[0]
    quiet = logging.getLogger("diffusers.models.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "an experimental feature" on every call
    try:
        for part_name, part in pipe.components.items():
            if not (part_name.startswith("transformer") and hasattr(part, "set_attention_backend")):
                continue
            if name is None:
                part.reset_attention_backend()
            else:
                part.set_attention_backend(name)
    finally:
        quiet.setLevel(level)
        _AttentionBackendRegistry.set_active_backend(default)


def kernel(name: str) -> tuple[Callable[..., torch.Tensor], str]:
    """(B, H, S, D) q, k, v and an optional mask -> attention through the dispatcher's `name` (for
    the hand-written processors), and the name of the function that runs it."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, dispatch_attention_fn

    backend = AttentionBackendName(name)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        t = (lambda x: x.transpose(1, 2))
        return t(dispatch_attention_fn(t(q), t(k), t(v), attn_mask=mask, backend=backend))

    return attend, kernel_name(_AttentionBackendRegistry._backends[backend])


def kernel_name(function: Callable[..., Any]) -> str:
    """What a kernel is called in the records: its function's name (`_native_attention_forward_op`,
    `_native_math_attention`, `scaled_dot_product_attention`)."""
    return getattr(function, "__name__", type(function).__name__)
