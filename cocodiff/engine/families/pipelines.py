"""What CoCoDiff knows of each stock pipeline class (not the transformer: that is the family's
module beside this one): its guidance defaults and whether they are CFG, its img2img and
inpainting classes, whether it edits from reference images (and how many), whether it makes video, and how a preset's text encoder feeds its prompt
arguments.
"""

from __future__ import annotations

import inspect
from typing import Any

from cocodiff.errors import UsageError

TASKS = ("img2img", "inpaint")


PIPELINES: dict[str, dict[str, str]] = {
    "FluxPipeline": {"img2img": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline"},
    "StableDiffusion3Pipeline": {"img2img": "StableDiffusion3Img2ImgPipeline", "inpaint": "StableDiffusion3InpaintPipeline"},
    "QwenImagePipeline": {"img2img": "QwenImageImg2ImgPipeline", "inpaint": "QwenImageInpaintPipeline"},
    "ZImagePipeline": {"img2img": "ZImageImg2ImgPipeline", "inpaint": "ZImageInpaintPipeline"},
    "ChromaPipeline": {"img2img": "ChromaImg2ImgPipeline", "inpaint": "ChromaInpaintPipeline"},
}
"""Text-to-image pipeline class -> task -> the stock diffusers class that runs it."""


EDIT_PIPELINES: dict[str, int] = {
    "Flux2Pipeline": 10,  # reference images, each its own block of tokens (time coordinate 10, 20, ...)
    "Flux2KleinPipeline": 10,  # FLUX.2 [klein]: FLUX.2's references, classifier-free guidance
    "FluxKontextPipeline": 1,  # FLUX.1 Kontext: one reference image, its tokens after the latents'
    # Qwen-Image-Edit-2509/2511: 1 to 3 references (its model card), each encoded at about a megapixel
    # whatever its size (the pipeline's VAE_IMAGE_SIZE), after the latents' tokens
    "QwenImageEditPlusPipeline": 3,
    # the first Qwen-Image-Edit: one reference, encoded at about a megapixel as 2509's, which also
    # sizes the output when no size is given
    "QwenImageEditPipeline": 1,
    # Z-Image-Omni: each reference's latents and SigLIP tokens join the sequence between the text's
    # segments (the pipeline sets no limit; each adds its own text segment and positions)
    "ZImageOmniPipeline": 4,
}
"""Pipelines whose `image` argument is reference images joined to the token sequence (editing), not
a picture to start from -> how many references a call takes here."""

EDIT_INPAINT = {"QwenImageEditPlusPipeline": "QwenImageEditInpaintPipeline",
                "QwenImageEditPipeline": "QwenImageEditInpaintPipeline",
                "Flux2KleinPipeline": "Flux2KleinInpaintPipeline",
                "FluxKontextPipeline": "FluxKontextInpaintPipeline"}
"""Edit pipeline -> the stock pipeline that edits one image where a mask is white (`--image` with
`--mask`): the picture it starts from (Qwen-Image-Edit's is also the reference whose tokens join
the sequence; FLUX.2 [klein]'s and FLUX.1 Kontext's take no reference then)."""

ONE_PER_CALL = {"QwenImageEditPlusPipeline": "QwenImageEditPlusPipeline makes one picture per call (diffusers "
                                             "refuses a batch of more than 1); run requests one by one, or split "
                                             "the sequence (--plan uN or rN)",
                "MiniMaxH3Pipeline": "MiniMax-H3 packs one clip per call into one sequence (its pipeline takes one "
                                     "prompt); run requests one by one, or split the sequence (--plan uN or rN)"}
ONE_PER_CALL["MiniMaxH3KeyframePipeline"] = ONE_PER_CALL["MiniMaxH3Pipeline"]
"""Pipelines that refuse a batch of more than one picture per call -> why (a preset or a checkpoint
of one refuses `--batch` over 1, and a server runs its requests one per call)."""

UNROUTED_EDITS = {"QwenImage21Pipeline": (
    "QwenImage21Pipeline's --image is condition images that its Qwen3-VL encoder reads with the prompt (an "
    "edit); prompt embeddings given to it carry no image positions (diffusers 0.42.1), so CoCoDiff, which encodes "
    "the prompt once and hands the embeddings on, runs it from text alone")}
"""Pipelines whose `image` argument is read by their own text encoder with the prompt -> why CoCoDiff
refuses it (`--image` refused in one line; its edit columns in the matrix refused, not n/a)."""

NEEDS_REFERENCE = ("QwenImageEditPlusPipeline", "QwenImageEditPipeline")
"""Edit pipelines that make nothing from text alone: every call takes at least one reference image
(Qwen-Image-Edit sizes its output and its rotary positions from the last one, the first from its one)."""


def needs_reference(model: str, pipeline: str) -> str:
    """Why an edit pipeline of `NEEDS_REFERENCE` refuses a run without a reference image."""
    limit = EDIT_PIPELINES[pipeline]
    if limit == 1:
        return f"{model} edits a reference image ({pipeline}): give it as --image"
    return f"{model} edits reference images ({pipeline}): give 1 to {limit} as --image"


ANIMATE_PIPELINES = ("WanImageToVideoPipeline", "LTXImageToVideoPipeline", "HunyuanVideo15ImageToVideoPipeline",
                     "LTX2ImageToVideoPipeline", "MiniMaxH3KeyframePipeline")
"""Pipelines that animate one image: its `image` argument is the clip's first frame, encoded into
the first latent frame (Wan 2.2 TI2V and LTX-Video: its tokens' own timestep, zero; Wan 2.1 I2V
and HunyuanVideo 1.5: beside the noise; MiniMax-H3: rows of their own ahead of the noise, at their
own timestep)."""

LAST_FRAME_PIPELINES = ("WanImageToVideoPipeline", "MiniMaxH3KeyframePipeline")
"""Image-to-video pipelines that also take the clip's last frame (`last_image`; `--last-frame`):
Wan's, whose condition then holds the last frame's latents too (and Wan 2.1 FLF2V's cross-attention
the CLIP features of both frames), and MiniMax-H3's, a keyframe's rows anchored at the clip's end.
Which Wan checkpoints take one: `last_frame_use`."""

FIRST_FRAME_ONLY_TI2V = ("Wan 2.2 TI2V conditions on its first frame alone (diffusers' WanImageToVideoPipeline "
                         "drops last_image under expand_timesteps)")
ONE_FRAME_EMBEDDER = ("Wan 2.1 I2V's image embedder takes one frame's CLIP features; a first-last-frame "
                      "checkpoint (Wan 2.1 FLF2V, pos_embed_seq_len in its transformer's config) takes two")


def takes_no_last_frame(pipeline: str | None, video: bool) -> str:
    """Why a model of `pipeline` refuses `--last-frame`, as far as its class says (after "model: ")."""
    if pipeline in ANIMATE_PIPELINES:
        return (f"{pipeline} animates from a first frame alone (a last frame: WanImageToVideoPipeline of "
                f"Wan 2.1 FLF2V or Wan 2.2 A14B I2V, MiniMaxH3KeyframePipeline)")
    made = "videos from text" if video else "images"
    return f"makes {made}; --last-frame is the last frame of an image-to-video clip"


def needs_last_frame(model: str) -> str:
    """Why a first-last-frame model refuses a run without its last frame."""
    return f"{model} animates from a first to a last frame (Wan 2.1 FLF2V): give both, --image and --last-frame"


def last_frame_use(pipe: Any) -> str:
    """How a loaded image-to-video pipeline takes a last frame: 'required' (Wan 2.1 FLF2V: its image
    embedder reads two frames' features), 'optional' (Wan 2.2 A14B I2V: the latents alone), or
    why it takes none."""
    name = _class_in(pipe, LAST_FRAME_PIPELINES)
    if name is None:
        return takes_no_last_frame(_class_in(pipe, ANIMATE_PIPELINES), True)
    if name == "MiniMaxH3KeyframePipeline":
        return "optional"
    if pipe.config.get("expand_timesteps"):
        return FIRST_FRAME_ONLY_TI2V
    config = (pipe.transformer or pipe.transformer_2).config
    if config.get("image_dim") is None:
        return "optional"
    return "required" if config.get("pos_embed_seq_len") else ONE_FRAME_EMBEDDER


def frame_mask(pipe: Any) -> Any:
    """For a pipeline that lays its given frames beside the noise on the channels, with a mask of
    which latent frames hold one (Wan's image-to-video but TI2V): a function of the transformer's
    call arguments giving that mask, (batch, latent frames), 1 where a frame was given; None: another
    pipeline. What a run shows of the frames it was conditioned on (a first, and a last)."""
    if _class_in(pipe, ("MiniMaxH3KeyframePipeline",)):
        return _keyframe_rows
    if _class_in(pipe, LAST_FRAME_PIPELINES) is None or pipe.config.get("expand_timesteps"):
        return None
    noise = pipe.vae.config.z_dim  # the noise's channels, then the mask's (4), then the frames' latents

    def read(kwargs: dict[str, Any]) -> Any:
        hidden = kwargs.get("hidden_states")
        if getattr(hidden, "dim", lambda: 0)() != 5 or hidden.shape[1] < noise + 4:
            return None
        # A latent frame packs 4 pixel frames, one mask channel each (a last frame: the fourth's); no host sync here
        return hidden[:, noise:noise + 4, :, 0, 0].detach().amax(dim=1)
    return read


def _keyframe_rows(kwargs: dict[str, Any]) -> Any:
    """MiniMax-H3's given latent frames, from a call's packed layout: its keyframes' video rows are
    those whose noise level (an index into the call's timesteps) is not the generated rows' (the last
    video row's), each anchored at the generated latent frame whose time position is nearest its own;
    (1, latent frames), 1 where a frame was given. A host read of the layout, once, at the first
    call's entry (before any of its collectives)."""
    import torch

    rows = kwargs.get("video_indices")
    if rows is None:
        return None
    level = kwargs["timestep_indices"][rows]
    given = level != level[-1]
    times = kwargs["position_ids"][rows, 0]
    frames = torch.unique(times[~given])  # each generated latent frame's time position, in order
    mask = torch.zeros(1, len(frames))
    for time in torch.unique(times[given]):
        mask[0, int((frames - time).abs().argmin())] = 1
    return mask


def check_last_frame(pipe: Any, model: str, given: bool, flag: str = "--last-frame") -> None:
    """Refuse (`UsageError`) an image-to-video call of a loaded pipeline with a last frame it takes
    none of, or without the one it needs (a checkpoint's, known once it loads; a preset's were
    refused before any rank). `flag`: what gives the last frame (`serve`: the `last_frame` file)."""
    use = last_frame_use(pipe)
    if given and use not in ("required", "optional"):
        raise UsageError(f"{flag}: {model}: {use}")
    if not given and use == "required":
        raise UsageError(f"{flag}: {needs_last_frame(model)}")


def animates(pipe: Any) -> bool:
    """Whether `pipe` is an image-to-video pipeline (`ANIMATE_PIPELINES`)."""
    return _class_in(pipe, ANIMATE_PIPELINES) is not None


AUDIO_PIPELINES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "MiniMaxH3Pipeline", "MiniMaxH3KeyframePipeline")
"""Video pipelines that make a soundtrack with their clips (`.audio`: LTX-2's and MiniMax-H3's stereo
waveforms)."""


def clip_rate(pipeline: str) -> float | None:
    """The frame rate an `AUDIO_PIPELINES` class makes its clips for when its call names none (its
    `frame_rate`'s default: LTX-2's 24; MiniMax-H3's fixed 24), which its soundtrack keeps pace with;
    None: another class."""
    if pipeline not in AUDIO_PIPELINES:
        return None
    if pipeline.startswith("MiniMaxH3"):
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_FPS

        return float(MINIMAX_H3_FPS)
    import diffusers

    return float(inspect.signature(getattr(diffusers, pipeline).__call__).parameters["frame_rate"].default)

SIZED_BY_IMAGE = ("HunyuanVideo15ImageToVideoPipeline",)
"""Image-to-video pipelines that take no height and width: the clip's size is the bucket of their
`target_size` (a pixel area) nearest the image's aspect ratio (`size_arguments` sets both)."""


def animates_one_image(model: str) -> str:
    """Why an image-to-video pipeline refuses a run without one image (or with a mask, a strength
    or several images)."""
    return f"{model} animates one image: give it as --image (the clip's first frame), with no --mask or --strength"


EDIT_FAMILY = {"FluxKontextPipeline": "FluxPipeline", "QwenImageEditPlusPipeline": "QwenImagePipeline",
               "QwenImageEditPipeline": "QwenImagePipeline",
               "ZImageOmniPipeline": "ZImagePipeline", "FluxKontextInpaintPipeline": "FluxPipeline",
               "Flux2KleinInpaintPipeline": "Flux2KleinPipeline",
               "QwenImageEditInpaintPipeline": "QwenImagePipeline",
               "WanImageToVideoPipeline": "WanPipeline",
               "LTXImageToVideoPipeline": "LTXPipeline", "HunyuanVideo15ImageToVideoPipeline": "HunyuanVideo15Pipeline",
               "LTX2ImageToVideoPipeline": "LTX2Pipeline", "MiniMaxH3KeyframePipeline": "MiniMaxH3Pipeline"}
"""Edit and image-to-video pipelines that take their text-to-X family's prompt inputs and guidance."""


def _class_in(pipe: Any, names: Any) -> str | None:
    """The class among `names` that `pipe` is (or derives from), by name; None: none of them."""
    return next((cls.__name__ for cls in type(pipe).__mro__ if cls.__name__ in names), None)


def edit_pipeline(pipe: Any) -> str | None:
    """The edit pipeline class `pipe` is (or derives from), by name; None: not an edit pipeline."""
    return _class_in(pipe, EDIT_PIPELINES)


def size_arguments(pipe: Any, height: int, width: int, image: Any = None) -> dict[str, Any]:
    """The call's arguments for an output of `height` x `width`: FLUX.1 Kontext also takes
    `max_area`, to which it rescales the output otherwise (1024 x 1024 by default). A pipeline
    sized by its image (`SIZED_BY_IMAGE`) gets the target size whose bucket is `height` x `width`
    (set on the pipeline) and `image` (a PIL image) cropped to that size, so that the bucket it
    picks from the image's aspect is that one."""
    name = _class_in(pipe, SIZED_BY_IMAGE)
    if name is not None:
        multiple = pipe.video_processor.config.vae_scale_factor
        target = bucket_target(height, width, multiple)
        if target is None:
            raise ValueError(no_bucket(name, height, width, multiple))
        pipe.target_size = target
        return {} if image is None else {"image": pipe.video_processor.resize(image, height=height, width=width,
                                                                               resize_mode="crop")}
    size = {"height": height, "width": width}
    kontext = _class_in(pipe, ("FluxKontextPipeline", "FluxKontextInpaintPipeline"))
    return {**size, "max_area": height * width} if kontext else size


def bucket_target(height: int, width: int, multiple: int) -> float | None:
    """The `target_size` (the side of a square of the same area) for which HunyuanVideo 1.5's
    image-to-video makes a `height` x `width` clip from an image of that aspect: its buckets are
    the sizes of at most target_size^2 pixels in steps of `multiple` with sides at most 4:1, and it
    takes the one nearest the image's aspect ratio (its own `calculate_default_height_width`, run
    here). None where no target gives that size."""
    import numpy as np
    from diffusers.pipelines.hunyuan_video1_5.image_processor import (
        generate_crop_size_list,
        get_closest_ratio,
    )

    target = multiple * ((height // multiple) * (width // multiple)) ** 0.5
    buckets = generate_crop_size_list(base_size=target, patch_size=multiple)
    ratios = np.array([round(float(h) / float(w), 5) for h, w in buckets])
    chosen = get_closest_ratio(height, width, ratios, buckets)[0] if buckets else None
    return target if chosen is not None and tuple(chosen) == (height, width) else None


def no_bucket(model: str, height: int, width: int, multiple: int) -> str:
    """Why a pipeline sized by its image (`SIZED_BY_IMAGE`) cannot make `height` x `width`."""
    return (f"{model} makes clips in its buckets (sides in multiples of {multiple} pixels, at most 4:1), and "
            f"{width} wide x {height} high is none of them; e.g. {multiple * 4} x {multiple * 4}, or {multiple * 8} "
            f"wide x {multiple * 4} high")


def check_reference(pipeline: str, image: Any) -> None:
    """Raise ValueError where `pipeline`'s own check refuses reference `image` (a PIL image): FLUX.2's
    sides of at least 64 pixels and aspect ratio of at most 8."""
    if pipeline == "Flux2Pipeline":
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        Flux2ImageProcessor.check_image_input(image)


def takes_no_start_image(pipeline: str) -> str:
    """Why an edit pipeline refuses `--strength` and `--mask` (with an `EDIT_INPAINT` class: `--strength`
    without `--mask`)."""
    if pipeline in EDIT_INPAINT:
        return (f"{pipeline} edits from reference images: it starts from an image only to repaint it where a "
                f"--mask is white ({EDIT_INPAINT[pipeline]}: one --image, a --mask, --strength optional)")
    return f"{pipeline} edits from reference images: it takes no --strength or --mask"


def too_many_references(pipeline: str) -> str:
    """Why an edit pipeline refuses more reference images than it takes."""
    limit = EDIT_PIPELINES[pipeline]
    return f"{pipeline} takes at most {limit} reference image{'s' if limit > 1 else ''}"


def takes_one_image(pipeline: str) -> str:
    """Why a pipeline that is not an edit pipeline refuses several `--image`."""
    return (f"{pipeline} takes one --image (image-to-image, or inpainting with --mask); several are the reference "
            f"images of an edit pipeline ({', '.join(name for name, limit in EDIT_PIPELINES.items() if limit > 1)})")


_FAMILY_OF = {name: family for family, tasks in PIPELINES.items() for name in (family, *tasks.values())}


def family_of(class_name: str) -> str | None:
    """The text-to-image family ('FluxPipeline', ...) of a pipeline class name, or None."""
    return _FAMILY_OF.get(class_name)


def task_pipeline(pipe: Any, task: str) -> Any:
    """The `task` ('img2img' or 'inpaint') pipeline of `pipe`'s family, built from `pipe`'s own parts.

    The stock class's constructor takes the same registered components (transformer, VAE,
    scheduler, text encoders); the parts are shared, not copied, so weights are loaded once.
    """
    import diffusers

    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {', '.join(TASKS)}")
    edit = _class_in(pipe, EDIT_INPAINT)
    family = next((family_of(cls.__name__) for cls in type(pipe).__mro__ if family_of(cls.__name__)), None)
    if edit is not None and task == "inpaint":
        stock = getattr(diffusers, EDIT_INPAINT[edit])
        accepted = inspect.signature(stock.__init__).parameters
        return stock(**{name: part for name, part in pipe.components.items() if name in accepted})
    if family is None and (unrouted := _class_in(pipe, UNROUTED_EDITS)):
        raise UsageError(UNROUTED_EDITS[unrouted])
    if family is None:
        raise UsageError(f"{type(pipe).__name__} has no image-to-image or inpainting pipeline here; supported: "
                         f"{', '.join(PIPELINES)}")
    stock = getattr(diffusers, PIPELINES[family][task])
    accepted = inspect.signature(stock.__init__).parameters
    return stock(**{name: part for name, part in pipe.components.items() if name in accepted})


VIDEO_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline", "LTXPipeline", "LTXImageToVideoPipeline", "LTX2Pipeline",
                   "LTX2ImageToVideoPipeline",
                   "HunyuanVideoPipeline", "HunyuanVideo15Pipeline", "CogVideoXPipeline", "MiniMaxH3Pipeline",
                   "MiniMaxH3KeyframePipeline")
"""Pipeline classes whose output is `.frames` (clips), not `.images`."""


FAMILY_OPTIONS: dict[str, dict[str, Any]] = {
    "FluxPipeline": {"guidance_scale": 3.5},  # feeds guidance-distilled transformers; true CFG needs negatives
    "StableDiffusion3Pipeline": {"guidance_scale": 5.0},  # classifier-free guidance: a batch of 2 per call
    "QwenImagePipeline": {"true_cfg_scale": 4.0},  # true CFG: two transformer calls per step, padded text masked
    "Flux2Pipeline": {"guidance_scale": 4.0},  # guidance-distilled: one call per step
    "Flux2KleinPipeline": {"guidance_scale": 4.0},  # classifier-free guidance (undistilled [klein]): two calls per step
    "WanPipeline": {"guidance_scale": 5.0},  # classifier-free guidance: two transformer calls per step
    "LTXPipeline": {"guidance_scale": 3.0},  # classifier-free guidance: a batch of 2 per call, padded text masked
    "ZImagePipeline": {"guidance_scale": 0.0},  # Z-Image-Turbo is distilled: no CFG, one call per step
    "HunyuanVideo15Pipeline": {},  # its guider runs classifier-free guidance: two calls per step
    "LTX2Pipeline": {"guidance_scale": 3.0},  # classifier-free guidance: a batch of 2 per call (video and audio)
    "CogView4Pipeline": {"guidance_scale": 5.0},  # classifier-free guidance: two transformer calls per step
    "ChromaPipeline": {"guidance_scale": 5.0},  # classifier-free guidance: two transformer calls per step
    "QwenImage21Pipeline": {"true_cfg_scale": 4.0},  # true CFG: two calls per step, each with its prefix cache
    "MiniMaxH3Pipeline": {},  # guidance-distilled: one call per step
}
"""Guidance arguments of each pipeline class when a preset runs it, unless the preset or the caller says otherwise."""


CFG_BY_GUIDANCE_SCALE = ("StableDiffusion3Pipeline", "WanPipeline", "LTXPipeline", "LTX2Pipeline", "Flux2KleinPipeline",
                         "CogView4Pipeline", "ChromaPipeline")
"""Pipelines whose `guidance_scale` > 1 is classifier-free guidance (not a distilled guidance input)."""


def uses_cfg(pipe: Any) -> bool:
    """Whether `pipe` runs classifier-free guidance by default: its preset's or its family's
    options (true CFG's `true_cfg_scale`, SD3's batched `guidance_scale`). A bare transformer: no."""
    try:
        family = pipeline_kind(pipe)
    except (KeyError, ValueError):
        return False
    options = getattr(pipe, "prompt_defaults", None) or FAMILY_OPTIONS[family]
    if options.get("true_cfg_scale", 1.0) > 1.0:
        return True
    return family in CFG_BY_GUIDANCE_SCALE and options.get("guidance_scale", 1.0) > 1.0


def pipeline_kind(pipe: Any) -> str:
    """The stock pipeline class `pipe` is (or derives from), by name."""
    for cls in type(pipe).__mro__:
        # img2img, inpaint and edit pipelines take their family's inputs
        family = family_of(cls.__name__) or EDIT_FAMILY.get(cls.__name__) or cls.__name__
        if family in FAMILY_OPTIONS:
            return family
    raise UsageError(f"no prompt inputs for {type(pipe).__name__}")


def _left_padded(embeds: Any, mask: Any) -> tuple[Any, Any]:
    """Right-padded (B, L, D) embeddings and their (B, L) mask with each row's real tokens moved to its end."""
    import torch

    order = torch.argsort(mask.long(), dim=1, stable=True)  # padding first, then the tokens in their order
    return embeds.gather(1, order[..., None].expand_as(embeds)), mask.gather(1, order)


def _chroma_mask(mask: Any) -> Any:
    """A (B, L) padding mask as ChromaPipeline's own encoding makes it: the real tokens and the
    first padding token after them (`mask_indices <= seq_lengths`)."""
    import torch

    lengths = mask.long().sum(1, keepdim=True)
    return torch.arange(mask.shape[1], device=mask.device)[None] <= lengths


def prompt_inputs(pipe: Any, encoder: Any, prompts: list[str], negatives: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """The stock pipeline's `prompt_embeds` arguments for `prompts`, from a preset's text encoder.

    Prompts and negatives are encoded as one batch (the prompts, then as many negatives) and cast
    to the transformer's device and dtype. `options` (the call's guidance arguments) decide
    whether FLUX gets negatives: only true CFG (`true_cfg_scale` > 1) uses them.
    """
    if len(negatives) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(negatives)} negative prompts")
    if _class_in(pipe, ("ZImageOmniPipeline",)):  # text segments around the references
        return _omni_segments(pipe, encoder, prompts, negatives, _count_images(options.get("image")))
    dtype, device = pipe.transformer.dtype, pipe.transformer.device
    (embeds, neg_embeds), (mask, neg_mask), (pooled, neg_pooled) = (
        t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).chunk(2)
        for t in encoder([*prompts, *negatives])
    )
    family = pipeline_kind(pipe)
    if family == "FluxPipeline":
        inputs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if options.get("true_cfg_scale", 1.0) > 1.0:
            inputs.update(negative_prompt_embeds=neg_embeds, negative_pooled_prompt_embeds=neg_pooled)
        return inputs
    if family == "Flux2Pipeline":
        return {"prompt_embeds": embeds}
    if family == "MiniMaxH3Pipeline":  # the prompt's real tokens alone, as its conditioner's hidden states are
        return {"prompt_embeds": embeds[:, :max(int(mask.sum(1).max()), 1)]}
    if family == "Flux2KleinPipeline":
        return {"prompt_embeds": embeds, "negative_prompt_embeds": neg_embeds}
    if family == "ChromaPipeline":  # its mask as its own T5 encoding makes it: float, the first padding token kept
        mask, neg_mask = (_chroma_mask(m).to(dtype) for m in (mask, neg_mask))
        return {
            "prompt_embeds": embeds, "prompt_attention_mask": mask,
            "negative_prompt_embeds": neg_embeds, "negative_prompt_attention_mask": neg_mask,
        }
    if family in ("WanPipeline", "CogView4Pipeline"):  # CogView4: no mask, its padded prompt attended whole
        return {"prompt_embeds": embeds, "negative_prompt_embeds": neg_embeds}
    if family == "LTX2Pipeline":  # left-padded, as LTX-2's pipeline reads a prompt encoded without its tokenizer
        embeds, mask, neg_embeds, neg_mask = (*_left_padded(embeds, mask), *_left_padded(neg_embeds, neg_mask))
    if family in ("LTXPipeline", "LTX2Pipeline"):
        return {
            "prompt_embeds": embeds, "prompt_attention_mask": mask,
            "negative_prompt_embeds": neg_embeds, "negative_prompt_attention_mask": neg_mask,
        }
    if family == "ZImagePipeline":  # per-item lists of the real tokens (a chat template always leaves some)
        count = mask.sum(1).clamp(min=1).tolist()
        return {"prompt_embeds": [e[:n] for e, n in zip(embeds, count)],
                "negative_prompt_embeds": [e[:n] for e, n in zip(neg_embeds, neg_mask.sum(1).clamp(min=1).tolist())]}
    if family == "HunyuanVideo15Pipeline":  # one tiny encoder stands in for both (Qwen2.5-VL and ByT5)
        return {
            "prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": embeds, "prompt_embeds_mask_2": mask,
            "negative_prompt_embeds": neg_embeds, "negative_prompt_embeds_mask": neg_mask,
            "negative_prompt_embeds_2": neg_embeds, "negative_prompt_embeds_mask_2": neg_mask,
        }
    if family == "StableDiffusion3Pipeline":
        return {
            "prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
            "negative_prompt_embeds": neg_embeds, "negative_pooled_prompt_embeds": neg_pooled,
        }
    return {  # QwenImagePipeline, QwenImage21Pipeline (its mask bool, as its own encoding makes it)
        "prompt_embeds": embeds, "prompt_embeds_mask": mask,
        "negative_prompt_embeds": neg_embeds, "negative_prompt_embeds_mask": neg_mask,
    }


def _count_images(image: Any) -> int:
    """References in a call's `image` argument: none, one, or a list."""
    return 0 if image is None else len(image) if isinstance(image, (list, tuple)) else 1


def _omni_segments(pipe: Any, encoder: Any, prompts: list[str], negatives: list[str], images: int) -> dict[str, Any]:
    """Z-Image-Omni's prompt arguments from a preset's encoder: per prompt, a list of text segments,
    one before each reference (whose latents and SigLIP tokens follow it in the sequence), the
    prompt's after the last, and a closing one; without references the prompt alone. The segments
    are ZImageOmniPipeline's own chat template (its `_encode_prompt`), each encoded apart and cut
    to its real tokens."""
    def segments(text: str) -> list[str]:
        if images == 0:
            return [f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"]
        return ["<|im_start|>user\n<|vision_start|>", *["<|vision_end|><|vision_start|>"] * (images - 1),
                f"<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n<|vision_start|>", "<|vision_end|><|im_end|>"]

    dtype, device = pipe.transformer.dtype, pipe.transformer.device
    texts = [segments(text) for text in (*prompts, *negatives)]
    embeds, mask, _ = encoder([segment for item in texts for segment in item])
    embeds = embeds.to(device=device, dtype=dtype)
    counts = mask.sum(1).clamp(min=1).tolist()
    rows = iter(zip(embeds, counts))
    per_item = [[e[:n] for e, n in (next(rows) for _ in item)] for item in texts]
    return {"prompt_embeds": per_item[:len(prompts)], "negative_prompt_embeds": per_item[len(prompts):]}
