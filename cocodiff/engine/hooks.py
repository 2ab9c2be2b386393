"""The split plan carried out: forward hooks that split a module's inputs (or outputs) along the
sequence at the transformer's entry and gather its output at the exit, as a family's `ModulePlan`
says (the manner of diffusers' `_cp_plan`). Sequence dims are negative so a plan holds with or
without a batch dim."""

from __future__ import annotations

import fnmatch
import inspect
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import UsageError
from .attention import UlyssesContext
from .families import JOINT, Gather, ModulePlan, Split, Whole

__all__ = ["install_split_hooks", "present_plans"]

_BLOCK_LISTS = (torch.nn.ModuleList, torch.nn.Sequential)


def _matching_modules(root: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    if pattern == "":
        return [root]
    depth = pattern.count(".")  # '*' stands for exactly one path component
    return [m for path, m in root.named_modules() if path.count(".") == depth and fnmatch.fnmatchcase(path, pattern)]


def present_plans(transformer: torch.nn.Module, plans: dict[str, ModulePlan]) -> dict[str, ModulePlan]:
    """The plan's entries this transformer has. A plan written for a checkpoint's depth names
    blocks a shallower config lacks (`blocks.39` of 2 blocks): those splits are passed over (no
    tokens reach a block that is not there). A gather there is refused (the output would stay
    split), and so is a module the transformer does not have at all."""
    name = type(transformer).__name__
    present = {}
    for pattern, module_plan in plans.items():
        if _matching_modules(transformer, pattern):
            present[pattern] = module_plan
            continue
        end = _past_the_end(transformer, pattern)
        if end is None:
            raise UsageError(f"{name} has no module {pattern!r}, which its split plan names")
        if isinstance(module_plan.output, Gather):
            raise UsageError(f"{name}'s split plan gathers at {pattern!r}, past the end of its {end}: "
                             f"the output would stay split")
    return present


def _past_the_end(root: torch.nn.Module, pattern: str) -> str | None:
    """'`path` (N modules)' when `pattern` indexes a block list of `root` past its end, else None."""
    parts = pattern.split(".")
    for i, part in enumerate(parts):
        if not part.isdigit():
            continue
        path = ".".join(parts[:i])
        lists = _matching_modules(root, path)
        if lists and all(isinstance(m, _BLOCK_LISTS) and int(part) >= len(m) for m in lists):
            return f"{path} ({min(len(m) for m in lists)} modules)"
    return None


def install_split_hooks(transformer: torch.nn.Module, plans: dict[str, ModulePlan], ctx: UlyssesContext,
                        live: Callable[[], bool] | None = None) -> list[RemovableHandle]:
    """The plan's hooks, after one that starts each forward with no stream split (attention
    before the split runs whole: engine/attention/dispatch.py). With `live`, each hook acts only
    while it says so (the hooks of one of `--plan auto`'s block layouts: engine/stage_trials.py)."""
    gate = (lambda hook: hook) if live is None else (lambda hook: _gated(hook, live))
    hooks = [transformer.register_forward_pre_hook(gate(lambda _module, _args: ctx.new_forward()), prepend=True)]
    for pattern, module_plan in present_plans(transformer, plans).items():
        for module in _matching_modules(transformer, pattern):
            if module_plan.inputs:
                hook = _input_hook(module, module_plan.inputs, ctx)
                hooks.append(module.register_forward_pre_hook(gate(hook), with_kwargs=True))
            if module_plan.output is not None:
                hooks.append(module.register_forward_hook(gate(_output_hook(module_plan.output, ctx))))
    return hooks


def _gated(hook: Callable[..., Any], live: Callable[[], bool]) -> Callable[..., Any]:
    """`hook` while `live()`; a hook that changes nothing otherwise."""
    return lambda *args: hook(*args) if live() else None


def _input_hook(module: torch.nn.Module, inputs: dict[str, Split], ctx: UlyssesContext):
    positions = list(inspect.signature(module.forward).parameters)

    def hook(_module, args, kwargs):
        args = list(args)
        for name, split in inputs.items():
            if name in kwargs:
                kwargs[name] = _shard_value(kwargs[name], split, ctx)
            elif name in positions and positions.index(name) < len(args):
                i = positions.index(name)
                args[i] = _shard_value(args[i], split, ctx)
        return tuple(args), kwargs

    return hook


def _shard_value(x: Any, split: Split, ctx: UlyssesContext) -> Any:
    """`x` split as `split` says: a tensor, or each tensor of a tuple or list (a rotary table's
    cosines and sines); anything else as it is."""
    if isinstance(split, Whole):  # keys of a local attention: their count tells it from one over split tokens
        if isinstance(x, torch.Tensor) and x.dim() >= -split.dim:
            ctx.whole_kv.add(x.shape[split.dim])
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(item if _beside(item, split, ctx) else _shard_value(item, split, ctx) for item in x)
    return _shard(x, split, ctx) if _splits(x, split) else x


def _beside(x: Any, split: Split, ctx: UlyssesContext) -> bool:
    """Whether a tuple's tensor has no token axis where `split` says, once the stream is split in this
    pass: Allegro's rotary tuple holds per-axis frequency tables beside its [B, S] positions."""
    if not _splits(x, split) or getattr(ctx, "patches", None) is not None:
        return False
    streams = split.stream.split(JOINT)
    if not all(s in ctx.sizes for s in streams):
        return False
    return x.shape[split.dim] != sum(sum(ctx.sizes[s]) for s in streams)


def _shard(x: torch.Tensor, split: Split, ctx: UlyssesContext) -> torch.Tensor:
    """This rank's share of `x`; a joint stream ('txt+img': a table of the text's rows, then the
    image's) is cut where its first stream ends and each part split as its own stream is."""
    if JOINT not in split.stream:
        return ctx.shard(x, split.dim, split.stream)
    first, second = split.stream.split(JOINT)
    whole = sum(ctx.sizes[first])  # the first stream is split already (at the block list's first block)
    return torch.cat([ctx.shard(x.narrow(split.dim, 0, whole), split.dim, first),
                      ctx.shard(x.narrow(split.dim, whole, x.shape[split.dim] - whole), split.dim, second)], split.dim)


def _gather(x: torch.Tensor, gather: Gather, ctx: UlyssesContext) -> torch.Tensor:
    """The whole of `x` on every rank; a joint stream ('txt+img': this rank's text tokens, then its
    image tokens) gathered stream by stream and joined again in the same order."""
    if JOINT not in gather.stream:
        return ctx.gather(x, gather.dim, gather.stream)
    first, second = gather.stream.split(JOINT)
    held = ctx.held(first)
    return torch.cat([ctx.gather(x.narrow(gather.dim, 0, held), gather.dim, first),
                      ctx.gather(x.narrow(gather.dim, held, x.shape[gather.dim] - held), gather.dim, second)], gather.dim)


def _output_hook(spec: Split | Gather | dict[int, Split | Gather], ctx: UlyssesContext):
    def apply(x: torch.Tensor, s: Split | Gather) -> torch.Tensor:
        if isinstance(s, Gather):
            return _gather(x, s, ctx)
        return _shard(x, s, ctx) if _splits(x, s) else x

    def hook(_module, _args, output):
        if isinstance(spec, dict):
            items = list(output)
            for index, s in spec.items():
                items[index] = apply(items[index], s)
            return type(output)(items)
        return apply(output, spec)

    return hook


def _splits(x: Any, split: Split) -> bool:
    """Whether `split` applies to `x`: a tensor, of the plan's number of dims when it names one."""
    return isinstance(x, torch.Tensor) and (split.dims is None or x.dim() == split.dims)
