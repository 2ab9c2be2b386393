"""Every rank of a world on the device-only stand-in for NCCL (every_rank.py), checked across ranks.

Each case simulates all its ranks in turn (model on `meta` in bf16, `meta:fake` groups: a CPU tensor
in a collective fails, as on NCCL), two transformer calls each, and holds their records against
each other: the same groups made in the same order, the same collectives on each group, every send
received. A case takes 0.1-3 s (12 ranks) in the default suite; the worlds of 16 to 64 ranks and the
trials' 24-30 steps (2-40 s each) are in the slow one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from every_rank import call_site, check, simulate

from cocodiff import ParallelConfig, parallelize
from cocodiff.config.levels import parse_levels
from cocodiff.config.plan import parse_plan
from cocodiff.distributed import clock
from cocodiff.distributed.clock import now
from cocodiff.distributed.topology import Topology
from cocodiff.models.presets import load_pipeline, refusal

RUNS_LONG = 4  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)

META = torch.device("meta")


@functools.cache
def _model(model: str, device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, dict]:
    """The preset's transformer on `device` (`meta`; a GPU's, where the ranks compute) in `dtype`, and
    the arguments of its first call in a real one-step run of its pipeline (each family's own:
    per-token timesteps, masks, rotary ids; two pictures; an edit pipeline's reference image of the
    output's size), moved there too."""
    from PIL import Image

    from cocodiff.engine.families.pipelines import ANIMATE_PIPELINES, EDIT_PIPELINES, size_arguments
    from cocodiff.models.presets import PRESETS

    pipe, _ = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    preset, calls = PRESETS[model], []
    names = list(inspect.signature(type(pipe.transformer).forward).parameters)[1:]
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append({**dict(zip(names, args)), **kwargs}), with_kwargs=True)
    size = preset.pixel_multiple * 8  # tokens for every rank of 64 (a rank with none: apply_rotary_emb fails)
    # Two pictures (a batch for the CFG and batch groups to share, guided or not), where the pipeline takes two;
    # a clip of half the preset's frames, or its shortest (MiniMax-H3's 5 seconds)
    two = 1 if refusal(model, {"batch"}) else 2
    frames = preset.frame_limits[0] if preset.frame_limits else 1 + (preset.frames or 1) // 2
    options = {"num_frames": frames, "num_videos_per_prompt": two} if preset.frames else {"num_images_per_prompt": two}
    if preset.pipeline in EDIT_PIPELINES or preset.pipeline in ANIMATE_PIPELINES:
        options["image"] = Image.new("RGB", (size, size), (200, 40, 30))
    if preset.last_frame:  # Wan's last frame: its latents beside the noise (Wan 2.1 FLF2V: its CLIP features too)
        options["last_image"] = Image.new("RGB", (size, size), (20, 40, 220))
    pipe("a red circle", **size_arguments(pipe, size, size), num_inference_steps=1, output_type="latent",
         generator=torch.Generator().manual_seed(0), **options)
    hook.remove()
    inputs = {k: _moved(v, device, dtype) for k, v in calls[0].items()}
    return pipe.transformer.to(device=device, dtype=dtype), inputs


def _moved(value, device: str, dtype: torch.dtype):
    """A call argument on `device`, floats in `dtype`: a tensor, or each tensor of a (nested) list or tuple (Z-Image's
    latents and text per item; Z-Image-Omni's per reference; a rotary table's cos and sin)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype if value.is_floating_point() else value.dtype)
    return type(value)(_moved(v, device, dtype) for v in value) if isinstance(value, (list, tuple)) else value


def _world(levels: str) -> int:
    return math.prod(size for _, size in parse_levels(levels))


def _calls(model: str, plan: str, levels: str, comm: str = "flat", calls: int = 2, quantize: str | None = None,
           device: str = "meta", timeline: bool = False, watch: Callable[[], Any] = contextlib.nullcontext, **options):
    """What each rank runs: the model on `device` (its weights `quantize`d: models/quantize.py)
    parallelized by `plan` on `levels`, then `calls` transformer calls, one per denoising step of a
    scheduler stand-in (what the step clock reads), each step's end marked on the device's clock as
    the pipeline marks it (a device-wide synchronize: run/pipeline.py `step_ended`); with
    `timeline`, each attention layer's spans marked as `bench e2e` marks them; each call inside
    `watch()` (tests/test_gpu.py: the host syncs a call makes on a GPU)."""

    def run(_rank: int) -> None:
        base, inputs = _model(model, device)
        transformer = copy.deepcopy(base)
        if quantize is not None:
            from cocodiff.models.quantize import apply_quantize

            assert apply_quantize(SimpleNamespace(components={"transformer": transformer}), quantize)["layers"] > 0
        topology = Topology.from_env(levels=parse_levels(levels), device=torch.device(device))
        scheduler = SimpleNamespace(timesteps=torch.arange(calls), step_index=None)
        config = ParallelConfig(plan=plan if plan == "auto" else parse_plan(plan), comm=comm, **options)
        parallel = parallelize(transformer, config, topology, scheduler=scheduler)
        if timeline:
            parallel.ctx.timeline = {}
        with torch.no_grad():
            for step in range(calls):
                scheduler.step_index = step or None
                with watch():
                    transformer(**inputs)
                now(topology.device)

    return run


# (plan, levels, exchange): every plan axis alone and combined, on one node, on nodes that the
# Ulysses groups fill or span, and on nodes of 6 and 8 with Ulysses degrees that divide them.
CASES = [
    ("u2", "node=1,rank=2", "flat"), ("u1r2", "node=1,rank=2", "flat"), ("c2u1", "node=1,rank=2", "flat"),
    ("b2u1", "node=1,rank=2", "flat"), ("p2", "node=2,rank=1", "flat"),
    ("u4", "node=2,rank=2", "tapa"), ("u2r2", "node=2,rank=2", "flat"), ("r2u2", "node=2,rank=2", "tapa"),
    ("c2u2", "node=2,rank=2", "tapa"), ("p2u2", "node=2,rank=2", "flat"), ("c2p2", "node=2,rank=2", "flat"),
    ("u4r2", "node=2,rank=4", "tapa"), ("p2u4", "node=2,rank=4", "tapa"), ("c2b2u2", "node=2,rank=4", "flat"),
    ("u2r3b2", "node=2,rank=6", "tapa"), ("u4r3", "node=2,rank=6", "tapa"),
]
SOME = ("u2", "u1r2", "u4", "u2r2", "c2u2", "p2u2", "c2b2u2", "u4r3")
"""The cases a family runs past FLUX.1, which runs every one: each axis alone (a ring without
Ulysses too), across nodes, combined with Ulysses, and a world of 12 whose token counts split
unevenly. What the other cases add (the order of the axes, a stage beside a data group, a world of
6) is the plan's, alike for every family."""
MODELS = ["tiny-flux", "tiny-sd3", "tiny-qwen-image", "tiny-wan"]
"""The families whose calls the stand-in can run on `meta` under every plan. LTX-Video, FLUX.2,
Z-Image (which refuses data groups and stages) and HunyuanVideo 1.5 below."""

DISPATCHED = ["tiny-ltx", "tiny-flux2"]
"""Families whose stock processors reach the exchange through diffusers' dispatcher: which
streams a call's tokens are is told from each rank's own count where the layout makes every count
distinct, with no collective (engine/attention/dispatch.py `_tokens`). Where two streams' counts
coincide on some rank (u4r3 on 12 ranks: the last rank's 42 image tokens, and 42 + 0 text tokens),
the ranks all-gather their counts: each rank reads its peers' counts from the passes before
(every_rank.py `simulate`)."""


@pytest.mark.parametrize("model, plan, levels, comm", [
    (model, *case) for model in MODELS for case in CASES if model == "tiny-flux" or case[0] in SOME])
def test_every_rank_agrees_with_every_other(model, plan, levels, comm):
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)  # something was exchanged, and checked


@pytest.mark.parametrize("model, plan, levels, comm", [
    *(("tiny-hunyuanvideo15", *case) for case in CASES if case[0] in SOME),
    *(("tiny-hunyuanvideo15-i2v", *case) for case in CASES if case[0] in ("c2u2", "p2u2", "u4r3")),
])
def test_every_rank_agrees_on_hunyuanvideo15(model, plan, levels, comm):
    """HunyuanVideo 1.5: its refiner run whole on every rank, its text streams reordered by their
    masks (boolean indexing: a `nonzero` the stand-in takes as all-nonzero, alike on every rank), the
    split at the first block with the text mask, and its square masks checked once per module by an
    all-reduce every rank takes; the image-to-video model's SigLIP tokens joined to the text."""
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)
    mask_check = ("all_reduce", ("torch.float64",), ((1,),))  # over the world, or a stage's ranks (one: none)
    assert all(any(mask_check in ops for ops in r.collectives.values()) for r in records) == (plan != "p2")


@pytest.mark.parametrize("model, plan, levels, comm", [
    (model, *case) for model, plans in (("tiny-cogview4", ("u2", "b2u1", "u2r2", "u4", "c2u2", "c2b2u2", "u4r3")),
                                        ("tiny-chroma", ("u2", "u2r2", "c2u2")))
    for case in CASES if case[0] in plans])
def test_every_rank_agrees_on_a_preset_whose_plan_is_inferred(model, plan, levels, comm):
    """tiny-cogview4 and tiny-chroma: their transformers have no `_cp_plan` and no plan written; each
    rank infers its plan at its first call from the shapes it is handed (alike on every rank, before
    any collective), under CFG and batch groups too; Chroma's m_i * m_j mask checked once per module
    by an all-reduce every rank takes, and a ring refused on every rank. CogView4 on 12 ranks: a
    rank's image and text counts coincide and the ranks all-gather their counts (`DISPATCHED`).
    Not tiny-qwen-image21: its forward cuts its segments by its mask's
    values (`repeat_interleave` by a tensor), which `meta` does not hold; it runs on gloo only
    (tests/test_plan_inference.py, docs/matrix.md)."""
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    if model == "tiny-chroma" and "r" in plan:
        assert all("cannot run on a ring" in (r.error or "") for r in records), records
        return
    assert check(records) == []
    if model == "tiny-chroma":
        mask_check = ("all_reduce", ("torch.float64",), ((1,),))
        assert all(any(mask_check in ops for ops in r.collectives.values()) for r in records)
    assert all(r.collectives or r.sends for r in records)


@pytest.mark.parametrize("plan, levels, comm", [case for case in CASES if case[0] in SOME and not set(case[0]) & set("cbp")])
@pytest.mark.parametrize("model", ["tiny-zimage", "tiny-zimage-omni"])
def test_every_rank_agrees_on_zimage_and_its_edits(model, plan, levels, comm):
    """Z-Image's lists of latents and text (and Z-Image-Omni's per reference: latents, SigLIP
    tokens and text segments, with a per-token noise mask split beside the tokens) under Ulysses and
    ring; its record refuses data groups and stages."""
    _, inputs = _model(model)
    assert isinstance(inputs["x"][0], list) == (model == "tiny-zimage-omni")  # omni: each item's references, then its noise
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


@pytest.mark.parametrize("model, plan, levels, comm", [
    (model, *case) for model in DISPATCHED for case in CASES if case[0] in SOME and (model, case[0]) != ("tiny-ltx", "u4r3")])
def test_every_rank_agrees_with_every_other_through_the_dispatcher(model, plan, levels, comm):
    """Not tiny-ltx on 12 ranks: its 11 text tokens leave the last rank none, and LTX-Video's processor
    shapes its mask by the count it holds (a view of 0 elements; its checkpoints' texts are 128 tokens)."""
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


@pytest.mark.parametrize("model, plan, levels, comm", [
    *(("tiny-flux-kontext", *case) for case in [
        ("u2", "node=1,rank=2", "flat"), ("u4", "node=2,rank=2", "tapa"), ("b2u2", "node=2,rank=2", "flat"),
        ("p2u2", "node=2,rank=2", "flat"), ("u4r2", "node=2,rank=4", "tapa")]),
    *(("tiny-qwen-image-edit", *case) for case in [
        ("u4", "node=2,rank=2", "tapa"), ("c2u2", "node=2,rank=2", "flat"), ("p2u2", "node=2,rank=2", "flat"),
        ("u4r2", "node=2,rank=4", "tapa")]),
    ("tiny-qwen-image-edit-v1", "b2u2", "node=2,rank=2", "flat"), ("tiny-qwen-image-edit-v1", "u2r2", "node=2,rank=2", "tapa"),
])
def test_every_rank_agrees_on_an_edit(model, plan, levels, comm):
    """FLUX.1 Kontext with a reference image: its tokens (as many as the output's) join the
    sequence the ranks split, exchange and hand on. Qwen-Image-Edit-2511's reference (encoded at a
    megapixel: 4096 tokens) joins it too, with a per-token modulation index (the reference's tokens
    at timestep 0) split beside them; the first Qwen-Image-Edit's, without the index, a batch of two
    split over groups."""
    _, inputs = _model(model)
    if model == "tiny-flux-kontext":
        assert inputs["hidden_states"].shape[1] == 2 * 8 ** 2  # the latents' 64 tokens, then the reference's
    else:
        assert inputs["hidden_states"].shape[1] == 8 ** 2 + 64 ** 2 and inputs["img_shapes"][0][1] == (1, 64, 64)
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


@pytest.mark.parametrize("model, plan, levels, comm", [
    ("tiny-wan-ti2v", "u2", "node=1,rank=2", "flat"), ("tiny-wan-ti2v", "u4", "node=2,rank=2", "tapa"),
    ("tiny-wan-ti2v", "c2u2", "node=2,rank=2", "flat"), ("tiny-wan-ti2v", "p2u2", "node=2,rank=2", "flat"),
    ("tiny-wan-ti2v", "u4r2", "node=2,rank=4", "tapa"),
    ("tiny-ltx-i2v", "u4", "node=2,rank=2", "tapa"), ("tiny-ltx-i2v", "c2u2", "node=2,rank=2", "flat"),
    ("tiny-ltx-i2v", "p2u2", "node=2,rank=2", "flat"), ("tiny-ltx-i2v", "u2r3", "node=2,rank=3", "tapa"),
    ("tiny-wan22-i2v", "c2u2", "node=2,rank=2", "flat"), ("tiny-wan22-i2v", "p2u2", "node=2,rank=2", "flat"),
    ("tiny-wan21-i2v", "u4", "node=2,rank=2", "tapa"), ("tiny-wan21-i2v", "c2p2", "node=2,rank=2", "flat"),
    ("tiny-wan21-flf2v", "b2u2", "node=2,rank=2", "tapa"), ("tiny-wan21-flf2v", "c2p2", "node=2,rank=2", "flat"),
])
def test_every_rank_agrees_on_image_to_video(model, plan, levels, comm):
    """Wan 2.2 TI2V's and LTX-Video's layouts: a (batch, tokens) timestep (the first frame's tokens
    at zero) split with the tokens, alike on every rank; Wan 2.2 A14B's and 2.1's: the image's
    latents on the channels (and 2.1's CLIP features beside the text), alike too; Wan 2.1 FLF2V's
    last frame too, its CLIP features two rows per item, split with the batch."""
    _, inputs = _model(model)
    if model in ("tiny-wan-ti2v", "tiny-ltx-i2v"):
        assert inputs["timestep"].dim() == 2  # per token
    else:
        assert inputs["hidden_states"].shape[1] == 36  # the noise, the first frame's mask and latents
    features = inputs.get("encoder_hidden_states_image")
    assert (features is not None) == model.startswith("tiny-wan21")
    if model == "tiny-wan21-flf2v":
        assert features.shape[0] == 2 * inputs["hidden_states"].shape[0]  # the first frame's rows, the last's
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


@pytest.mark.parametrize("model, plan, levels, comm", [
    ("tiny-ltx2", "u2", "node=1,rank=2", "flat"), ("tiny-ltx2", "u4", "node=2,rank=2", "tapa"),
    ("tiny-ltx2", "c2u2", "node=2,rank=2", "flat"), ("tiny-ltx2", "b2u2", "node=2,rank=2", "flat"),
    ("tiny-ltx2", "u2r2", "node=2,rank=2", "tapa"), ("tiny-ltx2-i2v", "u4", "node=2,rank=2", "tapa"),
    ("tiny-ltx2-i2v", "c2u2", "node=2,rank=2", "flat"), ("tiny-ltx2", "p2u2", "node=2,rank=2", "flat"),
    ("tiny-ltx2", "c2p2", "node=2,rank=2", "flat"), ("tiny-ltx2-i2v", "p2u2", "node=2,rank=2", "tapa"),
    ("tiny-minimax-h3", "u2", "node=1,rank=2", "flat"), ("tiny-minimax-h3", "u4", "node=2,rank=2", "tapa"),
    ("tiny-minimax-h3", "u2r2", "node=2,rank=2", "flat"), ("tiny-minimax-h3", "b2u2", "node=2,rank=2", "flat"),
    ("tiny-minimax-h3", "u4r2", "node=2,rank=4", "tapa"), ("tiny-minimax-h3", "p2u2", "node=2,rank=2", "flat"),
    ("tiny-minimax-h3-i2v", "u4", "node=2,rank=2", "tapa"), ("tiny-minimax-h3-i2v", "p2u2", "node=2,rank=2", "flat"),
])
def test_every_rank_agrees_on_video_with_sound(model, plan, levels, comm):
    """LTX-2: the audio stream split beside the video (its own attention, audio-to-video and back),
    its text whole on every rank (local cross-attention), both samples gathered; image-to-video's
    (batch, tokens) timestep split with the video tokens; under stages both streams handed on and
    both samples handed back, each sample's header read by every earlier stage. MiniMax-H3: one
    packed sequence of video, audio and text rows split at its first block with the rows' AdaLN
    indices and rotary table, its refiner whole on every rank first, 7 heads over 4 ranks; a batch
    group with its one clip runs it whole; a stage hands its one stream on; its keyframes' rows (a
    first and a last frame) packed ahead of the noise at their own timestep."""
    _, inputs = _model(model)
    assert inputs["audio_hidden_states"].dim() == 3 and (inputs["timestep"].dim() == 2) == (model == "tiny-ltx2-i2v")
    records = simulate(_world(levels), _calls(model, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


@pytest.mark.parametrize("plan, levels, comm", [("u4", "node=2,rank=2", "tapa"), ("p2u2", "node=2,rank=2", "flat")])
def test_every_rank_agrees_on_quantized_weights(plan, levels, comm):
    """int8 weights (torchao's tensors, on `meta` too): the activations the ranks exchange and hand
    on keep the run's dtype, under Ulysses across nodes and under stages."""
    pytest.importorskip("torchao")
    records = simulate(_world(levels), _calls("tiny-flux", plan, levels, comm, quantize="int8wo"))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


# Features on tiny-flux: (plan, levels, exchange, options, calls).
FEATURES = [
    ("u4", "node=2,rank=2", "tapa", {"v_major": "constant:0.5"}, 2),
    ("r2u4", "node=2,card=2,tile=2", "tapa-full", {}, 2),  # Ulysses over cards and tiles: a phase each
    ("u2r2", "node=2,rank=2", "flat", {"v_first": False}, 2),
    ("u4r2", "node=2,rank=4", "tapa", {"wire": "node=fp8"}, 2),
    ("p2u2", "node=2,rank=2", "flat", {"wire": "node=fp8"}, 2),
    ("p2u2", "node=2,rank=2", "flat", {"pipe_patches": 2}, 3),
    ("c2u2", "node=2,rank=2", "flat", {"cache": "dbcache:F1B0W1,0.5"}, 3),
    ("p2u2", "node=2,rank=2", "tapa", {"timeline": True}, 3),  # per-layer marks while a stage's receives are posted
    pytest.param("u4", "node=2,rank=2", "auto", {}, 24, marks=pytest.mark.slow),
    pytest.param("auto", "node=2,rank=4", "auto", {}, 30, marks=pytest.mark.slow),
    pytest.param("r6u4", "node=3,rank=8", "flat", {}, 2, marks=pytest.mark.slow),
    pytest.param("p4u4", "node=4,rank=4", "tapa", {}, 2, marks=pytest.mark.slow),
    pytest.param("u4r8", "node=4,rank=8", "tapa", {}, 2, marks=pytest.mark.slow),
    pytest.param("u4r16", "node=8,rank=8", "tapa", {}, 2, marks=pytest.mark.slow),  # 64 ranks: Ulysses over 4 nodes
]


@pytest.mark.parametrize("plan, levels, comm, options, calls", FEATURES)
def test_every_rank_agrees_under_each_feature(plan, levels, comm, options, calls):
    """V-Major, fp8 across the nodes (the exchanges' and a stage boundary's), displaced patches, a
    step cache's agreement under CFG groups, `--comm auto` and `--plan auto` through their trials to
    a choice (the agreed times read as zeros: every rank takes the first candidate), and worlds of
    16 to 64 ranks. A step cache's decision reads the agreed sums as zeros here: one branch of it."""
    records = simulate(_world(levels), _calls("tiny-flux", plan, levels, comm, calls=calls, **options))
    assert check(records) == []


FAMILIES = ["tiny-sd3", "tiny-qwen-image", "tiny-wan", *DISPATCHED, "tiny-hunyuanvideo15", "tiny-zimage", "tiny-ltx2",
            "tiny-cogview4", "tiny-chroma", "tiny-minimax-h3"]
"""The families past FLUX.1 that run FLUX.1's feature cases, each where its preset takes the feature,
but for what the stand-in cannot read (`BEYOND`)."""

BEYOND = {
    ("tiny-flux2", "pipe_patches"): "which of a dispatched processor's projections is V is told by values (V-First's probe)",
    ("tiny-hunyuanvideo15", "pipe_patches"): "the same: a dispatched processor's V told by values",
}
"""Feature cases whose decisions read values that `meta` holds none of (read as zeros, they take a
branch no run takes): the matrix runs them on gloo."""


def _needs(plan: str, options: dict) -> set[str]:
    """What a feature case needs that a preset may refuse (run/spec.py `needs`)."""
    parsed = parse_plan(plan)
    return {need for need, used in (
        ("data_groups", parsed.cfg * parsed.batch > 1), ("cfg", parsed.cfg > 1), ("ring", parsed.ring > 1),
        ("stages", parsed.pipe > 1 or "pipe_patches" in options), ("patches", "pipe_patches" in options),
        ("step_cache", "cache" in options), ("v_major", "v_major" in options)) if used}


@pytest.mark.slow
@pytest.mark.parametrize("model, plan, levels, comm, options, calls", [
    (model, *case) for model in FAMILIES for case in FEATURES
    if type(case) is tuple and refusal(model, _needs(case[0], case[3])) is None
    and not {(model, case[1]), *((model, option) for option in case[3])} & set(BEYOND)])
def test_every_rank_agrees_under_each_feature_on_every_family(model, plan, levels, comm, options, calls):
    """FLUX.1's feature cases (default suite above) on each family whose preset takes them: V-Major,
    tapa-full over three levels, the flat exchange without V-First, fp8 across nodes, a stage
    boundary in fp8, displaced patches and a step cache under CFG groups."""
    records = simulate(_world(levels), _calls(model, plan, levels, comm, calls=calls, **options))
    assert check(records) == []
    assert any(r.collectives or r.sends for r in records)


def test_every_rank_computes_on_a_device():
    """The stand-in with its ranks computing, as tests/test_gpu.py runs it on a GPU (here the CPU):
    a stage's output header read from its sender's record, what the fake group moves read as zeros
    on every rank alike, per-layer marks while the stage's receives are posted."""
    records = simulate(4, _calls("tiny-flux", "p2u2", "node=2,rank=2", "tapa", device="cpu", timeline=True), device="cpu")
    assert check(records) == []
    assert {r.device for r in records} == {"cpu"} and all(r.sends or r.receives for r in records)


def test_without_v_first_v_q_and_k_travel_in_one_message():
    """Without V-First an attention sends V, Q and K in one all-to-all and its output in a second
    (as xDiT's Ulysses does); with V-First, V goes first by itself: three. tiny-flux: 4 attentions."""
    def exchanges(v_first: bool) -> list[int]:
        records = simulate(2, _calls("tiny-flux", "u2", "node=1,rank=2", "flat", calls=1, v_first=v_first))
        assert check(records) == []
        return [sum(c[0] == "all_to_all_single" for calls in r.collectives.values() for c in calls) for r in records]

    assert exchanges(v_first=False) == [8, 8] and exchanges(v_first=True) == [12, 12]


@contextlib.contextmanager
def _engine_host_reads(reads: list[str]):
    """Inside: each read of a tensor's values on the host that the engine makes (on a GPU, a sync),
    appended to `reads` as 'cocodiff/...py:LINE FUNCTION'."""
    def counted(real):
        def read(*args, **kwargs):
            where = call_site(traceback.extract_stack()[:-1])
            if where is not None and where.startswith("cocodiff/"):
                reads.append(where)
            return real(*args, **kwargs)
        return read

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "unique"):
            patch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
        for name in ("equal", "nonzero", "unique", "repeat_interleave", "masked_select"):
            patch.setattr(torch, name, counted(getattr(torch, name)))
        yield


@pytest.mark.parametrize("model, plan, levels, comm, options, allowed", [
    ("tiny-ltx", "u2r2", "node=2,rank=2", "flat", {}, ()), ("tiny-hunyuanvideo15", "u2r2", "node=2,rank=2", "tapa", {}, ()),
    ("tiny-qwen-image", "u2r2", "node=2,rank=2", "flat", {}, ()), ("tiny-flux2", "u4", "node=2,rank=2", "tapa", {}, ()),
    ("tiny-flux", "p2u2", "node=2,rank=2", "tapa", {}, ()), ("tiny-flux", "p2u2", "node=2,rank=2", "flat", {"pipe_patches": 2}, ()),
    ("tiny-flux", "u4r2", "node=2,rank=4", "tapa", {"wire": "node=fp8"}, ()),
    # by design, once per call at the transformer's entry: V-Major's timestep (its jump test);
    # once per call between blocks: a step cache's agreed decision
    ("tiny-flux", "u4", "node=2,rank=2", "tapa", {"v_major": "constant:0.5"}, ("timestep_value",)),
    ("tiny-flux", "c2u2", "node=2,rank=2", "flat", {"cache": "dbcache:F1B0W1,0.5"}, ("agree",))])
def test_a_call_after_the_first_reads_nothing_on_the_host(model, plan, levels, comm, options, allowed):
    """Every rank computing (on the CPU, as on a GPU): a module's first call settles what it decides
    by values (V-First's V, the ranks' token counts, a mask's form: host reads, agreed by every
    rank), and from the second call on the engine reads no tensor on the host inside a call (on a
    GPU each read is a sync; tests/test_gpu.py counts them there), but for V-Major's and a step
    cache's once-a-call reads. Rings with key masks, stages, patches, V-Major and fp8 among them."""
    reads: list[str] = []
    calls = iter(range(10**6))

    def watch():  # each rank's calls after its first
        return _engine_host_reads(reads) if next(calls) % 3 else contextlib.nullcontext()

    run = _calls(model, plan, levels, comm, calls=3, device="cpu", watch=watch, **options)
    records = simulate(_world(levels), run, device="cpu")
    assert check(records) == []
    assert [r for r in reads if r.rsplit(" ", 1)[1] not in allowed] == [], sorted(set(reads))


def test_the_checker_finds_each_kind_of_mismatch():
    """Hand-made faults on 2 ranks, each reported: groups made on one rank only, an all-reduce of
    another shape, a send nobody receives, a CPU tensor (refused by the device-only group), a
    device-wide synchronize with a receive posted."""

    def faults(rank: int) -> None:
        x = torch.zeros(4, device=META)
        dist.all_reduce(x)
        if rank == 1:
            dist.new_group([0, 1])
        dist.all_reduce(torch.zeros(4 + rank, device=META))
        if rank == 0:
            dist.isend(x, 1)

    problems = check(simulate(2, faults))
    assert any(p.startswith("new_group: rank 1 made 1 groups, rank 0 0") for p in problems), problems
    assert any("rank 1's collectives differ from rank 0's at call 1" in p for p in problems), problems
    assert any(p.startswith("rank 0 sends") and "which receives []" in p for p in problems), problems
    def synchronized(rank: int) -> None:  # rank 1 waits for its device with a receive posted
        work = dist.irecv(torch.zeros(4, device=META), 1 - rank)
        dist.isend(torch.zeros(4, device=META), 1 - rank)
        if rank == 1:
            clock.synchronize(META)
        work.wait()
        clock.synchronize(META)

    assert check(simulate(2, synchronized)) == ["rank 1: a device-wide synchronize with 1 receives posted (1 such)"]
    cpu = check(simulate(2, lambda rank: dist.all_reduce(torch.zeros(4))))
    assert cpu == [*(f"rank {r} raised RuntimeError: No backend type associated with device type cpu" for r in (0, 1)),
                   *(f"rank {r} put a tensor on ['cpu']" for r in (0, 1))]
    assert check(simulate(2, lambda rank: dist.all_reduce(torch.zeros(4, device=META)))) == []


@pytest.mark.parametrize("plan, levels, message", [
    ("r3u4", "node=2,rank=6", "lie over the nodes in different ways (node=1,rank=4, node=2,rank=2)"),
    ("r8u3", "node=3,rank=8", "do not fall into equal runs of ranks per node"),
])
def test_a_plan_whose_ulysses_groups_lie_unevenly_is_refused_by_every_rank_first(plan, levels, message):
    """Consecutive Ulysses groups of 4 on nodes of 6 fall on the nodes in different ways from group
    to group (ranks 0-3 in one node, 4-7 over two), and groups of 3 on nodes of 8 straddle them
    unevenly: every rank refuses the plan the same way, before it makes a group of it. (Read from
    its own group only, on 2 x 6 ranks 0-3 and 8-11 made 15 groups and ranks 4-7 27.)"""
    records = simulate(_world(levels), _calls("tiny-flux", plan, levels))
    errors = {r.error for r in records}
    assert len(errors) == 1 and f"UsageError: --plan {plan}: its Ulysses groups {message}" in errors.pop(), errors
    topology_only = simulate(_world(levels), lambda _rank: Topology.from_env(levels=parse_levels(levels), device=META), [0])
    assert {tuple(r.groups) for r in records} == {tuple(topology_only[0].groups)}  # the run's levels' groups, no more


@pytest.mark.parametrize("levels", ["node=3,rank=8", "node=2,rank=6"])
def test_plan_auto_builds_the_same_candidates_and_groups_on_every_rank(levels):
    """`--plan auto`'s candidates and their groups (FLUX's 24 heads, guided), built on every rank:
    the same candidate list and the same `new_group` sequence everywhere."""
    from cocodiff.engine.plan_trials import build_plan_trials

    candidates = {}

    def build(rank: int) -> None:
        topology = Topology.from_env(levels=parse_levels(levels), device=META)
        trials = build_plan_trials(ParallelConfig(plan="auto"), topology, heads=24, guided=True, images=1)
        candidates[rank] = [c.name for c in trials.options]

    records = simulate(_world(levels), build)
    assert check(records) == [] and len({tuple(c) for c in candidates.values()}) == 1, candidates
    assert len(candidates[0]) > 1


def test_stage_hand_ons_travel_on_their_boundary_pairs():
    """Three stages: each boundary's hand-ons on a group of the pair alone (on NCCL a communicator
    each), the output's way back on the column's; nothing on the default group, where the middle
    stage's receives posted ahead from stage 0 would queue in front of its sends to stage 2."""
    records = simulate(3, _calls("tiny-flux", "p3", "node=3,rank=1"))
    assert check(records) == []
    by_pair = {pair: {entry[2] for entry in sends} for r in records for pair, sends in r.sends.items()}
    assert by_pair == {(0, 1): {(0, 1)}, (1, 2): {(1, 2)}, (2, 0): {(0, 1, 2)}, (2, 1): {(0, 1, 2)}}, by_pair


@pytest.mark.parametrize(("plan", "levels"), [("p3", "node=3,rank=1"), ("p2", "node=2,rank=1"), ("p2u2", "node=2,rank=2")])
def test_a_stage_of_one_rank_makes_no_group_of_one(plan, levels):
    """Every group a rank makes holds more than one rank (a group of one is a communicator that
    carries nothing): a one-rank stage takes its layers' agreements alone."""
    records = simulate(_world(levels), _calls("tiny-flux", plan, levels))
    assert check(records) == []
    assert records[0].groups and all(len(members) > 1 for members in records[0].groups), records[0].groups


INFERRED = ["LongCatImageTransformer2DModel", "BriaFibo2Transformer2DModel", "PRXTransformer2DModel",
            "SkyReelsV2Transformer3DModel", "CogVideoXTransformer3DModel", "AceStepTransformer1DModel",
            "AuraFlowTransformer2DModel", "WanVACETransformer3DModel"]
"""Classes with no plan (tests/dit_cases_*.py): their plans inferred at the first call, on every rank
from the same shapes. FLUX-like joint streams and rotary table, a text every block is handed whole
for its cross-attention (Bria FIBO 2's: K/V whole, told apart once per module), a text joined to
the image in attention (PRX), a Wan-like video. CogVideoX's processors call SDPA themselves
(routed); AceStep's S x S mask stays whole (Ulysses alone: a ring refuses it on every rank). AuraFlow's image is gathered past its blocks (at its output
norm: its forward cuts the text off the joint stream by this rank's count); Wan VACE's main blocks
split a stream its VACE blocks did not hand on."""


RINGED = ("LongCatImageTransformer2DModel", "PRXTransformer2DModel", "CogVideoXTransformer3DModel",
          "AceStepTransformer1DModel")
"""The classes the stand-in also runs across nodes with a ring: joint streams, a text joined in
attention, processors that call SDPA themselves, and a mask a ring refuses. The others' ring is
the same plan's (test_plan_inference.py runs every class exact on 4 ranks with a ring, on gloo)."""


def _inferred_calls(name: str, plan: str, levels: str, comm: str):
    from dit_cases_image import CASES as IMAGE_CASES
    from dit_cases_video import CASES as VIDEO_CASES

    def run(_rank: int) -> None:
        model, kwargs = {**IMAGE_CASES, **VIDEO_CASES}[name]()
        transformer = model.to(device=META, dtype=torch.bfloat16)
        inputs = {k: _moved(v, "meta", torch.bfloat16) for k, v in kwargs.items()}
        topology = Topology.from_env(levels=parse_levels(levels), device=META)
        scheduler = SimpleNamespace(timesteps=torch.arange(2), step_index=None)
        parallel = parallelize(transformer, ParallelConfig(plan=parse_plan(plan), comm=comm), topology, scheduler=scheduler)
        with torch.no_grad():
            for step in range(2):
                scheduler.step_index = step or None
                transformer(**inputs)
        assert parallel.inferred["plan"]

    return run


@pytest.mark.parametrize("name, plan, levels, comm", [
    *((name, "u2", "node=1,rank=2", "flat") for name in INFERRED),
    *((name, "u4r2", "node=2,rank=4", "tapa") for name in INFERRED if name in RINGED)])
def test_every_rank_agrees_on_a_plan_inferred_from_the_model(name, plan, levels, comm):
    """Ulysses on one node, and Ulysses across nodes with a ring (the plans in between are the
    plan's, alike for every class: the preset cases above run them on inferred plans)."""
    if name.startswith("AceStep") and "r" in plan:
        records = simulate(_world(levels), _inferred_calls(name, plan, levels, comm))
        assert all("over the whole sequence runs with Ulysses alone" in (r.error or "") for r in records), records
        return
    records = simulate(_world(levels), _inferred_calls(name, plan, levels, comm))
    assert check(records) == []
    assert any(r.collectives for r in records)


@pytest.mark.parametrize("options, flag", [
    ({"plan": "auto"}, "--plan auto"), ({"plan": "u2", "v_major": "linear"}, "--v-major"),
    ({"plan": "u2", "cache": "fbcache:1e9"}, "--cache")])
def test_every_rank_refuses_what_qwen_image21s_prefix_cache_cannot_have(options, flag):
    """Qwen-Image 2.1's transformer (a checkpoint's, no preset to refuse it before the ranks start):
    `parallelize` refuses `--plan auto`'s trials, V-Major and the step caches on every rank in one line
    with its family's reason, before anything is installed or any collective runs."""
    from dit_cases_image import _qwen_image21_model

    def run(_rank: int) -> None:
        transformer = _qwen_image21_model().to(device=META, dtype=torch.bfloat16)
        topology = Topology.from_env(levels=parse_levels("node=1,rank=2"), device=META)
        plan = options["plan"] if options["plan"] == "auto" else parse_plan(options["plan"])
        parallelize(transformer, ParallelConfig(**{**options, "plan": plan}), topology)

    records = simulate(2, run)
    assert all(r.error.startswith(f"UsageError: {flag}: QwenImage21Transformer2DModel cannot have it: its ")
               for r in records), records
    assert not any(r.collectives or r.sends for r in records)
