"""Sequence-parallel attention for stock diffusers processors, through the attention dispatcher.

Every dispatcher-based processor in diffusers projects Q, K and V, applies its norms and RoPE,
and calls `dispatch_attention_fn(q, k, v, ..., parallel_config=self._parallel_config)`. Each
context-parallel backend (native, flash, cuDNN, sage, ...) then hands (B, S_r, H, D) tensors and
its own kernel (`forward_op`) to `attention_dispatch._templated_context_parallel_attention`. That
one function is routed here when a processor's `_parallel_config` is this transformer's marker;
any other caller (diffusers' own context parallelism included) reaches diffusers' code unchanged.

Here the shards go through CoCoDiff's exchange (flat, TAPA, auto, V-Major's codec; Ulysses x ring)
and the local attention through the backend's own kernel, so a model runs with no family code:

* **Which tokens.** The plan (the class's `_cp_plan`, read as data) splits each stream (`txt`,
  `img`) unevenly and records every rank's share. A call's Q and K/V hold some of the streams
  (joint attention both, Wan's self-attention `img`, LTX's cross-attention K/V `txt`): on a
  module's first call, when the candidate streams disagree about some rank's count, the ranks
  all-gather their counts once and keep the streams that match (then no collective again).
* **Before the split.** A call in a forward pass whose split hooks have not run yet (a text
  refiner over the whole prompt, ahead of the split) holds whole sequences on every rank: it runs
  the backend's kernel as one process does, with no exchange. Every rank runs the same hooks, so
  every rank decides the same (a rank-local token count could not: a whole stream on one rank may
  hold as many tokens as a split one on another).
* **Masks.** A key mask over this rank's keys (Qwen-Image's text mask, LTX's) is all-gathered in
  the order of the gathered keys, per-head masks keep this rank's heads. An S x S self-attention
  mask m_i & m_j over this rank's tokens (HunyuanVideo 1.5's) is its key mask m plus zero rows.
  The processors rebuild their mask at every call from the one the transformer hands every block:
  the gathered mask is kept for the calls of the forward pass built from the same mask arguments.
  A bool mask reaches a kernel that takes only an additive bias (cuDNN's) as 0 / -inf.
* **V-First.** On a module's first call the V it builds is compared with the candidates
  (`to_v(x)`, `[add_v_proj(c), to_v(x)]`, `[to_v(x), add_v_proj(c)]`, `to_v(c)`, V's rows of
  a fused QKV+MLP weight); the ranks agree on the match. From then on a pre-hook projects V, starts
  its exchange, and hands that same V to the processor (each projection returns its result once),
  which spends V's flight computing Q, K, norms and RoPE. A module with no match keeps the plain
  order; a module that does not project V as on its first call is an error, never a wrong image.
  V is projected by calling the projection, so hooks on it (layerwise casting, offloading) run.

**Processors that call SDPA themselves** (`AttnProcessor2_0`, CogVideoX's, Mochi's, ...: older
classes never moved to the dispatcher) are routed too: their class is swapped for a subclass whose
call runs the original under a `TorchFunctionMode` that hands each `F.scaled_dot_product_attention`
((B, H, S, D) q, k, v) to the same entry, with torch's SDPA as the kernel. Which processors call it
is read from their source at `parallelize` (one with neither is refused in one line), and a call
that holds split tokens and made no SDPA call is an error, never a local attention on a shard.

Tested on diffusers 0.42 (see pyproject.toml); a diffusers without this entry point is refused
at `parallelize` with one line.
"""

from __future__ import annotations

import functools
import inspect
import re
from itertools import combinations
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from cocodiff.config.sizes import split_sizes
from cocodiff.errors import UsageError

from .backends import kernel_name
from .core import UlyssesContext

__all__ = ["DispatchedAttention", "check_backends", "install_exchange", "is_attention"]

_ENTRY = "_templated_context_parallel_attention"
_original: Callable[..., Any] | None = None
_float_bias: frozenset[Callable[..., Any]] = frozenset()
"""The backends' kernels that take the mask as an additive bias only (cuDNN's `attn_bias`)."""
_FLOAT_BIAS_OPS = ("_cudnn_attention_forward_op",)
_STREAMS = ("hidden_states", "encoder_hidden_states")
_UNKNOWN = object()


class _Marker:
    """What the stock processors hold as `_parallel_config`: a handle on this transformer's attention."""

    def __init__(self, owner: DispatchedAttention) -> None:
        self.owner = owner


def install_exchange() -> None:
    """Route the dispatcher's context-parallel entry point here (once per process)."""
    global _original, _float_bias
    if _original is not None:
        return
    import diffusers
    from diffusers.models import attention_dispatch

    entry = getattr(attention_dispatch, _ENTRY, None)
    params = set(inspect.signature(entry).parameters) if entry is not None else set()
    if not {"query", "key", "value", "attn_mask", "scale", "forward_op", "_parallel_config"} <= params:
        raise UsageError(f"diffusers {diffusers.__version__} has no attention_dispatch.{_ENTRY}(query, key, value, "
                         f"attn_mask, ..., forward_op, _parallel_config): the stock processors cannot reach the "
                         f"exchange; install a diffusers in pyproject.toml's range")
    _original = entry
    _float_bias = frozenset(op for op in (getattr(attention_dispatch, n, None) for n in _FLOAT_BIAS_OPS) if op is not None)
    setattr(attention_dispatch, _ENTRY, _routed)


def _routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
            return_lse=False, *, forward_op, backward_op=None, _parallel_config=None):
    if isinstance(_parallel_config, _Marker):
        if not _parallel_config.owner.ctx.split:  # whole sequences on every rank: attention as in one process
            return forward_op(None, query, key, value, _as_bias(attn_mask, forward_op, query.dtype), dropout_p, is_causal,
                              scale, enable_gqa, return_lse, _save_ctx=False, _parallel_config=None)
        if is_causal or enable_gqa or return_lse or dropout_p:
            raise UsageError("sequence-parallel attention: causal, GQA, dropout and returned LSE are not supported")
        return _parallel_config.owner.attend(query, key, value, attn_mask, scale, forward_op)
    return _original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                     forward_op=forward_op, backward_op=backward_op, _parallel_config=_parallel_config)


class _ToExchange(TorchFunctionMode):
    """The SDPA calls of a processor that calls it itself, handed to the exchange as the dispatcher's are."""

    def __init__(self, config: _Marker) -> None:
        super().__init__()
        self.config = config
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return _sdpa_routed(self.config, *args, **kwargs)


@torch.compiler.disable
def _sdpa_routed(config: _Marker, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False) -> torch.Tensor:
    """SDPA's (B, H, S, D) call through `_routed`, whose tensors are (B, S, H, D). Run eagerly in a compiled
    block (a graph break): dynamo, tracing the mode's handler, would hand it the exchange's own SDPA call too."""
    from diffusers.models.attention_dispatch import _native_attention_forward_op

    if query.dim() != 4:
        raise UsageError(f"{config.owner.layer}: an SDPA call on {query.dim()}-d queries; (B, H, S, D) only")
    t = (lambda x: x.transpose(1, 2))
    return t(_routed(t(query), t(key), t(value), attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     forward_op=_native_attention_forward_op, _parallel_config=config))


_sdpa_classes: dict[type, type] = {}


def _calls_sdpa(cls: type) -> bool:
    """Whether a processor class's call invokes torch's SDPA in its own source."""
    try:
        return "scaled_dot_product_attention" in inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return False


def _route_sdpa(processor: Any) -> None:
    """Swap a processor that calls SDPA itself for a subclass whose calls reach the exchange (`_ToExchange`)."""
    cls = type(processor)
    routed = _sdpa_classes.get(cls)
    if routed is None:
        call = cls.__call__

        @functools.wraps(call)  # its signature: Attention.forward drops the keyword arguments a processor lacks
        def __call__(self, *args, **kwargs):
            config = self.__dict__.get("_parallel_config")
            if not isinstance(config, _Marker):
                return call(self, *args, **kwargs)
            route = _ToExchange(config)  # named before the block: a graph break inside it (--compile) resumes with it
            with route:
                out = call(self, *args, **kwargs)
            if route.calls == 0 and config.owner.ctx.split:
                raise UsageError(f"{config.owner.layer}: its {cls.__name__} made no SDPA call on split tokens: its "
                                 f"attention cannot be split without a hand-written processor")
            return out

        routed = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                             "__qualname__": cls.__qualname__, "_parallel_config": None, "_sdpa_of": cls})
        _sdpa_classes[cls] = routed
    processor.__class__ = routed


def check_backends(transformer: torch.nn.Module, local: tuple[str, ...]) -> None:
    from diffusers.models.attention_dispatch import (
        _AttentionBackendRegistry as registry,
    )

    active = registry.get_active_backend()[0]
    for path, module in _attention_modules(transformer, local).items():
        processor = module.processor
        if not hasattr(processor, "_parallel_config"):
            if _calls_sdpa(type(processor)):
                continue  # routed by `DispatchedAttention` (`_route_sdpa`): torch's SDPA is its kernel
            raise UsageError(f"{type(transformer).__name__}: {path}'s {type(processor).__name__} calls neither the "
                             f"attention dispatcher nor SDPA, so its attention cannot be split without a hand-written "
                             f"processor")
        backend = getattr(processor, "_attention_backend", None) or active
        if backend not in registry._supports_context_parallel:
            raise UsageError(f"attention backend {getattr(backend, 'value', backend)!r} of {path} has no context-parallel "
                             f"path; use one of {', '.join(sorted(str(getattr(b, 'value', b)) for b in registry._supports_context_parallel))}")


class DispatchedAttention:
    """The stock processors of one transformer, reaching `ctx`'s exchange through the dispatcher."""

    def __init__(self, ctx: UlyssesContext, transformer: torch.nn.Module, local: tuple[str, ...] = (),
                 square_masks: bool = False) -> None:
        """`local`: module paths whose attention runs whole, before the split (left as it is);
        `square_masks`: (S, S) masks are m_i & m_j of a token mask (families.Family.square_masks)."""
        self.square_masks = square_masks
        self._squares_checked: set[str] = set()
        self._heads_checked: set[str] = set()
        """Modules whose per-head mask was found alike over its heads (a ring takes one mask per key)."""
        install_exchange()  # its processors were checked to reach it (`check_backends`, at `parallelize`)
        self.ctx = ctx
        self.transformer = transformer
        self.marker = _Marker(self)
        self.modules = _attention_modules(transformer, local)
        self._saved = {path: m.processor.__dict__.get("_parallel_config") for path, m in self.modules.items()}
        for module in self.modules.values():
            if not hasattr(module.processor, "_parallel_config"):  # it calls SDPA itself (`check_backends`)
                _route_sdpa(module.processor)
            module.processor._parallel_config = self.marker
        self.layer: str | None = None
        """The attention module whose call is in flight."""
        self.construction: dict[str, tuple[str, int] | None] = {}
        """Module -> how its V is built (a candidate's name, head dim), None: plain order."""
        self._probe: dict[str, dict[str, torch.Tensor]] = {}
        self._early: dict[str, Any] = {}
        self._armed: list[tuple[torch.nn.Module, Any, Callable[..., Any]]] = []
        """(projection, its own instance `forward` or None, the armed one) of the call in flight."""
        self._params: dict[str, tuple[str, ...]] = {}
        self._arguments: dict[str, Any] | None = None
        """The named arguments of the attention module's call in flight."""
        self._gathered_mask: tuple[tuple, tuple[torch.Tensor, ...], torch.Tensor] | None = None
        """(key, the mask arguments it was built from, the gathered mask) of the forward pass in flight."""
        self._streams: dict[tuple[str, str], list[tuple[str, ...]]] = {}
        self._held: dict[tuple[str, str], tuple[str, ...]] = {}
        """(module, 'q' or 'kv') -> the streams its call held last (`_tokens`)."""
        self._whole_kv: dict[tuple[str, int], bool] = {}
        """(module, its nth call in a forward pass) -> its K/V are whole on every rank (with `ctx.whole_kv`: `_whole`)."""
        self._nth: dict[str, int] = {}
        """Module -> its calls in the forward pass in flight, less one."""
        self._calls = 0
        self._reached = False
        """Whether an attention call reached the exchange: only ever set, never read in a layer (a value a
        compiled block reads is one of its guards)."""
        self.hooks: list[RemovableHandle] = []
        for path, module in self.modules.items():
            self.hooks.append(module.register_forward_pre_hook(self._before(path, _kind(path)), with_kwargs=True))
            # Not `always_call`: a hook called always is a guard on its handle's id, another in each block
            # (a recompilation per block); a module that raises is cleaned up after by `_checked`.
            self.hooks.append(module.register_forward_hook(self._after(path)))
        self.hooks.append(transformer.register_forward_hook(self._checked, always_call=True))

    def undo(self) -> None:
        self._gathered_mask = None
        for hook in self.hooks:
            hook.remove()
        for path, module in self.modules.items():
            processor = module.processor
            if self._saved[path] is None:
                processor.__dict__.pop("_parallel_config", None)
            else:
                processor._parallel_config = self._saved[path]
            processor.__class__ = getattr(type(processor), "_sdpa_of", type(processor))

    # -- hooks around each attention module ------------------------------------------------
    def _before(self, path: str, kind: str):
        """`kind`: the module's path with its block indices starred, the name it goes by inside compiled
        blocks: every block of a list then reads the same name, so one graph serves them all (a name
        read in a compiled block is a guard). Its state is the same for every block of the list (the
        streams its K/V hold, the order it exchanges in), but for displaced patches' per-module buffers."""
        def hook(module, args, kwargs):
            if torch.compiler.is_compiling():  # compiled blocks: the plain order, masks gathered in their graph
                self.layer = kind if self.ctx.patches is None else path
                return
            self.layer = path
            if path not in self._params:
                self._params[path] = tuple(inspect.signature(module.forward).parameters)
            self._arguments = {**dict(zip(self._params[path], args)), **kwargs}  # what a mask is built from
            if not self.ctx.split or not (self.ctx.v_first or self.ctx.patches is not None):
                return  # before the split: no exchange at all (displaced patches need the joined order: the probe)
            states, context = _inputs(module, args, kwargs)
            how = self.construction.get(path, _UNKNOWN)
            if how is _UNKNOWN:
                self._probe[path] = _candidates(module, states, context)
            elif how is not None and self.ctx.v_first:
                value = self._project_early(module, how, states, context)
                seq = self._chunk(self._tokens(path, "kv", value.shape[1]))
                self._early[path] = self.ctx.exchange.seq_to_head(value, seq, (path, "v", self._call()))
        return hook

    def _after(self, path: str):
        def hook(_module, _args, _output):
            self.layer, self._arguments = None, None
            if torch.compiler.is_compiling():  # nothing probed, armed or sent early in a compiled block
                return
            if self._probe.pop(path, None) is not None:  # never reached the exchange (a local cross-attention)
                self.construction[path] = None
            pending = self._early.pop(path, None)
            if pending is not None:  # started on every rank: finish it on every rank, then stop sending early
                pending.wait()
                self.construction[path] = None
            armed, self._armed = self._armed, []
            unused = [(proj, own) for proj, own, forward in armed if vars(proj).get("forward") is forward]
            for proj, own in unused:
                _restore(proj, own)
            if unused:
                raise RuntimeError(f"V-First: {path} did not project V from its inputs as on its first call")
        return hook

    def _checked(self, _module, _args, _output):
        """The transformer's exit, also where it raised (an attention module's own `_after` then never
        ran): what that call left is finished as `_after` finishes it, on every rank alike."""
        self.layer, self._arguments = None, None
        self._probe.clear()
        early, self._early = list(self._early.values()), {}
        for pending in early:  # started on every rank: finished on every rank
            pending.wait()
        armed, self._armed = self._armed, []
        for proj, own, forward in armed:
            if vars(proj).get("forward") is forward:
                _restore(proj, own)
        self._gathered_mask = None  # the forward pass is over: its mask arguments go
        self._nth.clear()
        self._calls += 1
        if self._calls == 1 and not self._reached:
            raise RuntimeError(f"{type(self.transformer).__name__}: no attention call reached the exchange; "
                               f"its processors bypass the dispatcher's context-parallel path")

    # -- the exchange ----------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None, forward_op: Callable[..., Any]) -> torch.Tensor:
        """(B, S_r, H, D) q, k, v of this rank -> this rank's (B, S_r, H, D) attention output."""
        ctx, layer, heads = self.ctx, self.layer or "attention", q.shape[2]
        self._reached = True
        call = self._call()
        # A module may attend twice a pass (QwenImage 2.1's); in a compiled block, whose name is its list's, the
        # count would differ from block to block (a guard each): there the first call's decision serves.
        nth = 0
        if not torch.compiler.is_compiling():
            nth = self._nth[layer] = self._nth.get(layer, -1) + 1
        if ctx.whole_kv and self._whole((layer, nth), k):  # every rank holds all of K/V: its own queries attend to them
            if not torch.compiler.is_compiling():  # no dict written in a graph: a guard on its size each call
                self._probe.pop(layer, None)
                self.construction[layer] = None
            ctx.ran(kernel_name(forward_op))  # no ring either: every rank holds every key
            return _kernel(forward_op, q, k, v, mask, scale)
        seq_q, seq_kv = self._tokens(layer, "q", q.shape[1]), self._tokens(layer, "kv", k.shape[1])
        chunk_q, chunk_kv = self._chunk(seq_q), self._chunk(seq_kv)
        if layer in self._probe:
            self._settle(layer, v)
        pending_v = self._early.pop(layer, None)
        if pending_v is None:  # plain order: V, then Q and K
            v = ctx.exchange.seq_to_head(v, chunk_kv, (layer, "v", call)).wait()
            q, k = self._start_qk(q, k, chunk_q, chunk_kv, layer, call)()
        else:  # V has travelled while the processor computed Q, K, norms and RoPE
            pending_v.poll()
            finish_qk = self._start_qk(q, k, chunk_q, chunk_kv, layer, call)
            pending_v.issue_all()
            q, k = finish_qk()
            v = pending_v.wait()
        square = self.square_masks and mask is not None and mask.dim() == 4 and seq_q == seq_kv
        if square and layer not in self._squares_checked:  # once per module, agreed by every rank
            self._check_square(layer, mask)
        mask = self._mask(mask, seq_kv, q.shape[0], square)
        rows = None
        if square and mask.dtype != torch.bool:  # a 0/1 bias m_i * m_j (Chroma's): one process's S x S bias, rebuilt
            mask = self._square_bias(mask)
        elif square:
            rows = mask[:, 0, 0]  # (B, S): the keys are the queries (every chunk's, with a ring)
        if ctx.patches is not None:  # the keys and values of the whole sequence, displaced
            k, v, mask = ctx.patches.displace(layer, self._ordered(layer), ctx.sizes, k, v, mask)
        out = self._local(q, k, v, mask, scale, forward_op, seq_kv)
        if rows is not None:  # a query whose own bit is False gets zeros, as in one process (a wholly masked row)
            if ctx.ring is not None:
                rows = rows.split([sum(ctx._chunk(seq_kv, g)) for g in range(ctx.ring.size)], dim=1)[ctx.groups.ring_index]
            out = out.masked_fill(~rows[:, None, :, None], 0.0)  # out: (B, H_r, S, D)
        return ctx.exchange.head_to_seq(out, chunk_q, heads).wait()

    def _square_bias(self, keys: torch.Tensor) -> torch.Tensor:
        """A float S x S mask m_i * m_j of a 0/1 token mask m, from m over every key ((B, h, 1, S)):
        SDPA adds it to the scores, so a query whose own m_i is 0 attends unmasked (no zero row, as
        with a boolean mask); rebuilt whole over this rank's heads, as one process builds it."""
        if self.ctx.ring is not None or self.ctx.patches is not None:
            raise UsageError(f"{self.layer}: a {keys.dtype} S x S mask m_i * m_j adds a different bias to each query's "
                             f"row, which ring blocks and displaced patches do not take (use Ulysses: --plan uN)")
        return keys.transpose(-1, -2) * keys

    def _check_square(self, layer: str, mask: torch.Tensor) -> None:
        ok = _outer(mask).to(device=self.ctx.topology.device, dtype=torch.float64).reshape(1)
        agreed = self.ctx.agree_min(ok, "mask check (all-reduce)")
        if not mask.is_meta and not agreed.item():  # on `meta` (the every-rank stand-in) no values to check
            raise UsageError(f"{layer}: a {tuple(mask.shape)} attention mask that is not m_i & m_j (or a 0/1 "
                                      f"m_i * m_j) of one token mask; query-dependent masks are not supported")
        self._squares_checked.update((layer,) if torch.compiler.is_compiling() else (layer, _kind(layer)))

    def _start_qk(self, q, k, chunk_q, chunk_kv, layer, call):
        if chunk_q == chunk_kv:
            return self.ctx._start_qk(q, k, chunk_q, (layer, "qk", call))
        pending_q = self.ctx.exchange.seq_to_head(q, chunk_q, (layer, "q", call))
        pending_k = self.ctx.exchange.seq_to_head(k, chunk_kv, (layer, "k", call))
        return lambda: (pending_q.wait(), pending_k.wait())

    def _local(self, q, k, v, mask, scale, forward_op, seq_kv) -> torch.Tensor:
        """(B, H_r, S, D) -> attention over every key: the backend's kernel, or the ring's."""
        ring = self.ctx.ring
        if ring is None:
            self.ctx.ran(kernel_name(forward_op))
            t = (lambda x: x.transpose(1, 2))
            return t(_kernel(forward_op, t(q), t(k), t(v), mask, scale))
        self.ctx.ran("ring")
        if scale is not None:
            q = q * (scale * q.shape[-1] ** 0.5)
        blocks = [sum(self.ctx._chunk(seq_kv, g)) for g in range(ring.size)]
        keys = None
        if mask is not None:  # the ring takes one mask per key (B, S): bool (True = attend) or an additive bias
            # Its heads alike: checked on a module's first call (a host read, before the ring posts anything;
            # not on `meta`, where no values are), as the mask is built alike at every call of the model.
            if mask.shape[1] > 1 and self.layer not in self._heads_checked and not mask.is_meta:
                if not torch.equal(mask, mask[:, :1].expand_as(mask)):
                    raise UsageError(f"{self.layer}: a per-head mask that differs between heads cannot run on a ring")
                self._heads_checked.update((self.layer, _kind(self.layer)))
            keys = mask[:, 0, 0]
        masks = list(keys.split(blocks, dim=1)) if keys is not None else [None] * len(blocks)
        return ring.attention(q, k, v, blocks, masks)

    def _mask(self, mask: torch.Tensor | None, seq_kv: list[int], batch: int, square: bool = False) -> torch.Tensor | None:
        """A key mask over this rank's keys -> over every key, in the gathered order, this rank's heads
        (`square`: an S x S mask m_i & m_j, taken as its key mask m). Gathered once per forward pass
        for the calls whose mask is built from the same mask arguments (`_mask_key`)."""
        if mask is None:
            return None
        if mask.shape[0] not in (1, batch):
            raise ValueError(f"{self.layer}: a {tuple(mask.shape)} attention mask for a batch of {batch}: its first dim "
                             f"must be the batch or 1{' (a 2-D mask is (batch, keys))' if mask.dim() == 2 else ''}")
        key = self._mask_key(mask, seq_kv, square)
        if key is not None and self._gathered_mask is not None and self._gathered_mask[0] == key[0]:
            return self._gathered_mask[2]  # built from the same mask arguments as a call before in this pass
        if square:
            mask = mask.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)
        here = seq_kv[self.ctx.groups.sp_index]
        if mask.dim() == 4 and mask.shape[-1] == sum(seq_kv) != here:  # over every key: left whole by the plan
            return self._heads(self._whole_mask(mask, seq_kv))
        if mask.shape[-1] != here:
            raise UsageError(f"{self.layer}: a {tuple(mask.shape)} attention mask is not over this rank's "
                                      f"{here} keys; masks over the whole sequence need a family rule")
        if mask.dim() == 2:
            mask = mask[:, None, None, :]
        if mask.dim() != 4 or mask.shape[-2] != 1:
            raise UsageError(f"{self.layer}: query-dependent attention masks {tuple(mask.shape)} are not supported")
        flag = mask.dtype == torch.bool
        gathered = self._gather(mask.to(torch.uint8) if flag else mask, seq_kv)  # all heads: ranks may hold unequal shares
        gathered = self._heads(gathered.bool() if flag else gathered)
        if key is not None:
            self._gathered_mask = (key[0], key[1], gathered)
        return gathered

    def _heads(self, mask: torch.Tensor) -> torch.Tensor:
        """A (B, h, ., S) mask over every key, this rank's heads of it (all of it when h is 1)."""
        if mask.shape[1] == 1:
            return mask
        heads = split_sizes(mask.shape[1], self.ctx.groups.plan.ulysses)
        u = self.ctx.exchange.topology.rank
        return mask.narrow(1, sum(heads[:u]), heads[u])

    def _whole_mask(self, mask: torch.Tensor, seq_kv: list[int]) -> torch.Tensor:
        """A (B, h, S_q or 1, S) mask over every query and key of one stream, as the transformer hands
        it to every block (an S x S mask an inferred plan leaves whole: AceStep's, Ideogram 4's): after
        the exchange this rank holds every token of its heads in that stream's order, so it applies
        as it is."""
        streams = self._held.get((self.layer, "kv"), ())
        if len(streams) != 1 or self.ctx.ring is not None or self.ctx.patches is not None:
            raise UsageError(f"{self.layer}: a {tuple(mask.shape)} attention mask over the whole sequence runs with "
                             f"Ulysses alone, on one split stream (here {'+'.join(streams) or 'none'}"
                             f"{', with a ring' if self.ctx.ring is not None else ''})")
        return mask

    def _mask_key(self, mask: torch.Tensor, seq_kv: list[int], square: bool) -> tuple[tuple, tuple[torch.Tensor, ...]] | None:
        """What a call's mask is built from: the processor, the token layout, the mask's form, and every
        tensor argument of the module's call but the token streams (their lengths are in the mask's
        shape), each by its storage, place, layout and version; and those arguments. None when no
        argument is a mask (a mask made from something else is gathered at each call).

        Every rank runs the same code on the same call sequence, so every rank passes the same
        objects at the same calls; the cache holds the arguments, so no later tensor can take their
        storage's address. Every rank therefore gathers at the same calls and reuses at the others,
        with no collective to agree on it."""
        arguments = self._arguments
        if arguments is None or self.layer is None or torch.compiler.is_compiling():
            return None  # a compiled block: gathered in its graph, no Python state
        sources = [(n, t) for n, t in arguments.items() if isinstance(t, torch.Tensor) and n not in _STREAMS]
        if not any("mask" in n for n, _ in sources):
            return None
        key = (type(self.modules[self.layer].processor), tuple(seq_kv), tuple(mask.shape), mask.dtype, mask.device, square,
               tuple((n, _storage(t)) for n, t in sources))
        return key, tuple(t for _, t in sources)

    def _gather(self, x: torch.Tensor, seq: list[int]) -> torch.Tensor:
        """Shards along the last dim, `seq[i]` on sequence rank i -> the whole, in sequence order."""
        ctx = self.ctx
        chunk = ctx.exchange.gather_seq(x.contiguous(), -1, self._chunk(seq))
        if ctx.ring is None:
            return chunk
        return ctx.ring.gather(chunk, -1, [sum(ctx._chunk(seq, g)) for g in range(ctx.ring.size)])

    # -- which tokens a call holds ---------------------------------------------------------
    def _chunk(self, seq: list[int]) -> list[int]:
        return self.ctx._chunk(seq, self.ctx.groups.ring_index)

    def _call(self) -> int:
        return self.ctx.vmajor.call if self.ctx.vmajor is not None else 0

    @staticmethod
    def _remember(store: dict[tuple[str, str], Any], layer: str, role: str, value: Any) -> None:
        """`store[(layer, role)] = value`; in an eager call also under the name the module's list goes by
        in compiled blocks (`_kind`), so that their first compiled call finds it (no collective to
        learn it again there, and no guard on a dict that grows)."""
        store[(layer, role)] = value
        if not torch.compiler.is_compiling():
            store[(_kind(layer), role)] = value

    def _tokens(self, layer: str, role: str, length: int) -> list[int]:
        """Tokens per sequence rank of the streams this call's Q ('q') or K/V ('kv') holds."""
        sizes = self.ctx.sizes
        names = sorted(sizes)
        options = self._streams.get((layer, role)) or self._options()
        vectors = [self.ctx.joint_sizes(c) for c in options]
        if len(options) > 1 and all(len(set(at)) == len(at) for at in zip(*vectors)):
            # every rank tells the options apart by its own count (the layout, and so this test, is
            # the same on every rank): no collective
            mine = [c for c, v in zip(options, vectors) if v[self.ctx.groups.sp_index] == length]
            if mine:  # (none: the check below says so)
                options, vectors = mine, [self.ctx.joint_sizes(mine[0])]
                self._remember(self._streams, layer, role, options)
        elif any(v != vectors[0] for v in vectors):  # the same on every rank: the layout is shared knowledge
            counts = self._all_counts(length)
            options = [c for c, v in zip(options, vectors) if v == counts]
            if not options:
                raise RuntimeError(f"{layer}: {role} tokens per rank {counts} match no split stream "
                                   f"({', '.join(f'{s} {sizes[s]}' for s in names)})")
            self._remember(self._streams, layer, role, options)
            vectors = [counts]
        if vectors[0][self.ctx.groups.sp_index] != length:  # e.g. keys of a K/V cache beside the split tokens
            raise UsageError(f"{layer}: {length} {role} tokens here, the split layout says {vectors[0]}: its attention "
                             f"takes tokens the split plan does not hold")
        if self._held.get((layer, role)) != options[0]:  # written when it changes: a compiled block's guard holds
            self._remember(self._held, layer, role, options[0])
        return vectors[0]

    def _ordered(self, layer: str) -> tuple[str, ...]:
        """The streams of a call's K/V in the order the processor joined them: its V's construction
        says (`[add_v_proj(c), to_v(x)]` is text first); V projected from one input that holds both
        streams is FLUX.2's single-stream join, text first."""
        streams = self._held[(layer, "kv")]
        if len(streams) == 1:
            return streams
        how = self.construction.get(layer)
        if how is not None and how[0] == "img_txt":
            return ("img", "txt")
        if how is not None:
            return ("txt", "img")
        raise UsageError(f"--pipe-patches: {layer} joins the text and image streams in an order its V does not tell")

    def _options(self) -> list[tuple[str, ...]]:
        """Every set of the split streams a call's Q or K/V may hold, in name order."""
        names = sorted(self.ctx.sizes)
        return [c for n in range(1, len(names) + 1) for c in combinations(names, n)]

    def _whole(self, layer: tuple[str, int], k: torch.Tensor) -> bool:
        """Whether this call's K/V are whole on every rank (a text no block hands on), once per
        module and call of it in a forward pass. By its key count where no split stream's count on any rank is a whole text's (the
        layout is every rank's knowledge: every rank decides the same); else the ranks all-gather
        their counts: whole if every rank holds a whole text's count, and where a split stream has
        that very count on every rank, the same keys too (a fingerprint of K compared)."""
        if layer not in self._whole_kv:
            layouts = [self.ctx.joint_sizes(streams) for streams in self._options()]
            if not {n for layout in layouts for n in layout} & self.ctx.whole_kv:
                self._keep_whole(layer, k.shape[1] in self.ctx.whole_kv)  # the layout tells every rank alike
                return self._whole_kv[layer]
            counts = self._all_counts(k.shape[1])  # a whole text's count is some split stream's on some rank
            whole = len(set(counts)) == 1 and counts[0] in self.ctx.whole_kv
            if whole and counts in layouts:  # and every rank's: the keys themselves tell
                k64 = k.detach().to(torch.float64)
                mine = torch.stack([k64.sum(), k64.square().sum(), (k64 * torch.arange(k.shape[1], device=k.device,
                                    dtype=torch.float64)[None, :, None, None]).sum()])
                every = self._gather(mine[:, None].to(self.ctx.topology.device), [1] * self.ctx.groups.plan.sp)
                whole = bool((every == every[:, :1]).all())  # (3, sp): one column per rank
            self._keep_whole(layer, whole)
        return self._whole_kv[layer]

    def _keep_whole(self, layer: tuple[str, int], whole: bool) -> None:
        """Keep a whole-K/V decision; the first call's, made eagerly, also under the name its module goes by in a
        compiled block (`_kind`), so that no compiled call all-gathers counts to make it again."""
        self._whole_kv[layer] = whole
        if not torch.compiler.is_compiling() and layer[1] == 0:
            self._whole_kv[(_kind(layer[0]), 0)] = whole

    def _all_counts(self, length: int) -> list[int]:
        """Every sequence rank's `length` (a small all-gather; once per module and role)."""
        t = torch.tensor([length], dtype=torch.int64, device=self.ctx.topology.device)
        sp = self.ctx.groups.plan.sp
        return [int(n) for n in self._gather(t, [1] * sp).tolist()]

    # -- V-First ---------------------------------------------------------------------------
    def _settle(self, layer: str, value: torch.Tensor) -> None:
        """First call of a module: which candidate is the V the processor built (agreed by all ranks)."""
        candidates = self._probe.pop(layer)
        flat = value.flatten(2)
        names = sorted(candidates)
        device = self.ctx.topology.device
        hits = torch.stack([_same_values(candidates[n], flat) for n in names]) if names else torch.zeros(0, device=device)
        hits = hits.to(device=device, dtype=torch.float64)
        if names:
            hits = self.ctx.agree_min(hits, "V-First check (all-reduce)")
        found = [n for n, hit in zip(names, hits.tolist()) if hit]
        self.construction[layer] = (found[0], value.shape[-1]) if found else None

    def _project_early(self, module, how: tuple[str, int], states, context) -> torch.Tensor:
        name, head_dim = how
        if name == "fused":
            rows = _fused_v(module, states)
            self._arm(module.to_qkv_mlp_proj, states, lambda: _fused_rest(module, states, rows))
            return rows.unflatten(-1, (-1, head_dim))
        parts = {"self": lambda: [(module.to_v, states)], "cross": lambda: [(module.to_v, context)],
                 "txt_img": lambda: [(module.add_v_proj, context), (module.to_v, states)],
                 "img_txt": lambda: [(module.to_v, states), (module.add_v_proj, context)]}[name]()
        outs = []
        for proj, x in parts:
            out = proj(x)  # its hooks run (layerwise casting, offloading), as for the processor's own call
            self._arm(proj, x, lambda out=out: out)
            outs.append(out.unflatten(-1, (-1, head_dim)))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    def _arm(self, proj: torch.nn.Module, x: torch.Tensor, result: Callable[[], torch.Tensor]) -> None:
        """`proj(x)` returns `result()` once (the V already sent); any other input runs as usual. A
        `forward` of the instance's own (diffusers' and accelerate's hooks wrap it there) is put back
        after, and was run by the early projection: the processor's call does not run it again."""
        own = vars(proj).get("forward")
        run = own if own is not None else type(proj).forward.__get__(proj)

        def forward(inp, *args, **kwargs):
            if inp is x and not args and not kwargs:
                _restore(proj, own)
                return result()
            return run(inp, *args, **kwargs)

        proj.forward = forward
        self._armed.append((proj, own, forward))


def is_attention(module: torch.nn.Module) -> bool:
    """An attention module: diffusers' (`set_processor`), or one that calls a processor it holds
    without that method (Mochi's `MochiAttention`)."""
    return hasattr(module, "set_processor") or callable(getattr(module, "processor", None))


def _kind(path: str) -> str:
    """A module path with its block indices starred: 'single_transformer_blocks.*.attn'."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)


def _attention_modules(transformer: torch.nn.Module, local: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """Path -> attention module, less those under `local` (named_modules: Z-Image has no `attn_processors`)."""
    return {path: m for path, m in transformer.named_modules() if is_attention(m)
            and not any(path == p or path.startswith(p + ".") for p in local)}


def _kernel(forward_op: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """The backend's kernel over (B, S, H, D) q, k, v as this rank holds them: no dropout, no causal mask."""
    return forward_op(None, q, k, v, _as_bias(mask, forward_op, q.dtype), 0.0, False, scale, False, False,
                      _save_ctx=False, _parallel_config=None)


def _as_bias(mask: torch.Tensor | None, forward_op: Callable[..., Any], dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = attend) as the additive bias, 0 / -inf in `dtype`, of a kernel that takes
    no bool mask (cuDNN's `attn_bias`); any other mask, or for any other kernel, as it is (SDPA takes both)."""
    if mask is None or mask.dtype != torch.bool or forward_op not in _float_bias:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _restore(proj: torch.nn.Module, own: Any) -> None:
    """Put back the `forward` a projection had before it was armed (its class's when None)."""
    if own is None:
        vars(proj).pop("forward", None)
    else:
        proj.forward = own


def _storage(t: torch.Tensor) -> tuple:
    """Where a tensor's values are and how they are read: equal for two live tensors holding the same values."""
    version = 0 if t.is_inference() else t._version  # inference tensors keep no version counter
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device, version)


def _hooked(proj: torch.nn.Module) -> bool:
    """Whether calling `proj` runs more than its class's forward (hooks of torch, or a wrapped `forward`)."""
    return "forward" in vars(proj) or bool(proj._forward_pre_hooks or proj._forward_hooks)


def _outer(mask: torch.Tensor) -> torch.Tensor:
    """Whether a (B, h, S, S) bool mask is m_i & m_j of one token mask m (HunyuanVideo 1.5's, built from the
    local tokens): then it is m as a key mask (every row with a True bit is m) plus zeros for m's False rows;
    or a float mask m_i * m_j of a 0/1 token mask (Chroma's additive one: m is its diagonal). A 0-dim bool
    tensor on the mask's device (no host read)."""
    if mask.shape[-1] != mask.shape[-2]:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    m = mask.diagonal(dim1=-2, dim2=-1)  # (B, h, S)
    if mask.dtype == torch.bool:
        return (mask == (m[..., :, None] & m[..., None, :])).all()
    return ((mask == m[..., :, None] * m[..., None, :]).all() & ((m == 0) | (m == 1)).all())


def _inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(hidden_states, encoder_hidden_states) of an attention module's call."""
    states = kwargs.get("hidden_states", args[0] if args else None)
    context = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
    return states, context if isinstance(context, torch.Tensor) else None


def _candidates(module: torch.nn.Module, states: Any, context: Any) -> dict[str, torch.Tensor]:
    """The ways a processor may build V from the module's inputs, flattened to (B, S, H * D)."""
    out: dict[str, torch.Tensor] = {}
    if not isinstance(states, torch.Tensor):
        return out
    to_v, add_v = getattr(module, "to_v", None), getattr(module, "add_v_proj", None)
    if isinstance(to_v, torch.nn.Linear) and states.shape[-1] == to_v.in_features:
        own = to_v(states)
        out["self"] = own
        if context is not None:
            if context.shape[-1] == to_v.in_features:
                out["cross"] = to_v(context)
            if isinstance(add_v, torch.nn.Linear) and context.shape[-1] == add_v.in_features:
                added = add_v(context)
                out["txt_img"] = torch.cat([added, own], dim=1)
                out["img_txt"] = torch.cat([own, added], dim=1)
    elif (isinstance(getattr(module, "to_qkv_mlp_proj", None), torch.nn.Linear) and hasattr(module, "inner_dim")
          and not _hooked(module.to_qkv_mlp_proj)):  # V's rows alone cannot go through its hooks: the plain order
        out["fused"] = _fused_v(module, states)
    return out


V_MATCH = 0.05
"""How far, relative to V's largest magnitude, a candidate may be from the processor's V and still be
it: the same numbers from another GEMM (a fused projection's rows alone, another cuBLAS kernel, TF32
or bf16 rounding) differ by far less; another candidate (the other stream's tokens, another order
of the streams) by the order of V itself."""


def _same_values(candidate: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """1.0 where `candidate` holds `value`'s numbers up to `V_MATCH` (on the device: no host read), else 0.0."""
    if candidate.shape != value.shape:
        return torch.zeros((), device=value.device)
    if value.numel() == 0:
        return torch.ones((), device=value.device)
    error = (candidate.float() - value.float()).abs().amax()
    return (error <= V_MATCH * value.float().abs().amax()).float()


def _fused_v(module: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """V's rows of a fused [Q, K, V, MLP-in] projection (FLUX.2's single-stream blocks)."""
    proj, inner = module.to_qkv_mlp_proj, module.inner_dim
    bias = proj.bias[2 * inner : 3 * inner] if proj.bias is not None else None
    return F.linear(states, proj.weight[2 * inner : 3 * inner], bias)


def _fused_rest(module: torch.nn.Module, states: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused projection's whole output, its V rows already computed."""
    proj, inner = module.to_qkv_mlp_proj, module.inner_dim
    w, b = proj.weight, proj.bias
    qk = F.linear(states, w[: 2 * inner], b[: 2 * inner] if b is not None else None)
    mlp = F.linear(states, w[3 * inner :], b[3 * inner :] if b is not None else None)
    return torch.cat([qk, v, mlp], dim=-1)
