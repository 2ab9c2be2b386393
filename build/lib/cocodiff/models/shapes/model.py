"""The `tiny-shapes` model: a stock diffusers `FluxPipeline` whose parts are trained here.

Parts, each saved and loaded with diffusers' own `save_pretrained` / `from_pretrained`, in the
layout of a hub checkpoint (one folder per part):

- `vae/`: an `AutoencoderKL` with two resolution levels, i.e. VAE factor 2: 64x64 RGB <-> 4 x 32 x 32
  latents. FLUX's 2x2 packing then makes 16 x 16 = 256 image tokens of 16 channels.
- `transformer/`: a `FluxTransformer2DModel`, 4 heads of 32 (hidden 128), 2 double-stream and 4
  single-stream blocks, no guidance embedding (classifier-free guidance is done by the pipeline's
  `true_cfg_scale`, with the empty prompt as negative).
- `text_encoder/`: `ShapesTextEncoder` (see text.py), 12 text tokens of 64 channels.
- `scheduler/`: `FlowMatchEulerDiscreteScheduler`, static shift.

Why a tiny autoencoder rather than pixels with 2x2 packing: 256 tokens of 2x2 pixels would be a
32x32 image, where a star of a few pixels is hard to tell from a circle (for the model, for the
checker and for a person). A factor-2 autoencoder gives 64x64 images for the same 256 tokens, and
flat-coloured shapes are easy to encode, so it trains in a few minutes on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

from . import CFG_SCALE, DEFAULT_STEPS, SIZE
from .data import VOCABULARY
from .text import ShapesTextEncoder

__all__ = [
    "CFG_SCALE", "DEFAULT_STEPS", "PARTS", "WEIGHTS", "load_parts", "make_pipeline", "new_scheduler",
    "new_text_encoder", "new_transformer", "new_vae", "pack", "image_ids",
]

WEIGHTS = Path(__file__).parent / "weights"
"""The shipped weights (copied from the output of `cocodiff train-tiny`)."""
PARTS = ("vae", "transformer", "text_encoder", "scheduler")
TEXT_TOKENS = 12
LATENT_CHANNELS = 4


def new_vae() -> AutoencoderKL:
    """Untrained autoencoder, VAE factor 2 (scaling and shift are set from data after training)."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=SIZE,
        mid_block_add_attention=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )


def new_transformer() -> FluxTransformer2DModel:
    """Untrained transformer, initialized as DiT's adaLN-Zero: every block starts as the identity.

    The modulation layers (shift, scale and gate of each block) and the output projection start at
    zero, which makes the first steps of training much more effective than diffusers' default
    initialization (meant for loading weights over it).
    """
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )
    for name, module in transformer.named_modules():
        if name == "proj_out" or name.endswith(("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear")):
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)
    return transformer


def new_text_encoder() -> ShapesTextEncoder:
    return ShapesTextEncoder(vocabulary=list(VOCABULARY), max_length=TEXT_TOKENS, dim=64, layers=2, heads=4, pooled_dim=64)


def new_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Euler over sigmas 1 -> 0 with a static shift (no resolution-dependent shift: one native size)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def make_pipeline(vae: AutoencoderKL, transformer: FluxTransformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler) -> FluxPipeline:
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=transformer,
    )


def load_parts(path: str | Path = WEIGHTS) -> tuple[FluxPipeline, ShapesTextEncoder]:
    """(FluxPipeline, text encoder) from a folder written by `train-tiny` (default: the shipped one)."""
    path = Path(path)
    missing = [part for part in PARTS if not (path / part).is_dir()]
    if missing:
        raise FileNotFoundError(f"{path} has no {', '.join(missing)}: not a tiny-shapes checkpoint")
    # low_cpu_mem_usage=False: what diffusers falls back to without `accelerate`, minus its warning.
    pipe = make_pipeline(
        AutoencoderKL.from_pretrained(path / "vae", low_cpu_mem_usage=False),
        FluxTransformer2DModel.from_pretrained(path / "transformer", low_cpu_mem_usage=False),
        FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler"),
    )
    encoder = ShapesTextEncoder.from_pretrained(path / "text_encoder", low_cpu_mem_usage=False)
    return pipe, encoder.eval()


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2 * W/2, 4C) tokens, exactly as FluxPipeline packs them."""
    batch, channels, height, width = latents.shape
    return FluxPipeline._pack_latents(latents, batch, channels, height, width)


def image_ids(latent_height: int, latent_width: int) -> torch.Tensor:
    """FLUX position ids of the packed image tokens, as FluxPipeline makes them."""
    return FluxPipeline._prepare_latent_image_ids(1, latent_height // 2, latent_width // 2, "cpu", torch.float32)

