"""Denoising steps where timesteps mislead: a timestep per token (LTX-Video's and Wan 2.2 TI2V's
image-to-video), split with the tokens by Wan's `_cp_plan`, and adjacent steps whose bf16 timesteps
are equal (FLUX at 2048 pixels).

The conditioning frame's tokens carry timestep 0 at every step and the denoised tokens the step's
t; a split gives some ranks only the conditioning frame's. The parts that act per step (CFG
pairing, `--plan auto` / `--comm auto` trials, step caches, patches, V-Major) read the step clock
(engine/steps.py: the scheduler's step counter), never a timestep, so every rank sees every step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import RANK_TIMEOUT_S, patience

from cocodiff import ParallelConfig
from cocodiff.engine.data_parallel import DataParallelForward, StepCounter
from cocodiff.engine.steps import StepClock, timestep_value
from cocodiff.run.launch import spawn

TOKENS, CONDITIONING = 12, 4  # the first 4 tokens: the conditioning frame


def per_token(t: float, batch: int = 2) -> torch.Tensor:
    """A call's timestep per token, as LTX-Video's image-to-video builds it: 0 on the conditioning frame."""
    timestep = torch.full((batch, TOKENS), t)
    timestep[:, :CONDITIONING] = 0.0
    return timestep


def test_a_timestep_per_token_reads_as_its_step():
    assert timestep_value(per_token(937.5)) == 937.5
    assert timestep_value(torch.tensor(0.25)) == 0.25  # one for the call
    assert timestep_value(torch.tensor([0.5, 0.5])) == 0.5  # one per item
    assert timestep_value(torch.tensor([0.5, 0.75])) == 0.5  # the first item's, as before
    assert timestep_value(3) == 3.0 and timestep_value(None) is None


def test_the_step_counter_ends_each_step_of_per_token_timesteps():
    """Two calls per step (true CFG) over 3 steps, then a new run: each step ends with its 2 calls."""
    counter, counted = StepCounter(), []
    for t in (1000.0, 750.0, 500.0, 1000.0):
        for _ in range(2):
            counted.append(counter.count(timestep_value(per_token(t))))
    assert counted == [(False, None), (False, None), (False, 2), (False, None), (False, 2), (False, None),
                       (True, 2), (False, None)]


class Scale(torch.nn.Module):
    """A transformer stand-in that takes a timestep per token."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> tuple[torch.Tensor]:
        return (hidden_states * (1 + timestep[..., None] / 1000),)


def test_cfg_pairing_learns_two_calls_per_step_from_the_clock():
    """The CFG pairing counts the calls of a run's first step from the step clock: two calls (the
    positive, then the negative) per step of the scheduler's counter. The timesteps are the same
    at every step, as two adjacent steps' can be in bf16: the clock still ends each step."""
    model = Scale()
    scheduler = SimpleNamespace(step_index=None, timesteps=torch.arange(3))
    clock = StepClock(model, scheduler)
    model.register_forward_pre_hook(clock.hook, with_kwargs=True)
    forward = DataParallelForward(model, None, 2, ("hidden_states", "timestep"), SimpleNamespace(batch_gather=None),
                                  step=clock.value)
    model.forward = forward
    for index in (None, 1, 2):
        scheduler.step_index = index
        for _ in range(2):
            model(hidden_states=torch.ones(1, TOKENS, 3), timestep=per_token(500.0, batch=1))
    assert forward._calls_per_step == 2 and clock.position() == (1, 2)
    scheduler.timesteps, scheduler.step_index = torch.arange(3), None  # set_timesteps: a new run
    model(hidden_states=torch.ones(1, TOKENS, 3), timestep=per_token(500.0, batch=1))
    assert clock.position() == (2, 0) and forward._calls_per_step is None


def image_to_video(model: str) -> tuple[object, dict]:
    """A preset's parts as its family's image-to-video pipeline and the call's arguments: tiny-ltx as
    `LTXImageToVideoPipeline` (CFG batched: one call per step), tiny-wan as Wan 2.2 TI2V's
    `WanImageToVideoPipeline(expand_timesteps=True)` (two calls per step). Both pass a timestep per
    token whose first frame's tokens are 0."""
    import diffusers

    from cocodiff.models.presets import load_pipeline, pipeline_inputs

    pipe, encoder = load_pipeline(model, seed=0)
    if model == "tiny-ltx":
        i2v = diffusers.LTXImageToVideoPipeline(**pipe.components)
    else:
        i2v = diffusers.WanImageToVideoPipeline(**pipe.components, image_encoder=None, image_processor=None,
                                                expand_timesteps=True)
    i2v.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    prompt = pipeline_inputs(pipe, encoder, "a red circle", model=model)
    call = dict(image=image, height=64, width=64, num_frames=9, output_type="latent",
                generator=torch.Generator().manual_seed(0), **prompt)
    return i2v, call


@pytest.mark.parametrize("model, calls_per_step", [("tiny-ltx", 1), ("tiny-wan", 2)])
def test_a_step_cache_skips_steps_of_image_to_video(model, calls_per_step):
    """One process, `--cache fbcache:1e9`, 4 steps: every step after the first skips its middle
    blocks (read from the first token, each call was a step of its own and nothing was skipped)."""
    from cocodiff.engine.cache import parse_cache
    from cocodiff.engine.cache.steps import apply_cache

    i2v, call = image_to_video(model)
    timesteps = []
    record = lambda _module, _args, kwargs: timesteps.append(kwargs["timestep"])  # noqa: E731
    i2v.transformer.register_forward_pre_hook(record, with_kwargs=True)
    cache = apply_cache(i2v.transformer, parse_cache("fbcache:1e9"), scheduler=i2v.scheduler)
    out = i2v(num_inference_steps=4, **call)
    cache.undo()
    assert all(t.dim() == 2 and (t[:, 0] == 0).all() for t in timesteps)  # per token, the first one conditioning
    assert cache.report()["skipped_steps"] == 3 * calls_per_step, cache.report()
    assert torch.isfinite(out.frames).all()


def plan_trials_report(config: ParallelConfig) -> dict:
    """Wan 2.2 TI2V's call of 6 steps under `config`: the report of its `--plan auto` trials."""
    from cocodiff import parallelize

    i2v, call = image_to_video("tiny-wan")
    parallel = parallelize(i2v, config)
    i2v(num_inference_steps=6, **call)
    return parallel.plan_trials.report()


def test_plan_auto_trials_finish_on_wan_ti2v():
    """2 ranks, `--plan auto`: a warm-up step, then each of the 2 candidate plans twice, and every
    rank commits to the same plan (read from the first token, no step ever ended: no trial step)."""
    reports = spawn(plan_trials_report, 2, ParallelConfig(plan="auto"), timeout_s=RANK_TIMEOUT_S)
    assert [r["trial_steps"] for r in reports] == [4, 4], reports
    assert reports[0]["chosen"] == reports[1]["chosen"]


def split_timestep_run(config: ParallelConfig | None, steps: int) -> object:
    """Wan 2.2 TI2V's call of `steps` steps at 5 frames (2 latent frames: on 2 ranks, rank 0's share
    of the tokens is the conditioning frame alone), parallelized by `config` (None: one process with
    `--cache fbcache:1e9` on the bare transformer): its step cache, or its `Parallelized`."""
    from cocodiff import parallelize
    from cocodiff.engine.cache import parse_cache
    from cocodiff.engine.cache.steps import apply_cache

    i2v, call = image_to_video("tiny-wan")
    if config is None:
        installed = apply_cache(i2v.transformer, parse_cache("fbcache:1e9"), scheduler=i2v.scheduler)
    else:
        installed = parallelize(i2v, config)
    i2v(num_inference_steps=steps, **{**call, "num_frames": 5})
    return installed


def split_cache_report() -> dict:
    """On each rank: the step cache's report of 4 steps under `--cache fbcache:1e9`."""
    return split_timestep_run(ParallelConfig(cache="fbcache:1e9"), 4).cache.report()


def split_comm_auto_report() -> dict:
    """On each rank: `--comm auto`'s trials' report of 12 steps."""
    return split_timestep_run(ParallelConfig(comm="auto"), 12).ctx.exchange.trials.report()


def test_ranks_skip_the_steps_of_a_split_timestep_per_token():
    """Wan's `_cp_plan` splits a timestep per token with the tokens. Read behind the split, rank 0's
    share (all conditioning frame) was 0 at every step: to it the call was one endless step, and
    the agreed cache skipped nothing. Read from the whole timestep, every rank skips what one
    process skips."""
    alone = split_timestep_run(None, 4).report()
    reports = spawn(split_cache_report, 2, timeout_s=RANK_TIMEOUT_S)
    assert [r["skipped_steps"] for r in reports] == [alone["skipped_steps"]] * 2 == [6, 6], (alone, reports)


def test_comm_auto_trials_finish_on_a_split_timestep_per_token():
    """The same split under `--comm auto`: read behind the split, only rank 1 reached a step's end
    and waited there for rank 0 (a hang, cut short by the guard). Read from the whole timestep,
    every rank times the same steps and commits to the same candidate."""
    reports = spawn(split_comm_auto_report, 2, timeout_s=patience(40))
    assert reports[0]["chosen"] is not None and reports[0] == reports[1], reports  # the step times are agreed


BF16_MU = 3.23
"""FLUX's shift at 2048 pixels square (16,384 image tokens): `calculate_shift(16384, 256, 4096, 0.5, 1.15)`.
Its 28 timesteps, divided by 1000 as FluxPipeline does and cast to bf16, repeat at steps 1, 3, 5, 7 and 11."""


def bf16_flux_latents(plan: str | None) -> tuple[torch.Tensor, list[float]]:
    """tiny-flux in bf16, unguided, 28 steps on the timesteps of 2048 pixels square (its scheduler
    shifted as there), under `plan` (None: one process): its latents, and the timesteps its
    transformer was called with."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline, pipeline_inputs

    pipe, encoder = load_pipeline("tiny-flux", seed=0)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, base_shift=BF16_MU, max_shift=BF16_MU)
    pipe.to(dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs["timestep"]), with_kwargs=True)
    if plan is not None:
        parallelize(pipe, ParallelConfig(plan=plan))
    latents = pipe(**pipeline_inputs(pipe, encoder, "a red circle"), height=32, width=32, num_inference_steps=28,
                   generator=torch.Generator().manual_seed(0), output_type="latent").images
    return latents.float(), [float(t) for t in seen]


def test_bf16_timesteps_that_repeat_are_still_two_steps():
    """On 2 ranks under `c2` an unguided FLUX call (one image) runs whole on both CFG groups. Its
    bf16 timesteps repeat (steps 0 and 1 are one value): read from them, the first "step" had two
    calls, the calls were then paired across steps and the scheduler read unfilled buffers. From
    the step clock, every rank's latents equal one process's."""
    alone, timesteps = bf16_flux_latents(None)
    assert len(timesteps) == 28 and len(set(timesteps)) < 28 and timesteps[0] == timesteps[1]
    ranks = spawn(bf16_flux_latents, 2, "c2u1", timeout_s=RANK_TIMEOUT_S)
    for latents, seen in ranks:
        assert seen == timesteps
        torch.testing.assert_close(latents, alone, rtol=0, atol=0)
