"""`--plan auto` times a pipeline stage per node with its other candidates (engine/stage_trials.py):
every rank holds the whole transformer while the trials run, each candidate runs its steps on its
block layout, and once a stage plan is chosen its cut is kept and the other blocks leave the device."""

from __future__ import annotations

import pytest
import torch
from conftest import RANK_TIMEOUT_S
from test_families import RTOL_OF_SCALE

from cocodiff import ParallelConfig
from cocodiff.run.launch import spawn

STEPS = 14  # a warm-up step, two per candidate (up to five), and steps after the choice
BATCHES = {"tiny-flux": ("num_images_per_prompt", 2), "tiny-wan": ("num_videos_per_prompt", 1)}


def _auto_run(model: str, favour: str | None) -> dict:
    """A run of `model` under `--plan auto` on 2 nodes x 2 ranks (one process: `favour` None), the
    trials' step times tipped towards the stage plan (`favour="stages"`) or away from it."""
    import cocodiff.engine.plan_trials as plan_trials
    from cocodiff import parallelize
    from cocodiff.engine.cache.steps import cache_blocks
    from cocodiff.engine.stages import _Handoff
    from cocodiff.models.presets import load_pipeline

    pipe, _encoder = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    blocks = cache_blocks(pipe.transformer)
    name, batch = BATCHES[model]
    found: dict = {}
    if favour is not None:
        timed = plan_trials._slowest

        def tipped(topology, what):
            slowest = timed(topology, what)
            # The step that ended ran under the context's plan: the others' steps take a second longer.
            staged = lambda: found["parallel"].ctx.groups.plan.pipe > 1  # noqa: E731
            return lambda seconds: slowest(seconds) + float(staged() != (favour == "stages"))

        plan_trials._slowest = tipped
        found["parallel"] = parallelize(pipe, ParallelConfig(plan="auto", ranks_per_node=2), images=batch)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return pipe("a small green star", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
                        output_type="latent", **{name: batch})[0]

    latents = run()
    if favour is None:
        return {"latents": latents}
    parallel = found["parallel"]
    parallel.undo()  # and again with the trials' choice, as bench e2e's repeats run
    found["parallel"] = parallelize(pipe, ParallelConfig(plan="auto", ranks_per_node=2), images=batch,
                                    plan_trials=parallel.plan_trials)
    again = run()
    parallel = found["parallel"]
    held = [b for lst in pipe.transformer.children() if isinstance(lst, torch.nn.ModuleList) for b in lst
            if not isinstance(b, _Handoff)]
    return {"latents": latents, "again": again, "plan": parallel.plan.short,
            "candidates": [c["name"] for c in parallel.plan_trials.report()["candidates"]],
            "held": len(held), "blocks": len(blocks), "gone": sum(all(p.is_meta for p in b.parameters()) for b in blocks),
            "stage": parallel.stages.stage if parallel.stages is not None else None}


@pytest.mark.parametrize(("model", "favour"), [("tiny-flux", "stages"), ("tiny-wan", "stages"), ("tiny-flux", "others")])
def test_plan_auto_times_a_stage_per_node_and_keeps_the_cut_it_chooses(model, favour):
    """FLUX (a batch of 2: two micro-batches, and batch groups among the others) and Wan (its
    plan splits the sequence at `blocks.0`: at each stage's first block). Exact either way; a
    chosen stage plan leaves each rank its stage's blocks, the others on `meta`; another plan
    chosen, the whole transformer stays (the matrix's `plan auto` column times the stage plan on
    every family that takes it). A second run with the trials' choice (bench e2e's repeats) is
    exact too."""
    ref = _auto_run(model, None)["latents"]
    for rank, result in enumerate(spawn(_auto_run, 4, model, favour, timeout_s=RANK_TIMEOUT_S)):
        for run in ("latents", "again"):
            diff = (result[run] - ref).abs().max().item()
            assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}, {run}: max diff {diff:.3g}"
        assert "p2u2" in result["candidates"], result["candidates"]
        if favour == "stages":
            assert result["plan"] == "p2u2" and result["stage"] == rank // 2, (rank, result)
            assert 0 < result["held"] < result["blocks"] and result["held"] + result["gone"] == result["blocks"], result
        else:
            assert result["plan"] != "p2u2" and result["stage"] is None and result["gone"] == 0, (rank, result)
            assert result["held"] == result["blocks"], result
