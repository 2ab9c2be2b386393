"""Split plans inferred from the model (engine/plan_inference.py): diffusers' transformer classes
with no `_cp_plan` and no record, each at a tiny config (tests/dit_cases_*.py), run on 2 ranks
(4 in the slow suite, Ulysses x ring) through `parallelize` and are equal to one process, or are refused in one
line; none crashes, hangs or differs. `COVERED` pins the classes that run exact, so a class that
stops running fails here; docs/families.md lists each class's outcome.

Each rank runs every class in one launch (one spawn per world size): its own one-process output
first, then the same call parallelized, so no tensor crosses processes.
"""

from __future__ import annotations

import command
import pytest
import torch
from conftest import RANK_TIMEOUT_S
from dit_cases_image import CASES as IMAGE_CASES
from dit_cases_video import CASES as VIDEO_CASES

from cocodiff import ParallelConfig
from cocodiff.engine.families import ModulePlan, Split
from cocodiff.engine.plan_inference import check_plan, infer_plan
from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn

RUNS_LONG = 5  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)

CASES = {**IMAGE_CASES, **VIDEO_CASES}
RTOL_OF_SCALE = 1e-5  # fp32, one all-to-all pair per layer: rounding only (as tests/test_cp_plan_generic.py)

COVERED = {
    "AllegroTransformer3DModel", "AuraFlowTransformer2DModel", "BriaFibo2Transformer2DModel",
    "BriaTransformer2DModel", "CogVideoXTransformer3DModel", "CogView3PlusTransformer2DModel",
    "CogView4Transformer2DModel", "DiTTransformer2DModel", "DreamLiteTransformer2DModel",
    "EasyAnimateTransformer3DModel", "ErnieImageTransformer2DModel", "Flux3Transformer2DModel",
    "GlmImageTransformer2DModel", "HunyuanDiT2DModel", "HunyuanImageTransformer2DModel",
    "HunyuanVideoFramepackTransformer3DModel", "HunyuanVideoTransformer3DModel", "JoyImageEditPlusTransformer3DModel",
    "JoyImageEditTransformer3DModel", "Kandinsky5Transformer3DModel", "Krea2Transformer2DModel",
    "LongCatAudioDiTTransformer", "LongCatImageTransformer2DModel", "Lumina2Transformer2DModel",
    "MiniMaxMusic3Transformer1DModel", "MotifVideoTransformer3DModel", "OvisImageTransformer2DModel",
    "PRXTransformer2DModel", "PixArtTransformer2DModel", "SkyReelsV2Transformer3DModel", "StableAudio3DiTModel",
    "StableAudioDiTModel", "WanVACETransformer3DModel",
}
"""The classes exact through an inferred plan on 2 and 4 ranks (docs/families.md's table)."""
MASKED = {"AceStepTransformer1DModel", "ChromaTransformer2DModel", "Ideogram4Transformer2DModel",
          "OmniGenTransformer2DModel", "QwenImage21Transformer2DModel"}
"""Exact on 2 ranks, refused with a ring: their S x S masks, whole on every rank, run with Ulysses alone, and so
do Chroma's m_i * m_j bias (engine/families/chroma.py) and Qwen-Image 2.1's block-causal attention
(engine/families/qwen_image21.py)."""


def _outcome(name: str, ranks: int, plan: str | None = None) -> dict:
    """One class, one process and then parallelized on this rank: 'exact', 'refused' or 'differs'."""
    from cocodiff import parallelize

    model, kwargs = CASES[name]()
    with torch.no_grad():
        reference = _first(model(**kwargs))
    try:
        parallel = parallelize(model, ParallelConfig(comm="flat", plan=plan))
    except UsageError as error:
        return {"outcome": "refused", "why": str(error)}
    try:
        with torch.no_grad():
            out = _first(model(**kwargs))
    except UsageError as error:
        return {"outcome": "refused", "why": str(error)}
    finally:
        calls = parallel.ctx.stats.totals()["calls"]
        parallel.undo()
    diff = (out - reference).abs().max().item()
    exact = diff <= RTOL_OF_SCALE * reference.abs().max().item()
    return {"outcome": "exact" if exact else "differs", "diff": diff, "calls": calls,
            "plan": sorted(parallel.inferred.get("plan", {}))}


def _first(output) -> torch.Tensor:
    """The sample of a forward's output: a tensor, a tuple or list whose first item holds it, or an output class."""
    while not isinstance(output, torch.Tensor):
        output = output[0] if isinstance(output, (tuple, list)) else output.sample
    return output


def _coverage(ranks: int, plan: str | None, prefix_cache: bool = False) -> dict[str, dict]:
    """Every class's outcome on this rank (with `prefix_cache`, Qwen-Image 2.1's cached steps too:
    `_prefix_cache_steps`, in the same launch)."""
    outcomes = {name: _outcome(name, ranks, plan) for name in CASES}
    if prefix_cache:
        outcomes["QwenImage21Transformer2DModel"]["prefix_cache"] = _prefix_cache_steps()
    return outcomes


def _check_coverage(ranks: int, plan: str | None = None, prefix_cache: bool = False) -> list[dict[str, dict]]:
    results = spawn(_coverage, ranks, ranks, plan, prefix_cache, timeout_s=RANK_TIMEOUT_S)
    for rank, outcomes in enumerate(results):
        assert outcomes == results[0] or _same_outcomes(outcomes, results[0]), f"rank {rank} differs from rank 0"
        for name, result in outcomes.items():
            assert result["outcome"] != "differs", f"{name} on rank {rank} of {ranks}: max diff {result['diff']:.3g}"
            if result["outcome"] == "refused":
                assert "\n" not in result["why"], f"{name}: {result['why']}"
            else:
                assert result["calls"] > 0 and result["plan"], f"{name}: no exchange ran, or no plan was inferred"
    exact = {name for name, result in results[0].items() if result["outcome"] == "exact"}
    pinned = COVERED | (MASKED if plan is None else set())
    assert pinned <= exact, f"no longer exact: {sorted(pinned - exact)}"
    return results


def _same_outcomes(a: dict, b: dict) -> bool:
    return {k: v["outcome"] for k, v in a.items()} == {k: v["outcome"] for k, v in b.items()}


def test_every_class_with_no_plan_is_exact_on_2_ranks_or_refused_in_one_line():
    """And Qwen-Image 2.1 edits from its prefix cache exact: block-causal segments (text, a condition
    image, text) exchanged before they are cut from the sequence, the prefix's keys and values
    stored at the first step on this rank's heads, the target's tokens alone split and exchanged after it."""
    for rank, outcomes in enumerate(_check_coverage(2, prefix_cache=True)):
        for step, (diff, scale, exchanges) in enumerate(outcomes["QwenImage21Transformer2DModel"]["prefix_cache"]):
            assert exchanges > 0, f"Qwen-Image 2.1 from its prefix cache, rank {rank} step {step}: nothing was exchanged"
            assert diff <= RTOL_OF_SCALE * scale, f"Qwen-Image 2.1 from its prefix cache, rank {rank} step {step}: {diff:.3g}"


@pytest.mark.slow
def test_every_class_with_no_plan_is_exact_on_4_ranks_with_a_ring_or_refused_in_one_line():
    _check_coverage(4, "u2r2")


def _longcat_plan() -> tuple[torch.nn.Module, dict, dict[str, ModulePlan]]:
    model, kwargs = CASES["LongCatImageTransformer2DModel"]()
    return model, kwargs, infer_plan(model, (), kwargs)


def test_the_plan_of_a_flux_like_class_splits_both_streams_and_its_joint_rotary_table():
    _, _, plan = _longcat_plan()
    assert plan["transformer_blocks.0"].inputs == {"hidden_states": Split(-2, "img"), "encoder_hidden_states": Split(-2, "txt")}
    rope = {"image_rotary_emb": Split(-2, "txt+img", 2)}  # its table is cat(txt_ids, img_ids)'s, both streams' rows
    assert plan["transformer_blocks.*"].inputs == rope and plan["single_transformer_blocks.*"].inputs == rope


def test_a_plan_inferred_wrong_fails_its_check_before_any_rank_runs():
    model, kwargs, plan = _longcat_plan()
    late = {("transformer_blocks.1" if path == "transformer_blocks.0" else path): spec for path, spec in plan.items()}
    with pytest.raises(UsageError, match=r"^LongCatImageTransformer2DModel: no split plan could be inferred: its "
                                         r"forward fails under its inferred split plan"):
        check_plan(model, late, (), kwargs)  # the streams split at the second block: the first's table is cut
    unsplit_table = {path: spec for path, spec in plan.items() if not path.endswith(".*")}
    with pytest.raises(UsageError, match="fails under its inferred split plan"):
        check_plan(model, unsplit_table, (), kwargs)
    check_plan(model, plan, (), kwargs)  # and the plan as inferred passes


WRITTEN = ("tiny-flux2", "tiny-wan", "tiny-zimage", "tiny-sd3")
"""Presets whose class has its plan written (FLUX.2's and Wan's `_cp_plan`, Z-Image's and SD3's records)."""


def _first_call(model: str) -> tuple[torch.nn.Module, dict]:
    """The preset's transformer and the arguments of its first call in a one-step run of its pipeline."""
    import inspect

    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    calls: list[dict] = []
    names = list(inspect.signature(type(pipe.transformer).forward).parameters)[1:]
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append({**dict(zip(names, args)), **kwargs}), with_kwargs=True)
    pipe("a red circle", num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
    hook.remove()
    return pipe.transformer, calls[0]


def _inferred_in_place_of_written(ranks: int) -> dict[str, float]:
    """Each preset's first transformer call, its written plan set aside for an inferred one: the
    largest difference from one process, relative to the output's scale."""
    from cocodiff import parallelize
    from cocodiff.engine.families import FAMILIES, INFERRED, class_name

    out = {}
    for model in WRITTEN:
        transformer, kwargs = _first_call(model)
        with torch.no_grad():
            reference = _first(transformer(**kwargs))
        name = class_name(transformer)
        saved = FAMILIES.pop(name, None)
        FAMILIES[name] = INFERRED
        try:
            parallel = parallelize(transformer, ParallelConfig(comm="flat"))
            with torch.no_grad():
                got = _first(transformer(**kwargs))
            assert parallel.inferred["plan"] and parallel.ctx.stats.totals()["calls"] > 0
            parallel.undo()
        finally:
            FAMILIES.pop(name)
            if saved is not None:
                FAMILIES[name] = saved
        out[model] = ((got - reference).abs().max() / reference.abs().max()).item()
    return out


def test_the_written_plans_fall_out_of_the_inference():
    """FLUX.2's, Wan's, Z-Image's and SD3's plans set aside, each inferred from its model (SD3's stock processors
    calling SDPA themselves: routed) runs exact on 2 ranks."""
    for rank, diffs in enumerate(spawn(_inferred_in_place_of_written, 2, 2, timeout_s=RANK_TIMEOUT_S)):
        for model, diff in diffs.items():
            assert diff <= RTOL_OF_SCALE, f"{model} on rank {rank}: {diff:.3g} of the output's scale"


GUIDED = ("LongCatImageTransformer2DModel", "SkyReelsV2Transformer3DModel")
"""Classes whose forward takes a batch of two as a guided pipeline hands it (latents, text, timesteps)."""


def _guided(ranks: int, plan: str) -> dict[str, tuple[float, float, dict]]:
    """Two calls of a batch of two (a conditional and an unconditional half) under CFG groups: each
    call's largest difference from one process, and the bytes by plan axis."""
    from cocodiff import parallelize

    out = {}
    for name in GUIDED:
        model, kwargs = CASES[name]()
        for key in ("hidden_states", "encoder_hidden_states", "timestep"):
            kwargs[key] = torch.cat([kwargs[key], kwargs[key].flip(-1) if kwargs[key].dim() > 1 else kwargs[key] * 0.5])
        with torch.no_grad():
            reference = _first(model(**kwargs))
        parallel = parallelize(model, ParallelConfig(comm="flat", plan=plan))
        with torch.no_grad():
            diffs = [(_first(model(**kwargs)) - reference).abs().max().item() for _ in range(2)]
        out[name] = (max(diffs) / reference.abs().max().item(), parallel.ctx.stats.by_axis())
        parallel.undo()
    return out


@pytest.mark.slow
def test_an_inferred_plan_takes_cfg_groups_with_ulysses():
    for rank, results in enumerate(spawn(_guided, 4, 4, "c2u2", timeout_s=RANK_TIMEOUT_S)):
        for name, (diff, axes) in results.items():
            assert diff <= RTOL_OF_SCALE, f"{name} on rank {rank}: {diff:.3g} of the output's scale"
            assert axes["cfg/batch"]["intra_node"] > 0 and axes["ulysses"]["intra_node"] > 0, f"{name}: {axes}"


def test_a_checkpoint_of_a_class_with_no_plan_verifies_on_2_ranks(tmp_path):
    """A SkyReels-V2 text-to-video checkpoint (its own UMT5 and tokenizer, loaded with from_pretrained,
    prompts encoded by its pipeline): `verify` on 2 ranks equals one process, with the plan inferred."""
    import json
    import subprocess
    import sys

    from tiny_checkpoint import skyreels_v2_checkpoint

    folder = skyreels_v2_checkpoint(tmp_path)
    figures = tmp_path / "v.json"
    run = command.cocodiff("verify", "--model", str(folder), "--nproc", "2", "--height", "64", "--width", "64",
                           "--frames", "5", "--steps", "2", "--json", str(figures), timeout=2 * RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ok"] and result["bytes_by_axis"]["ulysses"]["intra_node"] > 0, result
    assert result["inferred_plan"] == {"blocks.0": ["hidden_states"], "blocks.*": ["rotary_emb"], "blocks.1": ["output"]}
    assert "split plan (inferred)" in run.stdout


def _compiled(_ranks: int) -> list[float]:
    """LongCat-Image under `--compile`: its plan is inferred at the first call, past the blocks compiled
    already (the trace runs their class's forward, not the compiled one, on its fake tensors)."""
    from cocodiff import parallelize

    model, kwargs = CASES["LongCatImageTransformer2DModel"]()
    with torch.no_grad():
        reference = _first(model(**kwargs))
    parallel = parallelize(model, ParallelConfig(comm="flat", compile=True))
    with torch.no_grad():
        diffs = [(_first(model(**kwargs)) - reference).abs().max().item() / reference.abs().max().item() for _ in range(2)]
    assert parallel.inferred["plan"] and parallel.ctx.stats.totals()["calls"] > 0
    return diffs


def test_an_inferred_plan_takes_compiled_blocks():
    for rank, diffs in enumerate(spawn(_compiled, 2, 2, timeout_s=RANK_TIMEOUT_S)):
        assert max(diffs) <= RTOL_OF_SCALE, f"rank {rank}: {diffs}"


def _prefix_cache_steps() -> list[tuple[float, float, int]]:
    """Qwen-Image 2.1's three cached steps, one process and then parallelized on this rank: each
    step's (max diff, max of one process's output, exchanges the step ran)."""
    from dit_cases_image import qwen_image21_steps

    from cocodiff import parallelize

    model, steps = qwen_image21_steps()
    with torch.no_grad():
        references = [model(**step)[0] for step in steps]
    parallel = parallelize(model, ParallelConfig(comm="flat"))
    results = []
    try:
        for step, reference in zip(steps, references):
            before = parallel.ctx.stats.totals()["calls"]
            with torch.no_grad():
                out = model(**step)[0]
            results.append(((out - reference).abs().max().item(), reference.abs().max().item(),
                            parallel.ctx.stats.totals()["calls"] - before))
    finally:
        parallel.undo()
    return results

