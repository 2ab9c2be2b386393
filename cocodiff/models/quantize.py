"""Quantized transformer weights (`--quantize MODE`, LOSSY) through torchao.

Every `nn.Linear` of the transformer (and of its experts) gets torchao's quantized weight once the
pipeline has loaded and any `--lora` is fused, before sharding or cutting stages: each rank holds
the same quantized weights, so every plan runs on them as on any checkpoint. The activations, and
with them everything the ranks exchange, keep the run's dtype. `verify` holds the run against the
unquantized one-process run: the error it reports is what quantizing costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

__all__ = ["MODES", "QuantMode", "apply_quantize", "check_quantize"]


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


MODES: dict[str, QuantMode] = {
    "int8wo": QuantMode("Int8WeightOnlyConfig", "int8 weights per output channel, compute in the run's dtype"),
    "int8dq": QuantMode("Int8DynamicActivationInt8WeightConfig", "int8 weights and int8 activations quantized per token",
                        dynamic=True),
    "float8wo": QuantMode("Float8WeightOnlyConfig", "float8 (e4m3) weights per output channel, compute in the run's dtype"),
    "float8dq": QuantMode("Float8DynamicActivationFloat8WeightConfig",
                          "float8 weights and activations quantized per tensor, fp8 matmuls", fp8_compute=True,
                          dynamic=True),
}
"""`--quantize`'s modes, by the names diffusers' TorchAoConfig gives them."""


def _torchao() -> Any:
    """torchao's quantization module (its import notices: run/quiet.py)."""
    try:
        import torchao.quantization as quantization
    except ImportError:
        raise UsageError("--quantize needs torchao (pip install torchao)") from None
    return quantization


def check_quantize(mode: str | None, device: Any = None) -> None:
    """`mode` runs on `device` (one line otherwise; None: the ranks' first accelerator, else the CPU:
    `first_device`): torchao is there, and fp8 matmuls have a GPU that does them."""
    if mode is None:
        return
    if mode not in MODES:
        raise UsageError(f"--quantize {mode}: no such mode (one of {', '.join(MODES)})")
    _torchao()
    if MODES[mode].fp8_compute:
        import torch

        from ..distributed.devices import first_device

        device = device if device is not None else first_device()
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            name = "the CPU" if device.type != "cuda" else torch.cuda.get_device_name(device)
            raise UsageError(f"--quantize {mode} runs fp8 matmuls, which {name} does not have (a GPU of compute "
                             f"capability 8.9 or more: Ada, Hopper, Blackwell); float8wo keeps fp8 weights only")


def apply_quantize(pipe: Any, mode: str | None) -> dict[str, Any] | None:
    """Quantize the weights of every linear layer of `pipe`'s transformers (`transformer`,
    `transformer_2`) with `mode` -> the run's record: the mode, the layers quantized and the
    transformers' weight bytes before and after. None without a mode."""
    if mode is None:
        return None
    import torch

    from ..distributed.memory import tensor_bytes

    quantization = _torchao()
    config = getattr(quantization, MODES[mode].config)()
    layers, before, after = 0, 0, 0
    for name, part in pipe.components.items():
        if not (name.startswith("transformer") and isinstance(part, torch.nn.Module)):
            continue
        linears = [m for m in part.modules() if isinstance(m, torch.nn.Linear)]
        before += sum(tensor_bytes(p) for p in part.parameters())
        with torch.no_grad():
            quantization.quantize_(part, config)
        layers += sum(1 for m in linears if type(m.weight).__name__ not in ("Parameter", "Tensor"))
        after += sum(tensor_bytes(p) for p in part.parameters())
    return {"mode": mode, "layers": layers, "weight_bytes": before, "quantized_bytes": after}
