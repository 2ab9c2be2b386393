"""Continuous batching at denoising-step granularity, for FLUX pipelines.

A `Stepper` holds the images in flight, each with its own latents, prompt embeddings, guidance and
its own copy of the pipeline's scheduler (so each follows its own timesteps). Every
`step(joins, leaves)` first forgets the requests in `leaves` (their clients went away), then admits
the requests in `joins` (their noise drawn from their own seeds, exactly as the
pipeline draws it alone), then runs one transformer call for every image in flight (at its own
timestep, positive and negative prompts in one batch when guided), advances each image by its own
scheduler, and returns the images whose last step this was, decoded. So a short request joins a
running batch at the next step boundary and leaves it when its own steps are done, and each image
is the one `pipe(prompt, generator=seed)` gives alone, up to the rounding of a batched matmul.

This mirrors `FluxPipeline.__call__` (prepare_latents, calculate_shift + retrieve_timesteps, the
Euler steps, unpack and decode) with its own parts; only the loop is ours, because the stock one
runs one fixed batch from its first step to its last. What joins a batch must share its size and
whether it is guided (`key`); prompts, seeds, step counts and guidance scales may differ.

Every rank runs the same `step` calls with the same joins and leaves (rank 0 broadcasts them), so all ranks
issue the same collectives; only the ranks that answer requests decode (`decode=True`).

Step caches (LOSSY), per request: a join with a `cache` spec gets one cache run per CFG branch
(engine/cache/rows.py: the positive and the negative rows decide apart, as the pipeline's two calls per
step do alone), which follows its rows through the batch; requests without one always compute.
After a step, `reports` holds the steps computed and skipped of each request it finished.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config.cache import CacheSpec
from ..engine.cache.rows import RowCaches, RowRun
from ..engine.data_parallel import unpaired
from ..engine.families.pipelines import FAMILY_OPTIONS, edit_pipeline, pipeline_kind, prompt_inputs
from ..models.lora import use_adapters
from .guard import PeerFailed, Ready, StepFailed, collective_failed

__all__ = ["Join", "JoinsFailed", "StepFailed", "Stepper", "cache_report", "collective_failed", "supports_steps"]


def supports_steps(pipe: Any) -> bool:
    """Whether `pipe` can be served with step-level batching (FLUX's text-to-image pipeline; not
    FLUX.1 Kontext, whose edits join reference tokens the stepper does not make)."""
    try:
        return pipeline_kind(pipe) == "FluxPipeline" and edit_pipeline(pipe) is None
    except Exception:
        return False


def cache_report(runs: list[RowRun]) -> dict[str, Any]:
    """A request's steps computed and skipped, summed over its runs (true CFG: a step counts once
    per branch, as `generate` counts its two calls)."""
    report = runs[0].report()
    for key in ("computed_steps", "skipped_steps"):
        report[key] = sum(run.report()[key] for run in runs)
    return report | {"lossy": True}


@dataclass(frozen=True, kw_only=True)
class Join:
    """A request entering the running batch: `len(seeds)` images of one prompt."""

    prompt: str
    seeds: tuple[int, ...]
    width: int
    height: int
    steps: int
    guidance: float | None
    """None: the pipeline's default."""
    cache: CacheSpec | None = None
    """Its step cache (LOSSY); None: every step computed."""
    lora: tuple[tuple[str, float], ...] = ()
    """The LoRA adapters it turns on, (name, scale) (`serve --lora-dir`): the running batch's."""


class JoinsFailed(Exception):
    """The requests joining at a step could not be admitted on some rank: they left every rank,
    and the step was not run (the images in flight go on at the next one)."""

    def __init__(self, requests: range, message: str) -> None:
        super().__init__(message)
        self.requests = requests
        """The numbers the failed joins had."""


@dataclass
class _Image:
    """One image in flight."""

    request: int
    index: int
    latents: torch.Tensor
    embeds: torch.Tensor
    pooled: torch.Tensor
    negative: tuple[torch.Tensor, torch.Tensor] | None
    scheduler: Any
    timesteps: torch.Tensor
    cfg_scale: float
    guidance: float
    step: int = 0


class Stepper:
    """The images in flight on one rank, advanced one denoising step per `step` call."""

    def __init__(self, pipe: Any, *, decode: bool = True,
                 agree: Callable[[torch.Tensor], list[float]] | None = None,
                 share: Callable[[], tuple[int, int] | None] | None = None) -> None:
        """`agree` sums a step cache's decision values over every rank (None: one process); `share`
        is the rows of a call this rank runs under batch / CFG groups (None: every row)."""
        if not supports_steps(pipe):
            raise ValueError(f"step-level batching needs a FLUX pipeline, not {type(pipe).__name__}")
        self.pipe, self.decode = pipe, decode
        defaults = {**FAMILY_OPTIONS["FluxPipeline"], **getattr(pipe, "prompt_defaults", {})}
        self.true_cfg = "true_cfg_scale" in defaults
        self.default_guidance = float(defaults.get("true_cfg_scale" if self.true_cfg else "guidance_scale", 1.0))
        """What a request's `guidance` sets when it gives none: true CFG's scale, or FLUX's embedded guidance."""
        self.embedded_guidance = float(defaults.get("guidance_scale", 3.5))
        """The transformer's guidance input under true CFG (used only by guidance-distilled transformers)."""
        self.images: list[_Image] = []
        self.requests = 0
        """Requests admitted so far: the next one's number."""
        self.steps = 0
        """Steps run so far (the same count on every rank): the step named when one fails."""
        self._size: tuple[int, int] | None = None
        self._lora: tuple[tuple[str, float], ...] = ()
        """The LoRA adapters on for the running batch."""
        self._ids: tuple[torch.Tensor, torch.Tensor] | None = None
        self._agree, self._share = agree, share
        self._ready = Ready(agree)
        self.caches: RowCaches | None = None
        """The blocks' per-request step caches, installed with the first request that has one."""
        self.runs: dict[int, list[RowRun]] = {}
        """Each cached request's runs, one per CFG branch (positive first)."""
        self.reports: dict[int, dict[str, Any]] = {}
        """The cache report of each cached request the last `step` finished (`cache_report`)."""

    @property
    def idle(self) -> bool:
        return not self.images

    def key(self, width: int, height: int, guidance: float | None, lora: tuple[tuple[str, float], ...] = ()) -> Hashable:
        """What requests sharing one running batch have in common: size, guided or not, and the
        LoRA adapters turned on (one set per transformer call)."""
        scale = self.default_guidance if guidance is None else guidance
        return (width, height, self.true_cfg and scale > 1.0, lora)

    @property
    def size(self) -> tuple[int, int] | None:
        """(width, height) of the running batch's images; None while idle."""
        return self._size if self.images else None

    @property
    def running_key(self) -> Hashable | None:
        if not self.images:
            return None
        first = self.images[0]
        return (*self._size, first.negative is not None, self._lora)

    @torch.no_grad()
    def step(self, joins: list[Join], leaves: Collection[int] = ()) -> list[tuple[int, int, np.ndarray | None]]:
        """Forget the requests numbered in `leaves`, admit `joins`, run one step of every image in
        flight, and return the finished ones as (request number, image index, image (H, W, 3) in
        [0, 1] or None without `decode`)."""
        self.images = [im for im in self.images if im.request not in leaves]
        self.reports = {}
        for request in [r for r in self.runs if r in leaves]:
            del self.runs[request]
        self._admit_all(joins)
        if not self.images:
            return []
        pipe, images = self.pipe, self.images
        latents = torch.cat([im.latents for im in images])
        t = torch.stack([im.timesteps[im.step] for im in images]).to(latents.dtype)
        guided = images[0].negative is not None
        inputs = {
            "hidden_states": latents,
            "timestep": t / 1000,
            "encoder_hidden_states": torch.cat([im.embeds for im in images]),
            "pooled_projections": torch.cat([im.pooled for im in images]),
        }
        if pipe.transformer.config.guidance_embeds:
            inputs["guidance"] = torch.tensor([im.guidance for im in images], dtype=torch.float32, device=latents.device)
        if guided:  # one call for both branches: positives, then negatives (CFG-major under a cfg plan)
            inputs = {k: torch.cat([v, v]) for k, v in inputs.items()}
            inputs["encoder_hidden_states"][len(images):] = torch.cat([im.negative[0] for im in images])
            inputs["pooled_projections"][len(images):] = torch.cat([im.negative[1] for im in images])
        noise = self._transform(inputs, guided)
        if guided:
            positive, negative = noise.chunk(2)
            scale = torch.tensor([im.cfg_scale for im in images], dtype=noise.dtype, device=noise.device).view(-1, 1, 1)
            noise = negative + scale * (positive - negative)
        done = []
        for i, im in enumerate(images):
            im.latents = im.scheduler.step(noise[i : i + 1], im.timesteps[im.step], im.latents, return_dict=False)[0]
            im.step += 1
            if im.step == len(im.timesteps):
                done.append(im)
        self.images = [im for im in images if im not in done]
        for request in {im.request for im in done} - {im.request for im in self.images}:
            if request in self.runs:
                self.reports[request] = cache_report(self.runs.pop(request))
        decoded = self._decode(done) if self.decode and done else [None] * len(done)
        return [(im.request, im.index, image) for im, image in zip(done, decoded)]

    def _admit_all(self, joins: list[Join]) -> None:
        """Admit `joins` on every rank, or none of them: encoding a prompt is each rank's own work,
        and a rank that failed there must not leave its peers alone in the step's collectives.
        Every rank agrees (`Ready`) before the step; on a failure anywhere the joins leave every
        rank (their numbers stay used) and `JoinsFailed` says why; the images in flight go on."""
        if not joins:
            return
        start = self.requests
        failure: Exception | None = None
        try:
            for join in joins:
                self._admit(join)
        except Exception as error:
            failure = error
        try:
            self._ready.agree(failure is not None, "to admit a request (encoding its prompt)")
        except PeerFailed as error:
            failure = error
        if failure is None:
            self._start_caches(range(start, self.requests), joins)
            return
        self.images = [im for im in self.images if im.request < start]
        for request in [r for r in self.runs if r >= start]:
            del self.runs[request]
        self.requests = start + len(joins)
        rank = dist.get_rank() if dist.is_initialized() else 0
        message = str(failure) if isinstance(failure, PeerFailed) else f"rank {rank}: {type(failure).__name__}: {failure}"
        raise JoinsFailed(range(start, self.requests), message) from failure

    def _start_caches(self, requests: range, joins: list[Join]) -> None:
        """The step caches of admitted joins, once every rank agreed to admit them: a MagCache run
        reads its curve with the other ranks (an all-reduce), which a rank that failed to encode
        would not take part in."""
        for request, join in zip(requests, joins):
            if join.cache is None:
                continue
            if self.caches is None:  # every rank at this step: rank 0 broadcast the join
                self.caches = RowCaches(self.pipe.transformer, **{k: v for k, v in
                                        (("agree", self._agree), ("share", self._share)) if v is not None})
            guided = self.key(join.width, join.height, join.guidance)[2]
            self.runs[request] = [self.caches.run(join.cache) for _ in range(2 if guided else 1)]

    def _transform(self, inputs: dict[str, torch.Tensor], guided: bool) -> torch.Tensor:
        """The step's transformer call, where the collectives are: any error there is `StepFailed`
        (a collective's own, a peer's timeout or departure, is already one and passes as it is)."""
        self.steps += 1
        text_ids, image_ids = self._ids
        try:
            with unpaired(self.pipe.transformer), self._cached(self.images, inputs["timestep"], guided):
                return self.pipe.transformer(**inputs, txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        except Exception as error:
            if collective_failed(error):
                raise
            raise StepFailed(self.steps, error) from error

    def drop(self) -> list[int]:
        """Forget every image in flight (after a failed step); returns their request numbers."""
        requests = sorted({im.request for im in self.images})
        self.images, self.runs = [], {}
        return requests

    def _cached(self, images: list[_Image], timestep: torch.Tensor, guided: bool) -> contextlib.AbstractContextManager:
        """The cache runs of this call's rows: each cached request's images, positives (then negatives)."""
        if self.caches is None or not self.runs:
            return contextlib.nullcontext()
        rows, times = [], timestep.tolist()
        for start, im in enumerate(images):
            if im.index == 0 and im.request in self.runs:
                count = sum(1 for other in images if other.request == im.request)
                for branch, run in enumerate(self.runs[im.request]):
                    rows.append((run, start + branch * len(images), count, times[start]))
        return self.caches.call(rows)

    def _admit(self, join: Join) -> None:
        from diffusers.pipelines.flux.pipeline_flux import (
            calculate_shift,
            retrieve_timesteps,
        )

        pipe = self.pipe
        key = self.key(join.width, join.height, join.guidance, join.lora)
        if self.images and key != self.running_key:
            raise ValueError(f"a request of {key} cannot join a running batch of {self.running_key}")
        if not self.images:  # a new batch: its adapters on, every rank at this step
            use_adapters(pipe, join.lora)
            self._lora = join.lora
        scale = self.default_guidance if join.guidance is None else join.guidance
        guided = key[2]
        n = len(join.seeds)
        embeds, pooled, negative = self._encode([join.prompt] * n, guided, scale)
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(
            n, channels, join.height, join.width, embeds.dtype, embeds.device,
            [torch.Generator("cpu").manual_seed(s) for s in join.seeds], None,
        )
        sched = pipe.scheduler.config
        mu = calculate_shift(
            latents.shape[1], sched.get("base_image_seq_len", 256), sched.get("max_image_seq_len", 4096),
            sched.get("base_shift", 0.5), sched.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / join.steps, join.steps)
        if getattr(sched, "use_flow_sigmas", False):
            sigmas = None
        if not self.images:
            self._size = (join.width, join.height)
            self._ids = (torch.zeros(embeds.shape[1], 3, dtype=embeds.dtype, device=embeds.device), image_ids)
        request = self.requests
        self.requests += 1
        for i in range(n):
            scheduler = copy.deepcopy(pipe.scheduler)
            timesteps, _ = retrieve_timesteps(scheduler, join.steps, latents.device, sigmas=sigmas, mu=mu)
            scheduler.set_begin_index(0)
            self.images.append(_Image(
                request=request, index=i, latents=latents[i : i + 1], embeds=embeds[i : i + 1],
                pooled=pooled[i : i + 1],
                negative=None if negative is None else (negative[0][i : i + 1], negative[1][i : i + 1]),
                scheduler=scheduler, timesteps=timesteps, cfg_scale=scale,
                guidance=self.embedded_guidance if self.true_cfg else scale,
            ))

    def _encode(self, prompts: list[str], guided: bool, scale: float):
        """(embeds, pooled, (negative embeds, negative pooled) or None), as the pipeline encodes them."""
        pipe = self.pipe
        option = {"true_cfg_scale": scale if guided else 1.0}
        if getattr(pipe, "prompt_encoder", None) is not None:
            inputs = prompt_inputs(pipe, pipe.prompt_encoder, prompts, [""] * len(prompts), option)
            negative = (inputs["negative_prompt_embeds"], inputs["negative_pooled_prompt_embeds"]) if guided else None
            return inputs["prompt_embeds"], inputs["pooled_prompt_embeds"], negative
        device = pipe._execution_device
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device)
        negative = None
        if guided:
            neg, neg_pooled, _ = pipe.encode_prompt(prompt=[""] * len(prompts), prompt_2=None, device=device)
            negative = (neg, neg_pooled)
        return embeds, pooled, negative

    def _decode(self, done: list[_Image]) -> list[np.ndarray]:
        pipe = self.pipe
        width, height = self._size if self._size else (0, 0)
        latents = pipe._unpack_latents(torch.cat([im.latents for im in done]), height, width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return list(np.asarray(pipe.image_processor.postprocess(image, output_type="np"), dtype=np.float32))
