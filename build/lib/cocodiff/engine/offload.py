"""Text encoders off the device (`--offload-text-encoders auto|on|off`).

Only the rank that encodes the prompts needs the text encoders at all (`encode_once`: rank 0
encodes, the embeddings are broadcast), and it needs them for a moment per prompt. So with
offloading on:

    the encoding rank   the encoders' weights live on the host; diffusers' group offloading
                        (`apply_group_offloading`, leaf level, the same hooks as
                        `enable_group_offload`) copies each layer to the device just before it
                        runs and drops the copy after it, the next layer's copy in flight behind
                        it on a CUDA stream. The device holds a layer or two of the encoder, never
                        the whole of it.
    every other rank    the encoders are freed (a pipeline's are set to None, never moved to the
                        device; a preset's prompt encoder keeps its shape on the `meta` device).

Why encode on the device with the weights streamed in, rather than keep the encoder on the host
and run it there: FLUX.2's Mistral Small 3.1 (24 B parameters) costs about 2 x 24e9 x 512 = 25
TFLOPs per prompt of 512 tokens, tens of seconds to minutes on a host's cores; streaming its 48 GB
of bf16 weights over PCIe 5 (about 50 GB/s) takes about a second, overlapped with the layers'
compute. Moving the whole encoder to the device and back (diffusers' `enable_model_cpu_offload`)
would need the 48 GB free on the device for the moment of encoding: it would not fit beside the
transformer's shard on a 64 GB tile. The outputs are the same bits: only where weights are stored
changes, never what is computed.

On the CPU the "device" is the host: the hooks move nothing and the other ranks still free theirs.
`serve` encodes on every rank, so there every rank keeps (offloaded) encoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TextEncoderPlacement", "encoder_bytes", "keep_on_host", "place_text_encoders",
           "text_encoders", "text_tokens"]

HOST = torch.device("cpu")


def text_encoders(pipe: Any, encoder: Any = None) -> dict[str, nn.Module]:
    """The pipeline's text encoders by component name (`text_encoder`, `text_encoder_2`, ...), and a
    preset's own prompt encoder (`encoder`) as `prompt_encoder`."""
    found = {name: m for name, m in (getattr(pipe, "components", None) or {}).items()
             if name.startswith("text_encoder") and isinstance(m, nn.Module)}
    if isinstance(encoder, nn.Module) and all(encoder is not m for m in found.values()):
        found["prompt_encoder"] = encoder
    return found


def encoder_bytes(pipe: Any, encoder: Any = None) -> int:
    """Bytes of the text encoders' parameters and buffers (as loaded, wherever they are)."""
    from ..distributed.memory import weight_bytes

    return weight_bytes(*text_encoders(pipe, encoder).values())


def text_tokens(encoder: Any) -> int | None:
    """Text tokens of a preset's prompt encoder (its output's length for the empty prompt), found
    once and kept on the encoder, so that it is known after the encoder is freed; None without one."""
    if encoder is None:
        return None
    tokens = getattr(encoder, "_cocodiff_text_tokens", None)
    if tokens is None:
        tokens = int(encoder([""])[0].shape[1])
        encoder._cocodiff_text_tokens = tokens
    return tokens


def keep_on_host(pipe: Any, encoder: Any = None) -> None:
    """The text encoders back on the host (before `place_text_encoders` decides where they go)."""
    for module in text_encoders(pipe, encoder).values():
        module.to(HOST)


@dataclass(frozen=True, slots=True)
class TextEncoderPlacement:
    """Where this rank's text encoders ended up."""

    offloaded: bool
    encodes: bool
    """This rank runs the encoders (rank 0, or every rank in `serve`)."""
    names: tuple[str, ...]

    def describe(self) -> str:
        if not self.names:
            return "no text encoders"
        if not self.offloaded:
            return "text encoders on the device"
        return "text encoders on the host, streamed to the device layer by layer" if self.encodes else "text encoders freed"


def place_text_encoders(pipe: Any, encoder: Any, device: torch.device, *, offload: bool,
                        encodes: bool) -> TextEncoderPlacement:
    """Put this rank's text encoders where the module's doc says: on `device` (`offload` False),
    on the host streamed in for each encoding (`offload`, `encodes`), or freed (`offload`, not `encodes`)."""
    from diffusers.hooks import apply_group_offloading

    found = text_encoders(pipe, encoder)
    for name, module in found.items():
        if not offload:
            module.to(device)
        elif encodes:
            module.to(HOST)
            apply_group_offloading(module, onload_device=device, offload_device=HOST, offload_type="leaf_level",
                                   use_stream=device.type == "cuda")
        elif name == "prompt_encoder":  # not a pipeline component: it keeps its shape, without storage
            text_tokens(module)  # known before its weights go
            module.to(torch.device("meta"))
        else:
            setattr(pipe, name, None)  # the pipeline's own: encode_once never calls it on this rank
    return TextEncoderPlacement(offloaded=offload, encodes=encodes, names=tuple(found))
