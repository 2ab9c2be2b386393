"""LoRA adapters (`--lora PATH[:SCALE]`): read and checked before any rank starts, then loaded on
every rank through the pipeline's own diffusers loader (PEFT) and fused into the weights.

Fused, an adapter is part of the weights: every plan, sharded weights, stages, `--compile`, step
caches and V-Major run on them as on any checkpoint, and `verify`'s one-process reference fuses the
same adapters. Each rank fuses on the host when its transformer loads there (before sharding or
cutting stages), on its device otherwise.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError

__all__ = ["Adapter", "AdapterCache", "LORA_FILE", "SCALE_LIMIT", "adapter_cache", "adapter_folder", "adapter_listing",
           "apply_adapters", "check_loader", "find_adapter",
           "has_loader", "make_adapter", "parse_adapters", "use_adapters"]

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The file diffusers' `save_lora_weights` writes in a folder, and its loader looks for."""
SCALE_LIMIT = 4.0
"""A served request's adapter scale at most (in size): past it an adapter is no longer itself."""


@dataclass(frozen=True)
class Adapter:
    path: str
    """A diffusers-format LoRA: a .safetensors file, or a folder holding `LORA_FILE`."""
    scale: float = 1.0

    def record(self) -> dict[str, Any]:
        return {"path": self.path, "scale": self.scale}


def _weights_file(path: Path) -> Path:
    return path / LORA_FILE if path.is_dir() else path


def _parse_one(text: str) -> Adapter:
    path, scale = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass  # a ':' of the path itself
    if not math.isfinite(scale):
        raise UsageError(f"--lora {text}: its scale {tail} must be a finite number")
    found = _weights_file(Path(path))
    if not found.is_file():
        what = f"holds no {LORA_FILE}" if Path(path).is_dir() else "is no such file or folder"
        raise UsageError(f"--lora {path} {what} (a diffusers LoRA: a .safetensors file, or a folder holding {LORA_FILE})")
    try:
        from safetensors import safe_open

        with safe_open(str(found), framework="pt") as weights:
            keys = list(weights.keys())
    except Exception as error:  # safetensors raises its own errors, and OSError
        raise UsageError(f"--lora {path}: {found.name} is not a safetensors file ({str(error).splitlines()[0]})") from None
    if not any("lora" in key for key in keys):
        raise UsageError(f"--lora {path}: {found.name} holds no LoRA weights ({len(keys)} tensors, none named lora_*)")
    return Adapter(str(Path(path)), scale)


def parse_adapters(texts: list[str] | None) -> tuple[Adapter, ...]:
    """`--lora` as given (PATH or PATH:SCALE, repeated), each file found and read as a LoRA."""
    return tuple(_parse_one(text) for text in texts or ())


def adapter_folder(folder: Path) -> dict[str, str]:
    """`serve --lora-dir`: the adapters in `folder`, by name: each subfolder holding `LORA_FILE`
    (named by the subfolder) and each `.safetensors` file (by its stem), each read as `--lora`
    reads one; one line for a folder that is not one or holds none."""
    if not folder.is_dir():
        raise UsageError(f"--lora-dir {folder} is no folder")
    found: dict[str, str] = {}
    for entry in sorted(folder.iterdir()):
        if (entry.is_dir() and (entry / LORA_FILE).is_file()) or (entry.is_file() and entry.suffix == ".safetensors"):
            name = entry.name if entry.is_dir() else entry.stem
            if name in found:
                raise UsageError(f"--lora-dir {folder}: two adapters named {name!r} ({Path(found[name]).name} and {entry.name})")
            found[name] = _parse_one(str(entry)).path
    if not found:
        raise UsageError(f"--lora-dir {folder} holds no adapter (a subfolder with {LORA_FILE}, or a .safetensors file)")
    return found


def _load_each(pipe: Any, adapters: list[tuple[str, str, str]], flag: str) -> None:
    """Load each (name, path, what a message calls it) of `adapters` into `pipe` through its
    diffusers loader, under its name; one line for a pipeline without a loader or an adapter that
    does not fit (`flag`: the option that named them)."""
    if not hasattr(pipe, "load_lora_weights"):
        raise UsageError(f"{flag}: {type(pipe).__name__} has no LoRA loader in diffusers")
    import logging

    loaders = logging.getLogger("diffusers.loaders")
    level = loaders.level
    loaders.setLevel(logging.CRITICAL)  # its failures are raised (below), and an adapter of the transformer alone is no news
    try:
        for name, path, what in adapters:
            try:
                with warnings.catch_warnings():  # PEFT's note that a model holds several adapters: it may here
                    warnings.filterwarnings("ignore", message="Already found a `peft_config`", category=UserWarning)
                    pipe.load_lora_weights(path, adapter_name=name)
            except (RuntimeError, ValueError) as error:  # PEFT's and torch's: modules not found, shapes that differ
                raise UsageError(f"{what} does not fit {type(pipe.transformer).__name__}: {_first_fault(error)}") from None
    finally:
        loaders.setLevel(level)


class AdapterCache:
    """The adapters a server may turn on (`serve --lora-dir`: name -> path), at most `capacity` of
    them loaded (unfused) at a time. A call that needs one that is not loaded loads it then, in place
    of the least recently used one it does not need. Every rank makes the same calls in the same
    order (rank 0 broadcasts them), so every rank's cache makes the same choices with no collective.

    `on_load(name, seconds)` and `on_switch(seconds)` report a load (a miss) and a change of the
    adapters turned on (rank 0's, for /metrics)."""

    def __init__(self, pipe: Any, paths: dict[str, str], capacity: int,
                 on_load: Callable[[str, float], None] | None = None,
                 on_switch: Callable[[float], None] | None = None) -> None:
        self.pipe, self.paths, self.capacity = pipe, dict(paths), capacity
        self.on_load, self.on_switch = on_load, on_switch
        self.loaded: OrderedDict[str, None] = OrderedDict()
        """The adapters loaded now, least recently used first."""
        self.loads = 0
        self._active: tuple[tuple[str, float], ...] | None = None
        self._lock = threading.Lock()  # `listing` is read from the HTTP server's thread

    def start(self) -> AdapterCache:
        """Load every adapter once, so that one that does not fit is one line before serving;
        the last `capacity` of them (by name) stay loaded. Registers the cache for `use_adapters`."""
        on_load, self.on_load = self.on_load, None  # checks, not a request's misses
        for name in sorted(self.paths):
            self._load(name, keep=())
        self.loads, self.on_load = 0, on_load
        if self.loaded:
            self.pipe.disable_lora()
        _CACHES[self.pipe] = self
        return self

    def use(self, chosen: tuple[tuple[str, float], ...]) -> None:
        """Turn on exactly `chosen` ((name, scale), ...), loading what is missing; () turns every one off."""
        started = time.perf_counter()
        names = tuple(name for name, _ in chosen)
        for name in names:
            if name in self.loaded:
                with self._lock:
                    self.loaded.move_to_end(name)
            else:
                self._load(name, keep=names)
        if chosen == self._active:
            return
        _turn_on(self.pipe, chosen)
        self._active = chosen
        if self.on_switch is not None:
            self.on_switch(time.perf_counter() - started)

    def listing(self) -> list[dict[str, Any]]:
        """Every adapter a request may name, and whether it is loaded now."""
        with self._lock:
            loaded, names = set(self.loaded), list(self.paths)
        return adapter_listing(names, loaded)

    def names(self) -> tuple[str, ...]:
        """The adapters a request may name (read from the HTTP server's thread)."""
        with self._lock:
            return tuple(self.paths)

    def add(self, name: str, path: str, keep: tuple[str, ...] = ()) -> None:
        """`POST /v1/loras`: make `name` (at `path`) one a request may name, and load it now in place
        of the least recently used adapter not in `keep` (a running batch's); the adapters turned
        on stay on. An adapter that does not fit: one line, and nothing changes."""
        active = self._active
        known = self.paths.get(name)
        with self._lock:
            self.paths[name] = path
        try:
            if name not in self.loaded or known != path:
                if name in self.loaded:  # the same name, another file: the new one replaces it
                    self._delete(name)
                self._load(name, keep=keep)
        except UsageError:
            with self._lock:
                if known is None:
                    del self.paths[name]
                else:
                    self.paths[name] = known
            raise
        finally:
            self._restore(active)

    def unload(self, name: str) -> None:
        """`DELETE /v1/loras/NAME`: free `name`'s weights on this rank (it stays one a request may
        name, loaded again at such a request's turn); the other adapters turned on stay on."""
        active = self._active
        if name in self.loaded:
            self._delete(name)
        self._restore(tuple(item for item in active if item[0] != name) if active is not None else None)

    def _restore(self, active: tuple[tuple[str, float], ...] | None) -> None:
        """Turn on `active` again after loading or deleting changed PEFT's adapters (None: none was),
        those of them still loaded: an idle server's last batch's may have been evicted, and the next
        call turns on its own (`use`)."""
        kept = tuple(item for item in active or () if item[0] in self.loaded)
        _turn_on(self.pipe, kept)
        self._active = kept if active is not None else None

    def _delete(self, name: str) -> None:
        with warnings.catch_warnings():  # PEFT says which adapter it turns on instead: `use` chooses
            warnings.filterwarnings("ignore", category=UserWarning, module="peft")
            self.pipe.delete_adapters(name)
        with self._lock:
            del self.loaded[name]

    def _load(self, name: str, keep: tuple[str, ...]) -> None:
        while len(self.loaded) >= self.capacity:
            victim = next((n for n in self.loaded if n not in keep), None)
            if victim is None:  # a call needs more than the capacity: it holds them until its next switch
                break
            self._delete(victim)
        started = time.perf_counter()
        _load_each(self.pipe, [(name, self.paths[name], f"--lora-dir: {name} ({self.paths[name]})")], "--lora-dir")
        with self._lock:
            self.loaded[name] = None
        self.loads += 1
        self._active = None  # loading turns the new adapter on
        if self.on_load is not None:
            self.on_load(name, time.perf_counter() - started)


def find_adapter(folder: Path, name: str) -> str | None:
    """`POST /v1/loras`: adapter `name` in `serve --lora-dir` `folder` now, as `adapter_folder`
    finds it (a subfolder holding `LORA_FILE`, or NAME.safetensors) and read as `--lora` reads one
    (a UsageError for a file that is no LoRA); None where the folder has none of that name."""
    for entry in (folder / name, folder / f"{name}.safetensors"):
        if (entry.is_dir() and (entry / LORA_FILE).is_file()) or entry.is_file():
            return _parse_one(str(entry)).path
    return None


def adapter_cache(pipe: Any) -> AdapterCache | None:
    """The `AdapterCache` a server made for `pipe`, if any."""
    return _CACHES.get(pipe)


def adapter_listing(names: Iterable[str], loaded: Container[str] = ()) -> list[dict[str, Any]]:
    """`GET /v1/loras`' entries: each adapter a request may name, by name, and whether it is loaded."""
    return [{"id": name, "object": "lora", "loaded": name in loaded} for name in sorted(names)]


_CACHES: weakref.WeakKeyDictionary[Any, AdapterCache] = weakref.WeakKeyDictionary()
"""A pipeline's `AdapterCache`, where a server made one."""


def use_adapters(pipe: Any, chosen: tuple[tuple[str, float], ...]) -> None:
    """Turn on exactly the adapters `chosen` ((name, scale), ...) of those the pipeline's
    `AdapterCache` loaded, at their scales; () turns every one off; nothing
    where none was loaded (a server without `--lora-dir`, whose requests choose none). Every rank
    calls it with the same choice, at the same point (a served call or a step-level batch's first step)."""
    cache = _CACHES.get(pipe)
    if cache is not None:
        cache.use(chosen)
        return
    _turn_on(pipe, chosen)


def _turn_on(pipe: Any, chosen: tuple[tuple[str, float], ...]) -> None:
    if not getattr(getattr(pipe, "transformer", None), "peft_config", None):
        return
    if not chosen:
        pipe.disable_lora()
        return
    pipe.enable_lora()
    pipe.set_adapters([name for name, _ in chosen], adapter_weights=[scale for _, scale in chosen])


def has_loader(pipeline: str) -> bool:
    """Whether diffusers' pipeline class `pipeline` (or a preset's own: MiniMax-H3's) loads LoRA adapters."""
    import diffusers

    from . import minimax_h3

    cls = getattr(diffusers, pipeline, None) or getattr(minimax_h3, pipeline, None)
    return hasattr(cls, "load_lora_weights")


def check_loader(model: str) -> None:
    """A checkpoint folder's pipeline class loads LoRA adapters (one line otherwise); a hub id is
    checked once loaded."""
    import json

    index = Path(model) / "model_index.json"
    if index.is_file():
        pipeline = json.loads(index.read_text()).get("_class_name", "")
        if not has_loader(pipeline):
            raise UsageError(f"--lora: {model}'s {pipeline} has no LoRA loader in diffusers")


def apply_adapters(pipe: Any, adapters: tuple[Adapter, ...]) -> dict[str, Any] | None:
    """Load `adapters` into `pipe` with diffusers' loader, at their scales, and fuse them into the
    weights (the LoRA layers gone afterwards) -> the run's record: the adapters, the layers they
    changed and the largest relative change of a layer's weight (||dW|| / ||W||). None without adapters."""
    if not adapters:
        return None
    names = [f"adapter{i}" for i in range(len(adapters))]
    _load_each(pipe, [(name, adapter.path, f"--lora {adapter.path}") for name, adapter in zip(names, adapters)], "--lora")
    pipe.set_adapters(names, adapter_weights=[a.scale for a in adapters])
    layers, change = _changes(pipe, names)
    components = [c for c in pipe._lora_loadable_modules if getattr(pipe, c, None) is not None]
    pipe.fuse_lora(components=components, adapter_names=names)
    pipe.unload_lora_weights()  # the LoRA layers go; their sum stays in the weights
    return {"adapters": [a.record() for a in adapters], "layers": layers, "weight_change": change}


def _first_fault(error: BaseException, width: int = 200) -> str:
    """The first line of `error` that says what is wrong (torch's load lists its faults after a heading)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((l for l in lines if l.startswith(("size mismatch", "Target modules", "Missing", "Unexpected"))),
                lines[0] if lines else type(error).__name__)
    return line if len(line) <= width else line[:width - 3] + "..."


def _changes(pipe: Any, names: list[str]) -> tuple[int, float]:
    """(layers the adapters touch, the largest ||dW|| / ||W|| among them), one layer at a time."""
    import torch
    from peft.tuners.lora import LoraLayer

    layers, change = 0, 0.0
    with torch.no_grad():
        for component in pipe._lora_loadable_modules:
            model = getattr(pipe, component, None)
            if not isinstance(model, torch.nn.Module):
                continue
            for module in model.modules():
                if not isinstance(module, LoraLayer):
                    continue
                present = [n for n in names if n in module.lora_A]
                if not present:
                    continue
                layers += 1
                delta = sum(module.get_delta_weight(n).float() for n in present)
                weight = module.get_base_layer().weight.float()
                change = max(change, (delta.norm() / weight.norm().clamp_min(1e-30)).item())
    return layers, change


def make_adapter(pipe: Any, folder: Path, seed: int = 0, rank: int = 4, std: float = 0.02) -> Path:
    """A LoRA of `pipe`'s transformer on its attention projections, random A and B (seeded),
    saved in diffusers' format to `folder` -> its weights file (for tests and the matrix)."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = pipe.transformer
    targets = sorted({name.rsplit(".", 1)[-1] for name, module in transformer.named_modules()
                      if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v")})
    if not targets:
        raise ValueError(f"{type(transformer).__name__} has no to_q, to_k or to_v projections for a LoRA")
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False),
                            adapter_name="made")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if ".made." in name or name.endswith(".made"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    weights = get_peft_model_state_dict(transformer, adapter_name="made")
    transformer.unload_lora()  # the PEFT layers gone: the transformer as it was
    folder.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(folder, transformer_lora_layers=weights)
    return folder / LORA_FILE
