"""Tiny configurations of diffusers' image transformer classes with no `_cp_plan` (test-only).

Each case builds its model with `torch.manual_seed(0)` (eval mode, fp32) and its forward arguments from
`torch.Generator().manual_seed(1)`, as the class's pipeline hands them (`return_dict=False`). Every model has
4 attention heads, 2 layers per block list and a head dim of 16 (8 in Krea 2's text fusion); the stream its
blocks split holds an odd token count not divisible by 4 (21 image tokens, 25 in DiT's square grid, or 31 in a joint
text+image stream), and the text (9, 10 or 11 tokens, some models assembling it from several encoders or register
tokens) matches neither the image nor any width. Parameters that diffusers initialises to zero (gates, final layers,
modulation tables) are drawn at random instead, so that every block changes its input and a misplaced split shows
in the output.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import diffusers

__all__ = ["CASES"]

Case = tuple[torch.nn.Module, dict[str, Any]]

IMG_H, IMG_W = 3, 7  # 21 image tokens after patch embedding
IMG = IMG_H * IMG_W
TXT = 9  # text tokens of the dual-stream and cross-attention models
TXT_JOINT = 10  # text tokens where the blocks see text and image in one stream: 10 + 21 = 31


def _build(cls: type[torch.nn.Module], **config: Any) -> torch.nn.Module:
    """`cls(**config)` seeded with 0, its all-zero parameters redrawn, in eval mode."""
    torch.manual_seed(0)
    model = cls(**config)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.05)
    return model.eval()


def _gen() -> torch.Generator:
    """The generator every case draws its inputs from."""
    return torch.Generator().manual_seed(1)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    """A standard normal tensor drawn from `g`."""
    return torch.randn(*shape, generator=g)


def _grid_ids(h: int, w: int, first: float = 0.0, offset: int = 0) -> torch.Tensor:
    """[h * w, 3] position ids (first, row + offset, column + offset) of an image grid."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.stack([torch.full((h, w), first), rows + offset, cols + offset], dim=-1)
    return ids.reshape(h * w, 3).float()


def _text_mask(n: int, pad: int = 1) -> torch.Tensor:
    """[1, n] bool mask of a prompt whose last `pad` tokens are padding."""
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[:, n - pad:] = False
    return mask


def _flux_like(cls: type[torch.nn.Module], g: torch.Generator, **config: Any) -> Case:
    """Flux-style double + single stream models on packed latents with (t, h, w) ids, inputs drawn from `g`."""
    model = _build(cls, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                   axes_dims_rope=[4, 6, 6], **config)
    kwargs = {
        "hidden_states": _randn(g, 1, IMG, 16),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": _grid_ids(IMG_H, IMG_W),
        "txt_ids": torch.zeros(TXT, 3),
        "return_dict": False,
    }
    return model, kwargs


def _longcat() -> Case:
    """LongCat-Image: text ids run along both axes, image ids sit after the text (modality 1)."""
    model, kwargs = _flux_like(diffusers.LongCatImageTransformer2DModel, _gen(), patch_size=1, in_channels=16,
                               joint_attention_dim=24, pooled_projection_dim=24)
    ramp = torch.arange(TXT).float()
    kwargs["txt_ids"] = torch.stack([torch.zeros(TXT), ramp, ramp], dim=-1)
    kwargs["img_ids"] = _grid_ids(IMG_H, IMG_W, first=1.0, offset=TXT)
    return model, kwargs


def _ovis() -> Case:
    """Ovis-Image: Flux-like, text ids all zero."""
    return _flux_like(diffusers.OvisImageTransformer2DModel, _gen(), patch_size=1, in_channels=16, out_channels=16,
                      joint_attention_dim=24)


def _bria() -> Case:
    """Bria: Flux-like without pooled projections, timestep in [0, 1000]."""
    model, kwargs = _flux_like(diffusers.BriaTransformer2DModel, _gen(), patch_size=1, in_channels=16,
                               joint_attention_dim=24)
    kwargs["timestep"] = torch.tensor([500.0])
    return model, kwargs


def _bria_fibo() -> Case:
    """Bria FIBO: Flux-like, every block also reads its own text-encoder layer (`text_encoder_layers`)."""
    g = _gen()
    model, kwargs = _flux_like(diffusers.BriaFiboTransformer2DModel, g, patch_size=1, in_channels=16,
                               joint_attention_dim=24, text_encoder_dim=12)
    kwargs["timestep"] = torch.tensor([500.0])
    kwargs["text_encoder_layers"] = [_randn(g, 1, TXT, 12) for _ in range(4)]  # 2 double + 2 single blocks
    return model, kwargs


def _bria_fibo2() -> Case:
    """Bria FIBO 2: one stream of 10 gist tokens (a Perceiver's, from 9 text tokens) then 21 image tokens; no
    text mask, as the pipeline passes for a single unpadded prompt."""
    model = _build(
        diffusers.BriaFibo2Transformer2DModel, in_channels=8, patch_size=2, dim=64, n_layers=2, n_refiner_layers=2,
        n_heads=4, cap_feat_dim=24, injection_layer_ids=(1,), perceiver_num_layers=2, min_num_gist_tokens=TXT_JOINT,
        max_num_gist_tokens=TXT_JOINT, gist_step=1, gist_min_text_len=1, gist_max_text_len=16, axes_dims=(4, 6, 6),
        axes_lens=(16, 8, 8),
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, 2, TXT, 24),  # the Perceiver's bundle, then injection block 1's
        "return_dict": False,
    }
    return model, kwargs


def _hunyuan_image() -> Case:
    """HunyuanImage 2.1: latents [B, C, H, W] (patch 1), padded text with its mask, token refiner."""
    model = _build(
        diffusers.HunyuanImageTransformer2DModel, in_channels=16, out_channels=16, num_attention_heads=4,
        attention_head_dim=16, num_layers=2, num_single_layers=2, num_refiner_layers=2, mlp_ratio=2.0,
        patch_size=(1, 1), text_embed_dim=24, rope_axes_dim=(8, 8),
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 16, IMG_H, IMG_W),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "encoder_attention_mask": _text_mask(TXT, pad=2),
        "return_dict": False,
    }
    return model, kwargs


def _flux3() -> Case:
    """FLUX.3: per-mode blocks (text, image) then joint single blocks, (t, h, w, l) ids."""
    model = _build(
        diffusers.Flux3Transformer2DModel, in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=24, timestep_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4),
    )
    g = _gen()
    img_ids = torch.cat([_grid_ids(IMG_H, IMG_W), torch.zeros(IMG, 1)], dim=-1)
    txt_ids = torch.zeros(TXT, 4)
    txt_ids[:, 3] = torch.arange(TXT).float()
    kwargs = {
        "hidden_states": _randn(g, 1, IMG, 16),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    return model, kwargs


def _ernie_image() -> Case:
    """ERNIE-Image: one [image, text] stream held sequence-first ([S, B, C]) by its blocks."""
    model = _build(
        diffusers.ErnieImageTransformer2DModel, hidden_size=64, num_attention_heads=4, num_layers=2,
        ffn_hidden_size=128, in_channels=16, out_channels=16, patch_size=1, text_in_dim=24, rope_axes_dim=(4, 6, 6),
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 16, IMG_H, IMG_W),
        "timestep": torch.tensor([500.0]),
        "text_bth": _randn(g, 1, TXT_JOINT, 24),
        "text_lens": torch.tensor([TXT_JOINT]),
        "return_dict": False,
    }
    return model, kwargs


def _glm_image() -> Case:
    """GLM-Image: latents [B, C, H, W] with patch 2, one prior (VQ) token per image token."""
    model = _build(
        diffusers.GlmImageTransformer2DModel, patch_size=2, in_channels=8, out_channels=8, num_layers=2,
        attention_head_dim=16, num_attention_heads=4, text_embed_dim=24, time_embed_dim=32, condition_dim=16,
        prior_vq_quantizer_codebook_size=32,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 2 * IMG_H, 2 * IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "prior_token_id": torch.randint(0, 32, (1, IMG), generator=g),
        "prior_token_drop": torch.zeros(1, IMG, dtype=torch.bool),
        "timestep": torch.tensor([500.0]),
        "target_size": torch.tensor([[16.0 * IMG_H, 16.0 * IMG_W]]),
        "crop_coords": torch.zeros(1, 2),
        "return_dict": False,
    }
    return model, kwargs


def _ideogram4() -> Case:
    """Ideogram 4: one packed [text, image] sequence told apart by `indicator`, MRoPE (t, h, w) ids."""
    model = _build(
        diffusers.Ideogram4Transformer2DModel, in_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, intermediate_size=128, adaln_dim=32, llm_features_dim=24, mrope_section=(4, 2, 2),
    )
    g = _gen()
    seq = TXT_JOINT + IMG
    text_pos = torch.arange(TXT_JOINT).unsqueeze(-1).expand(-1, 3)
    image_pos = _grid_ids(IMG_H, IMG_W).long() + 65536  # IMAGE_POSITION_OFFSET
    latents = torch.cat([torch.zeros(1, TXT_JOINT, 16), _randn(g, 1, IMG, 16)], dim=1)
    features = torch.cat([_randn(g, 1, TXT_JOINT, 24), torch.zeros(1, IMG, 24)], dim=1)
    kwargs = {
        "hidden_states": latents,
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": features,
        "position_ids": torch.cat([text_pos, image_pos]).unsqueeze(0),
        "segment_ids": torch.ones(1, seq, dtype=torch.long),
        "indicator": torch.tensor([3] * TXT_JOINT + [2] * IMG).unsqueeze(0),  # LLM_TOKEN / OUTPUT_IMAGE
        "return_dict": False,
    }
    return model, kwargs


def _krea2() -> Case:
    """Krea 2: text fused from 3 tapped layers, then one [text, image] stream with (t, h, w) ids."""
    model = _build(
        diffusers.Krea2Transformer2DModel, in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=3,
        text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=64,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(4, 6, 6),
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, IMG, 16),
        "encoder_hidden_states": _randn(g, 1, TXT_JOINT, 3, 32),
        "timestep": torch.tensor([0.5]),
        "position_ids": torch.cat([torch.zeros(TXT_JOINT, 3), _grid_ids(IMG_H, IMG_W)]),
        "encoder_attention_mask": _text_mask(TXT_JOINT),
        "return_dict": False,
    }
    return model, kwargs


def _prx() -> Case:
    """PRX: latents [B, C, H, W] with patch 2; the image attends to itself and the (masked) text."""
    model = _build(
        diffusers.PRXTransformer2DModel, in_channels=16, patch_size=2, context_in_dim=24, hidden_size=64,
        mlp_ratio=2.0, num_heads=4, depth=2, axes_dim=[8, 8],
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 16, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "attention_mask": _text_mask(TXT),
        "return_dict": False,
    }
    return model, kwargs


def _nucleus_moe() -> Case:
    """Nucleus-MoE: image queries over image + text keys; block 1 is MoE. Each expert's capacity is the whole
    sequence (capacity factor = number of experts), so its expert-choice routing stays token-local."""
    model = _build(
        diffusers.NucleusMoEImageTransformer2DModel, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=24, axes_dims_rope=(4, 6, 6), mlp_ratio=4.0, moe_enabled=True,
        dense_moe_strategy="leave_first_block_dense", num_experts=4, moe_intermediate_dim=32, capacity_factors=4.0,
    )
    torch.manual_seed(0)
    with torch.no_grad():  # the experts' weights are `torch.empty`
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, 0.05)
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, IMG, 16),
        "img_shapes": [(1, IMG_H, IMG_W)],
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "encoder_hidden_states_mask": _text_mask(TXT),
        "timestep": torch.tensor([0.5]),
        "return_dict": False,
    }
    return model, kwargs


def _dreamlite() -> Case:
    """DreamLite's spatial transformer (U-Net attention block): latents [B, C, H, W], cross-attention to text."""
    model = _build(
        diffusers.DreamLiteTransformer2DModel, num_attention_heads=4, attention_head_dim=16, in_channels=16,
        num_layers=2, norm_num_groups=4, cross_attention_dim=24, use_linear_projection=True, qk_norm="rms_norm",
        ff_mult=2,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 16, IMG_H, IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "return_dict": False,
    }
    return model, kwargs


def _qwen_image21_model() -> torch.nn.Module:
    return _build(
        diffusers.QwenImage21Transformer2DModel, patch_size=1, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=16, num_attention_heads=4, context_in_dim=24, mlp_ratio=2, axes_dims_rope=(4, 6, 6),
    )


def qwen_image21_steps() -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    """Qwen-Image 2.1 editing with its prefix cache: [4 text, a 2 x 4 condition image, 4 text, 1 padded text, the
    4 x 5 target] (8 + 20 latent tokens, 37 in its joint sequence), three steps' calls; the first stores the
    prefix's keys and values (`kv_cache_mode='extract'`), the others run the target's 20 tokens over them."""
    model, g = _qwen_image21_model(), _gen()
    cache = diffusers.models.transformers.transformer_qwenimage21.QwenImage21KVCache(2)
    call = {"encoder_hidden_states": _randn(g, 1, 11, 24), "img_shapes": [[(1, 2, 4), (1, 4, 5)]],
            "img_mask": torch.tensor([[False] * 4 + [True] * 2 + [False] * 5 + [True] * 5]),
            "encoder_hidden_states_mask": _text_mask(11), "kv_cache": cache, "return_dict": False}
    return model, [dict(call, hidden_states=_randn(g, 1, 28, 16), timestep=torch.tensor([t]),
                        kv_cache_mode="extract" if t == 0.9 else "cached") for t in (0.9, 0.6, 0.3)]


def _qwen_image21() -> Case:
    """Qwen-Image 2.1: one block-causal [text, target image] stream of 11 + 20 = 31 tokens. The target image's
    tokens fill 2x2 slots of the vision-language sequence, so their count (4 x 5) must be a multiple of 4."""
    model = _qwen_image21_model()
    g = _gen()
    h, w, txt = 4, 5, 11
    img_mask = torch.zeros(1, txt + h * w // 4, dtype=torch.bool)
    img_mask[:, txt:] = True
    kwargs = {
        "hidden_states": _randn(g, 1, h * w, 16),
        "encoder_hidden_states": _randn(g, 1, txt, 24),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, h, w)]],
        "img_mask": img_mask,
        "encoder_hidden_states_mask": _text_mask(txt),
        "return_dict": False,
    }
    return model, kwargs


_JOY = {"patch_size": [1, 2, 2], "in_channels": 16, "hidden_size": 64, "num_attention_heads": 4, "text_dim": 24,
        "mlp_width_ratio": 2.0, "num_layers": 2, "rope_dim_list": [4, 6, 6]}
"""The config JoyImage Edit and Edit Plus share."""


def _joy_image_edit() -> Case:
    """JoyImage Edit: one item of latents [B, N, C, T, H, W], Conv3d patch (1, 2, 2), double-stream blocks."""
    model = _build(diffusers.JoyImageEditTransformer3DModel, **_JOY)
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 1, 16, 1, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "return_dict": False,
    }
    return model, kwargs


def _joy_image_edit_plus() -> Case:
    """JoyImage Edit Plus: pre-patchified latents [B, N, C, pt, ph, pw] with their `shape_list`, masked text."""
    model = _build(diffusers.JoyImageEditPlusTransformer3DModel, **_JOY)
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, IMG, 16, 1, 2, 2),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "encoder_hidden_states_mask": _text_mask(TXT).float(),
        "shape_list": [[(1, IMG_H, IMG_W)]],
        "return_dict": False,
    }
    return model, kwargs


def _pixart() -> Case:
    """PixArt-Sigma: latents [B, C, H, W] with patch 2, self-attention then cross-attention to the masked text."""
    model = _build(
        diffusers.PixArtTransformer2DModel, num_attention_heads=4, attention_head_dim=16, in_channels=4,
        out_channels=8, num_layers=2, cross_attention_dim=64, sample_size=2 * IMG_W, patch_size=2, caption_channels=24,
        interpolation_scale=1,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2 * IMG_H, 2 * IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "encoder_attention_mask": _text_mask(TXT).long(),
        "timestep": torch.tensor([500]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False,
    }
    return model, kwargs


def _sana() -> Case:
    """Sana: latents [B, C, H, W] (patch 1), linear self-attention then cross-attention to the masked text."""
    model = _build(
        diffusers.SanaTransformer2DModel, in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=16,
        num_layers=2, num_cross_attention_heads=4, cross_attention_head_dim=16, cross_attention_dim=64,
        caption_channels=24, mlp_ratio=2.0, sample_size=IMG_W, patch_size=1,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 16, IMG_H, IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "encoder_attention_mask": _text_mask(TXT).long(),
        "timestep": torch.tensor([500.0]),
        "return_dict": False,
    }
    return model, kwargs


def _aura_flow() -> Case:
    """AuraFlow: 8 register tokens go before the text, so 2 prompt tokens make a joint stream of 10 + 21 = 31."""
    model = _build(
        diffusers.AuraFlowTransformer2DModel, sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2,
        num_single_dit_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=24,
        caption_projection_dim=64, out_channels=4, pos_embed_max_size=64,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2 * IMG_H, 2 * IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT_JOINT - 8, 24),
        "timestep": torch.tensor([0.5]),
        "return_dict": False,
    }
    return model, kwargs


def _dit() -> Case:
    """DiT: class-conditional (no text), learned sigma doubles the channels. Its unpatchify takes the token grid
    to be square, so the latents are 10x10 with patch 2: 25 image tokens, still odd and not divisible by 4."""
    model = _build(
        diffusers.DiTTransformer2DModel, num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, sample_size=10, patch_size=2, num_embeds_ada_norm=10,
    )
    kwargs = {
        "hidden_states": _randn(_gen(), 1, 4, 10, 10),
        "timestep": torch.tensor([500]),
        "class_labels": torch.tensor([3]),
        "return_dict": False,
    }
    return model, kwargs


def _chroma() -> Case:
    """Chroma: Flux-like, modulation from a timestep approximator; its float 0/1 mask keeps the first padding
    token and covers the image."""
    model, kwargs = _flux_like(diffusers.ChromaTransformer2DModel, _gen(), patch_size=1, in_channels=16,
                               joint_attention_dim=24, approximator_num_channels=32, approximator_hidden_dim=32,
                               approximator_layers=2)
    kwargs["attention_mask"] = torch.cat([_text_mask(TXT), torch.ones(1, IMG, dtype=torch.bool)], dim=1).float()
    return model, kwargs


def _cogview_size() -> dict[str, torch.Tensor]:
    """The (height, width) micro-conditions of CogView 3+/4 for 6x14 latents (8x VAE), no crop."""
    size = torch.tensor([[16.0 * IMG_H, 16.0 * IMG_W]])
    return {"original_size": size, "target_size": size.clone(), "crop_coords": torch.zeros(1, 2)}


def _cogview3plus() -> Case:
    """CogView3-Plus: latents [B, C, H, W] with patch 2; text and image attend as one stream of 10 + 21 = 31."""
    model = _build(
        diffusers.CogView3PlusTransformer2DModel, patch_size=2, in_channels=8, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, out_channels=8, text_embed_dim=24, time_embed_dim=32, condition_dim=16,
        pos_embed_max_size=8, sample_size=16,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 2 * IMG_H, 2 * IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT_JOINT, 24),
        "timestep": torch.tensor([500]),
        **_cogview_size(),
        "return_dict": False,
    }
    return model, kwargs


def _cogview4() -> Case:
    """CogView4: latents [B, C, H, W] with patch 2, 2D RoPE on the image; text and image attend as one stream
    of 10 + 21 = 31 (the pipeline pads its prompts to a multiple of 16 tokens and passes no mask)."""
    model = _build(
        diffusers.CogView4Transformer2DModel, patch_size=2, in_channels=8, out_channels=8, num_layers=2,
        attention_head_dim=16, num_attention_heads=4, text_embed_dim=24, time_embed_dim=32, condition_dim=16,
        pos_embed_max_size=8, sample_size=16, rope_axes_dim=(8, 8),
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 2 * IMG_H, 2 * IMG_W),
        "encoder_hidden_states": _randn(g, 1, TXT_JOINT, 24),
        "timestep": torch.tensor([500.0]),
        **_cogview_size(),
        "return_dict": False,
    }
    return model, kwargs


def _hidream_image() -> Case:
    """HiDream-I1: MoE blocks; each block's text is T5 (4) + last Llama layer (3) + its own Llama layer (3) = 10, so
    the single blocks see 21 + 10 = 31. `max_resolution` (6, 14) gives exactly 21 slots to the non-square latents."""
    model = _build(
        diffusers.HiDreamImageTransformer2DModel, patch_size=2, in_channels=8, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=4, caption_channels=[24, 32], text_emb_dim=24,
        num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(4, 6, 6),
        max_resolution=(2 * IMG_H, 2 * IMG_W), llama_layers=[0, 1, 2, 3],
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 2 * IMG_H, 2 * IMG_W),
        "timesteps": torch.tensor([500.0]),
        "encoder_hidden_states_t5": _randn(g, 1, 4, 24),
        "encoder_hidden_states_llama3": _randn(g, 4, 1, 3, 32),  # [Llama layers, B, tokens, dim]
        "pooled_embeds": _randn(g, 1, 24),
        "return_dict": False,
    }
    return model, kwargs


def _hunyuan_dit() -> Case:
    """Hunyuan-DiT: cross-attention to CLIP (5) + T5 (4) masked tokens, 2D RoPE, size and style conditions (at 2
    layers its U-Net-like long skips are absent)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    model = _build(
        diffusers.HunyuanDiT2DModel, num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2,
        hidden_size=64, num_layers=2, mlp_ratio=2.0, cross_attention_dim=24, cross_attention_dim_t5=32,
        pooled_projection_dim=16, text_len=5, text_len_t5=4,
    )
    g = _gen()
    crops = ((9, 0), (23, 32))  # the pipeline's get_resize_crop_region_for_grid((3, 7), 32)
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 5, 24),
        "text_embedding_mask": _text_mask(5).long(),
        "encoder_hidden_states_t5": _randn(g, 1, 4, 32),
        "text_embedding_mask_t5": _text_mask(4).long(),
        "image_meta_size": torch.tensor([[16.0 * IMG_H, 16.0 * IMG_W] * 2 + [0.0, 0.0]]),
        "style": torch.tensor([0]),
        "image_rotary_emb": get_2d_rotary_pos_embed(16, crops, (IMG_H, IMG_W), output_type="pt"),
        "return_dict": False,
    }
    return model, kwargs


def _lumina2() -> Case:
    """Lumina-Image 2.0: text and image refined apart, then one [text, image] stream of 10 + 21 = 31 (masked text)."""
    model = _build(
        diffusers.Lumina2Transformer2DModel, patch_size=2, in_channels=8, hidden_size=64, num_layers=2,
        num_refiner_layers=2, num_attention_heads=4, num_kv_heads=4, multiple_of=16, axes_dim_rope=(4, 6, 6),
        axes_lens=(16, 8, 8), cap_feat_dim=24,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 8, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, TXT_JOINT, 24),
        "encoder_attention_mask": _text_mask(TXT_JOINT).long(),
        "return_dict": False,
    }
    return model, kwargs


def _lumina_next() -> Case:
    """Lumina-Next: image self-attention plus gated cross-attention to the masked text. The pipeline passes a
    384x384 2D RoPE table (scaled for the resolution), whose top-left 3x7 the model reads, and proportional
    attention's base length."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    model = _build(
        diffusers.LuminaNextDiT2DModel, sample_size=2 * IMG_W, patch_size=2, in_channels=4, hidden_size=64,
        num_layers=2, num_attention_heads=4, num_kv_heads=4, multiple_of=16, cross_attention_dim=24,
    )
    g = _gen()
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, TXT, 24),
        "encoder_mask": _text_mask(TXT).long(),
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(16, 384, 384, linear_factor=(IMG_H / IMG_W) ** 0.5),
        "cross_attention_kwargs": {"base_sequence_length": (8 * 2 * IMG_W // 16) ** 2},
        "return_dict": False,
    }
    return model, kwargs


def _omnigen() -> Case:
    """OmniGen: one [text ids (9), time token, image (21)] stream of 31; causal over the text and time token, the
    image sees everything (text-to-image: no input images)."""
    head_half = [1.0] * 8
    model = _build(
        diffusers.OmniGenTransformer2DModel, in_channels=4, patch_size=2, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, num_layers=2, pad_token_id=0, vocab_size=64,
        rope_scaling={"short_factor": head_half, "long_factor": head_half}, pos_embed_max_size=8,
        time_step_dim=32,
    )
    g = _gen()
    seq = TXT_JOINT + IMG
    mask = torch.tril(torch.ones(seq, seq))
    mask[TXT_JOINT:] = 1.0
    kwargs = {
        "hidden_states": _randn(g, 1, 4, 2 * IMG_H, 2 * IMG_W),
        "timestep": torch.tensor([0.5]),
        "input_ids": torch.randint(1, 64, (1, TXT), generator=g),
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": mask.unsqueeze(0),
        "position_ids": torch.arange(seq).unsqueeze(0),
        "return_dict": False,
    }
    return model, kwargs


CASES: dict[str, Callable[[], Case]] = {
    "LongCatImageTransformer2DModel": _longcat,
    "OvisImageTransformer2DModel": _ovis,
    "BriaTransformer2DModel": _bria,
    "BriaFiboTransformer2DModel": _bria_fibo,
    "BriaFibo2Transformer2DModel": _bria_fibo2,
    "HunyuanImageTransformer2DModel": _hunyuan_image,
    "Flux3Transformer2DModel": _flux3,
    "ErnieImageTransformer2DModel": _ernie_image,
    "GlmImageTransformer2DModel": _glm_image,
    "Ideogram4Transformer2DModel": _ideogram4,
    "Krea2Transformer2DModel": _krea2,
    "PRXTransformer2DModel": _prx,
    "NucleusMoEImageTransformer2DModel": _nucleus_moe,
    "DreamLiteTransformer2DModel": _dreamlite,
    "QwenImage21Transformer2DModel": _qwen_image21,
    "JoyImageEditTransformer3DModel": _joy_image_edit,
    "JoyImageEditPlusTransformer3DModel": _joy_image_edit_plus,
    "PixArtTransformer2DModel": _pixart,
    "SanaTransformer2DModel": _sana,
    "AuraFlowTransformer2DModel": _aura_flow,
    "DiTTransformer2DModel": _dit,
    "ChromaTransformer2DModel": _chroma,
    "CogView3PlusTransformer2DModel": _cogview3plus,
    "CogView4Transformer2DModel": _cogview4,
    "HiDreamImageTransformer2DModel": _hidream_image,
    "HunyuanDiT2DModel": _hunyuan_dit,
    "Lumina2Transformer2DModel": _lumina2,
    "LuminaNextDiT2DModel": _lumina_next,
    "OmniGenTransformer2DModel": _omnigen,
}

# left out: none (every class listed above runs its forward at this size).
