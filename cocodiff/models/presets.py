"""Built-in model presets: real diffusers pipelines, small enough for a laptop, no download.

`tiny-shapes` (the default) is a trained model shipped with the package: a `FluxPipeline` whose
transformer, autoencoder and text encoder were trained here on procedural coloured shapes by
`cocodiff train-tiny` (see `cocodiff/models/shapes/`), loaded with `from_pretrained` from the package's
weights folder. It draws 64x64 pictures of captions like "a red circle above a blue square".

`tiny-flux`, `tiny-sd3` and `tiny-qwen-image` are the stock `FluxPipeline`,
`StableDiffusion3Pipeline` and `QwenImagePipeline` with tiny configs (weights drawn from a fixed
seed) and a tiny seeded text encoder in place of CLIP/T5/Qwen2.5-VL. Their shapes exercise the
uneven cases of Ulysses on 4 ranks: 11 text tokens (joint sequences of 267 tokens at 256x256),
6 heads in tiny-sd3 and 5 in tiny-qwen-image.

`tiny-flux-kontext` is tiny-flux's parts in FLUX.1 Kontext's `FluxKontextPipeline` (editing: one
reference image, `--image`).

`tiny-flux2`, `tiny-zimage`, `tiny-wan`, `tiny-wan22`, `tiny-ltx` and `tiny-hunyuanvideo15` are
built the same way (models/tiny.py) and run on the generic family layer; the video ones make
clips (`Preset.frames`).

Any other model name is a local directory or hub id loaded with `from_pretrained`; its own text
encoders turn the prompt into embeddings.

A preset's pipeline is called like any diffusers pipeline, `pipe("a red circle")`: its text
encoder is not one diffusers knows, so `PromptEncoding` turns the prompt into the stock pipeline's
`prompt_embeds` arguments and calls the stock pipeline (see `load_preset`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config.env import PLUGINS_ENV
from ..config.parallel import DTYPE_NAMES
from ..engine.families import family_of_class
from ..engine.families.pipelines import (
    EDIT_INPAINT,
    EDIT_PIPELINES,
    FAMILY_OPTIONS,
    FIRST_FRAME_ONLY_TI2V,
    LAST_FRAME_PIPELINES,
    ONE_FRAME_EMBEDDER,
    ONE_PER_CALL,
    PIPELINES,
    UNROUTED_EDITS,
    VIDEO_PIPELINES,
    pipeline_kind,
    prompt_inputs,
    takes_no_last_frame,
    takes_no_start_image,
    takes_one_image,
    task_pipeline,
    too_many_references,
)
from ..engine.vae import prepare as prepare_vae
from ..errors import UsageError
from . import shapes
from .lora import has_loader
from .minimax_h3 import build_minimax_h3
from .stage_load import load_stage_transformer, pipeline_folder
from .tiny import (
    build_chroma,
    build_cogview4,
    build_flux2,
    build_hunyuanvideo15,
    build_hunyuanvideo15_i2v,
    build_ltx,
    build_ltx2,
    build_ltx_i2v,
    build_qwen_image21,
    build_wan,
    build_wan21_i2v,
    build_wan22,
    build_wan22_i2v,
    build_wan_ti2v,
    build_zimage,
    build_zimage_omni,
)
from .tiny_parts import TinyTextEncoder, vae_kl

__all__ = [
    "AUTO_DTYPE", "DTYPES", "PRESETS", "Preset", "PromptEncoding", "TinyTextEncoder", "VIDEO_PIPELINES", "load_pipeline",
    "last_frame_of", "last_frame_refusal", "load_preset", "makes_video", "pipeline_class", "pipeline_inputs", "pixel_multiple", "refusal", "resolve_dtype",
    "task_variant",
]

def _encodes_whole(vae: str) -> str:
    """Why an image-to-video preset whose VAE is `vae` refuses `--parallel-vae on`."""
    return (f"{vae} does not encode the first frame in bands (only 2D AutoencoderKL-style VAEs encode in bands); "
            f"--parallel-vae auto decodes in bands")


@dataclass(frozen=True)
class Preset:
    build: Callable[[], Any]
    """Returns (pipeline, text encoder); weights are drawn from the global RNG."""
    family: str
    """Its transformer's class: the family (engine/families) known before anything loads."""
    pipeline: str
    """Its pipeline's class (engine/families/pipelines.py: CFG, image-to-image, video)."""
    pixel_multiple: int
    """Height and width must be multiples of this (VAE factor x patch size)."""
    heads: int
    """Attention heads per layer: the largest Ulysses degree."""
    default_size: int = 256
    """Height and width when the user gives none (the size a trained preset was trained at)."""
    default_steps: int = 4
    """Denoising steps when the user gives none."""
    pipeline_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of the pipeline call, over the family's defaults (e.g. a guidance scale)."""
    frames: int | None = None
    """Frames of a video model's clip when the user gives none; None: an image model."""
    frame_step: int = 4
    """A video model's clips have k * frame_step + 1 frames (its VAE's temporal factor)."""
    frame_chunk: tuple[int, int] | None = None
    """A VAE that encodes in chunks (`catalog.ModelSpec.frame_chunk`): its clips have k * pixels + latents
    frames, in place of `frame_step`'s."""
    frame_limits: tuple[int, int] | None = None
    """The fewest and most frames a clip may have (MiniMax-H3: 5 to 15 seconds); None: any."""
    refuses: dict[str, str] = field(default_factory=dict)
    """What this preset's pipeline or VAE cannot have -> why (the transformer's own: its family's
    `refuses`); see `refusal`."""
    last_frame: str = ""
    """An image-to-video preset's last frame (`--last-frame`): 'required', 'optional', or "": none
    (why: its `refuses["last_frame"]`, else its class's)."""
    unmoved: str = ""
    """Why a lossy mode may leave this preset's output where one process puts it (the matrix then
    asks only for its evidence in effect, and says why); "": a lossy mode must move it."""


def _build_flux(pipeline: str = "FluxPipeline"):
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    pipe = getattr(diffusers, pipeline)(
        scheduler=scheduler, vae=vae_kl(16), text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=transformer,
    )
    return pipe, TinyTextEncoder(64, 32)


def _build_sd3():
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=6,  # 4 does not divide it, like SD3.5 Large's 38 heads
        joint_attention_dim=64,
        caption_projection_dim=96,
        pooled_projection_dim=32,
        out_channels=16,
        pos_embed_max_size=64,
        dual_attention_layers=(0,),  # SD3.5: a second, image-only attention in block 0
        qk_norm="rms_norm",  # SD3.5
    )
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae_kl(16),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None, transformer=transformer,
    )
    return pipe, TinyTextEncoder(64, 32)


def _build_qwen_image(pipeline: str = "QwenImagePipeline", zero_cond_t: bool = False):
    """tiny-qwen-image; or its parts in an edit pipeline, with `zero_cond_t` (Qwen-Image-Edit-2511's
    transformer: the reference tokens are modulated at timestep 0, a per-token index split with them)."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=5,  # 4 does not divide it
        joint_attention_dim=64,
        axes_dims_rope=(4, 6, 6),
        zero_cond_t=zero_cond_t,
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, time_shift_type="exponential",
    )
    stock = getattr(diffusers, pipeline)
    parts = {"scheduler": scheduler, "vae": vae, "text_encoder": None, "tokenizer": None, "transformer": transformer}
    accepted = inspect.signature(stock.__init__).parameters  # the edit pipelines' `processor` too
    pipe = stock(**parts, **{name: None for name in accepted if name not in parts and name != "self"})
    return pipe, TinyTextEncoder(64, 32)


def _build_shapes():
    from .shapes.model import load_parts

    pipe, encoder = load_parts()
    _point_posterior(pipe.vae)
    return pipe, encoder


def _point_posterior(vae: Any) -> None:
    """Make the autoencoder's posterior a point, so that sampling it gives its mean.

    tiny-shapes' autoencoder was trained on the posterior's mean (`mode()`, no KL term; see
    models/shapes/train.py), so the log-variance half of its encoder's output is untrained: the stock
    img2img and inpaint pipelines, which encode their image by sampling, would add noise the size
    of the latents themselves. Log-variance -30 (diffusers' floor) makes the standard deviation
    3e-7. Only encoding changes; text-to-image decodes only.
    """
    channels = vae.config.latent_channels
    with torch.no_grad():  # quant_conv: (mean, log-variance) channels
        vae.quant_conv.weight[channels:] = 0.0
        vae.quant_conv.bias[channels:] = -30.0


NO_CFG = ("its pipeline call runs without classifier-free guidance ({what}), so a CFG group would repeat "
          "the other's work; use batch groups or sequence parallelism (--plan bN or uN)")

LTX2_GUIDANCE = {"spatio_temporal_guidance_blocks": [1]}
"""The tiny LTX-2 presets' guidance: the pipeline's own, three transformer calls a step (classifier-free
guidance, a batch of 2; spatio-temporal guidance, a pass whose perturbed blocks skip their
self-attention; modality guidance, a pass with the streams isolated), each with its rescale, the
spatio-temporal pass perturbing the tiny transformer's last block (the checkpoint's default, 28,
is past its 2)."""
CHROMA_INPAINT = ("ChromaInpaintPipeline reads its transformer's config.guidance_embeds, which "
                  "ChromaTransformer2DModel has not (diffusers 0.42.1): inpainting fails in one process too "
                  "(img2img runs: --image with --strength)")
"""Why tiny-chroma refuses `--mask`."""


def _unsplit_vae(name: str) -> str:
    """Why `--parallel-vae on` is refused for a preset whose VAE class `name` is not split."""
    return f"{name} is not split (only 2D AutoencoderKL-style VAEs and the Wan, LTX-Video and HunyuanVideo 1.5 VAEs)"


QWEN_VAE = _unsplit_vae("AutoencoderKLQwenImage")
QWEN21_VAE = _unsplit_vae("AutoencoderKLQwenImage21")
LTX2_VAE = _unsplit_vae("AutoencoderKLLTX2Video")

PRESETS: dict[str, Preset] = {
    "tiny-shapes": Preset(
        _build_shapes, "FluxTransformer2DModel", "FluxPipeline", pixel_multiple=4, heads=4, default_size=shapes.SIZE, default_steps=shapes.DEFAULT_STEPS,
        pipeline_kwargs={"true_cfg_scale": shapes.CFG_SCALE},  # classifier-free guidance, the empty prompt as negative
    ),
    "tiny-flux": Preset(_build_flux, "FluxTransformer2DModel", "FluxPipeline", pixel_multiple=16, heads=4,
                        refuses={"cfg": NO_CFG.format(what="FLUX.1's guidance is distilled into the model")}),
    "tiny-flux-kontext": Preset(
        functools.partial(_build_flux, "FluxKontextPipeline"), "FluxTransformer2DModel", "FluxKontextPipeline",
        pixel_multiple=16, heads=4,
        pipeline_kwargs={"_auto_resize": False},  # the reference keeps its size (stock: one of ~1 megapixel)
        refuses={"cfg": NO_CFG.format(what="FLUX.1 Kontext's guidance is distilled into the model")}),
    "tiny-sd3": Preset(_build_sd3, "SD3Transformer2DModel", "StableDiffusion3Pipeline", pixel_multiple=16, heads=6),
    "tiny-qwen-image": Preset(
        _build_qwen_image, "QwenImageTransformer2DModel", "QwenImagePipeline", pixel_multiple=16, heads=5,
        refuses={"parallel_vae": QWEN_VAE},
    ),
    "tiny-qwen-image-edit": Preset(
        functools.partial(_build_qwen_image, "QwenImageEditPlusPipeline", zero_cond_t=True), "QwenImageTransformer2DModel",
        "QwenImageEditPlusPipeline", pixel_multiple=16, heads=5, default_size=64,
        unmoved=("its sequence is mostly the reference's tokens (4096 of 4112 at 64x64), whose latents and "
                 "timestep (0: zero_cond_t) are the same at every step, so V-Major reuses and displaced patches "
                 "read their unchanged rows"),
        refuses={"parallel_vae": QWEN_VAE}),
    "tiny-qwen-image-edit-v1": Preset(  # the first Qwen-Image-Edit: one reference, modulated at the step's timestep
        functools.partial(_build_qwen_image, "QwenImageEditPipeline"), "QwenImageTransformer2DModel",
        "QwenImageEditPipeline", pixel_multiple=16, heads=5, default_size=64,
        refuses={"parallel_vae": QWEN_VAE}),
    "tiny-flux2": Preset(build_flux2, "Flux2Transformer2DModel", "Flux2Pipeline", pixel_multiple=16, heads=6,
                         refuses={"cfg": NO_CFG.format(what="FLUX.2's guidance is distilled into the model")}),
    "tiny-flux2-klein": Preset(functools.partial(build_flux2, "Flux2KleinPipeline"), "Flux2Transformer2DModel",
                               "Flux2KleinPipeline", pixel_multiple=16, heads=6),
    "tiny-wan": Preset(build_wan, "WanTransformer3DModel", "WanPipeline", pixel_multiple=16, heads=6, default_size=64, frames=9),
    "tiny-wan-ti2v": Preset(
        build_wan_ti2v, "WanTransformer3DModel", "WanImageToVideoPipeline", pixel_multiple=16, heads=6, default_size=64,
        frames=9, refuses={"parallel_vae": _encodes_whole("AutoencoderKLWan"), "last_frame": FIRST_FRAME_ONLY_TI2V}),
    "tiny-wan21-i2v": Preset(
        build_wan21_i2v, "WanTransformer3DModel", "WanImageToVideoPipeline", pixel_multiple=16, heads=6, default_size=64,
        frames=9, refuses={"parallel_vae": _encodes_whole("AutoencoderKLWan"), "last_frame": ONE_FRAME_EMBEDDER}),
    "tiny-wan21-flf2v": Preset(
        functools.partial(build_wan21_i2v, last_frame=True), "WanTransformer3DModel", "WanImageToVideoPipeline",
        pixel_multiple=16, heads=6, default_size=64, frames=9, last_frame="required",
        refuses={"parallel_vae": _encodes_whole("AutoencoderKLWan")}),
    "tiny-wan22-i2v": Preset(
        build_wan22_i2v, "WanTransformer3DModel", "WanImageToVideoPipeline", pixel_multiple=16, heads=6, default_size=64,
        frames=9, last_frame="optional", refuses={"parallel_vae": _encodes_whole("AutoencoderKLWan")}),
    "tiny-wan22": Preset(build_wan22, "WanTransformer3DModel", "WanPipeline", pixel_multiple=16, heads=6, default_size=64, frames=9),
    "tiny-ltx": Preset(build_ltx, "LTXVideoTransformer3DModel", "LTXPipeline", pixel_multiple=32, heads=6, default_size=64, frames=9),
    "tiny-ltx-i2v": Preset(
        build_ltx_i2v, "LTXVideoTransformer3DModel", "LTXImageToVideoPipeline", pixel_multiple=32, heads=6,
        default_size=64, frames=9, refuses={"parallel_vae": _encodes_whole("AutoencoderKLLTXVideo")}),
    "tiny-ltx2": Preset(
        build_ltx2, "LTX2VideoTransformer3DModel", "LTX2Pipeline", pixel_multiple=32, heads=6, default_size=64, frames=9,
        pipeline_kwargs=LTX2_GUIDANCE, refuses={"parallel_vae": LTX2_VAE}),
    "tiny-ltx2-i2v": Preset(
        functools.partial(build_ltx2, "LTX2ImageToVideoPipeline"), "LTX2VideoTransformer3DModel",
        "LTX2ImageToVideoPipeline", pixel_multiple=32, heads=6, default_size=64, frames=9,
        pipeline_kwargs=LTX2_GUIDANCE, refuses={"parallel_vae": LTX2_VAE}),
    "tiny-zimage": Preset(build_zimage, "ZImageTransformer2DModel", "ZImagePipeline", pixel_multiple=16, heads=6),
    "tiny-zimage-omni": Preset(build_zimage_omni, "ZImageTransformer2DModel", "ZImageOmniPipeline", pixel_multiple=16,
                               heads=6, pipeline_kwargs={"guidance_scale": 4.0}),  # Z-Image-Omni runs CFG: a batch of 2
    "tiny-cogview4": Preset(build_cogview4, "CogView4Transformer2DModel", "CogView4Pipeline", pixel_multiple=16, heads=6),
    "tiny-chroma": Preset(build_chroma, "ChromaTransformer2DModel", "ChromaPipeline", pixel_multiple=16, heads=6,
                          refuses={"mask": CHROMA_INPAINT}),
    "tiny-qwen-image21": Preset(build_qwen_image21, "QwenImage21Transformer2DModel", "QwenImage21Pipeline",
                                pixel_multiple=32, heads=10, refuses={"parallel_vae": QWEN21_VAE}),
    "tiny-minimax-h3": Preset(
        build_minimax_h3, "MiniMaxH3Transformer3DModel", "MiniMaxH3Pipeline", pixel_multiple=32, heads=7, default_size=32,
        frames=124, frame_chunk=(17, 5), frame_limits=(124, 345),
        refuses={"cfg": NO_CFG.format(what="MiniMax-H3's guidance is distilled into the model"),
                 "parallel_vae": _unsplit_vae("AutoencoderKLMiniMaxH3")}),
    "tiny-minimax-h3-i2v": Preset(
        functools.partial(build_minimax_h3, "MiniMaxH3KeyframePipeline"), "MiniMaxH3Transformer3DModel",
        "MiniMaxH3KeyframePipeline", pixel_multiple=32, heads=7, default_size=32, frames=124, frame_chunk=(17, 5),
        frame_limits=(124, 345), last_frame="optional",
        refuses={"cfg": NO_CFG.format(what="MiniMax-H3's guidance is distilled into the model"),
                 "parallel_vae": _encodes_whole("AutoencoderKLMiniMaxH3")}),
    "tiny-hunyuanvideo15": Preset(build_hunyuanvideo15, "HunyuanVideo15Transformer3DModel", "HunyuanVideo15Pipeline", pixel_multiple=16, heads=6, default_size=64, frames=9),
    "tiny-hunyuanvideo15-i2v": Preset(
        build_hunyuanvideo15_i2v, "HunyuanVideo15Transformer3DModel", "HunyuanVideo15ImageToVideoPipeline",
        pixel_multiple=16, heads=6, default_size=64, frames=9,
        refuses={"parallel_vae": _encodes_whole("AutoencoderKLHunyuanVideo15")}),
}


def refusal(model: str, needs: set[str]) -> str | None:
    """Why preset `model` cannot have what a run needs, or None (any other model: None, it is
    checked once loaded). Needs: 'data_groups' (CFG or batch groups), 'cfg' (CFG groups: a call with
    classifier-free guidance), 'batch' (several pictures per call), 'ring' (a plan with a ring), 'stages' (pipeline stages), 'patches' (displaced
    patches), 'step_cache', 'plan_trials' (`--plan auto`), 'v_major' (`--v-major`), 'image_input' (image-to-image
    or inpainting), 'mask' (inpainting: `--mask`), 'references' (several reference images: an edit), 'edit' (reference images at all),
    'parallel_vae' (`--parallel-vae on`), 'lora' (`--lora`: the pipeline's LoRA loader), 'split_kernel'
    (an attention backend with no context-parallel path in the dispatcher, under several ranks: only
    the hand-written processors run it); the transformer's refusals are its family's (`Family.refuses`),
    the pipeline's and VAE's the preset's own, and a batch its pipeline class's (`ONE_PER_CALL`), as a
    checkpoint's."""
    preset = PRESETS.get(model)
    if preset is None:  # a checkpoint: what its pipeline class tells before it loads
        reason = ONE_PER_CALL.get(pipeline_class(model) or "") if "batch" in needs else None
        return f"{model}: {reason}" if reason else None
    family = family_of_class(preset.family)
    refuses = {**(family.refuses if family is not None else {}), **preset.refuses}
    if preset.pipeline in ONE_PER_CALL:
        refuses.setdefault("batch", ONE_PER_CALL[preset.pipeline])
    if "image_input" in needs and preset.pipeline in EDIT_PIPELINES:
        if not ("mask" in needs and preset.pipeline in EDIT_INPAINT):  # an edit with a mask: its inpaint class
            refuses["image_input"] = takes_no_start_image(preset.pipeline)
    elif "image_input" in needs and preset.pipeline not in PIPELINES and preset.frames is None:
        refuses["image_input"] = (f"{preset.pipeline} has no image-to-image or inpainting pipeline here; supported: "
                                  f"{', '.join(PIPELINES)}")
    if preset.pipeline in UNROUTED_EDITS:
        for need in {"image_input", "references", "edit"} & needs:
            refuses[need] = UNROUTED_EDITS[preset.pipeline]
    elif "references" in needs and preset.frames is None and preset.pipeline not in EDIT_PIPELINES:
        refuses["references"] = takes_one_image(preset.pipeline)
    elif "references" in needs and EDIT_PIPELINES.get(preset.pipeline) == 1:
        refuses["references"] = too_many_references(preset.pipeline)
    if "split_kernel" in needs and getattr(family, "processor", None) is None:
        refuses["split_kernel"] = ("its stock attention processors split the tokens over the ranks through the "
                                   "dispatcher's context-parallel path, which this backend lacks (native has one)")
    if "last_frame" in needs and not preset.last_frame:
        refuses.setdefault("last_frame", takes_no_last_frame(preset.pipeline, preset.frames is not None))
    if "lora" in needs and not has_loader(preset.pipeline):
        refuses["lora"] = f"{preset.pipeline} has no LoRA loader in diffusers (--lora)"
    reasons = [f"{preset.family if need in getattr(family, 'refuses', {}) else model}: {refuses[need]}"
               for need in sorted(needs) if need in refuses]
    return "; ".join(dict.fromkeys(reasons)) or None  # a reason given for two needs, once


def is_checkpoint(model: str) -> bool:
    """A local directory, or something shaped like a hub id ('org/name')."""
    return Path(model).is_dir() or (model.count("/") == 1 and not model.startswith(("/", ".")))


def makes_video(model: str) -> bool:
    """Whether `model` (a preset, a local folder or a cached hub id) is a video pipeline."""
    if model in PRESETS:
        return PRESETS[model].frames is not None
    name = pipeline_class(model)
    return name in VIDEO_PIPELINES or _takes_frames(name)


def _takes_frames(name: str | None) -> bool:
    """Whether diffusers' pipeline class `name` takes `num_frames` (a video pipeline CoCoDiff has no entry for)."""
    import diffusers

    cls = getattr(diffusers, name, None) if name else None
    return isinstance(cls, type) and "num_frames" in inspect.signature(cls.__call__).parameters


def last_frame_of(model: str) -> str | None:
    """A preset's `last_frame` ('required', 'optional' or ""); None: a checkpoint's, known once it loads."""
    return PRESETS[model].last_frame if model in PRESETS else None


def last_frame_refusal(model: str) -> str | None:
    """Why `model` takes no last frame ("model: why"), as far as is known before it loads; None: it
    takes one, or a checkpoint of `LAST_FRAME_PIPELINES` (its ranks check once it loads)."""
    if model in PRESETS:
        return refusal(model, {"last_frame"})
    pipeline = pipeline_class(model)
    return None if pipeline in LAST_FRAME_PIPELINES else f"{model}: {takes_no_last_frame(pipeline, makes_video(model))}"


def pipeline_class(model: str) -> str | None:
    """The pipeline class `model` names (a preset's, or `_class_name` in a local folder's or a
    cached hub id's model_index.json); None where nothing says, before anything loads."""
    if model in PRESETS:
        return PRESETS[model].pipeline
    index = Path(model) / "model_index.json"
    if not index.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "model_index.json")
        except Exception:  # not a hub id
            return None
        if not isinstance(found, str):
            return None
        index = Path(found)
    import json

    try:
        return json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError):
        return None


def check_model(model: str) -> None:
    if model not in PRESETS and not is_checkpoint(model):
        raise UsageError(
            f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory or hub id"
        )
    if Path(model).is_dir() and not (Path(model) / "model_index.json").is_file():
        raise UsageError(
            f"--model {model}: the folder has no model_index.json, so it is not a diffusers pipeline "
            f"(a folder written by save_pretrained, or a hub snapshot)"
        )


def pixel_multiple(model: str, pipe: Any = None) -> int:
    """Height and width must be multiples of this for `model`."""
    if model in PRESETS:
        return PRESETS[model].pixel_multiple
    return getattr(pipe, "vae_scale_factor", 8) * 2


def load_pipeline(model: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                  task: str | None = None, host_text_encoders: bool = False, host_transformers: bool = False,
                  stage: tuple[int, int] | None = None, read: dict[str, Any] | None = None):
    """(pipeline, text encoder or None) for a preset, or `from_pretrained` for anything else.

    A preset's pipeline takes a prompt (`PromptEncoding`); the encoder is also returned for
    callers that encode prompts themselves (`pipeline_inputs`). `task` 'img2img' or 'inpaint'
    gives that task's stock pipeline of the same family, built from the same parts
    (`engine.families.pipelines.task_pipeline`). `host_text_encoders`: a checkpoint's text encoders stay on the
    host, never on `device` (`--offload-text-encoders`: engine/offload.py places them after).
    `host_transformers`: the transformer (and its experts) stay on the host, never whole on
    `device` (`--shard-weights on`: FSDP2 moves them there one unit at a time, engine/shard.py).
    `stage` (stages, this rank's stage): a checkpoint's transformer is read only as far as that
    stage keeps it (models/stage_load.py), what was read noted in `read`; presets are built whole.
    """
    check_model(model)
    if model in PRESETS:
        preset = PRESETS[model]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pipe, encoder = preset.build()
        if task is not None:
            pipe = task_pipeline(pipe, task)
        if dtype != torch.float32:
            pipe.to(dtype=dtype)  # on the host: a cast never holds two copies on the device
        _place(pipe, device, host_transformers=host_transformers)
        _accept_prompts(pipe, encoder, preset)
        prepare_vae(pipe.vae)
        return pipe, encoder
    from diffusers import DiffusionPipeline

    parts = {}
    if stage is not None and (folder := pipeline_folder(model)) is not None:
        staged = load_stage_transformer(folder, dtype, *stage)
        if staged is not None:
            parts["transformer"] = staged[0]
            if read is not None:
                read.update(staged[1])
    pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype, **parts)
    if task is not None:
        pipe = task_pipeline(pipe, task)
    if getattr(pipe, "vae", None) is not None:
        prepare_vae(pipe.vae)
    _place(pipe, device, host_text_encoders=host_text_encoders, host_transformers=host_transformers)
    return pipe, None


def _place(pipe: Any, device: torch.device | None, *, host_text_encoders: bool = False,
           host_transformers: bool = False) -> None:
    """Move `pipe`'s components to `device`, but those kept on the host (text encoders, transformers)."""
    if not host_text_encoders and not host_transformers:
        pipe.to(device=device)
        return
    for name, part in pipe.components.items():
        on_host = (host_text_encoders and name.startswith("text_encoder")) or (host_transformers and name.startswith("transformer"))
        if isinstance(part, torch.nn.Module) and not on_host:
            part.to(device)


def load_preset(model: str = "tiny-shapes", seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | None = None) -> Any:
    """A preset's stock diffusers pipeline, called like any other: `load_preset()("a red circle")`.

    Weights come from the package (tiny-shapes) or from `seed` (the random-weight presets), so
    every rank that loads the same preset with the same seed holds the same model.
    """
    if model not in PRESETS:
        raise UsageError(f"{model!r} is not a preset ({', '.join(PRESETS)}); load checkpoints with from_pretrained")
    return load_pipeline(model, seed=seed, dtype=dtype, device=device)[0]


def pipeline_inputs(
    pipe: Any, encoder: Any, prompt: str, negative_prompt: str = "", model: str | None = None
) -> dict[str, Any]:
    """Prompt arguments for `pipe(...)`: embeddings from the preset's encoder, or the prompt itself.

    With `model`, that preset's `pipeline_kwargs` override the family's defaults.
    """
    if encoder is None:
        return {"prompt": prompt}
    options = {**FAMILY_OPTIONS[pipeline_kind(pipe)], **(PRESETS[model].pipeline_kwargs if model in PRESETS else {})}
    return {**options, **prompt_inputs(pipe, encoder, [prompt], [negative_prompt], options)}


class PromptEncoding:
    """Mixed into a preset's pipeline class so that `pipe("a red circle")` works as in diffusers.

    The presets' text encoders (`TinyTextEncoder`, tiny-shapes' `ShapesTextEncoder`) are not
    CLIP, T5 or Qwen2.5-VL, so the stock pipeline cannot encode a prompt itself. This `__call__`
    encodes `prompt` and `negative_prompt` (default: the empty prompt) with `self.prompt_encoder`
    into the stock pipeline's own `prompt_embeds` arguments, fills in `self.prompt_defaults` (the
    preset's size, steps and guidance) under whatever the caller passes, and calls the stock
    `__call__`, which runs unchanged. Given `prompt_embeds` instead of a prompt, it only fills in
    the defaults. `load_pipeline` mixes it in; nothing of the pipeline is re-implemented.
    """

    prompt_encoder: Any
    prompt_defaults: dict[str, Any]

    def __call__(self, prompt: str | list[str] | None = None, negative_prompt: str | list[str] | None = None,
                 **kwargs: Any) -> Any:
        stock = super().__call__  # type: ignore[misc]
        options = {**self.prompt_defaults, **kwargs}
        if prompt is None or kwargs.get("prompt_embeds") is not None:
            return stock(prompt=prompt, negative_prompt=negative_prompt, **options)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negative = "" if negative_prompt is None else negative_prompt
        negatives = [negative] * len(prompts) if isinstance(negative, str) else list(negative)
        # The stock pipelines repeat embeddings they encode themselves, not given ones (LTX-Video's
        # image-to-video neither): repeat here.
        copies = (options.pop("num_images_per_prompt", None) or 1) * (options.pop("num_videos_per_prompt", None) or 1)
        prompts, negatives = ([p for p in texts for _ in range(copies)] for texts in (prompts, negatives))
        return stock(**options, **prompt_inputs(self, self.prompt_encoder, prompts, negatives, options))


@functools.cache
def _prompt_class(stock: type) -> type:
    """`stock` (e.g. FluxPipeline) with `PromptEncoding` in front; same name, so reports and checks read the same."""
    return type(stock.__name__, (PromptEncoding, stock), {"__module__": __name__, "__doc__": stock.__doc__})


def _accept_prompts(pipe: Any, encoder: Any, preset: Preset) -> None:
    """Make a preset's freshly built pipeline callable with a prompt (see `PromptEncoding`)."""
    pipe.__class__ = _prompt_class(type(pipe))
    pipe.prompt_encoder = encoder
    defaults = {
        "height": preset.default_size, "width": preset.default_size, "num_inference_steps": preset.default_steps,
        **({"num_frames": preset.frames} if preset.frames else {}), **FAMILY_OPTIONS[pipeline_kind(pipe)], **preset.pipeline_kwargs,
    }
    accepted = inspect.signature(super(PromptEncoding, pipe).__call__).parameters  # the stock call's (no size: HunyuanVideo 1.5 I2V)
    pipe.prompt_defaults = {name: value for name, value in defaults.items() if name in accepted}


def task_variant(pipe: Any, task: str) -> Any:
    """`pipe`'s `task` pipeline ('inpaint': an edit pipeline's `EDIT_INPAINT` class too) built from
    its parts once and kept on it, for a server that runs either per call; a preset's takes a
    prompt as `pipe` does (`PromptEncoding`, with `pipe`'s encoder and the defaults its call takes)."""
    variants = pipe.__dict__.setdefault("_cocodiff_task_variants", {})
    if task not in variants:
        variant = task_pipeline(pipe, task)
        if isinstance(pipe, PromptEncoding):
            variant.__class__ = _prompt_class(type(variant))
            variant.prompt_encoder = pipe.prompt_encoder
            accepted = inspect.signature(super(PromptEncoding, variant).__call__).parameters
            variant.prompt_defaults = {k: v for k, v in pipe.prompt_defaults.items() if k in accepted}
        variants[task] = variant
    return variants[task]


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if name != "auto"}


AUTO_DTYPE = "bfloat16"
"""What `--dtype auto` runs a checkpoint in on an accelerator: the dtype the DiT checkpoints
(FLUX.1/2, SD3.5, Qwen-Image, Wan) are published in."""


def resolve_dtype(name: str, model: str, device: torch.device) -> str:
    """`--dtype` as run: `auto` is bfloat16 for a checkpoint on CUDA/XPU, float32 for the presets
    (tiny, trained and checked in fp32) and on the CPU; any other name as given."""
    if name != "auto":
        return name
    return AUTO_DTYPE if device.type in ("cuda", "xpu") and model not in PRESETS else "float32"


def load_plugins() -> None:
    """Import the modules `COCODIFF_PLUGINS` names (config/env.py): presets and families of their
    own, known to every rank (spawned ranks import this module too)."""
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(name)


load_plugins()
