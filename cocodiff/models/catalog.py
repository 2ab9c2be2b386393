"""The checkpoint catalog, torch-free: heads, layers, tokens and guidance of each real checkpoint,
read by `simulate` (its cost model) and by `footprint` (models.counts builds each one's parts on `meta`).

`workload.Workload` turns one of these, at one size, into FLOPs and message shapes. Each entry's
`source` says where its figures come from (a published config, diffusers 0.42.1's defaults, a
pipeline's defaults); the rest-FLOPs comment above `MODELS` derives each block's FLOPs.

Video models (`temporal_factor` > 1) count tokens over latent frames: (frames - 1) // t + 1 latent
frames of (height / pixel multiple) x (width / pixel multiple) tokens each (every temporal patch is 1).
Text reaches a block in one of three ways (`LayerKind.attends`, `LayerKind.cross`): in the joint
sequence (FLUX, SD3, HunyuanVideo 1.5, Z-Image, Qwen-Image 2.1, MiniMax-H3 with its audio rows), by
cross-attention computed on every rank against the whole text with nothing exchanged (Wan,
`cross="local"`), or by cross-attention with the text split over the ranks and exchanged like
self-attention (LTX-Video's and LTX-2's diffusers plans, `cross="exchanged"`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["DTYPES", "LayerKind", "MODELS", "ModelSpec", "TEXT_TOKENS", "frame_form", "get_model", "latent_frames"]

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerKind:
    """Blocks of one shape: each has one attention layer."""

    name: str
    count: int
    image_only: bool = False
    """Attention over the image tokens only (SD3.5 Medium's second attention, Z-Image's noise refiner)."""
    text_only: bool = False
    """Attention over the joint text tokens only (Z-Image's context refiner)."""
    cross: str = ""
    """Cross-attention from the image (video) tokens to the model's `cross_tokens` text tokens:
    `local` (every rank: its own queries, all heads, the whole text; nothing exchanged, only FLOPs)
    or `exchanged` (the text split over the ranks like the queries, through the same exchange);
    empty: self-attention."""
    rest_flops: float
    """FLOPs per token, in units of d^2, besides the V/Q/K projections and attention."""
    overlap_flops: float = 0.0
    """Of `rest_flops`, what can run while the attention output travels back (with V-First)."""
    qk_passes: int = 2
    """Read+write passes over Q and K after their projection: RMSNorm (1) and RoPE (1)."""

    def __post_init__(self) -> None:
        if self.cross not in ("", "local", "exchanged"):
            raise ValueError(f"LayerKind {self.name}: cross={self.cross!r} is not '', 'local' or 'exchanged'")
        if self.cross and (self.image_only or self.text_only) or (self.image_only and self.text_only):
            raise ValueError(f"LayerKind {self.name}: image_only, text_only and cross exclude each other")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    source: str
    """Where the configuration comes from."""
    heads: int
    head_dim: int
    layers: tuple[LayerKind, ...]
    text_tokens: int
    vae_factor: int
    patch: int
    """Image tokens per side = pixels / vae_factor / patch (FLUX's 2x2 latent packing counts as patch 2)."""
    out_channels: int
    """Values per image token of the transformer's output (gathered to every rank at the end)."""
    cfg: str
    """Classifier-free guidance: `none` (guidance-distilled), `batch` (a batch of 2 per call), `calls` (2 calls)."""
    default_steps: int
    default_dtype: str = "bf16"
    note: str = ""
    cross_tokens: int = 0
    """Text tokens reached by cross-attention only (Wan's 512 UMT5 tokens); not in the joint sequence."""
    temporal_factor: int = 1
    """Video: frames per latent frame (the VAE's temporal stride); 1 for image models."""
    default_frames: int = 1
    default_size: tuple[int, int] = (1024, 1024)
    """(height, width) in pixels when none is given."""
    frame_chunk: tuple[int, int] | None = None
    """(pixel frames, latent frames) of a VAE that encodes in chunks (MiniMax-H3's 17 -> 5: 17 n + 5
    frames make 5 n + 2 latent frames), in place of `temporal_factor`'s (frames - 1) // t + 1."""
    even_heads: bool = False
    """Ulysses degrees must divide the heads (ring for the rest): the new families' attention layer
    splits the heads evenly, so a plan with an uneven head split is not run for them."""

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def pixel_multiple(self) -> int:
        return self.vae_factor * self.patch

    @property
    def video(self) -> bool:
        return self.temporal_factor > 1

    def latent_frames(self, frames: int) -> int:
        return latent_frames(frames, self.temporal_factor, self.frame_chunk)


def latent_frames(frames: int, temporal_factor: int, chunk: tuple[int, int] | None = None) -> int:
    """The latent frames a video VAE makes of `frames` (`ModelSpec.frame_chunk` for `chunk`)."""
    if chunk is not None:
        pixels, latents = chunk
        return (frames - latents) // pixels * latents + 2
    return (frames - 1) // temporal_factor + 1


def frame_form(frames: int, temporal_factor: int, chunk: tuple[int, int] | None = None) -> str | None:
    """None where the VAE makes `frames` frames, else the form a frame count must have ("4 x k + 1")."""
    pixels, rest = chunk if chunk is not None else (temporal_factor, 1)
    return None if frames >= rest and (frames - rest) % pixels == 0 else f"{pixels} x k + {rest}"


def next_clip(frames: int, temporal_factor: int, chunk: tuple[int, int] | None = None) -> int:
    """The fewest frames, `frames` or more, that the VAE makes (of the form `frame_form` names)."""
    pixels, rest = chunk if chunk is not None else (temporal_factor, 1)
    return rest + max(0, -(-(frames - rest) // pixels)) * pixels


def clip_rule(frames: int, chunk: tuple[int, int], limits: tuple[int, int] | None) -> str | None:
    """None where a VAE that encodes in `chunk`s makes a clip of `frames` frames within `limits` (the
    fewest and most; None: any), else the rule a clip's frames must meet ("17 x k + 5 frames, 124 to 345")."""
    (pixels, rest), (low, high) = chunk, limits or (1, frames)
    if frame_form(frames, 1, chunk) is None and low <= frames <= high:
        return None
    return f"{pixels} x k + {rest} frames" + (f", {low} to {high}" if limits else "")


# FLOPs per token in units of d^2 (a linear d -> k d is 2 k d^2), summed over both streams where a
# block has two (each token is in one stream):
#   FLUX.1 double-stream: QKV 6, to_out 2, MLP d -> 4d -> d 16           -> rest 2 + 16 = 18
#   FLUX.1 single-stream: QKV 6, proj_mlp d -> 4d 8, proj_out 5d -> d 10 -> rest 18, of which the
#                         MLP branch (8) runs under the output exchange (the engine does this)
#   FLUX.2 double-stream: QKV 6, to_out 2, SwiGLU d -> 2x3d 12, 3d -> d 6 -> rest 20
#   FLUX.2 single-stream: fused QKV+MLP-in d -> 3d + 6d (6 + 12), to_out 4d -> d 8 -> rest 20; the
#                         MLP-in columns (12) are assumed split from the fused weight so V comes
#                         first and the MLP branch runs under the output exchange, as in FLUX.1
#   SD3.5 / Qwen-Image joint blocks: QKV 6, out 2, MLP 4x 16             -> rest 18
#   Wan: self-attention QKV 6, out 2, FFN d -> f -> d 4 f / d            -> rest 2 + 4 f / d (14B: f 13824,
#        d 5120: 12.8); cross-attention (local): Q 2 per video token, K and V 4 per text token (every
#        rank projects the whole text), out 2                             -> rest 2
#   HunyuanVideo 1.5 dual-stream joint blocks: QKV 6, out 2, MLP 4x 16  -> rest 18
#   LTX-Video: self-attention QKV 6, out 2, FFN 4x 16 -> rest 18; cross-attention (exchanged): Q 2 per video
#        token, K and V 4 per text token (a rank's share of the text), out 2 -> rest 2
#   Z-Image: QKV 6, out 2, SwiGLU d -> 2 x 8d/3, 8d/3 -> d 16           -> rest 18 (the refiners alike)
#   MiniMax-H3: the residual stream is w = 5376 = 0.75 d wide (d = 56 heads x 128 = 7168): Q, K, V w -> d
#        1.5 each (4.5, where the model counts 6), out d -> w 1.5, SwiGLU w -> 2 x 14336, 14336 -> w
#        6 x 5376 x 14336 / d^2 = 9 -> rest 10.5, less the projections' 1.5 counted above -> rest 9
#        (per token the sum is exact, 15; the Q/K that V-First hides V under are 1.0 more than they are)
#   LTX-2: video self-attention QKV 6, out 2, FFN 4x 16, audio-to-video cross-attention's Q d -> d/2 and
#        out d/2 -> d 1 (its queries are the video's; its 2048-wide audio keys are not counted) -> rest 19;
#        text cross-attention (exchanged) as LTX-Video's                -> rest 2
#   Qwen-Image 2.1 single-stream: QKV 6, out 2, SwiGLU d -> 2 x 3d 12, 3d -> d 6 -> rest 20
def _wan_rest(dim: int, ffn: int) -> float:
    return 2.0 + 4.0 * ffn / dim


WAN_SOURCE = ("diffusers 0.42.1 WanTransformer3DModel (self-attention over the video, cross-attention to the text, "
              "FFN) and WanPipeline (max_sequence_length 512: UMT5 text padded to 512; guidance 5.0 as two calls; "
              "50 steps); Wan-AI configs (wan/configs/): ")
FLUX1_DOUBLE, FLUX1_SINGLE = 18.0, 18.0
MODELS: dict[str, ModelSpec] = {
    "flux1-dev": ModelSpec(
        name="flux1-dev",
        source="black-forest-labs/FLUX.1-dev transformer config: 19 double + 38 single blocks, 24 heads x 128; "
        "T5 max_sequence_length 512 (FluxPipeline default); 2x2 packed latents of a VAE with factor 8",
        heads=24, head_dim=128,
        layers=(LayerKind(name="double-stream", count=19, rest_flops=FLUX1_DOUBLE),
                LayerKind(name="single-stream", count=38, rest_flops=FLUX1_SINGLE, overlap_flops=8.0)),
        text_tokens=512, vae_factor=8, patch=2, out_channels=64, cfg="none", default_steps=28,
        note="guidance-distilled: one transformer call per step",
    ),
    "sd35-large": ModelSpec(
        name="sd35-large",
        source="stabilityai/stable-diffusion-3.5-large transformer config: 38 joint blocks, 38 heads x 64, "
        "patch 2, VAE factor 8; text = 77 CLIP + 256 T5 tokens (StableDiffusion3Pipeline defaults)",
        heads=38, head_dim=64,
        layers=(LayerKind(name="joint", count=38, rest_flops=18.0, qk_passes=1),),  # QK RMSNorm, no RoPE
        text_tokens=333, vae_factor=8, patch=2, out_channels=64, cfg="batch", default_steps=28,
        note="CFG as a batch of 2 per call; the last block's text stream (context_pre_only) is counted in full",
    ),
    "qwen-image": ModelSpec(
        name="qwen-image",
        source="Qwen/Qwen-Image (diffusers QwenImageTransformer2DModel defaults: 60 blocks, 24 heads x 128, "
        "patch 2; VAE factor 8); text tokens: 256, an assumed typical prompt length (it varies per prompt)",
        heads=24, head_dim=128,
        layers=(LayerKind(name="dual-stream", count=60, rest_flops=18.0),),
        text_tokens=256, vae_factor=8, patch=2, out_channels=64, cfg="calls", default_steps=50,
        note="true CFG with a negative prompt: two transformer calls per step",
    ),
    "flux2-dev": ModelSpec(
        name="flux2-dev",
        source="diffusers 0.42.1 Flux2Transformer2DModel defaults: 8 double + 48 single blocks, 48 heads x 128, "
        "mlp_ratio 3 (SwiGLU), in_channels 128 = 32 latent channels packed 2x2; Flux2Pipeline: "
        "max_sequence_length 512, VAE factor 8 (4 block_out_channels)",
        heads=48, head_dim=128,
        layers=(LayerKind(name="double-stream", count=8, rest_flops=20.0),
                LayerKind(name="single-stream", count=48, rest_flops=20.0, overlap_flops=12.0)),
        text_tokens=512, vae_factor=8, patch=2, out_channels=128, cfg="none", default_steps=50, even_heads=True,
        note="guidance-distilled: one transformer call per step",
    ),
    "wan21-14b": ModelSpec(
        name="wan21-14b",
        source=WAN_SOURCE + "T2V 14B dim 5120, ffn 13824, 40 heads x 128, 40 layers, VAE stride 4x8x8, patch 1x2x2 "
        "(= diffusers' defaults); 81 frames -> 21 latent frames, 1280x720 -> 75 600 tokens",
        heads=40, head_dim=128,
        layers=(LayerKind(name="self-attention", count=40, rest_flops=_wan_rest(5120, 13824)),
                LayerKind(name="cross-attention", count=40, cross="local", rest_flops=2.0, qk_passes=1)),
        text_tokens=0, cross_tokens=512, vae_factor=8, patch=2, out_channels=64, cfg="calls", default_steps=50,
        temporal_factor=4, default_frames=81, default_size=(720, 1280), even_heads=True,
        note="true CFG as two calls per step; cross-attention to the text on every rank, nothing exchanged",
    ),
    "wan21-1.3b": ModelSpec(
        name="wan21-1.3b",
        source=WAN_SOURCE + "T2V 1.3B dim 1536, ffn 8960, 12 heads x 128, 30 layers, VAE stride 4x8x8, patch 1x2x2",
        heads=12, head_dim=128,
        layers=(LayerKind(name="self-attention", count=30, rest_flops=_wan_rest(1536, 8960)),
                LayerKind(name="cross-attention", count=30, cross="local", rest_flops=2.0, qk_passes=1)),
        text_tokens=0, cross_tokens=512, vae_factor=8, patch=2, out_channels=64, cfg="calls", default_steps=50,
        temporal_factor=4, default_frames=81, default_size=(480, 832), even_heads=True,
        note="true CFG as two calls per step; cross-attention to the text on every rank, nothing exchanged",
    ),
    "wan22-ti2v-5b": ModelSpec(
        name="wan22-ti2v-5b",
        source=WAN_SOURCE + "TI2V 5B dim 3072, ffn 14336, 24 heads x 128, 30 layers, VAE stride 4x16x16 (48 latent "
        "channels), patch 1x2x2, 121 frames, 50 steps, guidance 5.0; 1280x704x121 -> 31 x 22 x 40 = 27 280 tokens",
        heads=24, head_dim=128,
        layers=(LayerKind(name="self-attention", count=30, rest_flops=_wan_rest(3072, 14336)),
                LayerKind(name="cross-attention", count=30, cross="local", rest_flops=2.0, qk_passes=1)),
        text_tokens=0, cross_tokens=512, vae_factor=16, patch=2, out_channels=192, cfg="calls", default_steps=50,
        temporal_factor=4, default_frames=121, default_size=(704, 1280), even_heads=True,
        note="true CFG as two calls per step; cross-attention to the text on every rank, nothing exchanged",
    ),
    "hunyuanvideo15": ModelSpec(
        name="hunyuanvideo15",
        source="diffusers 0.42.1 HunyuanVideo15Transformer3DModel defaults: 54 dual-stream joint blocks, 16 heads x 128, "
        "mlp_ratio 4, patch 1x1x1, out_channels 32; HunyuanVideo15Pipeline: VAE 4x16x16, 121 frames, 50 steps, CFG "
        "by its guider (two calls); text in the joint sequence: 1000 Qwen2.5-VL + 256 ByT5 + 729 image slots (padded, "
        "masked: 1985 tokens); 720p checkpoint 1280x720x121 -> 31 x 45 x 80 = 111 600 tokens",
        heads=16, head_dim=128,
        layers=(LayerKind(name="dual-stream", count=54, rest_flops=18.0),),
        text_tokens=1985, vae_factor=16, patch=1, out_channels=32, cfg="calls", default_steps=50,
        temporal_factor=4, default_frames=121, default_size=(720, 1280), even_heads=True,
        note="CFG as two calls per step; the text token refiner (2 layers) is left out like the embedders",
    ),
    "ltx-video": ModelSpec(
        name="ltx-video",
        source="diffusers 0.42.1 LTXVideoTransformer3DModel defaults: 28 blocks (self-attention, cross-attention, "
        "FFN 4x), 32 heads x 64, patch 1x1x1, 128 channels; LTXPipeline: VAE 8x32x32, T5 max_sequence_length 128, "
        "704x512x161, 50 steps, guidance 3 as a batch of 2; its _cp_plan splits the text, so cross-attention "
        "goes through the exchange",
        heads=32, head_dim=64,
        layers=(LayerKind(name="self-attention", count=28, image_only=True, rest_flops=18.0),
                LayerKind(name="cross-attention", count=28, cross="exchanged", rest_flops=2.0, qk_passes=1)),
        text_tokens=0, cross_tokens=128, vae_factor=32, patch=1, out_channels=128, cfg="batch", default_steps=50,
        temporal_factor=8, default_frames=161, default_size=(512, 704), even_heads=True,
        note="CFG as a batch of 2 per call; cross-attention's text split over the ranks and exchanged",
    ),
    "zimage-turbo": ModelSpec(
        name="zimage-turbo",
        source="diffusers 0.42.1 ZImageTransformer2DModel defaults: dim 3840, 30 heads x 128, 30 single-stream joint "
        "layers + 2 noise refiner (image tokens) + 2 context refiner (text tokens) layers, SwiGLU 8/3, patch 2, "
        "16 latent channels, VAE factor 8; Tongyi-MAI/Z-Image-Turbo card: 9 steps, guidance 0; text tokens: 256, an "
        "assumed typical prompt (the pipeline keeps the valid tokens only, padded to a multiple of 32)",
        heads=30, head_dim=128,
        layers=(LayerKind(name="single-stream", count=30, rest_flops=18.0),
                LayerKind(name="noise-refiner", count=2, image_only=True, rest_flops=18.0),
                LayerKind(name="context-refiner", count=2, text_only=True, rest_flops=18.0)),
        text_tokens=256, vae_factor=8, patch=2, out_channels=64, cfg="none", default_steps=9, even_heads=True,
        note="guidance-distilled (Turbo): one transformer call per step",
    ),
    "minimax-h3": ModelSpec(
        name="minimax-h3",
        source="diffusers 0.42.1 MiniMaxH3Transformer3DModel defaults (33.1 B parameters): 50 blocks of full "
        "self-attention over one packed sequence of text, audio and video rows, 56 heads x 128 over a 5376-wide "
        "stream, SwiGLU 14336, patch 1x2x2, 24 latent channels; MiniMaxH3ModularPipeline: VAE 16x, 16:9 canvas "
        "768x1344, 124 frames (17 n + 5 at 24 fps -> 37 latent frames), 2 x 207 audio rows (40 latents/s, stereo), "
        "guidance-distilled, 50 steps (the steps input's default); text: 256, an assumed typical prompt (its own "
        "tokens, no template, no padding)",
        heads=56, head_dim=128,
        layers=(LayerKind(name="packed", count=50, rest_flops=9.0),),
        text_tokens=256 + 2 * 207, vae_factor=16, patch=2, out_channels=96 + 32, cfg="none", default_steps=50,
        temporal_factor=3, frame_chunk=(17, 5), default_frames=124, default_size=(768, 1344), even_heads=True,
        note="one call per step; text_tokens = 256 text + 414 audio rows (the packed sequence's other rows); the VAE "
        "makes 5 latent frames of every 17 (frame_chunk: 17 n + 5 frames -> 5 n + 2, 124 -> 37; temporal factor 3 "
        "is only its decode's frames per latent frame); out_channels = both heads (96 video + 32 audio) on every row; the 2 text refiner blocks left out",
    ),
    "ltx2": ModelSpec(
        name="ltx2",
        source="diffusers 0.42.1 LTX2VideoTransformer3DModel defaults, LTX-2's (use_prompt_embeddings, no gated "
        "attention or prompt modulation: not LTX-2.3, whose config diffusers does not give; 18.9 B parameters): 48 "
        "blocks, video 32 heads x 128, audio 32 x 64, FFN 4x, patch 1x1x1, 128 channels; LTX2Pipeline: VAE 8x32x32, "
        "Gemma 3 text padded to max_sequence_length 1024, 768x512x121, 30 steps, guidance 3 as a batch of 2; its "
        "_cp_plan splits the video and the text, so text cross-attention goes through the exchange",
        heads=32, head_dim=128,
        layers=(LayerKind(name="self-attention", count=48, image_only=True, rest_flops=19.0),
                LayerKind(name="cross-attention", count=48, cross="exchanged", rest_flops=2.0, qk_passes=1)),
        text_tokens=0, cross_tokens=1024, vae_factor=32, patch=1, out_channels=128, cfg="batch", default_steps=30,
        temporal_factor=8, default_frames=121, default_size=(512, 768), even_heads=True,
        note="CFG as a batch of 2 per call; the pipeline's defaults add STG (stg_scale 1) and modality isolation "
        "(modality_scale 3): two more calls of batch 1 per step, not modelled (--batch 2 has their FLOPs); the audio "
        "stream (126 tokens at 2048 wide: self- and text attention, FFN, video-to-audio) and audio-to-video's "
        "attention to it not modelled",
    ),
    "qwen-image-2.1": ModelSpec(
        name="qwen-image-2.1",
        source="diffusers 0.42.1 QwenImage21Transformer2DModel defaults (7.1 B parameters): 32 single-stream joint "
        "blocks, 32 heads x 128, SwiGLU 3x, patch 1, 64 latent channels; QwenImage21Pipeline: VAE 16x, 1024x1024, "
        "40 steps, true_cfg_scale 1 (no CFG); text tokens: 256, an assumed typical prompt (the Qwen3-VL template's "
        "own tokens, no padding)",
        heads=32, head_dim=128,
        layers=(LayerKind(name="single-stream", count=32, rest_flops=20.0),),
        text_tokens=256, vae_factor=16, patch=1, out_channels=64, cfg="none", default_steps=40, even_heads=True,
        note="no CFG by default: one call per step; the pipeline's KV cache (steps after the first recompute only "
        "the image's tokens) and the block-causal text mask are not modelled: the text's share is counted each step",
    ),
    # The repository's presets (cocodiff/models/presets.py), run by `bench e2e` on the emulated clusters. Written
    # out here so the simulator needs no torch; tests/test_models.py checks them against the real pipelines.
    "tiny-flux": ModelSpec(
        name="tiny-flux",
        source="cocodiff/presets.py _build_flux: FluxTransformer2DModel 2 double + 2 single blocks, 4 heads x 32, "
        "11 text tokens; AutoencoderKL with 3 down-samplings (factor 8) and FLUX's 2x2 packing",
        heads=4, head_dim=32,
        layers=(LayerKind(name="double-stream", count=2, rest_flops=FLUX1_DOUBLE),
                LayerKind(name="single-stream", count=2, rest_flops=FLUX1_SINGLE, overlap_flops=8.0)),
        text_tokens=11, vae_factor=8, patch=2, out_channels=64, cfg="none", default_steps=4, default_dtype="fp32",
    ),
    "tiny-shapes": ModelSpec(
        name="tiny-shapes",
        source="cocodiff/shapes/model.py: FluxTransformer2DModel 2 double + 4 single blocks, 4 heads x 32, "
        "12 text tokens; AutoencoderKL with one down-sampling (factor 2) and FLUX's 2x2 packing; true CFG",
        heads=4, head_dim=32,
        layers=(LayerKind(name="double-stream", count=2, rest_flops=FLUX1_DOUBLE),
                LayerKind(name="single-stream", count=4, rest_flops=FLUX1_SINGLE, overlap_flops=8.0)),
        text_tokens=12, vae_factor=2, patch=2, out_channels=16, cfg="calls", default_steps=20, default_dtype="fp32",
    ),
    "tiny-sd3": ModelSpec(
        name="tiny-sd3",
        source="cocodiff/presets.py _build_sd3: 3 joint blocks, 6 heads x 16, block 0 with a second image-only "
        "attention, patch 2, 11 text tokens, VAE factor 8",
        heads=6, head_dim=16,
        layers=(LayerKind(name="joint", count=3, rest_flops=18.0, qk_passes=1),
                LayerKind(name="image-only", count=1, image_only=True, rest_flops=2.0, qk_passes=1)),
        text_tokens=11, vae_factor=8, patch=2, out_channels=64, cfg="batch", default_steps=4, default_dtype="fp32",
    ),
    "tiny-qwen-image": ModelSpec(
        name="tiny-qwen-image",
        source="cocodiff/presets.py _build_qwen_image: 2 blocks, 5 heads x 16, patch 2, 11 text tokens, "
        "AutoencoderKLQwenImage with 3 down-samplings (factor 8)",
        heads=5, head_dim=16,
        layers=(LayerKind(name="dual-stream", count=2, rest_flops=18.0),),
        text_tokens=11, vae_factor=8, patch=2, out_channels=64, cfg="calls", default_steps=4, default_dtype="fp32",
    ),
}


def get_model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UsageError(f"--model {name!r} is not one of {', '.join(MODELS)}")
    return MODELS[name]


TEXT_TOKENS = 512
"""Text tokens assumed: T5's default `max_sequence_length` in the FLUX pipelines, more than any preset's."""
