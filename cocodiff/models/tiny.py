"""The tiny presets of the families added on the generic layer (engine/families/__init__.py, engine/attention/dispatch.py):
FLUX.2, Wan 2.1/2.2, LTX-Video, Z-Image and HunyuanVideo 1.5, as stock diffusers pipelines with
tiny configs (weights from the global RNG, seeded by `presets.load_pipeline`), a tiny seeded text
encoder in place of Mistral / UMT5 / T5 / Qwen3 / Qwen2.5-VL, and VAEs built in-process: nothing is
downloaded. Each returns (pipeline, text encoder); `presets.PRESETS` names them.
"""

from __future__ import annotations

from typing import Any

from .tiny_parts import TinyTextEncoder, vae_kl

__all__ = ["build_chroma", "build_cogview4", "build_flux2", "build_hunyuanvideo15", "build_hunyuanvideo15_i2v", "build_ltx", "build_ltx2", "build_qwen_image21",
           "build_wan", "build_wan22", "build_zimage"]


def build_flux2(pipeline: str = "Flux2Pipeline"):
    """FLUX.2; with `pipeline` "Flux2KleinPipeline", FLUX.2 [klein]'s: no guidance embedding in the
    transformer (classifier-free guidance instead: two calls per step) and the same references."""
    import diffusers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2x2
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=6,  # 4 does not divide it (FLUX.2-dev: 48)
        joint_attention_dim=32,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=pipeline == "Flux2Pipeline",
    )
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), latent_channels=4, norm_num_groups=8, layers_per_block=1,
        mid_block_add_attention=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    pipe = getattr(diffusers, pipeline)(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=transformer)
    return pipe, TinyTextEncoder(32, 32)


def build_wan():
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=6,  # Wan 2.1 14B: 40
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=64,
    )
    # Temporal factor 4, spatial 8, as the real Wan VAE; z_dim 16 matches its latent statistics.
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer)
    return pipe, TinyTextEncoder(32, 32)


def build_wan_ti2v():
    """Wan 2.2 TI2V-5B's layout: image-to-video with the image as the first latent frame, whose tokens
    carry their own timestep (zero: `expand_timesteps`, a (batch, tokens) timestep), no image encoder."""
    from diffusers import WanImageToVideoPipeline

    pipe, encoder = build_wan()
    parts = {name: getattr(pipe, name) for name in ("vae", "scheduler", "transformer")}
    return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, image_encoder=None, image_processor=None,
                                   expand_timesteps=True, **parts), encoder


def _wan_i2v_transformer(**extra: Any) -> Any:
    """tiny-wan's transformer for Wan 2.1 / 2.2 A14B image-to-video: its input is the noise (16
    channels) beside the first frame's condition (a 4-channel frame mask and 16 latent channels)."""
    from diffusers import WanTransformer3DModel

    pipe, _ = build_wan()
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}  # not `_use_default_values`
    return WanTransformer3DModel(**{**config, "in_channels": 36, **extra})


def build_wan22_i2v():
    """Wan 2.2 A14B image-to-video's layout: two experts (boundary 0.875), each taking the noise
    beside the first frame's latents and mask on the channels; no image encoder."""
    from diffusers import WanImageToVideoPipeline

    pipe, encoder = build_wan()
    high, low = _wan_i2v_transformer(), _wan_i2v_transformer()
    return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, image_encoder=None, image_processor=None,
                                   vae=pipe.vae, scheduler=pipe.scheduler, transformer=high, transformer_2=low,
                                   boundary_ratio=0.875), encoder


def build_wan21_i2v(last_frame: bool = False):
    """Wan 2.1 image-to-video's layout: the first frame's latents and mask beside the noise, and its
    CLIP image features as extra context of every cross-attention (a tiny CLIP vision encoder).
    `last_frame`: Wan 2.1 FLF2V's, which takes the clip's last frame too (its latents at the end,
    its CLIP features after the first's, both with a learned position: `pos_embed_seq_len`)."""
    import torch
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    pipe, encoder = build_wan()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    image_encoder = CLIPVisionModel(vision).eval()
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    image_tokens = (32 // 8) ** 2 + 1  # the patches and CLS of the penultimate hidden states
    positions = {"pos_embed_seq_len": 2 * image_tokens} if last_frame else {}
    transformer = _wan_i2v_transformer(image_dim=32, added_kv_proj_dim=96, **positions)  # 6 heads x 16
    if last_frame:  # diffusers starts the positions at zero; a checkpoint's are learned
        torch.nn.init.normal_(transformer.condition_embedder.image_embedder.pos_embed, std=0.5)
    return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, image_encoder=image_encoder,
                                   image_processor=processor, vae=pipe.vae, scheduler=pipe.scheduler,
                                   transformer=transformer), encoder


def build_wan22():
    """Wan 2.2 A14B's layout: two experts, `transformer` above the boundary timestep, `transformer_2` below."""
    from diffusers import WanTransformer3DModel

    pipe, encoder = build_wan()
    pipe.register_modules(transformer_2=WanTransformer3DModel.from_config(pipe.transformer.config))
    pipe.register_to_config(boundary_ratio=0.875)  # A14B's
    return pipe, encoder


def build_ltx():
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=6,  # 4 does not divide it (LTX-Video 2B: 32)
        attention_head_dim=16,
        cross_attention_dim=96,  # the heads' width: cross-attention reads the projected text
        num_layers=2,
        caption_channels=32,
    )
    # Spatial factor 16 and temporal 4 (the real one: 32 and 8), so a 64x64 clip of 9 frames has
    # 48 tokens; the pipeline still wants sizes that are multiples of 32.
    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 16, 16),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        patch_size=4,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096
    )
    pipe = LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)
    return pipe, TinyTextEncoder(32, 32)


def build_ltx_i2v():
    """LTX-Video's image-to-video: the image is the first latent frame, its tokens at timestep zero
    in a (batch, tokens) timestep (the conditioning mask)."""
    from diffusers import LTXImageToVideoPipeline

    pipe, encoder = build_ltx()
    parts = {name: getattr(pipe, name) for name in ("vae", "scheduler", "transformer")}
    return LTXImageToVideoPipeline(tokenizer=None, text_encoder=None, **parts), encoder


def build_ltx2(pipeline: str = "LTX2Pipeline"):
    """LTX-2 (`LTX2Pipeline`): a video stream and a stereo audio stream in one transformer, each
    with its own attention and its own text (a connector apiece), joined by audio-to-video and
    video-to-audio cross-attention; the audio decoded to a mel spectrogram and a waveform by the
    vocoder. With `pipeline` "LTX2ImageToVideoPipeline", the image is the first latent frame, its
    tokens at timestep zero (a (batch, tokens) timestep)."""
    import diffusers
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    caption, layers, mel_bins, audio_latent = 16, 2, 8, 2  # the prompt: 2 "encoder layers" of 16
    audio_packed = audio_latent * mel_bins // 4
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=6, attention_head_dim=8,  # 4 does not divide 6 (LTX-2: 32)
        cross_attention_dim=48,  # the video heads' width: cross-attention reads the projected text
        vae_scale_factors=(4, 16, 16),  # the VAE's below (the real one: 8, 32, 32)
        audio_in_channels=audio_packed, audio_out_channels=audio_packed,
        audio_num_attention_heads=6, audio_attention_head_dim=4,  # as many heads as the video (LTX-2: 32 each)
        audio_cross_attention_dim=24, num_layers=2, caption_channels=caption, rope_type="interleaved",
        rope_double_precision=False,
    )
    connectors = LTX2TextConnectors(
        caption_channels=caption, text_proj_in_factor=layers,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=caption // 2,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=caption // 2,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split",
    )
    # Spatial factor 16 and temporal 4, as tiny-ltx's: a 64x64 clip of 9 frames is 48 video tokens.
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"), upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False), upsample_factor=(1, 1), timestep_conditioning=False, patch_size=4,
        patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=audio_packed, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=audio_latent, norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
        mel_bins=mel_bins,
    )
    vocoder = LTX2Vocoder(  # 100 mel frames a second, 80 samples each: 8 kHz stereo
        in_channels=2 * mel_bins, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[16, 20],
        upsample_factors=[8, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=8000,
    )
    pipe = getattr(diffusers, pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
        connectors=connectors, transformer=transformer, vocoder=vocoder, processor=None, prompt_enhancer=None,
        duration_head=None,
    )
    return pipe, TinyTextEncoder(caption * layers, 32)


def build_zimage():
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(
        in_channels=16,
        dim=96,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=6,  # 4 does not divide it (Z-Image: 30)
        n_kv_heads=6,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],  # the head dim, 16
        axes_lens=[256, 64, 64],
    )
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae_kl(16), text_encoder=None, tokenizer=None,
        transformer=transformer,
    )
    return pipe, TinyTextEncoder(32, 32)


def build_zimage_omni():
    """Z-Image's editing layout (`ZImageOmniPipeline`, Z-Image-Omni): tiny-zimage's transformer
    with SigLIP features (`siglip_feat_dim`, a tiny SigLIP 2 vision encoder); each reference image's
    latents and SigLIP tokens join one sequence with the text's segments and the noise's, each token
    with its own timestep (the references' clean)."""
    from diffusers import ZImageOmniPipeline, ZImageTransformer2DModel
    from transformers import Siglip2ImageProcessorPil, Siglip2VisionConfig, Siglip2VisionModel

    pipe, encoder = build_zimage()
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    transformer = ZImageTransformer2DModel(**{**config, "siglip_feat_dim": 16})
    vision = Siglip2VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 patch_size=8, num_patches=16)
    siglip = Siglip2VisionModel(vision).eval()
    processor = Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16)
    return ZImageOmniPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None, tokenizer=None,
                              transformer=transformer, siglip=siglip, siglip_processor=processor), encoder


def build_hunyuanvideo15():
    from diffusers import (
        AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,  # latents, the (zero) image condition and its mask: 4 + 4 + 1
        out_channels=4,
        num_attention_heads=6,  # HunyuanVideo 1.5: 16
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=32,
        text_embed_2_dim=32,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
        task_type="t2v",
    )
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1)
    pipe = HunyuanVideo15Pipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=None, tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),  # two transformer calls per step
    )
    return pipe, TinyTextEncoder(32, 32)


def build_hunyuanvideo15_i2v():
    """HunyuanVideo 1.5 image-to-video's layout: the first frame's latents and mask beside the noise
    (the channels the text-to-video model gets as zeros), and its SigLIP image features as more
    context tokens after the text (a tiny SigLIP vision encoder, 16 features: `image_embed_dim`)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    pipe, encoder = build_hunyuanvideo15()
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)  # 16 image tokens
    i2v = HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=pipe.transformer, vae=pipe.vae, scheduler=pipe.scheduler,
        text_encoder_2=None, tokenizer_2=None, guider=pipe.guider, image_encoder=SiglipVisionModel(vision).eval(),
        feature_extractor=SiglipImageProcessorPil(size={"height": 32, "width": 32}))
    return i2v, encoder


def build_cogview4():
    """CogView4 (`CogView4Transformer2DModel`): a class with no `_cp_plan` and no plan written, its
    split plan inferred at its first call (engine/plan_inference.py); text and image attend as one
    stream, CFG as two calls per step, the GLM text encoder's padded prompt unmasked."""
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler

    transformer = CogView4Transformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=6, text_embed_dim=64, time_embed_dim=32, condition_dim=16, pos_embed_max_size=64,
        sample_size=32, rope_axes_dim=(8, 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
    pipe = CogView4Pipeline(tokenizer=None, text_encoder=None, vae=vae_kl(16), transformer=transformer, scheduler=scheduler)
    return pipe, TinyTextEncoder(64, 32)


def build_chroma():
    """Chroma (`ChromaTransformer2DModel`): FLUX.1's blocks with no `_cp_plan`, their modulation
    from a timestep approximator, its plan inferred at its first call; true CFG as two calls a
    step; its blocks attend with m_i * m_j of its float prompt mask (the engine's `chroma` record)."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=6,
        joint_attention_dim=64, axes_dims_rope=(8, 12, 12), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=2,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae_kl(16), text_encoder=None, tokenizer=None, transformer=transformer)
    return pipe, TinyTextEncoder(64, 32)


class _TemplateLength:
    """What `QwenImage21Pipeline.__init__` reads of its Qwen3-VL processor: the tokens of its system
    prompt (dropped from the encoder's output) and the id of its image placeholder. Both serve its
    own prompt encoding only; a preset's prompts are encoded by its tiny encoder, so no processor is
    kept (the constructor's reads are answered, then the component is set to None)."""

    class tokenizer:  # noqa: N801 (the processor's attribute)
        @staticmethod
        def encode(_text: str) -> list[int]:
            return [0]

    @staticmethod
    def apply_chat_template(*_args: Any, **_kwargs: Any) -> list[list[int]]:
        return [[0]]


def build_qwen_image21():
    """Qwen-Image 2.1 (`QwenImage21Transformer2DModel`, `QwenImage21Pipeline`): one block-causal
    stream [text, target image], patch 1 over a 16x VAE, its plan inferred at its first call and its
    attention the engine's `qwen_image21` processor; the pipeline's prefix K/V cache on (the text's
    keys and values kept from the first step), true CFG as two calls a step, each with its own cache."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=10,  # neither 4 nor 8 divides it (Qwen-Image 2.1: 32)
        context_in_dim=64, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage21(  # 16x, as the pipeline assumes (its vae_scale_factor is fixed)
        base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=None, processor=_TemplateLength(),
                               transformer=transformer)
    pipe.register_modules(processor=None)
    return pipe, TinyTextEncoder(64, 32)
