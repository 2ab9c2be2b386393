"""One timed pipeline call: the prompt encoded once, the VAE decoded in bands where it helps, each
denoising step timed and reported as progress."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..distributed.clock import now
from ..engine.encode_once import encode_once
from ..engine.families import family_of
from ..engine.families.pipelines import check_last_frame, clip_rate, frame_mask, size_arguments
from ..engine.parallelized import Parallelized
from ..engine.steps import step_callback
from ..engine.vae.kl2d import encode_split
from ..engine.vae import decode_split, latent_rows, use_parallel_encode, use_parallel_vae
from ..errors import PeerTimeout, UsageError
from .lifetime import Progress
from .spec import GenerateSpec


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _splits_vae(spec: GenerateSpec, pipe: Any, parallel: Parallelized) -> bool:
    """Whether this run decodes in bands (the same answer on every rank: it depends on the run only)."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not hasattr(vae, "config"):
        return False
    rows = latent_rows(vae, spec.height)
    return use_parallel_vae(spec.parallel.parallel_vae, vae, rows, parallel.topology.world_size)


def run_pipeline(spec: GenerateSpec, pipe: Any, encoder: Any, parallel: Parallelized | None,
                 decode: bool = True) -> dict[str, Any]:
    """One pipeline call: the first image, every image of the batch, the final latents and per-step timings on this rank.

    The pipeline encodes `spec.prompt` itself (a preset's with `encoder`, see `PromptEncoding`);
    with `parallel`, on rank 0 alone, the embeddings broadcast to the others (`encode_once`).
    A video model's run also gives its clips (`video`: the first, `videos`: every one, (F, H, W, 3)
    in [0, 1]); `image` is then the first clip's first frame. `decode` False skips the VAE (the
    latents only): the ranks whose pictures nobody reads. Under `--parallel-vae` every rank
    decodes (a band each, `engine.vae`), `decode` False or not, and an image input is encoded
    in bands too (where the VAE's 2D encoder can be; `parallel_vae_encodes`: the encodes that were).
    """
    # Layers are followed by hooks on the attention modules: not inside compiled blocks, where
    # each module's own hook would be a guard (a recompilation per block); the step still is.
    follow_layers = parallel is not None and getattr(parallel, "compiled", None) is None
    stages = getattr(parallel, "stages", None)  # not diffusers' own Ulysses (bench e2e's baseline)
    role = f"stage {stages.stage} of {stages.stages}" if stages is not None and stages.stages > 1 else None
    timer = _StepTimer(pipe.transformer, Progress(spec.steps, pipe.transformer if follow_layers else None, role),
                       frame_mask(pipe))
    if parallel is not None:
        parallel.stats.reset()
    group = parallel.topology.world_group if parallel is not None else None
    split_vae = parallel is not None and _splits_vae(spec, pipe, parallel)
    decode = decode or split_vae
    split_encode = split_vae and spec.source is not None and use_parallel_encode(spec.parallel.parallel_vae, pipe.vae)
    encoded: list[tuple[int, ...]] = []
    split = spec.parallel.offload_text_encoders is not True  # every rank holds the encoders: many prompts split
    once = encode_once(pipe, group, parallel.topology.device, split=split) if parallel is not None else contextlib.nullcontext()
    try:
        with (once, decode_split(pipe.vae, group) if split_vae else contextlib.nullcontext(),
              encode_split(pipe.vae, group) if split_encode else contextlib.nullcontext(encoded) as encoded,
              step_callback(pipe, timer.step_ended) as callback):
            output = _call(spec, pipe, decode, callback)
    except PeerTimeout as error:
        timer.progress.locate(error)  # the layer and step it happened at
        raise
    finally:
        timer.close()
    run = {"latents": timer.latents(), "step_s": timer.step_s(), "reference_tokens": timer.reference_tokens(),
           "conditioned_frames": timer.conditioned_frames(), "parallel_vae": split_vae,
           "parallel_vae_encodes": len(encoded), "image": None, "images": [], "video": None, "videos": []}
    return _with_pictures(run, output, pipe) if decode else run


class _StepTimer:
    """Each denoising step's time on this rank, and the last step's latents. A step's time is the
    device's: the clock is read once the device has run the step."""

    def __init__(self, transformer: torch.nn.Module, progress: Progress, frame_mask: Any = None) -> None:
        self.device, self.progress, self.frame_mask = transformer.device, progress, frame_mask
        self.count_references = _reference_counter(transformer)
        self.references: int | None = None
        """The first call's reference tokens as its family counts them (`Family.reference_tokens`)."""
        self.mask: torch.Tensor | None = None
        """The first call's mask of given latent frames (`pipelines.frame_mask`); None: none."""
        self.marks: list[float] = []
        self.final: dict[str, torch.Tensor] = {}
        self.tokens: int | None = None
        """Tokens of the first call's packed (B, S, C) `hidden_states`, before any split; None: not packed."""
        self.hook = transformer.register_forward_pre_hook(self._first_call, prepend=True, with_kwargs=True)

    def _first_call(self, _module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not self.marks:
            self.marks.append(now(self.device))
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self.tokens = hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None
            if self.tokens is None and self.count_references is not None:  # latents not packed (Z-Image-Omni)
                self.references = self.count_references(kwargs)
            self.mask = self.frame_mask(kwargs) if self.frame_mask is not None else None

    def step_ended(self, _pipe: Any, step: int, _timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        self.marks.append(now(self.device))
        self.final["latents"] = tensors["latents"]  # copied to the host once, after the last step
        self.progress.step_ended(step)
        return tensors

    def close(self) -> None:
        self.hook.remove()
        self.progress.close()

    def step_s(self) -> list[float]:
        return np.diff(self.marks).tolist()

    def latents(self) -> torch.Tensor:
        return self.final["latents"].detach().float().cpu().clone()

    def conditioned_frames(self) -> list[int] | None:
        """The latent frames given to the model beside the noise (a first frame: [0]; and a last:
        [0, n - 1]), read from its first call's input; None where the pipeline lays none there."""
        if self.mask is None:
            return None
        return torch.nonzero(self.mask[0].cpu()).flatten().tolist()

    def reference_tokens(self) -> int | None:
        """Tokens the transformer's sequence held beyond the latents' (an edit's reference images);
        None where the latents are not packed tokens and the family counts none."""
        if self.references is not None:
            return self.references
        latents = self.final.get("latents")
        if self.tokens is None or latents is None or latents.dim() != 3:
            return None
        return self.tokens - latents.shape[1]


def _reference_counter(transformer: torch.nn.Module) -> Any:
    """The family's count of an edit's reference tokens from a call's arguments, or None."""
    try:
        return family_of(transformer).reference_tokens
    except UsageError:  # no family: nothing to count
        return None


def _call(spec: GenerateSpec, pipe: Any, decode: bool, callback: dict[str, Any]) -> Any:
    """The stock pipeline's call for `spec` (pictures, or latents alone when not `decode`)."""
    images = spec.source.pipeline_kwargs() if spec.source is not None else {}
    if spec.source is not None and spec.source.animates:
        check_last_frame(pipe, spec.model, spec.source.last is not None)
    return pipe(
        spec.prompt,
        **{**images, **size_arguments(pipe, spec.height, spec.width, images.get("image"))},
        num_inference_steps=spec.steps,
        **{_per_prompt(pipe): spec.batch},
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type="np" if decode else "latent",
        **callback,
        **({"num_frames": spec.frames} if spec.frames is not None else {}),
    )


def _with_pictures(run: dict[str, Any], output: Any, pipe: Any = None) -> dict[str, Any]:
    """`run` with the pipeline's pictures: images (H, W, 3), or clips (F, H, W, 3) and their first
    frames, in [0, 1]; and a clip's soundtrack where the pipeline makes one (LTX-2: `audios`, one
    (channels, samples) waveform per clip, at `sample_rate`)."""
    if hasattr(output, "frames"):  # a video pipeline: (B, F, H, W, 3)
        run["videos"] = [np.asarray(clip, dtype=np.float32) for clip in output.frames]
        run["video"] = run["videos"][0]
        run["images"] = [clip[0] for clip in run["videos"]]
        audio = getattr(output, "audio", None)
        if audio is not None:
            run["audios"] = [np.asarray(torch.as_tensor(wave).float().cpu(), dtype=np.float32) for wave in audio]
            run["sample_rate"], run["fps"] = sample_rate(pipe), frame_rate(pipe)
    else:
        run["images"] = [np.asarray(image, dtype=np.float32) for image in output.images]
    run["image"] = run["images"][0]
    return run


def sample_rate(pipe: Any) -> int:
    """The rate of the waveforms `pipe` makes (LTX-2's vocoder's output rate, MiniMax-H3's audio VAE's)."""
    vocoder = getattr(pipe, "vocoder", None)
    return int(vocoder.config.output_sampling_rate) if vocoder is not None else int(pipe.audio_vae.config.sampling_rate)


def frame_rate(pipe: Any) -> float:
    """The frame rate `pipe` makes its clips for when the call names none (LTX-2's `frame_rate`,
    24): the rate its soundtrack keeps pace with, so the MP4's."""
    return clip_rate(type(pipe).__name__)  # a preset's class bears its stock pipeline's name


def _per_prompt(pipe: Any) -> str:
    """The name under which `pipe` takes pictures per prompt: `num_videos_per_prompt` where its call has
    that and no `num_images_per_prompt` (a video pipeline loaded from a checkpoint), else the latter."""
    params = inspect.signature(type(pipe).__call__).parameters
    if "num_images_per_prompt" not in params and "num_videos_per_prompt" in params:
        return "num_videos_per_prompt"
    return "num_images_per_prompt"
