"""Tiny configurations of diffusers' video (and audio) transformer classes with no `_cp_plan` (test-only).

Each case builds its model with `torch.manual_seed(0)` (eval mode, fp32) and its forward arguments from
`torch.Generator().manual_seed(1)`, shaped as the class's pipeline calls it: batch 1, 4 attention heads of
8 or 16 channels, 2 blocks per block list, and 45 video tokens (3 frames x 3 x 5 after patching, odd and
not divisible by 4) against 11 text tokens, unless a comment says otherwise. Parameters that diffusers
initialises to zero (gates, modulation, embeddings) are drawn at random instead, so that every block changes
its input and a misplaced split shows in the output.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import diffusers
from diffusers.models.transformers import transformer_wan_animate_2
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache
from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline  # diffusers' top level: a stub without cv2

__all__ = ["CASES"]

Case = tuple[torch.nn.Module, dict[str, Any]]

FRAMES, HEIGHT, WIDTH = 3, 6, 10
"""Latent video (frames, height, width): 3 x 3 x 5 = 45 tokens after a (1, 2, 2) patch."""
TEXT, TEXT_DIM, POOLED_DIM = 11, 24, 12
"""Text tokens, their channels, and the pooled text embedding's channels."""


def _model(cls: type[torch.nn.Module], **config: Any) -> torch.nn.Module:
    """`cls(**config)` built from seed 0, its all-zero parameters redrawn, in eval mode."""
    torch.manual_seed(0)
    model = cls(**config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.numel() > 1 and not parameter.any():
                parameter.normal_(0.0, 0.1)
    return model


def _gen() -> torch.Generator:
    """The generator every case draws its inputs from."""
    return torch.Generator().manual_seed(1)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal values of `shape`, drawn from `g`."""
    return torch.randn(*shape, generator=g)


def _text_mask(length: int = TEXT, padding: int = 2) -> torch.Tensor:
    """A prompt mask padded at the end, as a tokenizer pads to max_length."""
    mask = torch.ones(1, length, dtype=torch.long)
    mask[:, length - padding:] = 0
    return mask


def _pipeline_rope(pipeline: type, model: torch.nn.Module, *args: Any) -> Any:
    """The rotary embedding `pipeline._prepare_rotary_positional_embeddings(*args)` hands `model`, sizes in latents."""
    owner = SimpleNamespace(transformer=model, vae_scale_factor_spatial=1)
    return pipeline._prepare_rotary_positional_embeddings(owner, *args)


def _skyreels_v2() -> Case:
    """SkyReels-V2 (Wan-like): self-attention over the video, cross-attention to the text."""
    model = _model(diffusers.SkyReelsV2Transformer3DModel, patch_size=(1, 2, 2), num_attention_heads=4,
                   attention_head_dim=8, in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=16,
                   ffn_dim=48, num_layers=2, rope_max_seq_len=32)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "return_dict": False}


def _hunyuan_video() -> Case:
    """HunyuanVideo: dual-stream then single-stream blocks, text refined first, a joint padding mask."""
    model = _model(diffusers.HunyuanVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=4,
                   attention_head_dim=8, num_layers=2, num_single_layers=2, num_refiner_layers=2, mlp_ratio=2.0,
                   patch_size=2, patch_size_t=1, guidance_embeds=True, text_embed_dim=TEXT_DIM,
                   pooled_projection_dim=POOLED_DIM, rope_axes_dim=(4, 2, 2))
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "encoder_attention_mask": _text_mask(),
                   "pooled_projections": _randn(g, 1, POOLED_DIM), "guidance": torch.tensor([6000.0]),
                   "return_dict": False}


def _cosmos() -> Case:
    """Cosmos (text2world): head dim 16 (its RoPE's height/width parts need more than 2 channels); no padding
    mask channel (`concat_padding_mask=False`: resizing that mask needs torchvision, not installed here)."""
    model = _model(diffusers.CosmosTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=4,
                   attention_head_dim=16, num_layers=2, mlp_ratio=2.0, text_embed_dim=TEXT_DIM, adaln_lora_dim=8,
                   max_size=(8, 16, 16), patch_size=(1, 2, 2), concat_padding_mask=False)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([0.5]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "fps": 24, "return_dict": False}


def _kandinsky5() -> Case:
    """Kandinsky 5 T2V: text blocks, then visual blocks cross-attending to the text (latents [B, T, H, W, C]);
    called with return_dict=True, as its pipeline does: its return_dict=False returns a bare tensor."""
    model = _model(diffusers.Kandinsky5Transformer3DModel, in_visual_dim=4, in_text_dim=TEXT_DIM,
                   in_text_dim2=POOLED_DIM, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2), model_dim=32,
                   ff_dim=48, num_text_blocks=2, num_visual_blocks=2, axes_dims=(4, 2, 2))
    g = _gen()
    rope = [torch.arange(FRAMES), torch.arange(HEIGHT // 2), torch.arange(WIDTH // 2)]
    return model, {"hidden_states": _randn(g, 1, FRAMES, HEIGHT, WIDTH, 4),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "timestep": torch.tensor([500.0]),
                   "pooled_projections": _randn(g, 1, POOLED_DIM), "visual_rope_pos": rope,
                   "text_rope_pos": torch.arange(TEXT), "scale_factor": (1.0, 1.0, 1.0), "sparse_params": None,
                   "return_dict": True}


def _kandinsky6() -> Case:
    """Kandinsky 6 T2VA with audio (its pipeline's default): per-modality text blocks, then fused video/audio
    blocks; 21 audio tokens."""
    model = _model(diffusers.Kandinsky6Transformer3DModel, in_visual_dim=4, out_visual_dim=4, in_text_dim=TEXT_DIM,
                   in_text_dim2=POOLED_DIM, time_dim=16, patch_size=(1, 2, 2), model_dim=32, ff_dim=48,
                   num_text_blocks=2, num_visual_blocks=2, axes_dims=(4, 2, 2), visual_cond=True, in_audio_dim=6,
                   out_audio_dim=6, text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, FRAMES, HEIGHT, WIDTH, 2 * 4 + 1),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "pooled_projections": _randn(g, 1, POOLED_DIM), "timestep": torch.tensor([500.0]),
                   "audio_hidden_states": _randn(g, 1, 21, 6), "encoder_attention_mask": _text_mask().bool(),
                   "return_dict": False}


def _kandinsky6_sr() -> Case:
    """Kandinsky 6 SR: NABLA attention groups 8 x 8 tokens, so the grid is 3 frames x 8 x 8 = 192 tokens
    (a multiple of 64: odd or not divisible by 4 cannot be had); no text."""
    model = _model(diffusers.Kandinsky6SRTransformer3DModel, in_visual_dim=4, out_visual_dim=4, time_dim=16,
                   patch_size=(1, 1, 1), model_dim=32, ff_dim=48, num_visual_blocks=2, axes_dims=(4, 2, 2),
                   nabla_window=(3, 3, 3))
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, FRAMES, 8, 8, 2 * 4 + 1), "timestep": torch.tensor([500.0]),
                   "return_dict": False}


def _motif_video() -> Case:
    """Motif-Video T2V: latents, condition and mask stacked on channels; dual- then single-stream blocks."""
    model = _model(diffusers.MotifVideoTransformer3DModel, in_channels=2 * 4 + 1, out_channels=4,
                   num_attention_heads=4, attention_head_dim=8, num_layers=2, num_single_layers=2, mlp_ratio=2.0,
                   patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM, rope_axes_dim=(4, 2, 2))
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 2 * 4 + 1, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "encoder_attention_mask": _text_mask(),
                   "return_dict": False}


def _sana_video() -> Case:
    """Sana-Video: linear self-attention, cross-attention to the masked text, temporal conv in the FFN."""
    model = _model(diffusers.SanaVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=4,
                   attention_head_dim=8, num_layers=2, num_cross_attention_heads=4, cross_attention_head_dim=8,
                   cross_attention_dim=32, caption_channels=TEXT_DIM, patch_size=(1, 2, 2), rope_max_seq_len=32)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "timestep": torch.tensor([500.0]),
                   "encoder_attention_mask": _text_mask(), "return_dict": False}


def _sana_wm() -> Case:
    """SANA-WM stage 1: GDN (linear) and softmax camera-conditioned attention, patch (1, 1, 1), per-frame
    timesteps, the text as [B, 1, L, C]; camera raymap [B, F, 20] (c2w + fx, fy, cx, cy) and Plucker maps."""
    model = _model(diffusers.SanaWMTransformer3DModel, in_channels=4, num_layers=2, hidden_size=32,
                   num_attention_heads=4, softmax_every_n=2, linear_head_dim=8, chunk_plucker_channels=6,
                   chunk_plucker_post_attn_blocks=2, caption_channels=TEXT_DIM, mlp_ratio=2.0)
    g = _gen()
    frames, height, width = FRAMES, HEIGHT // 2, WIDTH // 2
    c2w = torch.eye(4).repeat(frames, 1, 1)
    c2w[:, 2, 3] = torch.arange(frames) * 0.1  # the camera moves forward
    intrinsics = torch.tensor([float(width), float(width), width / 2, height / 2]).repeat(frames, 1)
    camera = torch.cat([c2w.flatten(1), intrinsics], dim=1)[None]
    return model, {"hidden_states": _randn(g, 1, 4, frames, height, width),
                   "timestep": torch.tensor([[[0.0, 700.0, 700.0]]]),
                   "encoder_hidden_states": _randn(g, 1, 1, TEXT, TEXT_DIM), "mask": _text_mask(),
                   "camera_conditions": camera, "chunk_plucker": _randn(g, 1, 6, frames, height, width),
                   "return_dict": False}


def _sana_wm_refiner() -> Case:
    """SANA-WM stage 2 (LTX-2 refiner), one denoising step of an AR window as its pipeline runs it
    (`kv_cache_mode="inject"`): 45 active tokens attend to a cached 15-token attention sink and 15 tokens
    of refined history; tokens packed [B, S, C], per-token timesteps, RoPE for absolute frame positions."""
    model = _model(diffusers.SanaWMLTX2RefinerTransformer3DModel, in_channels=4, out_channels=4,
                   num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32, audio_in_channels=4,
                   audio_out_channels=4, audio_num_attention_heads=4, audio_attention_head_dim=4,
                   audio_cross_attention_dim=16, num_layers=2, caption_channels=TEXT_DIM)
    g = _gen()
    height, width, frame = HEIGHT // 2, WIDTH // 2, (HEIGHT // 2) * (WIDTH // 2)
    cache = SanaWMRefinerKVCache(2)
    cache.sink_pe = model.build_rotary_emb_for_absolute_positions(1, [0], height, width, torch.device("cpu"), 24.0)
    for layer in cache.layer_caches:
        layer.store_sink(_randn(g, 1, frame, 32), _randn(g, 1, frame, 32))
        layer.store_history(_randn(g, 1, frame, 32), _randn(g, 1, frame, 32))
    rope = model.build_rotary_emb_for_absolute_positions(1, [2, 3, 4], height, width, torch.device("cpu"), 24.0)
    return model, {"hidden_states": _randn(g, 1, FRAMES * frame, 4),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "timestep": torch.full((1, FRAMES * frame), 700.0), "video_rotary_emb": rope,
                   "encoder_attention_mask": _text_mask(), "kv_cache": cache, "kv_cache_mode": "inject",
                   "return_dict": False}


def _wan_animate() -> Case:
    """Wan2.2-Animate: a reference frame before 2 pose-driven frames (3 x 3 x 5 tokens), the face video
    (5 pixel frames of 8 x 8, for the 2 latent frames) through the motion and face encoders into a face
    adapter after each block, 7 CLIP image tokens before the text."""
    model = _model(diffusers.WanAnimateTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=4,
                   attention_head_dim=8, in_channels=2 * 4 + 4, latent_channels=4, out_channels=4,
                   text_dim=TEXT_DIM, freq_dim=16, ffn_dim=48, num_layers=2, image_dim=20, rope_max_seq_len=32,
                   motion_encoder_channel_sizes={"8": 8, "4": 8}, motion_encoder_size=8, motion_style_dim=16,
                   motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16, face_encoder_num_heads=4,
                   inject_face_latents_blocks=1, motion_encoder_batch_size=8)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 2 * 4 + 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "encoder_hidden_states_image": _randn(g, 1, 7, 20),
                   "pose_hidden_states": _randn(g, 1, 4, FRAMES - 1, HEIGHT, WIDTH),
                   "face_pixel_values": _randn(g, 1, 3, 4 * (FRAMES - 2) + 1, 8, 8), "return_dict": False}


def _wan_animate2() -> Case:
    """Wan-Animate-2, one denoising step (`kv_cache_mode="cached"`): 2 generated frames plus the reference
    slot (3 x 3 x 5 tokens), conditioning latents stacked on channels, the text padded to `text_len` (11),
    and the reference pass's pre-RoPE keys/values (2 x 3 x 5 tokens) in the cache; no CLIP image branch
    (`use_img_emb=False`: its projection is fixed at 1280 channels). The forward's flex block mask is
    built with `_compile=True` (18 s of inductor on CPU), so the case builds the same mask uncompiled
    first, into the model's own mask cache."""
    model = _model(diffusers.WanAnimate2Transformer3DModel, patch_size=(1, 2, 2), text_len=TEXT, in_dim=4 + 8,
                   dim=32, ffn_dim=48, freq_dim=16, text_dim=TEXT_DIM, out_dim=4, num_heads=4, num_layers=2,
                   use_img_emb=False)
    g = _gen()
    frames, hw = FRAMES - 1, (HEIGHT // 2) * (WIDTH // 2)
    # the segment in pixels: origin_len // 4 + 1 latent frames, h * w / 256 tokens a frame
    origin_len, origin_area = 4 * (frames - 1) + 1, [8 * HEIGHT, 8 * WIDTH]

    def uncompiled(*args: Any, _compile: bool = False, **kwargs: Any) -> BlockMask:
        return create_block_mask(*args, **kwargs)

    with mock.patch.object(transformer_wan_animate_2, "create_block_mask", uncompiled):
        model.block_masks[(frames, hw)] = model.create_mask(frames, hw, torch.device("cpu"))
    cache = transformer_wan_animate_2.WanAnimate2KVCache(2)
    for layer in cache.layer_caches:
        layer.store(_randn(g, 1, frames * hw, 4, 8), _randn(g, 1, frames * hw, 4, 8))
    return model, {"hidden_states": [_randn(g, 4, FRAMES, HEIGHT, WIDTH)], "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": [_randn(g, 9, TEXT_DIM)],
                   "condition_latents": [_randn(g, 8, FRAMES, HEIGHT, WIDTH)], "kv_cache": cache,
                   "kv_cache_mode": "cached", "seq_len": FRAMES * hw,
                   "reference_grid_sizes": torch.tensor([[frames, HEIGHT // 2, WIDTH // 2]]), "origin_len": origin_len,
                   "origin_area": origin_area, "return_dict": False}


def _anyflow() -> Case:
    """AnyFlow (bidirectional flow map): latents [B, F, C, H, W], per-frame source and target timesteps."""
    model = _model(diffusers.AnyFlowTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=4,
                   attention_head_dim=8, in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=48,
                   num_layers=2, rope_max_seq_len=32)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, FRAMES, 4, HEIGHT, WIDTH),
                   "timestep": torch.full((1, FRAMES), 800.0), "r_timestep": torch.full((1, FRAMES), 500.0),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "return_dict": False}


def _anyflow_far() -> Case:
    """AnyFlow FAR (causal, flex attention), a denoising step of the second chunk with the KV cache, as its
    pipeline runs it: chunks (1, 3), the first one's 15 tokens cached; the 3-frame chunk is the 45 tokens."""
    model = _model(diffusers.AnyFlowFARTransformer3DModel, patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4),
                   full_chunk_limit=3, num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                   text_dim=TEXT_DIM, freq_dim=16, ffn_dim=48, num_layers=2, rope_max_seq_len=32,
                   chunk_partition=(1, FRAMES))
    g = _gen()
    partition, limit = (1, FRAMES), 3
    full, compressed = (HEIGHT // 2) * (WIDTH // 2), (HEIGHT // 4) * (WIDTH // 4)  # tokens a frame
    cache = {  # [keys/values, batch, heads, tokens, head dim], as the pipeline allocates it
        layer: {"full_cache": torch.zeros(2, 1, 4, limit * max(partition) * full, 8),
                "compressed_cache": torch.zeros(2, 1, 4, (len(partition) - limit + 1) * max(partition) * compressed, 8)}
        for layer in range(2)}
    for layer in cache.values():
        layer["full_cache"][:, :, :, :full] = _randn(g, 2, 1, 4, full, 8)  # the first chunk's keys and values
    return model, {"hidden_states": _randn(g, 1, FRAMES, 4, HEIGHT, WIDTH),
                   "timestep": torch.full((1, FRAMES), 800.0), "r_timestep": torch.full((1, FRAMES), 500.0),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "chunk_partition": list(partition),
                   "kv_cache": cache, "kv_cache_flag": {"num_cached_chunks": 1, "is_cache_step": False},
                   "return_dict": False}


def _ace_step() -> Case:
    """ACE-Step 1.5 (audio, 1-D): 90 latent frames patched by 2 into 45 tokens, a sliding-window layer then
    a full one, cross-attention to 11 condition tokens; 4 key/value heads (no GQA), so heads split 4 ways."""
    model = _model(diffusers.AceStepTransformer1DModel, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=8, in_channels=4 + 8,
                   audio_acoustic_hidden_dim=4, patch_size=2, sliding_window=8, encoder_hidden_size=TEXT_DIM)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 90, 4), "timestep": torch.tensor([0.7]),
                   "timestep_r": torch.tensor([0.7]), "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "context_latents": _randn(g, 1, 90, 8), "return_dict": False}


def _minimax_music3() -> Case:
    """MiniMax Music 3 (audio, 1-D): 44 latent frames with frame-aligned conditioning (no separate text),
    plus the timestep token the forward puts first: 45 tokens; partial RoPE on 8 of 16 head channels."""
    model = _model(diffusers.MiniMaxMusic3Transformer1DModel, in_channels=4, condition_dim=TEXT_DIM, num_layers=2,
                   num_attention_heads=4, attention_head_dim=16, ff_inner_dim=96, rotary_dim=8,
                   fourier_embedding_dim=16)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, 44), "timestep": torch.tensor([0.3]),
                   "encoder_hidden_states": _randn(g, 1, 44, TEXT_DIM), "return_dict": False}


def _allegro() -> Case:
    """Allegro: self-attention over the video with the pipeline's 3-axis RoPE (head dim 24: a third per axis,
    each even), cross-attention to the masked text."""
    model = _model(diffusers.AllegroTransformer3DModel, patch_size=2, patch_size_t=1, num_attention_heads=4,
                   attention_head_dim=24, in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=96,
                   caption_channels=TEXT_DIM)
    g = _gen()
    rope = _pipeline_rope(diffusers.AllegroPipeline, model, 1, HEIGHT, WIDTH, FRAMES, torch.device("cpu"))
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "encoder_attention_mask": _text_mask(),
                   "timestep": torch.tensor([500.0]), "image_rotary_emb": rope, "return_dict": False}


def _cogvideox() -> Case:
    """CogVideoX 1.0 (5B-like): text and video in one attention, RoPE on the video only; latents [B, F, C, H, W],
    integer DDIM timesteps."""
    model = _model(diffusers.CogVideoXTransformer3DModel, num_attention_heads=4, attention_head_dim=16, in_channels=4,
                   out_channels=4, time_embed_dim=32, text_embed_dim=TEXT_DIM, num_layers=2,
                   use_rotary_positional_embeddings=True)
    g = _gen()
    rope = _pipeline_rope(diffusers.CogVideoXPipeline, model, HEIGHT, WIDTH, FRAMES, torch.device("cpu"))
    return model, {"hidden_states": _randn(g, 1, FRAMES, 4, HEIGHT, WIDTH),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "timestep": torch.tensor([500]),
                   "image_rotary_emb": rope, "return_dict": False}


def _consisid() -> Case:
    """ConsisID: CogVideoX-like, the image latents stacked on channels, a face (id embedding and 2 ViT scales of
    7 tokens) through the local facial extractor into a Perceiver cross-attention after block 0."""
    model = _model(diffusers.ConsisIDTransformer3DModel, num_attention_heads=4, attention_head_dim=16,
                   in_channels=2 * 4, out_channels=4, time_embed_dim=32, text_embed_dim=TEXT_DIM, num_layers=2,
                   use_rotary_positional_embeddings=True, is_train_face=True, cross_attn_interval=2,
                   cross_attn_dim_head=8, cross_attn_num_heads=4, LFE_id_dim=12, LFE_vit_dim=16, LFE_depth=2,
                   LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2, LFE_num_querie=3,
                   LFE_output_dim=64 * 2 // 3, LFE_ff_mult=2, LFE_num_scale=2)
    g = _gen()
    rope = _pipeline_rope(ConsisIDPipeline, model, HEIGHT, WIDTH, FRAMES, torch.device("cpu"))
    return model, {"hidden_states": _randn(g, 1, FRAMES, 2 * 4, HEIGHT, WIDTH),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "timestep": torch.tensor([500]),
                   "image_rotary_emb": rope, "id_vit_hidden": [_randn(g, 1, 7, 16) for _ in range(2)],
                   "id_cond": _randn(g, 1, 12), "return_dict": False}


def _easyanimate() -> Case:
    """EasyAnimate V5.1: MMDiT blocks (text and video in one attention), RoPE computed inside; no text mask."""
    model = _model(diffusers.EasyAnimateTransformer3DModel, num_attention_heads=4, attention_head_dim=16,
                   in_channels=4, out_channels=4, patch_size=2, num_layers=2, mmdit_layers=2, time_embed_dim=32,
                   text_embed_dim=TEXT_DIM)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "return_dict": False}


def _hunyuan_video_framepack() -> Case:
    """FramePack F1 (vanilla sampling): the 45 window tokens after 44 history tokens (16 frames 4x-, 2 frames
    2x-compressed, the image and 1 frame clean): 89 in all; 7 SigLIP image tokens before the text, whose
    padding the forward drops (batch 1)."""
    model = _model(diffusers.HunyuanVideoFramepackTransformer3DModel, in_channels=4, out_channels=4,
                   num_attention_heads=4, attention_head_dim=16, num_layers=2, num_single_layers=2,
                   num_refiner_layers=2, mlp_ratio=2.0, text_embed_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM,
                   rope_axes_dim=(4, 6, 6), has_image_proj=True, image_proj_dim=20, has_clean_x_embedder=True)
    g = _gen()
    history = (16, 2, 1)
    _, i4x, i2x, i1x, window = torch.arange(1 + sum(history) + FRAMES).split([1, *history, FRAMES])
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "encoder_attention_mask": _text_mask().float(), "pooled_projections": _randn(g, 1, POOLED_DIM),
                   "image_embeds": _randn(g, 1, 7, 20), "indices_latents": window,
                   "guidance": torch.tensor([6000.0]), "latents_clean": _randn(g, 1, 4, 2, HEIGHT, WIDTH),
                   "indices_latents_clean": torch.cat([torch.tensor([0]), i1x]),
                   "latents_history_2x": _randn(g, 1, 4, 2, HEIGHT, WIDTH), "indices_latents_history_2x": i2x,
                   "latents_history_4x": _randn(g, 1, 4, 16, HEIGHT, WIDTH), "indices_latents_history_4x": i4x,
                   "return_dict": False}


def _latte() -> Case:
    """Latte: spatial blocks over each frame's 15 tokens (cross-attending to the text), temporal blocks over each
    patch's 3 frames; `video_length` is the frame count (its temporal embedding is added whole); learned sigma
    (8 output channels)."""
    model = _model(diffusers.LatteTransformer3DModel, num_attention_heads=4, attention_head_dim=16, in_channels=4,
                   out_channels=8, num_layers=2, cross_attention_dim=64, attention_bias=True, sample_size=8,
                   patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                   norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                   caption_channels=TEXT_DIM, video_length=FRAMES)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "timestep": torch.tensor([500]),
                   "enable_temporal_attentions": True, "return_dict": False}


def _mochi() -> Case:
    """Mochi: asymmetric joint attention (video and text with their own widths), the text masked per sample;
    the last block updates the video only."""
    model = _model(diffusers.MochiTransformer3DModel, patch_size=2, num_attention_heads=4, attention_head_dim=16,
                   num_layers=2, pooled_projection_dim=32, in_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=16,
                   max_sequence_length=TEXT)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM), "timestep": torch.tensor([500.0]),
                   "encoder_attention_mask": _text_mask().bool(), "return_dict": False}


def _wan_vace() -> Case:
    """Wan VACE: Wan blocks plus VACE blocks at layers 0 and 1 of 3 on the control video (inactive and reactive
    latents, then the 8 x 8 pixel mask folded into 64 channels), their hints added with per-layer scales. As in
    the released 14B (VACE at every fifth of 40 layers from 0), the last layer has none: a hint added after the
    last block would meet the gathered stream (refused in one line)."""
    model = _model(diffusers.WanVACETransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=4,
                   attention_head_dim=16, in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=96,
                   num_layers=3, rope_max_seq_len=32, vace_layers=[0, 1], vace_in_channels=2 * 4 + 64)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH), "timestep": torch.tensor([500.0]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "control_hidden_states": _randn(g, 1, 2 * 4 + 64, FRAMES, HEIGHT, WIDTH),
                   "control_hidden_states_scale": torch.tensor([1.0, 0.5]), "return_dict": False}


def _cosmos3_omni() -> Case:
    """Cosmos 3 Omni (text to video), unbatched packed tokens: 11 prompt tokens (a causal understanding pathway)
    then 45 video tokens (the generation pathway, attending to both); interleaved 3-D mRoPE with fps-scaled
    frame positions, segments laid out by the pipeline's own helpers; 4 key/value heads (no GQA)."""
    model = _model(diffusers.Cosmos3OmniTransformer, head_dim=16, hidden_size=64, intermediate_size=96,
                   latent_channel=4, latent_patch_size=2, num_attention_heads=4, num_hidden_layers=2,
                   num_key_value_heads=4, patch_latent_dim=4 * 2 * 2, vocab_size=64, rope_axes_dim=(4, 2, 2))
    g = _gen()
    owner = SimpleNamespace(transformer=model, vae_scale_factor_temporal=4)
    pipeline = diffusers.Cosmos3OmniPipeline
    text = pipeline._prepare_text_segment(owner, torch.randint(64, (TEXT,), generator=g).tolist(), "cpu")
    latents = _randn(g, 1, 4, FRAMES, HEIGHT, WIDTH)
    vision = pipeline._prepare_vision_segment(owner, latents, False, text["vision_start_temporal_offset"], 24.0,
                                              text["und_len"], "cpu")
    return model, {"input_ids": text["input_ids"], "text_indexes": text["text_indexes"],
                   "position_ids": torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
                   "und_len": text["und_len"], "sequence_length": text["und_len"] + vision["num_vision_tokens"],
                   "vision_tokens": [latents], "vision_token_shapes": vision["vision_token_shapes"],
                   "vision_sequence_indexes": vision["vision_sequence_indexes"],
                   "vision_mse_loss_indexes": vision["vision_mse_loss_indexes"],
                   "vision_timesteps": torch.full((vision["num_noisy_vision_tokens"],), 500.0),
                   "vision_noisy_frame_indexes": vision["vision_noisy_frame_indexes"], "return_dict": False}


def _longcat_audio_dit() -> Case:
    """LongCat-AudioDiT (audio, 1-D): 45 latent frames [B, T, C] with their all-true mask, a zero latent
    condition (as the text-to-audio pipeline passes), cross-attention to the masked text; timestep in [0, 1]."""
    model = _model(diffusers.LongCatAudioDiTTransformer, dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=TEXT_DIM,
                   latent_dim=4)
    g = _gen()
    return model, {"hidden_states": _randn(g, 1, 45, 4), "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "encoder_attention_mask": _text_mask().bool(), "timestep": torch.tensor([0.5]),
                   "attention_mask": torch.ones(1, 45, dtype=torch.bool), "latent_cond": torch.zeros(1, 45, 4),
                   "return_dict": False}


def _stable_audio() -> Case:
    """Stable Audio Open (audio, 1-D): the global (duration + timestep) token before 44 latent frames: 45 tokens;
    cross-attention to 9 text + 2 duration tokens; partial RoPE on half the head channels, from the pipeline;
    4 key/value heads (no GQA)."""
    model = _model(diffusers.StableAudioDiTModel, sample_size=44, in_channels=4, num_layers=2, attention_head_dim=16,
                   num_attention_heads=4, num_key_value_attention_heads=4, out_channels=4, cross_attention_dim=32,
                   time_proj_dim=16, global_states_input_dim=2 * TEXT_DIM, cross_attention_input_dim=TEXT_DIM)
    g = _gen()
    rope = diffusers.models.embeddings.get_1d_rotary_pos_embed(16 // 2, 1 + 44, use_real=True,
                                                               repeat_interleave_real=False)
    return model, {"hidden_states": _randn(g, 1, 4, 44), "timestep": torch.tensor([0.5]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "global_hidden_states": _randn(g, 1, 1, 2 * TEXT_DIM), "rotary_embedding": rope,
                   "return_dict": False}


def _stable_audio3() -> Case:
    """Stable Audio 3 (audio, 1-D): 5 memory tokens before 40 latent frames: 45 tokens; differential self- and
    cross-attention, partial RoPE; the context is 10 text tokens (2 padding) and a duration token."""
    model = _model(diffusers.StableAudio3DiTModel, io_channels=4, embed_dim=64, depth=2, num_heads=4,
                   cond_token_dim=TEXT_DIM, global_cond_dim=POOLED_DIM, local_add_cond_dim=5,
                   timestep_features_dim=16, ff_mult=2.0, num_memory_tokens=5)
    g = _gen()
    mask = torch.cat([_text_mask(TEXT - 1), torch.ones(1, 1, dtype=torch.long)], dim=1).bool()
    return model, {"hidden_states": _randn(g, 1, 4, 40), "timestep": torch.tensor([0.5]),
                   "encoder_hidden_states": _randn(g, 1, TEXT, TEXT_DIM),
                   "global_hidden_states": _randn(g, 1, POOLED_DIM), "encoder_attention_mask": mask,
                   "return_dict": False}


CASES: dict[str, Callable[[], Case]] = {
    "SkyReelsV2Transformer3DModel": _skyreels_v2,
    "HunyuanVideoTransformer3DModel": _hunyuan_video,
    "CosmosTransformer3DModel": _cosmos,
    "Kandinsky5Transformer3DModel": _kandinsky5,
    "Kandinsky6Transformer3DModel": _kandinsky6,
    "Kandinsky6SRTransformer3DModel": _kandinsky6_sr,
    "MotifVideoTransformer3DModel": _motif_video,
    "SanaVideoTransformer3DModel": _sana_video,
    "SanaWMTransformer3DModel": _sana_wm,
    "SanaWMLTX2RefinerTransformer3DModel": _sana_wm_refiner,
    "WanAnimateTransformer3DModel": _wan_animate,
    "WanAnimate2Transformer3DModel": _wan_animate2,
    "AnyFlowTransformer3DModel": _anyflow,
    "AnyFlowFARTransformer3DModel": _anyflow_far,
    "AceStepTransformer1DModel": _ace_step,
    "MiniMaxMusic3Transformer1DModel": _minimax_music3,
    "AllegroTransformer3DModel": _allegro,
    "CogVideoXTransformer3DModel": _cogvideox,
    "ConsisIDTransformer3DModel": _consisid,
    "EasyAnimateTransformer3DModel": _easyanimate,
    "HunyuanVideoFramepackTransformer3DModel": _hunyuan_video_framepack,
    "LatteTransformer3DModel": _latte,
    "MochiTransformer3DModel": _mochi,
    "WanVACETransformer3DModel": _wan_vace,
    "Cosmos3OmniTransformer": _cosmos3_omni,
    "LongCatAudioDiTTransformer": _longcat_audio_dit,
    "StableAudioDiTModel": _stable_audio,
    "StableAudio3DiTModel": _stable_audio3,
}
