"""Memory as measured on this rank: free, resident, peak, the bytes of the weights it holds, and the
largest figure over the ranks. The estimates made before anything is allocated are `footprint`'s."""

from __future__ import annotations

import resource
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .comm.ulysses import all_reduce


def available_bytes(device: torch.device) -> int | None:
    """Free memory of this rank's accelerator, or the machine's available memory on CPU; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
        return torch.xpu.mem_get_info(device)[0]
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _proc_bytes(path: str, field: str) -> int | None:
    """The `field:  N kB` line of the Linux /proc file `path`, in bytes; None where it cannot be read."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident set now (Linux); None where it cannot be read."""
    return _proc_bytes("/proc/self/status", "VmRSS")


def agreed(value: float, device: torch.device, op: dist.ReduceOp.RedOpType) -> float:
    """The same number on every rank, so that every rank takes the same decision (all-reduced)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    figure = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL and XCCL reduce device tensors only
    return all_reduce(figure, None, "memory check (all-reduce)", op=op).item()


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` holds: of a tensor subclass that stores its values in parts (a quantized
    weight's int8 or fp8 data and its scales, torchao), those parts, not its nominal dtype's size.
    A DTensor counts at its global size (`to_local()` first for this rank's share)."""
    if isinstance(tensor, DTensor) or type(tensor) in (torch.Tensor, torch.nn.Parameter) \
            or not hasattr(tensor, "__tensor_flatten__"):
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__()
    parts = (getattr(tensor, name) for name in names)
    return sum(tensor_bytes(part) for part in parts if isinstance(part, torch.Tensor))


def weight_bytes(*modules: Any, on: torch.device | None = None) -> int:
    """Bytes of the parameters and buffers of `modules` that this rank holds (each counted once;
    None skipped; of a sharded parameter, its local shard; freed ones, on `meta`, not at all);
    `on`: only those on that kind of device (not a text encoder offloaded to the host)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if local.device.type != "meta" and (on is None or local.device.type == on.type):
                    total += tensor_bytes(local)
    return total


def runtime_bytes(*pipes: Any, encoder: Any = None) -> int:
    """On the CPU, what this process holds besides the weights as a run starts (the Python runtime,
    torch's and the other libraries' code and caches): its resident set less the weights of `pipes`
    (and `encoder`) that it holds. 0 on an accelerator, whose allocator counts tensors only."""
    device = pipes[0].transformer.device
    if device.type != "cpu":
        return 0
    resident = resident_bytes()
    if resident is None:
        return 0
    parts = [part for pipe in pipes for part in (getattr(pipe, "components", {}) or {}).values()]
    return max(0, resident - weight_bytes(encoder, *parts, on=device))


def reset_peak(device: torch.device) -> None:
    """Start the peak count afresh: the accelerator's peak allocation, or on the CPU (Linux) the
    process's resident-set high-water mark, brought down to what it holds now (`/proc/self/clear_refs`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "xpu" and hasattr(torch.xpu, "reset_peak_memory_stats"):
        torch.xpu.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:  # not Linux, or not allowed: the peak since the process started
            pass


def peak_bytes(device: torch.device) -> int:
    """This rank's peak memory since the last `reset_peak`: the accelerator's peak allocation, or on
    the CPU this process's peak resident set (`VmHWM`; `ru_maxrss`, the peak since the process
    started, where /proc is not there)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "xpu" and hasattr(torch.xpu, "max_memory_allocated"):
        return int(torch.xpu.max_memory_allocated(device))
    peak = _proc_bytes("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of every rank's `value` (an all-reduce; the value itself with one rank)."""
    return int(agreed(float(value), device, dist.ReduceOp.MAX))
