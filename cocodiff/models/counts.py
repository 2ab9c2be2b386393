"""What `cocodiff footprint` knows of a model without loading its weights: parameter counts and shapes.

`--model` is one of three things:

    a real checkpoint     by the simulator's name (`CHECKPOINTS`: flux1-dev, sd35-large, qwen-image,
                          flux2-dev, zimage-turbo, wan21-14b, wan22-a14b, wan22-ti2v-5b, hunyuanvideo15,
                          ltx-video, minimax-h3, ltx2, qwen-image-2.1);
                          each part's config is written out below from the
                          published config.json, built on the `meta` device (no memory) and its
                          parameters counted
    a preset              built (tiny, random or packaged weights) and counted
    a local folder        a diffusers pipeline's folder: each component's config.json, built on `meta`

Text tokens, guidance and the pixel multiple of the checkpoints the simulator knows come from its
`MODELS` (models/catalog.py), so both tools assume the same workload.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .catalog import MODELS

__all__ = ["CHECKPOINTS", "Checkpoint", "Component", "FLUX1_VAE", "ModelCounts", "count_model", "stage_blocks", "transformer_units"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Component:
    """One part of a pipeline: a diffusers or transformers class and its config."""

    library: str
    """`diffusers` or `transformers`."""
    cls: str
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class (diffusers) or of its config class (transformers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    source: str
    """Where the configs come from."""
    transformer: Component
    text_encoders: dict[str, Component]
    """By the pipeline's component name (text_encoder, text_encoder_2, ...)."""
    vae: Component
    text_tokens: int
    """Text tokens in the transformer's joint sequence (0: text enters by cross-attention only)."""
    cfg: str
    """As in `ModelSpec.cfg`: `none`, `batch` (a batch of 2 per call) or `calls` (two calls)."""
    pixel_multiple: int
    temporal_factor: int = 1
    """Video: frames per latent frame (the VAE's temporal compression); 1 for images."""
    frame_chunk: tuple[int, int] | None = None
    """As `catalog.ModelSpec.frame_chunk` (MiniMax-H3's VAE: 17 frames -> 5 latent frames)."""
    default_frames: int = 1
    default_size: tuple[int, int] = (1024, 1024)
    """(height, width) when none is given."""
    experts: int = 1
    """Transformers of this config in the pipeline (Wan 2.2 A14B: two experts, one per noise range)."""


FLUX1_VAE = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16,
                 down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4)
"""FLUX.1's and SD3.5's AutoencoderKL config (the rest diffusers' defaults): 16 latent channels, factor 8."""


def _kl_vae() -> Component:
    """FLUX.1's and SD3.5's AutoencoderKL."""
    return Component(library="diffusers", cls="AutoencoderKL", config=dict(FLUX1_VAE))


_CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=49408,
               max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
_CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20, vocab_size=49408,
               max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
_T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
               feed_forward_proj="gated-gelu")
_UMT5_XXL = dict(_T5_XXL, vocab_size=256384)
_QWEN25_VL_7B = dict(
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
    tie_word_embeddings=False)
_MISTRAL_SMALL_31 = dict(tie_word_embeddings=False)  # Mistral3Config's defaults are Mistral Small 3.1 24B's
_QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064)
_BYT5_SMALL = dict(d_model=1472, d_ff=3584, d_kv=64, num_heads=6, num_layers=12, vocab_size=384,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False)
_QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
_QWEN3_VL_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24])
_QWEN3_VL_8B = dict(  # Qwen-Image 2.1's encoder (its transformer's context_in_dim 4096): 8.77 B
    text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    vision_config=dict(_QWEN3_VL_VISION, out_hidden_size=4096), tie_word_embeddings=False)
_QWEN3_VL_32B = dict(  # MiniMax-H3's (text_dim 5120, hidden_states[50] of more than 50 layers): 33.4 B
    text_config=dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    vision_config=dict(_QWEN3_VL_VISION, out_hidden_size=5120), tie_word_embeddings=False)
_GEMMA3_12B = dict(  # LTX-2's (caption_channels 3840, its connectors' 49 = 48 layers + 1): 12.2 B
    text_config=dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=256, vocab_size=262208),
    vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       image_size=896, patch_size=14), mm_tokens_per_image=256)


def _spec(name: str) -> dict[str, Any]:
    """The simulator's text tokens, guidance, pixel multiple, frames and default size for `name`."""
    model = MODELS[name]
    return dict(text_tokens=model.text_tokens, cfg=model.cfg, pixel_multiple=model.pixel_multiple,
                temporal_factor=model.temporal_factor, frame_chunk=model.frame_chunk, default_frames=model.default_frames,
                default_size=model.default_size)


_WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6)
"""The 14B WanTransformer3DModel of Wan 2.1 T2V-14B, and of each of Wan 2.2 A14B's two experts."""

CHECKPOINTS: dict[str, Checkpoint] = {
    "flux1-dev": Checkpoint(
        source="black-forest-labs/FLUX.1-dev: FluxTransformer2DModel (19 + 38 blocks, 24 x 128), CLIP-L, T5-XXL, FLUX's VAE",
        transformer=Component(library="diffusers", cls="FluxTransformer2DModel", config=dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=[16, 56, 56])),
        text_encoders={"text_encoder": Component(library="transformers", cls="CLIPTextModel", config=_CLIP_L),
                       "text_encoder_2": Component(library="transformers", cls="T5EncoderModel", config=_T5_XXL)},
        vae=_kl_vae(), **_spec("flux1-dev"),
    ),
    "sd35-large": Checkpoint(
        source="stabilityai/stable-diffusion-3.5-large: SD3Transformer2DModel (38 blocks, 38 x 64), CLIP-L, CLIP-G, T5-XXL",
        transformer=Component(library="diffusers", cls="SD3Transformer2DModel", config=dict(
            sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
            joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
            pos_embed_max_size=192, qk_norm="rms_norm")),
        text_encoders={
            "text_encoder": Component(library="transformers", cls="CLIPTextModelWithProjection", config=_CLIP_L),
            "text_encoder_2": Component(library="transformers", cls="CLIPTextModelWithProjection", config=_CLIP_G),
            "text_encoder_3": Component(library="transformers", cls="T5EncoderModel", config=_T5_XXL)},
        vae=_kl_vae(), **_spec("sd35-large"),
    ),
    "qwen-image": Checkpoint(
        source="Qwen/Qwen-Image: QwenImageTransformer2DModel (60 blocks, 24 x 128), Qwen2.5-VL-7B, AutoencoderKLQwenImage",
        transformer=Component(library="diffusers", cls="QwenImageTransformer2DModel", config=dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
            joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
        text_encoders={"text_encoder": Component(library="transformers", cls="Qwen2_5_VLForConditionalGeneration",
                                                 config=_QWEN25_VL_7B)},
        vae=Component(library="diffusers", cls="AutoencoderKLQwenImage"), **_spec("qwen-image"),
    ),
    "flux2-dev": Checkpoint(
        source="black-forest-labs/FLUX.2-dev: Flux2Transformer2DModel defaults (8 + 48 blocks, 48 x 128), "
        "Mistral Small 3.1 24B, AutoencoderKLFlux2",
        transformer=Component(library="diffusers", cls="Flux2Transformer2DModel"),
        text_encoders={"text_encoder": Component(library="transformers", cls="Mistral3ForConditionalGeneration",
                                                 config=_MISTRAL_SMALL_31)},
        vae=Component(library="diffusers", cls="AutoencoderKLFlux2"), **_spec("flux2-dev"),
    ),
    "wan21-14b": Checkpoint(
        source="Wan-AI/Wan2.1-T2V-14B-Diffusers: WanTransformer3DModel (40 blocks, 40 x 128, self-attention over the "
        "video, text by cross-attention), UMT5-XXL, AutoencoderKLWan (8x spatial, 4x temporal); true CFG as two calls",
        transformer=Component(library="diffusers", cls="WanTransformer3DModel", config=_WAN_14B),
        text_encoders={"text_encoder": Component(library="transformers", cls="UMT5EncoderModel", config=_UMT5_XXL)},
        vae=Component(library="diffusers", cls="AutoencoderKLWan"),
        text_tokens=0, cfg="calls", pixel_multiple=16, temporal_factor=4, default_frames=81, default_size=(720, 1280),
    ),
    "wan22-a14b": Checkpoint(
        source="Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts (transformer, transformer_2: high and low noise), each "
        "the 14B WanTransformer3DModel (40 blocks, 40 x 128, ffn 13824), UMT5-XXL, AutoencoderKLWan (z_dim 16, 8x "
        "spatial, 4x temporal); true CFG as two calls; one expert runs per step, both are held",
        transformer=Component(library="diffusers", cls="WanTransformer3DModel", config=_WAN_14B),
        text_encoders={"text_encoder": Component(library="transformers", cls="UMT5EncoderModel", config=_UMT5_XXL)},
        vae=Component(library="diffusers", cls="AutoencoderKLWan"),
        text_tokens=0, cfg="calls", pixel_multiple=16, temporal_factor=4, default_frames=81, default_size=(720, 1280),
        experts=2,
    ),
    "wan22-ti2v-5b": Checkpoint(
        source="Wan-AI/Wan2.2-TI2V-5B-Diffusers: WanTransformer3DModel (30 blocks, 24 x 128, ffn 14336, 48 latent "
        "channels), UMT5-XXL, AutoencoderKLWan of Wan 2.2 (16x spatial with its 2x2 patchify, 4x temporal, z_dim 48)",
        transformer=Component(library="diffusers", cls="WanTransformer3DModel", config=dict(
            patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
            text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6)),
        text_encoders={"text_encoder": Component(library="transformers", cls="UMT5EncoderModel", config=_UMT5_XXL)},
        vae=Component(library="diffusers", cls="AutoencoderKLWan", config=dict(
            base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
            scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)),
        **_spec("wan22-ti2v-5b"),
    ),
    "hunyuanvideo15": Checkpoint(
        source="HunyuanVideo 1.5 (diffusers 0.42.1 defaults): HunyuanVideo15Transformer3DModel (54 blocks, 16 x 128), "
        "Qwen2.5-VL-7B's language model, ByT5-small (glyphs), AutoencoderKLHunyuanVideo15 (16x spatial, 4x temporal)",
        transformer=Component(library="diffusers", cls="HunyuanVideo15Transformer3DModel"),
        text_encoders={
            "text_encoder": Component(library="transformers", cls="Qwen2_5_VLTextModel", config=_QWEN25_VL_7B_TEXT),
            "text_encoder_2": Component(library="transformers", cls="T5EncoderModel", config=_BYT5_SMALL)},
        vae=Component(library="diffusers", cls="AutoencoderKLHunyuanVideo15"), **_spec("hunyuanvideo15"),
    ),
    "ltx-video": Checkpoint(
        source="Lightricks/LTX-Video (diffusers 0.42.1 defaults): LTXVideoTransformer3DModel (28 blocks, 32 x 64), "
        "T5-XXL, AutoencoderKLLTXVideo (32x spatial, 8x temporal, 128 latent channels)",
        transformer=Component(library="diffusers", cls="LTXVideoTransformer3DModel"),
        text_encoders={"text_encoder": Component(library="transformers", cls="T5EncoderModel", config=_T5_XXL)},
        vae=Component(library="diffusers", cls="AutoencoderKLLTXVideo"),
        **{**_spec("ltx-video"), "text_tokens": 0},  # the text enters by cross-attention only
    ),
    "minimax-h3": Checkpoint(
        source="MiniMaxAI/MiniMax-H3 (diffusers 0.42.1 defaults): MiniMaxH3Transformer3DModel (50 blocks + 2 text "
        "refiner blocks, 56 x 128 over a 5376-wide stream), Qwen3-VL-32B (all 64 layers held, hidden_states[50] "
        "read), AutoencoderKLMiniMaxH3 (16x spatial, 17 frames -> 5 latent frames); the audio VAE (0.15 B) not counted",
        transformer=Component(library="diffusers", cls="MiniMaxH3Transformer3DModel"),
        text_encoders={"text_encoder": Component(library="transformers", cls="Qwen3VLForConditionalGeneration",
                                                 config=_QWEN3_VL_32B)},
        vae=Component(library="diffusers", cls="AutoencoderKLMiniMaxH3"), **_spec("minimax-h3"),
    ),
    "ltx2": Checkpoint(
        source="Lightricks/LTX-2 (diffusers 0.42.1 defaults, LTX-2's, not LTX-2.3's): LTX2VideoTransformer3DModel (48 "
        "blocks, video 32 x 128, audio 32 x 64), Gemma 3 12B, AutoencoderKLLTX2Video (32x spatial, 8x temporal, 128 "
        "latent channels); the text connectors (1.43 B), audio VAE (0.05 B) and vocoder (0.06 B) not counted",
        transformer=Component(library="diffusers", cls="LTX2VideoTransformer3DModel"),
        text_encoders={"text_encoder": Component(library="transformers", cls="Gemma3ForConditionalGeneration",
                                                 config=_GEMMA3_12B)},
        vae=Component(library="diffusers", cls="AutoencoderKLLTX2Video"),
        **_spec("ltx2"),  # text_tokens 0: the text enters by cross-attention only
    ),
    "qwen-image-2.1": Checkpoint(
        source="Qwen/Qwen-Image-2.1 (diffusers 0.42.1 defaults): QwenImage21Transformer2DModel (32 single-stream "
        "blocks, 32 x 128), Qwen3-VL-8B, AutoencoderKLQwenImage21 (16x spatial, 64 latent channels)",
        transformer=Component(library="diffusers", cls="QwenImage21Transformer2DModel"),
        text_encoders={"text_encoder": Component(library="transformers", cls="Qwen3VLForConditionalGeneration",
                                                 config=_QWEN3_VL_8B)},
        vae=Component(library="diffusers", cls="AutoencoderKLQwenImage21"), **_spec("qwen-image-2.1"),
    ),
    "zimage-turbo": Checkpoint(
        source="Tongyi-MAI/Z-Image-Turbo (diffusers 0.42.1 defaults): ZImageTransformer2DModel (30 layers + 2 + 2 "
        "refiners, 30 x 128, dim 3840), Qwen3-4B, FLUX's AutoencoderKL",
        transformer=Component(library="diffusers", cls="ZImageTransformer2DModel"),
        text_encoders={"text_encoder": Component(library="transformers", cls="Qwen3Model", config=_QWEN3_4B)},
        vae=_kl_vae(), **_spec("zimage-turbo"),
    ),
}


def _footprint_config(config: dict[str, Any]) -> dict[str, Any]:
    """A transformer config with the keys footprint reads: Z-Image names its heads, width and layers
    `n_heads`, `dim`, `n_layers` (its refiners, `n_refiner_layers` each for image and text, counted as layers)."""
    if "n_heads" not in config or "num_attention_heads" in config:
        return config
    return {**config, "num_attention_heads": config["n_heads"], "attention_head_dim": config["dim"] // config["n_heads"],
            "num_layers": config["n_layers"] + 2 * config.get("n_refiner_layers", 0)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelCounts:
    """What footprint needs of one model: configs for the activation estimate, parameter counts for the weights."""

    name: str
    checkpoint: bool
    """A real checkpoint (run in bf16 on accelerators), not a preset."""
    family: str
    """The transformer's class name."""
    transformer_config: dict[str, Any]
    vae_config: dict[str, Any]
    transformer_params: int
    block_params: int
    """Parameters of the transformer's largest block (what a sharded rank gathers at a time)."""
    text_encoders: dict[str, tuple[str, int]]
    """Component name -> (class name, parameters)."""
    encoder_layer_params: dict[str, int] = field(default_factory=dict)
    """Component name -> parameters of its largest leaf module (what an offloaded encoder streams at a time)."""
    vae_halo: int | None = None
    """Rows a band borrows from each neighbour per convolution with `--parallel-vae` (bands.HALO_ROWS); None: not split."""
    experts: int = 1
    """Transformers of this config held (Wan 2.2 A14B: 2)."""
    linear_weights: int = 0
    """Parameters in the weights of the transformer's linear layers (what `--quantize` stores in one byte)."""
    linear_rows: int = 0
    """Output rows of those layers (each gets its scale, and an int8 zero point, when quantized)."""
    float8_stored: int = 0
    """Parameters of the transformer that diffusers' layerwise casting stores in float8
    (`--quantize float8storage`: its linear and convolution layers outside norms and embeddings)."""
    encoder_quantizable: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Component name -> a text encoder's (linear weights, their rows, parameters stored in float8):
    what `--quantize-text-encoders` stores in one byte, as the three counts above are the transformer's."""
    vae_params: int
    text_tokens: int
    cfg: str
    pixel_multiple: int
    temporal_factor: int = 1
    frame_chunk: tuple[int, int] | None = None
    default_frames: int = 1
    default_size: tuple[int, int] = (1024, 1024)

    @property
    def heads(self) -> int:
        return int(self.transformer_config["num_attention_heads"])

    @property
    def video(self) -> bool:
        return self.temporal_factor > 1


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _largest_leaf(module: nn.Module) -> int:
    """Parameters of `module`'s largest leaf (an embedding, a linear layer): what leaf-level offloading holds at a time."""
    return max((_params(m) for m in module.modules() if not list(m.children())), default=0)


def _halo(vae: nn.Module) -> int | None:
    from ..engine.vae.bands import HALO_ROWS
    from ..engine.vae import splits

    # the 2D and the video VAEs alike: every convolution borrows a row of each neighbouring band
    return HALO_ROWS if splits(vae) else None


def _largest_block(module: nn.Module) -> int:
    """Parameters of the largest element of any ModuleList in `module` (its transformer blocks)."""
    return max((_params(block) for child in module.modules() if isinstance(child, nn.ModuleList) for block in child),
               default=0)


def _build(component: Component) -> nn.Module:
    """`component` on the meta device: shapes only, nothing allocated."""
    if component.library == "diffusers":
        import diffusers

        with torch.device("meta"):
            return getattr(diffusers, component.cls).from_config(component.config)
    import transformers

    cls = getattr(transformers, component.cls)
    with torch.device("meta"):
        return cls(cls.config_class(**component.config))


def _counts_of(name: str, transformer: nn.Module, vae: nn.Module, encoders: dict[str, nn.Module], **rest: Any) -> ModelCounts:
    weights, rows = _linear_counts(transformer)
    quantizable = {key: (*_linear_counts(m), _float8_stored(m)) for key, m in encoders.items()}
    return ModelCounts(
        name=name, family=type(transformer).__name__, transformer_config=_footprint_config(dict(transformer.config)),
        vae_config=dict(vae.config), transformer_params=_params(transformer), block_params=_largest_block(transformer),
        text_encoders={key: (type(m).__name__, _params(m)) for key, m in encoders.items()}, vae_params=_params(vae),
        encoder_layer_params={key: _largest_leaf(m) for key, m in encoders.items()}, vae_halo=_halo(vae),
        linear_weights=weights, linear_rows=rows,
        float8_stored=_float8_stored(transformer), encoder_quantizable=quantizable, **rest,
    )


def _linear_counts(module: nn.Module) -> tuple[int, int]:
    """(weights, output rows) of `module`'s linear layers, a weight shared by two layers counted once."""
    linears = list({id(m.weight): m for m in module.modules() if isinstance(m, nn.Linear)}.values())
    return sum(m.weight.numel() for m in linears), sum(m.out_features for m in linears)


def _float8_stored(module: nn.Module) -> int:
    """Parameters of `module` that diffusers' layerwise casting stores in float8, counted on a copy
    as `--quantize float8storage` stores them."""
    from .quantize import store_float8

    model = copy.deepcopy(module)
    store_float8(model)
    return sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)


def _checkpoint(name: str) -> ModelCounts:
    spec = CHECKPOINTS[name]
    encoders = {key: _build(c) for key, c in spec.text_encoders.items()}
    return _counts_of(
        name, _build(spec.transformer), _build(spec.vae), encoders, checkpoint=True, text_tokens=spec.text_tokens,
        cfg=spec.cfg, pixel_multiple=spec.pixel_multiple, temporal_factor=spec.temporal_factor,
        frame_chunk=spec.frame_chunk, default_frames=spec.default_frames, default_size=spec.default_size,
        experts=spec.experts,
    )


def _preset(name: str) -> ModelCounts:
    from .presets import PRESETS, load_pipeline
    from ..engine.families.pipelines import uses_cfg

    preset = PRESETS[name]
    pipe, encoder = load_pipeline(name)
    encoders = {key: m for key, m in pipe.components.items() if key.startswith("text_encoder") and m is not None}
    if encoder is not None:
        encoders["text_encoder" if "text_encoder" not in encoders else "text_encoder_preset"] = encoder
    batched = any(cls.__name__.startswith("StableDiffusion3") for cls in type(pipe).__mro__)  # CFG as a batch of 2
    cfg = "none" if not uses_cfg(pipe) else "batch" if batched else "calls"
    return _counts_of(
        name, pipe.transformer, pipe.vae, encoders, checkpoint=False,
        text_tokens=encoder([""])[0].shape[1] if encoder is not None else 0, cfg=cfg,
        pixel_multiple=preset.pixel_multiple, default_size=(preset.default_size, preset.default_size),
        experts=2 if getattr(pipe, "transformer_2", None) is not None else 1,  # tiny-wan22: Wan 2.2 A14B's two
    )


def _folder(path: Path) -> ModelCounts:
    from .catalog import TEXT_TOKENS

    index = json.loads((path / "model_index.json").read_text())
    parts: dict[str, nn.Module] = {}
    for key, value in index.items():
        if key.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] not in ("diffusers", "transformers"):
            continue
        if key != "transformer" and key != "vae" and not key.startswith("text_encoder"):
            continue
        config = json.loads((path / key / "config.json").read_text())
        config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "model_type", "transformers_version")}
        parts[key] = _build(Component(library=value[0], cls=value[1], config=config))
    if "transformer" not in parts or "vae" not in parts:
        raise UsageError(f"--model {path}: footprint needs a transformer and a vae in its model_index.json")
    vae = parts["vae"].config
    factor = 2 ** (len(vae.get("block_out_channels") or [0] * 4) - 1)
    encoders = {k: m for k, m in parts.items() if k.startswith("text_encoder")}
    guided = index.get("_class_name", "").startswith("StableDiffusion3")
    return _counts_of(str(path), parts["transformer"], parts["vae"], encoders, checkpoint=True, text_tokens=TEXT_TOKENS,
                      cfg="batch" if guided else "none", pixel_multiple=factor * 2)


@functools.lru_cache(maxsize=None)
def count_model(model: str) -> ModelCounts:
    """The counts of a checkpoint name, a preset or a local folder; a one-line UsageError otherwise."""
    from .presets import PRESETS, check_model

    if model in CHECKPOINTS:
        return _checkpoint(model)
    if model in PRESETS:
        return _preset(model)
    known = f"a preset ({', '.join(PRESETS)}), a known checkpoint ({', '.join(CHECKPOINTS)}) or a local pipeline folder"
    if not Path(model).is_dir():
        raise UsageError(f"--model {model!r} is not {known} (footprint reads configs offline: no hub ids)")
    check_model(model)
    try:
        return _folder(Path(model))
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise UsageError(f"--model {model}: its configs could not be read ({error})") from None


@functools.lru_cache(maxsize=None)
def transformer_units(model: str) -> tuple[int, tuple[int, ...]]:
    """(the root's parameters, each repeated block's parameters in the order they run): the units
    that `--shard-weights on` gathers one at a time (engine/shard.py: `repeated_blocks`, then the root takes
    the rest), of a checkpoint's transformer (its config on `meta`) or a preset's; a one-line
    UsageError for any other name."""
    from ..engine.families import family_of
    from ..engine.shard import repeated_blocks

    transformer = _transformer(model)
    blocks = tuple(_params(block) for block in repeated_blocks(transformer, family_of(transformer)))
    return _params(transformer) - sum(blocks), blocks


def stage_blocks(model: str) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(the parameters outside the blocks, each block's parameters, each block's cost per image
    token) in the order the blocks run, as engine/stages.py cuts pipeline stages (`token_params`)."""
    from ..engine.cache.steps import cache_blocks
    from ..engine.stages import token_params

    transformer = _transformer(model)
    blocks = cache_blocks(transformer)
    params = tuple(_params(block) for block in blocks)
    return _params(transformer) - sum(params), params, tuple(token_params(block) for block in blocks)


def _transformer(model: str) -> Any:
    """A checkpoint's transformer on `meta` (from its config) or a preset's; a one-line UsageError otherwise."""
    from .presets import PRESETS, load_pipeline

    if model in CHECKPOINTS:
        return _build(CHECKPOINTS[model].transformer)
    if model in PRESETS:
        return load_pipeline(model)[0].transformer
    raise UsageError(f"--model {model!r}: no parameter counts offline (known: {', '.join([*CHECKPOINTS, *PRESETS])})")
