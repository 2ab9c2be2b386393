"""Quantized transformer weights (`--quantize MODE`, LOSSY) through torchao, or stored in fp8
through diffusers' layerwise casting.

Every `nn.Linear` of the transformer (and of its experts) gets torchao's quantized weight once the
pipeline has loaded and any `--lora` is fused, before sharding or cutting stages: each rank holds
the same quantized weights, so every plan runs on them as on any checkpoint. `float8storage`
instead keeps the weights of the layers diffusers casts (linear and convolution layers outside
the model's norms and patch and position embeddings) in float8 e4m3, each cast back to the run's
dtype as its layer runs (`ModelMixin.enable_layerwise_casting`). The activations, and
with them everything the ranks exchange, keep the run's dtype. `verify` holds the run against the
unquantized one-process run: the error it reports is what quantizing costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

__all__ = ["MODES", "QuantMode", "apply_quantize", "check_quantize", "store_float8"]


@dataclass(frozen=True)
class QuantMode:
    config: str
    """torchao's config class (`torchao.quantization`)."""
    what: str
    fp8_compute: bool = False
    """The matmul itself runs in fp8: a GPU with fp8 tensor cores (compute capability 8.9 or more)."""
    dynamic: bool = False
    """The activations are rounded too, as each call meets them: how the ranks split the work
    changes what a rounding sees, so a run is not exact against one process on the same weights
    (measured: int8dq on tiny-flux under u2, 4e-3 relative)."""
    layerwise: bool = False
    """Stored in float8 by diffusers' layerwise casting (no torchao; `config` unused): each layer's
    weights cast to the run's dtype as it runs, and back."""


MODES: dict[str, QuantMode] = {
    "int8wo": QuantMode("Int8WeightOnlyConfig", "int8 weights per output channel, compute in the run's dtype"),
    "int8dq": QuantMode("Int8DynamicActivationInt8WeightConfig", "int8 weights and int8 activations quantized per token",
                        dynamic=True),
    "float8wo": QuantMode("Float8WeightOnlyConfig", "float8 (e4m3) weights per output channel, compute in the run's dtype"),
    "float8dq": QuantMode("Float8DynamicActivationFloat8WeightConfig",
                          "float8 weights and activations quantized per tensor, fp8 matmuls", fp8_compute=True,
                          dynamic=True),
    "float8storage": QuantMode("", "float8 (e4m3) storage of the linear and convolution weights, each layer cast "
                                   "to the run's dtype as it runs (diffusers' layerwise casting)", layerwise=True),
}
"""`--quantize`'s modes, by the names diffusers' TorchAoConfig gives them."""


def _torchao() -> Any:
    """torchao's quantization module (its import notices: run/quiet.py)."""
    try:
        import torchao.quantization as quantization
    except ImportError:
        raise UsageError("--quantize needs torchao (pip install torchao)") from None
    return quantization


def check_quantize(mode: str | None, device: Any = None, text_encoders: bool = False) -> None:
    """`mode` runs on `device` (one line otherwise; None: the ranks' first accelerator, else the CPU:
    `first_device`): torchao is there, and fp8 matmuls have a GPU that does them; `text_encoders`
    (`--quantize-text-encoders`) takes its mode."""
    if mode is None:
        if text_encoders:
            raise UsageError("--quantize-text-encoders quantizes the text encoders in --quantize's mode: give "
                             f"--quantize MODE too (one of {', '.join(MODES)})")
        return
    if mode not in MODES:
        raise UsageError(f"--quantize {mode}: no such mode (one of {', '.join(MODES)})")
    if not MODES[mode].layerwise:
        _torchao()
    if MODES[mode].fp8_compute:
        import torch

        from ..distributed.devices import first_device

        device = device if device is not None else first_device()
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            name = "the CPU" if device.type != "cuda" else torch.cuda.get_device_name(device)
            raise UsageError(f"--quantize {mode} runs fp8 matmuls, which {name} does not have (a GPU of compute "
                             f"capability 8.9 or more: Ada, Hopper, Blackwell); float8wo keeps fp8 weights only")


def apply_quantize(pipe: Any, mode: str | None, encoders: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Quantize the weights of every linear layer of `pipe`'s transformers (`transformer`,
    `transformer_2`) with `mode` (`float8storage`: store the layers diffusers casts in float8) ->
    the run's record: the mode, the layers quantized (or stored in float8) and the transformers'
    weight bytes before and after; `encoders` (`--quantize-text-encoders`: the text encoders by
    name, engine/offload.text_encoders) quantized alike, each with its record under
    `text_encoders`. None without a mode."""
    if mode is None:
        return None
    import torch

    parts = [part for name, part in pipe.components.items()
             if name.startswith("transformer") and isinstance(part, torch.nn.Module)]
    record = {"mode": mode, **_quantize(parts, mode)}
    if encoders is not None:
        record["text_encoders"] = {name: _quantize([encoder], mode) for name, encoder in encoders.items()}
    return record


def _quantize(parts: list[Any], mode: str) -> dict[str, int]:
    """Quantize `parts` in place with `mode` -> the layers quantized (or stored in float8) and their
    weight bytes before and after."""
    import torch

    from ..distributed.memory import tensor_bytes

    layers, before, after = 0, 0, 0
    for part in parts:
        linears = [m for m in part.modules() if isinstance(m, torch.nn.Linear)]
        before += sum(tensor_bytes(p) for p in part.parameters())
        if MODES[mode].layerwise:
            layers += store_float8(part)
        else:
            quantization = _torchao()
            with torch.no_grad():
                quantization.quantize_(part, getattr(quantization, MODES[mode].config)())
            layers += sum(1 for m in linears if type(m.weight).__name__ not in ("Parameter", "Tensor"))
        after += sum(tensor_bytes(p) for p in part.parameters())
    return {"layers": layers, "weight_bytes": before, "quantized_bytes": after}


def store_float8(model: Any) -> int:
    """Store `model`'s weights in float8 e4m3 where diffusers' layerwise casting does, computing in
    the dtype they have now -> the layers stored so (on `meta` too: `footprint` counts them so). A
    model of diffusers' by its own call (its patterns of layers kept); any other (a text encoder)
    by diffusers' hook with its default patterns (norms, patch and position embeddings kept) and the
    modules a transformers model keeps in float32 (`_keep_in_fp32_modules`: T5's `wo`, whose input
    is cast to its weight's dtype before the layer runs)."""
    import re

    import torch

    compute = next(model.parameters()).dtype
    if hasattr(model, "enable_layerwise_casting"):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute)
    else:
        from diffusers.hooks import apply_layerwise_casting
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

        kept = tuple(rf"(^|\.){re.escape(name)}($|\.)" for name in getattr(model, "_keep_in_fp32_modules", None) or ())
        apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=compute,
                                skip_modules_pattern=(*DEFAULT_SKIP_MODULES_PATTERN, *kept))
    return sum(1 for m in model.modules()
               if any(p.dtype == torch.float8_e4m3fn for p in m.parameters(recurse=False)))
