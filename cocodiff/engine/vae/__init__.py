"""The VAE decoded (and encoded) in bands of latent rows across the ranks: the router, and one
module per VAE over the shared band machinery (`bands`).

`kl2d` splits diffusers' 2D `Decoder`/`Encoder` (FLUX's, SD3's, Qwen-Image's AutoencoderKL); `wan`,
`ltx` and `hunyuanvideo15` split those video VAEs' decoders. Each VAE module answers `supports(vae)`
and gives `decode_split(vae, group)`; the functions here pick the module for a VAE and take the one
band decision (`use_parallel_vae`) that `generate`, `verify` and `footprint` share.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch.distributed as dist

from ...errors import UsageError
from . import hunyuanvideo15, kl2d, ltx, wan
from .bands import HALO_ROWS
from .kl2d import encode_split, parallel_decode, parallel_encode, supports, supports_encode

__all__ = [
    "decode_split", "encode_split", "latent_rows", "parallel_decode", "parallel_encode", "prepare",
    "splits", "supports", "supports_encode", "use_parallel_encode", "use_parallel_vae",
]



def _video(vae: Any) -> ModuleType | None:
    """The module that decodes `vae` in bands where it is a video VAE split so (Wan, LTX-Video,
    HunyuanVideo 1.5); else None."""
    return next((m for m in (wan, ltx, hunyuanvideo15) if m.supports(vae)), None)


def prepare(vae: Any) -> None:
    """What a freshly loaded VAE needs before any encode or decode (HunyuanVideo 1.5's:
    `decode_items_apart`; a 2D one's: `kl2d.contiguous_inputs`, an exact stock GroupNorm on the CPU,
    and `kl2d.own_dtype_inputs`)."""
    if supports(vae) or supports_encode(vae):
        kl2d.contiguous_inputs(vae)
        kl2d.own_dtype_inputs(vae)
    if hunyuanvideo15.supports(vae):
        hunyuanvideo15.decode_items_apart(vae)


def latent_rows(vae: Any, height: int) -> int:
    """The latent's rows for pictures `height` pixels high, for the VAEs this module or
    the video modules split (2D: 2 ** (levels - 1) pixels a row; the video VAEs: their spatial factor)."""
    video = _video(vae)
    if video is not None:
        return video.latent_rows(vae, height)
    return height // 2 ** (len(getattr(vae.config, "block_out_channels", ())) - 1)


def splits(vae: Any) -> bool:
    """Whether `vae` decodes in bands: through the 2D `Decoder` here, or a video module's."""
    return supports(vae) or _video(vae) is not None


def use_parallel_vae(choice: str, vae: Any, latent_rows: int, world: int) -> bool:
    """`--parallel-vae` for a run: `on` where supported (an error where it cannot split), `off`
    never, `auto` on where supported and every band's own rows are at least twice its halo, the
    one row each convolution borrows from a neighbour (`bands.HALO_ROWS`: smaller bands would
    mostly exchange rows)."""
    if choice == "off" or world < 2:
        return False
    if not splits(vae):
        if choice == "on":
            raise UsageError(f"--parallel-vae on: {type(vae).__name__} is not split (only 2D AutoencoderKL-style VAEs "
                             f"and the Wan, LTX-Video and HunyuanVideo 1.5 VAEs); "
                             f"use auto or off")
        return False
    if choice == "on":
        if latent_rows < world:
            raise UsageError(f"--parallel-vae on: the image has {latent_rows} latent rows, fewer than the {world} ranks")
        return True
    return latent_rows // world >= 2 * HALO_ROWS


def use_parallel_encode(choice: str, vae: Any) -> bool:
    """Whether a run whose decode splits (`use_parallel_vae`) also encodes its image input in bands:
    where `vae` encodes through the 2D `Encoder`; `on` refuses any other VAE, naming its class."""
    if supports_encode(vae):
        return True
    if choice == "on":
        raise UsageError(f"--parallel-vae on: {type(vae).__name__} does not encode in bands (only 2D AutoencoderKL-style "
                         f"VAEs); use auto or off")
    return False


def decode_split(vae: Any, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, `vae.decode` (as the pipelines call it) is `parallel_decode` over `group`
    (the video VAEs': their module's `decode_split`: `wan`, `ltx`, `hunyuanvideo15`)."""
    video = _video(vae)
    return video.decode_split(vae, group) if video is not None else kl2d.decode_split(vae, group)
