"""Split plans inferred from the model, for a transformer class with no `_cp_plan` and no record.

At its first call the transformer's forward is traced on fake tensors (shapes only, nothing
computed, every hook set aside) with the arguments of that call, and the plan is read from what
its block lists were handed:

* **The block lists** are the transformer's own `ModuleList`s whose blocks hold attention and ran,
  in the order they ran; a list named `*refiner*` runs whole before the split (Z-Image's and
  HunyuanVideo 1.5's refiners), and so does any list inside another module (a text encoder's), or
  a first list whose output the next list's blocks are all handed alike (Kandinsky 5's text blocks).
* **The streams** are what one block hands the next (`hidden_states`, `encoder_hidden_states`):
  an argument of block i that is an output of block i-1, or computed from one and changed from
  block to block. Their token axis is the one before the channels ([B, S, C]; the first for
  [S, B, C]); `encoder_*` / `txt_*` / `text_*` are text, the rest image. They are split at the
  first block of the first list, and the image stream's output (or the two streams joined) is
  gathered at the last block.
* **What else carries tokens**: every other tensor a block is handed (rotary tables, masks,
  per-token modulation) that was made before the split (not computed from a block's output) is
  split at every block, along the axis whose size is a split stream's token count (or the two
  streams' together: a joint table, in the order the blocks join them, seen from their `cat`s).
  The channel axis (last) counts only for masks. A text that no block hands on (the cross-attention
  of Wan-like models) stays whole on every rank, with its masks.

The plan is then checked before any rank runs it: the forward is traced again on fake tensors as
one rank of two holds it (the plan's splits on, attention over its own tokens); a token tensor left
whole, split twice or at the wrong module breaks a shape there, and the output must come back
whole. What cannot be inferred or fails the check is refused in one line naming the module.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle
from torch.utils._pytree import tree_flatten, tree_map

from ..config.sizes import split_sizes
from ..errors import UsageError
from .attention import UlyssesContext
from .attention.dispatch import is_attention
from .families import JOINT, Gather, ModulePlan, Split, block_lists, stream_of
from .hooks import install_split_hooks

__all__ = ["check_plan", "infer_plan", "install_inferred_split", "outside_block_lists", "trace"]

_CATS = {torch.cat, torch.concat, torch.concatenate}


@dataclass
class _Call:
    path: str
    leaves: list[tuple[str, tuple[int, ...] | None, torch.Tensor]]
    """(argument, where in its tuples or None, tensor) the block was handed."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    places: list[int | None] = field(default_factory=list)
    """Where each of `outputs` is in what the block returned: its index there, None for a bare tensor
    (SD3's last block returns (None, hidden_states)) or one held deeper."""


@dataclass
class Trace:
    """What one forward's blocks were handed, and the joins it made (fake tensors)."""

    lists: list[tuple[str, list[_Call]]]
    """(block list path, one call per block in order) of the block lists that ran, in that order."""
    derived: set[int]
    """ids of the tensors computed from a block's output."""
    cats: list[tuple[int, ...]]
    """The sizes along the joined axis of every `cat` the forward made."""
    output: Any
    tail: list[tuple[str, list[torch.Tensor]]] = field(default_factory=list)
    """(name, outputs) of the transformer's own modules but its block lists that ran after the last block."""


def _leaves(value: Any, name: str, at: tuple[int, ...] = ()) -> list[tuple[str, tuple[int, ...] | None, torch.Tensor]]:
    """(argument, where in its tuples or None, tensor) of each tensor an argument holds."""
    if isinstance(value, torch.Tensor):
        return [(name, at or None, value)]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, name, (*at, i))]
    return []


def _flat(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda v: out.append(v) if isinstance(v, torch.Tensor) else None, value)
    return out


class _Flow(TorchFunctionMode):
    """Marks the tensors computed from `derived` ones and records the sizes each `cat` joins."""

    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.split = split
        """Tracing one rank's share under a plan: attention is local, on this rank's tokens (`_local_keys`)."""
        self.derived: set[int] = set()
        self.keep: list[torch.Tensor] = []  # ids stay unique while the trace runs
        self.cats: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.split:
            args, kwargs = _local_keys(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in _CATS:
            tensors = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if tensors and all(isinstance(t, torch.Tensor) and t.dim() for t in tensors):
                self.cats.append(tuple(t.shape[dim] for t in tensors))
        if any(id(t) in self.derived for t in _flat((args, kwargs))):
            for t in _flat(out):
                self.derived.add(id(t))
                self.keep.append(t)
        return out


def _local_keys(query, key, value, attn_mask=None, *rest, **options) -> tuple[tuple, dict]:
    """An SDPA call of a rank's share traced under a plan, its mask over every key (one the plan leaves
    whole: an S x S mask, as attention sees it after the exchange) dropped: this rank's keys are fewer."""
    if attn_mask is None:
        attn_mask = options.pop("attn_mask", None)
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() and attn_mask.shape[-1] not in (1, key.shape[-2]):
        attn_mask = None
    return (query, key, value, attn_mask, *rest), options


@contextmanager
def _hooks_aside(transformer: torch.nn.Module, diffusers_hooks: bool = False) -> Iterator[None]:
    """Every module's forward hooks (and the processors' parallel configs, and a family's
    hand-written processors for the stock ones) set aside: the trace runs the model as diffusers
    wrote it, and hooks registered meanwhile go with the trace."""
    names = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
             "_forward_hooks_always_called")
    saved = []
    for module in transformer.modules():
        saved.append((module, {n: getattr(module, n) for n in names if hasattr(module, n)}))
        for n in saved[-1][1]:
            setattr(module, n, type(getattr(module, n))())
    compiled = [(m, m.__dict__["_compiled_call_impl"]) for m in transformer.modules()
                if m.__dict__.get("_compiled_call_impl") is not None]  # blocks compiled under --compile: run eager
    for module, _ in compiled:
        module._compiled_call_impl = None
    forwards = [(m, vars(m).pop("forward")) for m in transformer.modules()
                if "forward" in vars(m) and not (diffusers_hooks and getattr(m, "_diffusers_hook", None) is not None)]
    # a block's forward put on the instance (--compile's compiled one, which fake tensors would reach
    # as real ones and crash in its kernels; V-First's): its class's. With `diffusers_hooks`, diffusers'
    # own stay (the layerwise casting of `--quantize float8storage`: its weights cast to their
    # compute dtype as they run, on real tensors)
    configs = [(p, p.__dict__["_parallel_config"]) for m in transformer.modules()
               if (p := getattr(m, "processor", None)) is not None and "_parallel_config" in p.__dict__]
    for processor, _ in configs:
        processor._parallel_config = None
    written = [(m, p) for m in transformer.modules() if getattr(p := getattr(m, "processor", None), "stock", None) is not None]
    for module, processor in written:
        module.processor = processor.stock
    try:
        yield
    finally:
        for module, processor in written:
            module.processor = processor
        for module, hooks in saved:
            for n, value in hooks.items():
                setattr(module, n, value)
        for processor, config in configs:
            processor._parallel_config = config
        for module, impl in compiled:
            module._compiled_call_impl = impl
        for module, forward in forwards:
            module.forward = forward


@contextmanager
def _shadow(transformer: torch.nn.Module, mode: Any = None) -> Iterator[torch.nn.Module]:
    """A copy of `transformer` sharing its parameters and buffers, without its hooks, compiled calls
    and parallel configs, to trace: what a module keeps as it runs (a rotary table's cache) stays in
    the copy, and the caches of the functions its modules call are emptied after, so no fake tensor
    is left for the real forward. Under a fake `mode`, a parameter sharded over a node's ranks
    (`--shard-weights`: FSDP2's DTensor, gathered by hooks the trace sets aside) is a fake tensor of
    its whole shape, and one stored in float8 (`--quantize float8storage`, whose casting hooks the
    trace sets aside) a fake tensor of the dtype it computes in: shapes are all a trace reads. On
    real tensors diffusers' own hooks stay, that casting among them, and sharded weights are
    gathered whole for the trace by FSDP2 (`_unsharded`): a forward that reads values holds the
    whole transformer's weights while it is traced, once."""
    from torch.distributed.tensor import DTensor

    compute = next((p.dtype for p in transformer.parameters() if p.is_floating_point() and p.dtype not in _FLOAT8),
                   torch.float32)

    def held(t: torch.Tensor) -> torch.Tensor:
        dtype = compute if t.dtype in _FLOAT8 else t.dtype  # a weight stored in float8 (layerwise casting, set
        if mode is _META:                                   # aside) as the dtype it computes in
            whole = torch.empty(t.shape, dtype=dtype, device="meta")
        elif mode is None or not (isinstance(t, DTensor) or t.dtype in _FLOAT8):
            return t
        else:
            with mode:
                whole = torch.empty(t.shape, dtype=dtype, device=t.device)
        return torch.nn.Parameter(whole, requires_grad=False) if isinstance(t, torch.nn.Parameter) else whole

    with ExitStack() as aside:
        if mode is None:  # real tensors: sharded weights gathered whole by FSDP2 itself, every rank alike
            aside.enter_context(_unsharded(transformer))
        aside.enter_context(_hooks_aside(transformer, diffusers_hooks=mode is None))
        try:
            traced = copy.deepcopy(transformer, {id(t): held(t) for t in (*transformer.parameters(), *transformer.buffers())})
            aside.close()  # the copy holds none of them: the original has its own back
        except Exception:  # noqa: BLE001 - a module that cannot be copied (FSDP2's): traced as it is, its hooks
            traced = transformer  # aside till then, its sharded parameters swapped for whole fake ones
            swapped = [(m, n, p) for m in transformer.modules() for n, p in m._parameters.items() if isinstance(p, DTensor)]
            for module, name, parameter in swapped:
                module._parameters[name] = held(parameter)
            aside.callback(lambda: [module._parameters.__setitem__(name, parameter) for module, name, parameter in swapped])
        try:
            yield traced
        finally:
            _clear_caches(traced)


@contextmanager
def _unsharded(transformer: torch.nn.Module) -> Iterator[None]:
    """Inside: the FSDP2-sharded modules of `transformer` (`--shard-weights`) hold their whole
    parameters, gathered as FSDP2 gathers them for a forward (on every rank, in module order), and
    sharded again after; nothing where none is sharded."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in transformer.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in reversed(sharded):
            module.reshard()


def _clear_caches(transformer: torch.nn.Module) -> None:
    """Empty the `functools` caches of the modules' classes and of the files that define them."""
    owners: dict[int, Any] = {}
    for module in transformer.modules():
        for owner in (sys.modules.get(type(module).__module__), type(module)):
            if owner is not None:
                owners[id(owner)] = owner
    for owner in owners.values():
        for value in list(vars(owner).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and hasattr(value, "cache_info"):
                clear()


def _fake(mode: Any, value: Any) -> Any:
    return tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, value)


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


_VALUE_READS = ("DataDependentOutputException", "DynamicOutputShapeException")
"""What a fake tensor raises where the forward reads values (`.item()`, `nonzero`, `repeat_interleave` by a
tensor): such a forward is traced on its real arguments instead."""


def trace(transformer: torch.nn.Module, args: tuple, kwargs: dict, plan: dict[str, ModulePlan] | None = None,
          share: tuple[int, int] = (0, 1)) -> Trace:
    """One forward of `transformer` on tensors shaped as `args` / `kwargs` with no values, as rank
    `share[0]` of `share[1]` holds it under `plan` (None: no split): on a copy of it on `meta`, or
    where that fails (a tensor the forward makes on the CPU meets one on `meta`), on fake tensors. A
    forward that reads its tensors' values runs on the real ones (`_VALUE_READS`): one forward's
    compute, once."""
    if _on_meta(transformer, args, kwargs):  # shapes are all there is already
        return _trace(transformer, args, kwargs, plan, share, how="real")
    try:  # a copy on `meta` first: a tenth of fake tensors' cost per op, where the forward runs there
        return _trace(transformer, args, kwargs, plan, share, how="meta")
    except _NotOnMeta:  # a tensor it makes on the CPU meets a meta one, an op with no meta kernel, a value read
        pass
    try:
        return _trace(transformer, args, kwargs, plan, share, how="fake")
    except _ValueRead:
        return _trace(transformer, args, kwargs, plan, share, how="real")


def _on_meta(transformer: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the transformer's weights and the call's tensors are all on `meta` (the stand-in for a
    device, `cocodiff footprint`), none of them sharded or stored in float8."""
    from torch.distributed.tensor import DTensor

    tensors = [*transformer.parameters(), *transformer.buffers(),
               *(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))]
    return all(t.device.type == "meta" and not isinstance(t, DTensor) and t.dtype not in _FLOAT8 for t in tensors)


class _ValueRead(Exception):
    pass


class _NotOnMeta(Exception):
    pass


_META = object()
"""`_shadow`'s mode for a copy whose parameters and buffers are empty tensors on `meta`."""


def _trace(transformer: torch.nn.Module, args: tuple, kwargs: dict, plan: dict[str, ModulePlan] | None,
           share: tuple[int, int], how: str) -> Trace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    name = type(transformer).__name__
    calls: dict[str, list[_Call]] = {}
    order: list[str] = []
    flow = _Flow(split=plan is not None)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs what fails on fake tensors: we name it
    level, quiet.level = quiet.level, logging.CRITICAL
    with ExitStack() as stack:
        mode = FakeTensorMode(allow_non_fake_inputs=True) if how == "fake" else _META if how == "meta" else None
        transformer = stack.enter_context(_shadow(transformer, mode))
        if how == "fake":
            stack.enter_context(mode)
            args, kwargs = _fake(mode, args), _fake(mode, kwargs)
        elif how == "meta":
            args, kwargs = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (args, kwargs))
        tail: list[tuple[str, list[torch.Tensor]]] = []
        lists = block_lists(transformer)
        for path, blocks in lists:
            for index, block in enumerate(blocks):
                _watch(block, f"{path}.{index}", path, calls, order, flow)
                block.register_forward_pre_hook(lambda *_: tail.clear())
        for child, module in transformer.named_children():
            if child not in dict(lists) and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                module.register_forward_hook(lambda _m, _a, out, child=child: tail.append((child, _flat(out))))
        if plan is not None:
            install_split_hooks(transformer, plan, _OneShare(*share))
        try:
            with flow, torch.no_grad():  # the class's forward: not one a CFG group or a stage put on the instance
                output = type(transformer).forward(transformer, *args, **kwargs)
        except UsageError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure of the model on fake tensors, named
            if how == "meta":
                raise _NotOnMeta from None
            if how == "fake" and type(error).__name__ in _VALUE_READS:
                raise _ValueRead from None
            what = "under its inferred split plan" if plan is not None else f"on {how} tensors"
            raise UsageError(f"{name}: no split plan could be inferred: its forward fails {what}: "
                             f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
        finally:
            quiet.setLevel(level)
    return Trace([(path, calls[path]) for path in order], flow.derived, flow.cats, output, tail)


def _watch(block: torch.nn.Module, path: str, owner: str, calls: dict[str, list[_Call]], order: list[str],
           flow: _Flow) -> None:
    params = list(inspect.signature(block.forward).parameters)

    def before(_module, args, kwargs):
        bound = {**dict(zip(params, args)), **kwargs}
        if owner not in calls:
            calls[owner] = []
            order.append(owner)
        calls[owner].append(_Call(path, [leaf for n, v in bound.items() for leaf in _leaves(v, n)]))

    def after(_module, _args, _kwargs, output):
        call = calls[owner][-1]
        call.outputs = _flat(output)
        if isinstance(output, torch.Tensor):
            call.places = [None]
        else:
            call.places = [i if isinstance(v, torch.Tensor) else None for i, v in enumerate(output) for _ in _flat(v)]
        for t in calls[owner][-1].outputs:
            flow.derived.add(id(t))
            flow.keep.append(t)

    block.register_forward_pre_hook(before, with_kwargs=True)
    block.register_forward_hook(after, with_kwargs=True)


class _OneShare:
    """What the split hooks need of a context, as one rank of `world` holds the tokens (the check)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.sizes: dict[str, list[int]] = {}

    def new_forward(self) -> None:
        self.sizes.clear()

    def shard(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        sizes = split_sizes(x.shape[dim], self.world)
        self.sizes[stream] = sizes
        return x.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])

    def held(self, stream: str) -> int:
        return self.sizes[stream][self.rank]

    def gather(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = sum(self.sizes[stream])
        return x.new_zeros(shape)


def infer_plan(transformer: torch.nn.Module, args: tuple, kwargs: dict, whole: set[int] | None = None) -> dict[str, ModulePlan]:
    """The split plan of `transformer` read from one traced forward with these arguments, checked
    (`check_plan`); a one-line UsageError naming the module where it cannot be inferred. `whole`
    gets the token counts of the texts the blocks are handed whole (cross-attention's keys)."""
    name = type(transformer).__name__
    seen = trace(transformer, args, kwargs)
    if not seen.lists:
        raise UsageError(f"{name}: no split plan could be inferred: none of its own block lists with attention ran")
    seen.lists = _past_refiners(seen.lists, seen.derived)
    plan: dict[str, ModulePlan] = {}
    first_path, first_calls = seen.lists[0]
    batch = _batch(args, kwargs)
    streams = _streams(name, first_calls, seen.derived, batch)
    sizes = {stream: tensor.shape[dim] for stream, (_, tensor, dim) in streams.items()}
    if "txt" not in sizes:  # a text every block is handed whole: split too where attention joins it to the image
        sizes.update(_joined_text(first_calls[0], sizes["img"], seen))
    joint = _joint_order(sizes, seen.cats)
    tokens_first = streams["img"][2] == -3  # the streams hold their tokens first ([S, B, C])
    plan[f"{first_path}.0"] = ModulePlan(inputs={n: Split(dim, s) for s, (n, _, dim) in streams.items()})
    for path, calls in seen.lists:
        chained = _chained(calls, seen.derived)
        shared: dict[str, Split] = {}
        for arg, item, tensor in calls[0].leaves:
            if arg in chained and path != first_path and item is None and id(tensor) not in seen.derived:
                # a stream this list hands on that no block before made (Wan VACE's main blocks, after
                # its VACE blocks ran on the control stream): split at its first block
                split = _token_axis(name, f"{path}.0", arg, tensor, sizes, joint, tokens_first, batch)
                if split is not None:
                    plan.setdefault(f"{path}.0", ModulePlan(inputs={})).inputs[arg] = Split(split.dim, split.stream)
                continue
            if arg in chained or id(tensor) in seen.derived:
                continue  # a stream handed on, or computed from one: split already
            split = _token_axis(name, f"{path}.0", arg, tensor, sizes, joint, tokens_first, batch)
            if split is None:
                continue
            if arg in shared and shared[arg] != split:
                raise UsageError(f"{name}: no split plan could be inferred: {path}.0's {arg!r} holds tensors split "
                                 f"along different axes")
            shared[arg] = split
        if shared:
            plan[f"{path}.*"] = ModulePlan(inputs=shared)
    last_path, last_calls = seen.lists[-1]
    gather = _gather(name, last_calls[-1], *streams["img"][1:], sizes, joint)
    plan[last_calls[-1].path] = ModulePlan(output=gather)
    try:
        check_plan(transformer, plan, args, kwargs, seen.output)
    except UsageError:
        later = _gather_later(seen, gather, *streams["img"][1:])
        if later is None:
            raise
        plan.pop(last_calls[-1].path)  # the joint stream split to the end, the image gathered past the blocks
        plan[later] = ModulePlan(output=Gather(streams["img"][2], "img"))
        check_plan(transformer, plan, args, kwargs, seen.output)
    if whole is not None and "txt" not in sizes:  # what the blocks are handed, or the forward itself
        given = [leaf for name, value in kwargs.items() for leaf in _leaves(value, name)] + first_calls[0].leaves
        whole.update(_text_counts(given))
    return plan


def _past_refiners(lists: list[tuple[str, list[_Call]]], derived: set[int]) -> list[tuple[str, list[_Call]]]:
    """The block lists from the first one whose stream goes on to the next list block by block:
    a list before it whose output every block of the next is handed alike (Kandinsky 5's text
    blocks, whose text its visual blocks attend to), or handed as its text only (FLUX.3's text-mode
    blocks), refines that input and runs whole, as a `*refiner*` list does (its attention before
    the split runs as in one process: dispatch.py)."""
    while len(lists) > 1:
        (_, calls), (_, following) = lists[0], lists[1]
        made = {id(t) for t in calls[-1].outputs}
        handed = [arg for arg, _, t in following[0].leaves if id(t) in made or id(t) in derived]
        text = all(stream_of(arg, "", {}) == "txt" for arg in handed)  # FLUX.3's text-mode blocks: their
        # output is the next list's text, whatever they call it
        if not handed or not text and any(arg in _chained(following, derived) for arg in handed):
            break
        lists = lists[1:]
    return lists


def _batch(args: tuple, kwargs: dict) -> int:
    """The call's batch: its `hidden_states`' (or first tensor's) leading size."""
    first = kwargs.get("hidden_states", next(iter(_flat((args, kwargs))), None))
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1


def _streams(name: str, calls: list[_Call], derived: set[int], batch: int) -> dict[str, tuple[str, torch.Tensor, int]]:
    """The first list's streams: stream -> (argument, its tensor at the first block, token axis).
    The token axis is the one before the channels ([B, S, C]), or the first ([S, B, C]: ERNIE-Image's)."""
    chained = _chained(calls, derived)
    streams: dict[str, tuple[str, torch.Tensor, int]] = {}
    for arg, item, tensor in calls[0].leaves:
        if arg not in chained or item is not None:
            continue
        if tensor.dim() != 3:
            raise UsageError(f"{name}: no split plan could be inferred: {calls[0].path}'s {arg!r} is handed on from "
                             f"block to block but is not [batch, tokens, channels] ({list(tensor.shape)})")
        stream = stream_of(arg, "", {})
        if stream in streams:
            raise UsageError(f"{name}: no split plan could be inferred: {calls[0].path} hands on two {stream} streams "
                             f"({streams[stream][0]!r}, {arg!r})")
        first = tensor.shape[1] == batch and tensor.shape[0] != batch  # tokens first
        streams[stream] = (arg, tensor, -3 if first else -2)
    if "img" not in streams:
        raise UsageError(f"{name}: no split plan could be inferred: {calls[0].path} hands on no image stream "
                         f"(arguments {', '.join(repr(a) for a, _, _ in calls[0].leaves)})")
    return streams


def _joined_text(call: _Call, image: int, seen: Trace) -> dict[str, int]:
    """{'txt': its tokens} when the text a block is handed (not from the block before) is joined to
    the image (a `cat` of the two: PRX's attention over [text, image]), so it is split as a stream;
    {} when it is only attended to (cross-attention: whole on every rank)."""
    texts = _text_counts(call.leaves)
    joined = [n for n in texts if (n, image) in seen.cats or (image, n) in seen.cats]
    return {"txt": joined[0]} if len(joined) == 1 else {}


def _text_counts(leaves: list[tuple[str, tuple[int, ...] | None, torch.Tensor]]) -> set[int]:
    """The token counts of the texts among `leaves` (named as text, [..., tokens, channels])."""
    return {t.shape[-2] for arg, _, t in leaves if stream_of(arg, "", {}) == "txt" and t.dim() >= 3}


def _chained(calls: list[_Call], derived: set[int]) -> set[str]:
    """The arguments a block of the list is handed from the block before it: its output, or a tensor
    computed from a block's output that is not what the block before was handed (Wan-Animate adds
    its face adapter's output between two blocks; a refined text handed alike to every block is not)."""
    if len(calls) < 2:  # one block: the arguments shaped as its outputs
        return {arg for arg, _, t in calls[0].leaves if any(t.shape == o.shape for o in calls[0].outputs)} \
            if calls else set()
    outputs = {id(t) for t in calls[0].outputs}
    before = {(arg, item): t for arg, item, t in calls[0].leaves}
    return {arg for arg, item, t in calls[1].leaves
            if id(t) in outputs or (id(t) in derived and before.get((arg, item)) is not t)}


def _joint_order(sizes: dict[str, int], cats: list[tuple[int, ...]]) -> str | None:
    """'txt+img' or 'img+txt': how the forward joins its two streams (None: one stream, or never joined)."""
    if len(sizes) < 2:
        return None
    txt, img = sizes["txt"], sizes["img"]
    orders = {"txt+img" for c in cats if c == (txt, img)} | {"img+txt" for c in cats if c == (img, txt)}
    return orders.pop() if len(orders) == 1 else None


def _token_axis(name: str, path: str, arg: str, tensor: torch.Tensor, sizes: dict[str, int],
                joint: str | None, tokens_first: bool, batch: int) -> Split | None:
    """How a tensor made before the split and handed to every block is split (None: no token axis)."""
    if stream_of(arg, "", {}) == "txt" and "txt" not in sizes:
        return None  # the text no block hands on (cross-attention's): whole on every rank
    by_size: dict[int, list[str]] = {}
    for stream, n in sizes.items():
        by_size.setdefault(n, []).append(stream)
    if len(sizes) == 2:
        by_size.setdefault(sum(sizes.values()), []).append(joint or "?")
    masks = "mask" in arg or (tensor.dim() == 2 and tensor.shape[0] == batch and any(k in arg for k in ("rotary", "rope")))
    # its last axis counts too: a mask's keys, or a rotary embedding's [B, S] positions (Allegro's)
    axes = [d for d in range(tensor.dim()) if tensor.shape[d] in by_size and (masks or d < tensor.dim() - 1)
            and not (tensor.dim() > 2 and d == 0 and not tokens_first)]  # a first axis of 3 or more is the batch's
    # (unless the streams hold their tokens first: ERNIE-Image's [S, B, C])
    if not axes:
        return None
    what = f"{path}'s {arg!r} {list(tensor.shape)}"
    if masks and len(sizes) == 1 and axes == [tensor.dim() - 2, tensor.dim() - 1]:
        return None  # an S x S mask of the one stream: whole on every rank, as attention sees it after the exchange
    if len(axes) > 1:
        raise UsageError(f"{name}: no split plan could be inferred: {what} has more than one axis the size of a "
                         f"stream's tokens ({sizes})")
    streams = by_size[tensor.shape[axes[0]]]
    if len(streams) > 1:
        named = stream_of(arg, "", {})
        if named not in streams:
            raise UsageError(f"{name}: no split plan could be inferred: {what}: its tokens could be either stream's "
                             f"({sizes})")
        streams = [named]
    if streams[0] == "?":
        raise UsageError(f"{name}: no split plan could be inferred: {what} holds both streams' tokens, but the "
                         f"forward never joins them in one order")
    return Split(axes[0] - tensor.dim(), streams[0], tensor.dim())


def _gather(name: str, call: _Call, img: torch.Tensor, dim: int, sizes: dict[str, int],
            joint: str | None) -> Gather | dict[int, Gather]:
    """The last block's image output gathered: the one shaped as the image stream, else the one
    holding both streams' tokens joined (FLUX.2's single-stream blocks), gathered stream by stream."""
    stream = "img"
    matches = [i for i, t in enumerate(call.outputs) if t.shape == img.shape]
    if not matches and joint is not None:
        both = list(img.shape)
        both[dim] = sum(sizes.values())
        matches, stream = [i for i, t in enumerate(call.outputs) if list(t.shape) == both], joint
    if len(matches) != 1:
        raise UsageError(f"{name}: no split plan could be inferred: {call.path} returns {len(matches)} tensors shaped "
                         f"as the image stream {list(img.shape)}")
    place = call.places[matches[0]]
    return Gather(dim, stream) if place is None else {place: Gather(dim, stream)}


def _gather_later(seen: Trace, gather: Gather | dict[int, Gather], img: torch.Tensor, dim: int) -> str | None:
    """Where the image stream is gathered when the last block returns the joint stream and the forward
    cuts the text off by its own count (Chroma's, AuraFlow's `[:, encoder_hidden_states.shape[1]:]`,
    this rank's share after the split): the first of the transformer's modules past the blocks that
    returns the image stream alone (its output norm), as FLUX.1's written plan gathers at `proj_out`."""
    stream = (gather if isinstance(gather, Gather) else next(iter(gather.values()))).stream
    if JOINT not in stream:
        return None
    for child, outputs in seen.tail:
        if len(outputs) == 1 and outputs[0].dim() == img.dim() and outputs[0].shape[dim] == img.shape[dim]:
            return child
    return None


def check_plan(transformer: torch.nn.Module, plan: dict[str, ModulePlan], args: tuple, kwargs: dict,
               whole: Any | None = None) -> None:
    """Trace the forward as one rank of two holds it under `plan`: a token tensor left whole, or
    split at the wrong module, breaks a shape; the output must come back as one process makes it."""
    name = type(transformer).__name__
    if whole is None:
        whole = trace(transformer, args, kwargs).output
    split = trace(transformer, args, kwargs, plan, share=(1, 2)).output
    got, want = [list(t.shape) for t in _flat(split)], [list(t.shape) for t in _flat(whole)]
    if got != want:
        raise UsageError(f"{name}: its inferred split plan gives an output shaped {got}, not {want}")


def install_inferred_split(transformer: torch.nn.Module, ctx: UlyssesContext, inferred: dict[str, Any],
                           live: Callable[[], bool] | None = None) -> list[RemovableHandle]:
    """The split hooks of a plan inferred at the transformer's first call (engine/plan_inference.py): a
    pre-hook infers it from that call's arguments (the same on every rank: every rank is handed the
    same shapes), then installs it for that call and the rest, and records it in `inferred['plan']`."""
    hooks: list[RemovableHandle] = []

    def infer(module, args, kwargs):
        hooks.remove(first)
        first.remove()
        inferred["plan"] = infer_plan(module, args, kwargs, ctx.whole_kv)  # and a text handed whole to every block
        hooks.extend(install_split_hooks(module, inferred["plan"], ctx, live))
        ctx.new_forward()  # the pre-hook just installed runs from the next call

    first = transformer.register_forward_pre_hook(infer, with_kwargs=True, prepend=True)
    hooks.append(first)
    return hooks


def outside_block_lists(transformer: torch.nn.Module) -> tuple[str, ...]:
    """The attention modules outside the block lists a plan is inferred for (a text refiner inside an
    embedder, a list named `*refiner*`): they run whole on every rank, before the split, with their
    own processors."""
    lists = tuple(path for path, _ in block_lists(transformer))
    return tuple(path for path, m in transformer.named_modules() if is_attention(m)
                 and not any(path.startswith(p + ".") for p in lists))
