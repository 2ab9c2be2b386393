"""MiniMax-H3 (text to video with stereo sound) as a pipeline called like the stock ones.

diffusers 0.42.1 runs MiniMax-H3 through a modular pipeline (`MiniMaxH3Blocks`): its text encoder
(Qwen3-VL, hidden states after its 50th layer) presents the prompt, a layout step packs video,
audio and text rows into one sequence, and a loop calls the transformer once a step (the checkpoint
is guidance-distilled: no unconditional pass) and steps the video and audio rows down two schedules.
`MiniMaxH3Pipeline` runs that text-to-video-and-audio workflow's own blocks (`t2va`: layout, noise,
row timesteps, denoising, decoding) from prompt embeddings, as every preset's pipeline takes them,
behind a `DiffusionPipeline` call: `prompt_embeds`, size, frames, steps, generator, `output_type`
and `callback_on_step_end`, with `.frames` and `.audio` out; given keyframes (`image`, the clip's
first frame, and `last_image`, its last), the keyframe workflow's (`fl2va`: the keyframes put on the
canvas and encoded, their rows packed ahead of the noise at their own timestep).
`MiniMaxH3KeyframePipeline` is the same pipeline under the name of one that animates an image
(`--image`, and `--last-frame` optionally). Nothing of the blocks is re-implemented.

Steps: diffusers' MiniMax-H3 takes `num_inference_steps` as the points of its sigma grid, the final
0 included, so n of them are n - 1 transformer calls; here, as in every other pipeline, a step is a
transformer call (n steps: a grid of n + 1 points).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.loaders import MiniMaxH3LoraLoaderMixin
from diffusers.utils import BaseOutput

from ..engine.steps import scheduler_steps
from .tiny_parts import TinyTextEncoder

__all__ = ["MiniMaxH3KeyframePipeline", "MiniMaxH3Output", "MiniMaxH3Pipeline", "build_minimax_h3"]

@dataclass
class MiniMaxH3Output(BaseOutput):
    frames: Any
    """(batch, frames, height, width, 3) in [0, 1]; with `output_type="latent"`, the denoised packed video rows."""
    audio: Any
    """(batch, 2, samples) stereo waveforms at `audio_sampling_rate`; None with `output_type="latent"`."""


def _vae_configs() -> type:
    """A block that declares the two VAEs and does nothing: the denoising blocks read their configs
    (latent channels, compression) without declaring them, so blocks that stop at the latents take
    the VAEs through it."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from diffusers.modular_pipelines import ModularPipelineBlocks
    from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec

    class VaeConfigs(ModularPipelineBlocks):
        model_name = "minimax-h3"
        description = "The video and audio VAEs, whose configs the denoising blocks read."
        expected_components = [ComponentSpec("vae", AutoencoderKLMiniMaxH3),
                               ComponentSpec("audio_vae", AutoencoderKLMiniMaxH3Audio)]
        inputs: list = []
        intermediate_outputs: list = []

        def __call__(self, components: Any, state: Any) -> tuple[Any, Any]:
            return components, state

    return VaeConfigs


class MiniMaxH3Pipeline(DiffusionPipeline, MiniMaxH3LoraLoaderMixin):
    """MiniMax-H3's `t2va` workflow from prompt embeddings (see the module's text); LoRA adapters load
    as into diffusers' MiniMax-H3 pipeline (its own loader)."""

    model_cpu_offload_seq = "transformer->vae->audio_vae"
    animates = False
    """Whether a call takes the clip's first frame (`MiniMaxH3KeyframePipeline`)."""

    def __init__(self, transformer: Any, vae: Any, audio_vae: Any, scheduler: Any, audio_scheduler: Any) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, audio_vae=audio_vae, scheduler=scheduler,
                              audio_scheduler=audio_scheduler)

    @property
    def audio_sampling_rate(self) -> int:
        return int(self.audio_vae.config.sampling_rate)

    @property
    def frame_chunk(self) -> tuple[int, int]:
        """(pixel frames, latent frames) its VAE encodes at a time: 17 -> 5, clips of 17 k + 5 frames."""
        return int(self.vae.config.clip_length), int(self.vae.tokens_chunk_size)

    @property
    def frame_limits(self) -> tuple[int, int]:
        """The fewest and most frames of a clip: whole chunks from 5 to 15 seconds at 24 fps (124 to 345)."""
        modular, (pixels, rest) = self._blocks(True), self.frame_chunk
        low, high = round(modular.min_duration * modular.fps), round(modular.max_duration * modular.fps)
        return low + (rest - low) % pixels, high - (high - rest) % pixels

    def _blocks(self, decode: bool, keyframes: bool = False) -> Any:
        """The modular pipeline of the `t2va` blocks, or with `keyframes` the `fl2va` ones (and the
        decoders when `decode`), over these components."""
        cache = self.__dict__.setdefault("_modular", {})
        if (decode, keyframes) not in cache:
            from diffusers.modular_pipelines import SequentialPipelineBlocks
            from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
            from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep
            from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
                MiniMaxH3CoreDenoiseStep,
                MiniMaxH3DecodeStep,
                MiniMaxH3FL2VACoreDenoiseStep,
            )

            last = MiniMaxH3DecodeStep() if decode else _vae_configs()()
            first = {"before_encode": MiniMaxH3ResizeStep(), "vae_encoder": MiniMaxH3KeyframeVaeEncoderStep()}
            core = MiniMaxH3FL2VACoreDenoiseStep() if keyframes else MiniMaxH3CoreDenoiseStep()
            # The core's steps side by side, so that the loop's progress bar is the pipeline's to set
            blocks = {**(first if keyframes else {}), **core.sub_blocks, "decode" if decode else "vae_configs": last}
            cache[decode, keyframes] = SequentialPipelineBlocks.from_blocks_dict(blocks).init_pipeline()
        modular = cache[decode, keyframes]
        modular.update_components(**{name: getattr(self, name) for name in self.components})
        modular.set_progress_bar_config(**getattr(self, "_progress_bar_config", {}))
        return modular

    @torch.no_grad()
    def __call__(self, prompt: str | None = None, negative_prompt: str | None = None,
                 prompt_embeds: torch.Tensor | None = None, image: Any = None, last_image: Any = None,
                 height: int = 32,
                 width: int = 32, num_frames: int = 124, num_inference_steps: int = 4, num_videos_per_prompt: int = 1,
                 generator: torch.Generator | None = None, output_type: str = "np",
                 attention_kwargs: dict[str, Any] | None = None, callback_on_step_end: Any = None,
                 callback_on_step_end_tensor_inputs: tuple[str, ...] = ("latents",),
                 return_dict: bool = True) -> Any:
        if prompt is not None or prompt_embeds is None:
            raise ValueError("MiniMaxH3Pipeline takes prompt_embeds (Qwen3-VL's hidden states), not a prompt")
        if negative_prompt:
            raise ValueError("MiniMax-H3 is guidance-distilled: it takes no negative prompt")
        if self.animates and image is None:
            raise ValueError(f"{type(self).__name__} animates an image: give the clip's first frame as `image`")
        if prompt_embeds.shape[0] != 1 or num_videos_per_prompt != 1:
            raise ValueError(f"MiniMax-H3 packs one clip per call into one sequence; got {prompt_embeds.shape[0]} "
                             f"prompts x {num_videos_per_prompt} clips")
        decode, keyframes = output_type != "latent", {"image": image, "last_image": last_image}
        keyframes = {name: frame for name, frame in keyframes.items() if frame is not None}
        modular = self._blocks(decode, bool(keyframes))
        tags = torch.full((prompt_embeds.shape[1],), modular.text_tag, dtype=torch.long)
        # Its loop has no step callback: the video rows' scheduler step runs it
        callback = scheduler_steps(self, callback_on_step_end) if callback_on_step_end else contextlib.nullcontext()
        with callback:
            state = modular(prompt_embeds=prompt_embeds, text_token_tags=tags, height=height, width=width,
                            num_frames=num_frames, num_inference_steps=num_inference_steps + 1, generator=generator,
                            attention_kwargs=attention_kwargs, **keyframes, **({"output_type": "pt"} if decode else {}))
        if not decode:
            frames, audio = state.get("latents"), None
        else:
            frames, audio = state.get("videos"), state.get("audio")
            if output_type == "np":
                frames = frames.permute(0, 1, 3, 4, 2).float().cpu().numpy().astype(np.float32)
            elif output_type == "pil":
                frames = modular.video_processor.postprocess_video(frames.permute(0, 2, 1, 3, 4), output_type="pil")
        self.maybe_free_model_hooks()
        if not return_dict:
            return frames, audio
        return MiniMaxH3Output(frames=frames, audio=audio)


class MiniMaxH3KeyframePipeline(MiniMaxH3Pipeline):
    """`MiniMaxH3Pipeline` animating an image: `image` is the clip's first frame (and `last_image`,
    where given, its last), the keyframe workflow's (`fl2va`)."""

    animates = True


def build_minimax_h3(pipeline: str = "MiniMaxH3Pipeline"):
    """Tiny MiniMax-H3: 7 heads (as its 56, no power of two divides them), a refiner block over the
    prompt, 2 blocks over the packed sequence; the video VAE 16x spatially and its 17 frames -> 5
    latent frames, its decoder a one-block transformer; the audio VAE 200 samples a latent at 8 kHz
    (40 latents a second, as the real one's 800 at 32 kHz). Its shortest clip, 124 frames (5 s at 24
    fps), at 32x32 is 37 video rows (one 1x2x2 patch a latent frame), 414 audio rows (207 a channel)
    and the prompt's. `pipeline` "MiniMaxH3KeyframePipeline": the same parts animating an image."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )

    heads, latent, audio_latent, text = 7, 8, 6, 24
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=16, hidden_size=16 * heads, num_layers=2, num_refiner_layers=1,
        ffn_dim=64, in_channels=latent, audio_in_channels=audio_latent, text_dim=text, freq_dim=32,
        time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=latent, block_out_channels=(8,) * 6, layers_per_block=1, norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, decoder_ffn_mult=1, latents_mean=(0.0,) * latent, latents_std=(1.0,) * latent)
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(5, 5, 8), latent_dim=2 * audio_latent, latent_channels=audio_latent,
        num_attention_heads=2, decoder_dim=8, decoder_rates=(5, 5, 8), decoder_kernel_sizes=(10, 10, 16),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), sampling_rate=8000,
        latents_mean=[0.0] * audio_latent, latents_std=[1.0] * audio_latent)
    stock = MiniMaxH3KeyframePipeline if pipeline == "MiniMaxH3KeyframePipeline" else MiniMaxH3Pipeline
    pipe = stock(transformer=transformer, vae=vae, audio_vae=audio_vae, scheduler=MiniMaxH3Scheduler(),
                 audio_scheduler=MiniMaxH3Scheduler())
    return pipe, TinyTextEncoder(text, 32)
