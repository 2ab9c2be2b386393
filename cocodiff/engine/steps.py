"""Denoising steps: which step a transformer call belongs to (`StepClock`), and a callback at the
end of every step for pipelines with and without diffusers' own.

Most diffusers pipelines take `callback_on_step_end(pipe, step, timestep, tensors)`; a few do not
(HunyuanVideo 1.5's). For those the scheduler's `step`, which every pipeline calls once per
denoising step and whose first output is the step's new latents, calls it instead, with the same
arguments (`tensors` holds the latents).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .vmajor import VMajor

__all__ = ["StepClock", "clock_of", "scheduler_steps", "step_callback", "timestep_value"]

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
    with scheduler_steps(pipe, on_step_end):
        yield {}


@contextlib.contextmanager
def scheduler_steps(pipe: Any, on_step_end: StepEnd) -> Iterator[None]:
    """Within the block, `on_step_end(pipe, step, timestep, {"latents": ...})` runs after each
    `pipe.scheduler.step` (with its new latents; latents it returns replace them, as diffusers'
    callbacks do): the step callback of a pipeline whose loop has none."""
    scheduler, steps = pipe.scheduler, [0]

    def step(model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
        out = type(scheduler).step(scheduler, model_output, timestep, sample, *args, **kwargs)
        latents = out[0] if isinstance(out, tuple) else out.prev_sample
        given = (on_step_end(pipe, steps[0], timestep, {"latents": latents}) or {}).get("latents", latents)
        steps[0] += 1
        if given is latents:
            return out
        return (given, *out[1:]) if isinstance(out, tuple) else type(out)(prev_sample=given)

    scheduler.step = step
    try:
        yield
    finally:
        del scheduler.step


def timestep_value(timestep: Any) -> float | None:
    """A transformer call's timestep as one number, or None: the first item's, and of a timestep
    per token (LTX-Video's and Wan 2.2 TI2V's image-to-video, 0 on the conditioning frame's tokens)
    the largest of the item's tokens. A host read: only what needs the value itself reads it
    (MagCache's curve, V-Major's jumps), once per call; which step a call belongs to is `StepClock`'s."""
    if isinstance(timestep, torch.Tensor):
        first = timestep[0] if timestep.dim() else timestep
        return float(first.max())
    return None if timestep is None else float(timestep)


_CLOCKS: weakref.WeakKeyDictionary[torch.nn.Module, StepClock] = weakref.WeakKeyDictionary()


class StepClock:
    """Which denoising step each call of a transformer belongs to: the one clock that every part
    acting per step reads (CFG pairing, `--plan auto` / `--comm auto` trials, step caches,
    displaced patches, V-Major).

    With the pipeline's scheduler, a step is the scheduler's step counter (diffusers' `step_index`:
    None until a run's first step ends, then counted up by `scheduler.step`), and a run begins when
    `set_timesteps` gives the scheduler new timesteps (or resets the counter). Nothing is read from
    the timestep: it is the same on every rank whatever splits the call's tensors, costs no host
    sync, and never merges two steps whose timesteps round to one value (FLUX's adjacent steps in
    bf16 from 1536 pixels on). Without a scheduler (a bare transformer driven by its caller's own
    loop), or for a caller that steps many requests itself (`each_call`: serving's step-level
    batching), every call is a step of its own and `begin_run` starts a run.

    `install` makes `hook` the transformer's first forward pre-hook; `value()` is the call's step as one number
    that falls within a run and rises at a new one (as timesteps do), `position()` as (run, step)."""

    SPAN = 2**20
    """Steps per run that `value()` tells apart."""

    def __init__(self, transformer: torch.nn.Module, scheduler: Any = None) -> None:
        self.scheduler = scheduler if hasattr(scheduler, "step_index") else None
        self.each_call = False
        self.transformer = transformer
        self._handle: Any = None
        parameters = list(inspect.signature(type(transformer).forward).parameters)[1:]  # less self
        self._at = parameters.index("timestep") if "timestep" in parameters else None
        self._run, self._step = 0, -1
        self._timesteps: Any = None
        self._index: Any = None
        self._timestep: Any = None
        self._read: float | None = None
        self._unread = False

    def install(self) -> StepClock:
        """`hook` in front of the transformer's forward pre-hooks (moved there if it was elsewhere):
        the clock `clock_of` finds until `remove`."""
        if self._handle is not None:
            self._handle.remove()
        self._handle = self.transformer.register_forward_pre_hook(self.hook, with_kwargs=True, prepend=True)
        _CLOCKS[self.transformer] = self
        return self

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if _CLOCKS.get(self.transformer) is self:
            del _CLOCKS[self.transformer]

    def hook(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """At the call's entry, ahead of every other hook: which step this call is."""
        at = self._at
        self._timestep = kwargs["timestep"] if "timestep" in kwargs else args[at] if at is not None and at < len(args) else None
        self._unread = True
        scheduler = self.scheduler
        if scheduler is None or self.each_call:
            self._step += 1
            return
        timesteps, index = getattr(scheduler, "timesteps", None), scheduler.step_index
        if self._step < 0 or timesteps is not self._timesteps or (index is None and self._index is not None):
            self.begin_run()
            self._step, self._timesteps = 0, timesteps
        elif index != self._index:
            self._step += 1
        self._index = index

    def begin_run(self) -> None:
        """The next call starts a run (a caller that drives the transformer without a scheduler)."""
        self._run, self._step = self._run + 1, -1

    def last_step(self) -> bool:
        """Whether the call belongs to its run's last step: the scheduler's counter at its last
        timestep (from the `begin_index` an image-to-image run starts at); False without a scheduler."""
        scheduler = self.scheduler
        timesteps = getattr(scheduler, "timesteps", None) if scheduler is not None and not self.each_call else None
        if timesteps is None:
            return False
        index = self._index if self._index is not None else (getattr(scheduler, "begin_index", None) or 0)
        return index == len(timesteps) - 1

    def position(self) -> tuple[int, int]:
        """The call's (run, step within the run)."""
        return self._run, max(self._step, 0)

    def value(self) -> float:
        """The call's step as one number: equal within a step, falling through a run, larger at a new run."""
        run, step = self.position()
        return float(run * self.SPAN - step)

    def timestep(self) -> float | None:
        """The call's whole timestep as one number (`timestep_value`; read once per call, on the
        host: only for what needs the value)."""
        if self._unread:
            self._read, self._timestep, self._unread = timestep_value(self._timestep), None, False
        return self._read


def clock_of(transformer: torch.nn.Module) -> StepClock | None:
    """The step clock `parallelize` (or a step cache) installed on `transformer`, if any."""
    return _CLOCKS.get(transformer)


def vmajor_step_hook(scheduler: Any, vmajor: VMajor, clock: StepClock):
    """Tell V-Major which denoising step each transformer call belongs to (`clock`: the same on all
    ranks, whatever a split plan cuts per rank)."""
    seen: list[tuple[int, int] | None] = [None]

    def hook(_module, args, kwargs):
        position = clock.position()
        steps = len(scheduler.timesteps) if getattr(scheduler, "timesteps", None) is not None else 1
        vmajor.begin_call(position[1], steps, clock.timestep() or 0.0, same_step=position == seen[0])
        seen[0] = position
        return args, kwargs

    return hook
