"""Device-true time: what every reported figure is measured with.

On CUDA and XPU the host runs ahead of the device, so a host clock around a kernel launch or
`work.wait()` (which only orders streams under NCCL/XCCL) measures the enqueue, not the work.
`Clock` times regions with events on the device's current stream there (read after one
synchronize, when the figures are collected), and with the host's `perf_counter` on the CPU,
where the host waits for the work itself. `now(device)` is a host time taken after the device
has finished everything queued: for the edges of a timed region (a denoising step, a timed
exchange). Every JSON names its clock (`clock_name`).

    clock = Clock(device)
    start = clock.mark(); ...; end = clock.mark()
    seconds = clock.seconds(start, end)   # on a device: after clock.sync()
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Clock", "clock_name", "now", "synchronize"]


def _accelerator(device: torch.device) -> Any | None:
    """torch.cuda or torch.xpu for a device of that kind; None for the CPU (and `meta`)."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "xpu":
        return torch.xpu
    return None


def synchronize(device: torch.device) -> None:
    """Wait until `device` has run everything queued (nothing to do on the CPU)."""
    module = _accelerator(device)
    if module is not None:
        module.synchronize(device)


def now(device: torch.device) -> float:
    """Host seconds (`perf_counter`) once `device` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


def clock_name(device: torch.device) -> str:
    """What the figures of a run on `device` were timed with, for reports."""
    if _accelerator(device) is not None:
        return f"{device.type} events and synchronized host clock"
    return "host perf_counter"


class Clock:
    """Marks on the device's stream (events) or the host's clock, and the seconds between two."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._module = _accelerator(self.device)

    @property
    def on_device(self) -> bool:
        return self._module is not None

    def mark(self) -> Any:
        if self._module is None:
            return time.perf_counter()
        event = self._module.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from `start` to `end` (on a device both must have completed: `sync()`)."""
        if self._module is None:
            return end - start
        return start.elapsed_time(end) / 1e3

    def sync(self) -> None:
        synchronize(self.device)
