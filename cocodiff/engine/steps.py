"""A callback at the end of every denoising step, for pipelines with and without diffusers' own.

Most diffusers pipelines take `callback_on_step_end(pipe, step, timestep, tensors)`; a few do not
(HunyuanVideo 1.5's). For those the scheduler's `step`, which every pipeline calls once per
denoising step and whose first output is the step's new latents, calls it instead, with the same
arguments (`tensors` holds the latents).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from . import data_parallel
from .vmajor import VMajor

__all__ = ["step_callback", "step_clock"]

StepEnd = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]


def _takes_step_callback(pipe: Any) -> bool:
    """Whether the diffusers pipeline class behind `pipe` (a preset's prompt-taking subclass
    included) takes `callback_on_step_end`."""
    for cls in type(pipe).__mro__:
        call = cls.__dict__.get("__call__")
        if call is not None and cls.__module__.startswith("diffusers."):
            return "callback_on_step_end" in inspect.signature(call).parameters
    return True


@contextlib.contextmanager
def step_callback(pipe: Any, on_step_end: StepEnd) -> Iterator[dict[str, Any]]:
    """Within the block, `on_step_end` runs at the end of every step of `pipe`'s call given the
    yielded keyword arguments."""
    if _takes_step_callback(pipe):
        yield {"callback_on_step_end": on_step_end}
        return
    scheduler, steps = pipe.scheduler, [0]

    def step(model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
        out = type(scheduler).step(scheduler, model_output, timestep, sample, *args, **kwargs)
        latents = out[0] if isinstance(out, tuple) else out.prev_sample
        on_step_end(pipe, steps[0], timestep, {"latents": latents})
        steps[0] += 1
        return out

    scheduler.step = step
    try:
        yield {}
    finally:
        del scheduler.step


def step_clock(scheduler: Any) -> Callable[[], float]:
    """A step value for `StepTrials.step_boundary` from the scheduler's own step counter (diffusers'
    `step_index`: None until a run's first step ends, then counted up; `set_timesteps` resets it),
    negated so that it falls within a run and rises at a new one, as timesteps do. Unlike the
    timestep, it is the same on every rank whatever the split, needs no host sync, and holds for
    models whose timestep rises (Z-Image) or whose forward names it otherwise (Z-Image's `t`)."""

    def value() -> float:
        index = getattr(scheduler, "step_index", None)
        return -float(index or 0)

    return value


def timestep_of(args: tuple, kwargs: dict[str, Any], step: Callable[[], float | None] | None = None) -> float:
    """A transformer call's timestep (`data_parallel.timestep_value`); 0 when it has none. `step`
    (`data_parallel.CallStep.value`) reads it from the call's whole timestep: a hook behind the
    split hooks sees its rank's share of a timestep per token, which may differ from rank to rank."""
    if step is not None:
        value = step()
    else:
        value = data_parallel.timestep_value(kwargs.get("timestep", args[3] if len(args) > 3 else None))
    return 0.0 if value is None else value


def vmajor_step_hook(scheduler: Any, vmajor: VMajor, step: Callable[[], float | None] | None = None):
    """Tell V-Major which denoising step each transformer call belongs to (the same on all ranks:
    `step` reads the call's whole timestep, ahead of a split plan that cuts it per rank)."""

    def hook(_module, args, kwargs):
        value = timestep_of(args, kwargs, step)
        steps = len(scheduler.timesteps) if getattr(scheduler, "timesteps", None) is not None else 1
        vmajor.begin_call(scheduler.step_index or 0, steps, value)
        return args, kwargs

    return hook
