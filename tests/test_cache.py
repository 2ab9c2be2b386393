"""Step caches (LOSSY): the spec grammar, the decision rule, and every rank taking the same decisions."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S
from model_cases import HEIGHT, WIDTH
from test_cli import exit_status

from cocodiff import ParallelConfig, UsageError, parallelize
from cocodiff.engine.cache import parse_cache, should_skip
from cocodiff.engine.cache.steps import apply_cache
from cocodiff.run.launch import spawn
from cocodiff.models.presets import load_pipeline, pipeline_inputs


def test_specs_and_their_defaults():
    fb = parse_cache("fbcache")
    assert (fb.first, fb.last, fb.threshold, fb.warmup, fb.max_in_a_row) == (1, 0, 0.05, 0, None)  # diffusers' FBCache
    db = parse_cache("dbcache")
    assert (db.first, db.last, db.threshold, db.warmup, db.max_in_a_row) == (8, 0, 0.08, 8, None)  # cache-dit's DBCache
    assert db.block_split(6) == (5, 6)  # F not written: capped to leave one middle block
    given = parse_cache("dbcache:F8B0,0.08")
    with pytest.raises(UsageError, match="F8 \\+ B0 blocks leave none to cache; this transformer has 6"):
        given.block_split(6)
    spec = parse_cache("dbcache:F2B1W3MC2,0.2")
    assert (spec.first, spec.last, spec.threshold, spec.warmup, spec.max_in_a_row) == (2, 1, 0.2, 3, 2)
    assert str(spec) == "dbcache:F2B1W3MC2,0.2" and parse_cache("fbcache:0.1").threshold == 0.1
    assert parse_cache("dbcache:0.3").first == 8 and ParallelConfig(cache="fbcache").lossy
    a, b = parse_cache("dbcache:0.2,F1B0O1"), parse_cache("dbcache:F1B0O1,0.2")  # in either order
    assert (a.first, a.last, a.threshold, a.order) == (b.first, b.last, b.threshold, b.order) == (1, 0, 0.2, 1)
    ts = parse_cache("taylorseer:N3O2")
    assert (ts.first, ts.last, ts.interval, ts.order, ts.warmup, ts.max_in_a_row) == (0, 0, 3, 2, 3, 2)  # W: O + 1
    tea, mag = parse_cache("teacache"), parse_cache("magcache")
    assert (tea.threshold, tea.first, mag.threshold, mag.max_in_a_row, mag.warmup) == (0.25, 0, 0.06, 3, None)


@pytest.mark.parametrize("text, message", [
    ("lru", "'lru' is not a step cache: use fbcache[:THRESH], dbcache"),
    ("dbcache:F0B0", "F0 must be at least 1"),
    ("dbcache:0.1,0.2", "'0.2' is not expected here (one threshold at most)"),
    ("fbcache:F2B0", "F2 is not expected here (fbcache takes a threshold only)"),
    ("dbcache:F8B0,fast", "'fast' is neither options (letter codes like F1B0W2) nor a threshold"),
    ("taylorseer:0.3", "'0.3' is not expected here (taylorseer takes no threshold: N sets its interval)"),
    ("taylorseer:N0O1", "N0 must be at least 1"),
    ("taylorseer:N2O4", "O4 must be from 1 to 3"),
    ("teacache:F1B0,0.3", "F1 is not an option of teacache (W, MC, O)"),
    ("teacache:-0.3", "the threshold -0.3 must be a finite number at least 0"),
    ("magcache:W2W3", "W3 is given twice"),
    ("magcache:MC2,0.1,W2", "'W2' is not expected here (one group of options at most)"),
    ("fbcache:-1", "the threshold -1 must be a finite number at least 0"),
    ("dbcache:F1B0MC0", "MC0 must be at least 1"),
])
def test_bad_specs_are_one_line_and_exit_2(capsys, text, message):
    assert exit_status(["generate", "--cache", text, "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_cache_without_middle_blocks_is_one_line(tmp_path, capsys):
    argv = ["generate", "--model", "tiny-qwen-image", "--cache", "dbcache:F1B1", "--nproc", "1", "--steps", "1",
            "--height", "16", "--width", "16", "--out", str(tmp_path / "x.png")]
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert "F1 + B1 blocks leave none to cache; this transformer has 2" in err and len(err.strip().splitlines()) == 1


def test_the_decision_rule():
    assert should_skip([1.0, 10.0, 0.0], 0.2) and not should_skip([3.0, 10.0, 0.0], 0.2)
    assert not should_skip([0.0, 10.0, 1.0], 0.2)  # a rank must compute: everyone does
    assert not should_skip([0.0, 10.0, 0.0], 0.0)  # threshold 0: never
    assert not should_skip([0.0, 0.0, 0.0], 0.5)  # nothing to compare with


class ToyBlock(torch.nn.Module):
    """Takes and returns (text, image) like the diffusers blocks; the text leaves the last block as None."""

    def __init__(self, weight: float, last: bool = False) -> None:
        super().__init__()
        self.weight, self.last = weight, last

    def forward(self, hidden_states, encoder_hidden_states, temb=None):
        text = None if self.last else encoder_hidden_states + self.weight * torch.tanh(encoder_hidden_states + temb)
        return text, hidden_states + self.weight * torch.tanh(hidden_states * temb)


class ToyScheduler:
    """What the step clock reads of a diffusers scheduler (engine/steps.py), moved by `toy_run` as a
    pipeline's loop moves it: new `timesteps` at a run's start, `step_index` counted up after each step."""

    timesteps: torch.Tensor | None = None
    step_index: int | None = None


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = ToyScheduler()
        self.transformer_blocks = torch.nn.ModuleList([ToyBlock(w) for w in (0.5, 0.4, 0.3)])
        self.single_blocks = torch.nn.ModuleList([ToyBlock(0.2, last=True)])

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        text, temb = encoder_hidden_states, timestep / 1000
        for block in [*self.transformer_blocks, *self.single_blocks]:
            text, hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=text, temb=temb)
        return hidden_states


def toy_run(toy: Toy, x: torch.Tensor, text: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """A run of `steps` calls at timesteps 1000, 990, ...: the inputs barely change from step to step."""
    toy.scheduler.timesteps = torch.arange(steps)  # set_timesteps: a new run
    out = []
    for s in range(steps):
        toy.scheduler.step_index = s or None
        out.append(toy(x + 1e-3 * s, text, torch.tensor([1000.0 - 10 * s])))
    return out


def toy_cache(toy: Toy, spec: str, *args, **kwargs):
    """`spec` on the toy, its steps read from the toy's scheduler."""
    return apply_cache(toy, parse_cache(spec), *args, scheduler=toy.scheduler, **kwargs)


def test_decisions_warm_up_skip_in_a_row_and_reset():
    toy, g = Toy(), torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 6, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    plain = toy_run(toy, x, text, 7)
    cache = toy_cache(toy, "dbcache:F1B1W2MC2,0.5")
    cached = toy_run(toy, x, text, 7)
    # Steps 0-1 warm up; then at most 2 skipped in a row: computed, computed, skip, skip, computed, skip, skip.
    same = [torch.equal(a, b) for a, b in zip(plain, cached)]
    assert same == [True, True, False, False, True, False, False]
    assert cache.report() == {"spec": "dbcache:F1B1W2MC2,0.5", "computed_steps": 3, "skipped_steps": 4}
    assert (cached[2] - plain[2]).abs().max() < 1e-2  # a skip reuses the middle's residual: close, not equal
    toy_run(toy, x, text, 1)  # a larger timestep: a new run, nothing cached from the last
    assert cache.report()["computed_steps"] == 1 and cache.report()["skipped_steps"] == 0
    cache.undo()
    assert all(torch.equal(a, b) for a, b in zip(plain, toy_run(toy, x, text, 7)))
    never = toy_cache(toy, "dbcache:F1B1W0,0")
    assert all(torch.equal(a, b) for a, b in zip(plain, toy_run(toy, x, text, 7)))
    assert never.report()["skipped_steps"] == 0


def test_a_plan_switch_drops_the_cached_tensors():
    """`--plan auto` may switch to a plan that shards the tokens alike in shape but not in content
    (c2u1 and b2u1 on 2 ranks): the step after a switch computes rather than reuse another shard's residual."""
    toy, g = Toy(), torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 6, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    plans = iter(["c2u1", "c2u1", "b2u1", "b2u1", "b2u1"])
    layout = {}
    cache = toy_cache(toy, "dbcache:F1B1W0,0.5", layout=lambda: layout.setdefault(current[0], object()))
    skipped = []
    for s in range(5):
        current = [next(plans)]
        before = cache.skipped_steps
        toy.scheduler.step_index = s or None
        toy(x + 1e-3 * s, text, torch.tensor([1000.0 - 10 * s]))
        skipped.append(cache.skipped_steps > before)
    assert skipped == [False, True, False, True, True]  # step 2 switched: computed (and compared with from step 3)


PERTURBATION = 0.5
"""Relative noise on every weight of rank 1 (as in test_vmajor.py): the ranks' shards differ more."""
DIVERGENT = "dbcache:F1B1W1,0.51"
"""A threshold the ranks' own relative L1 changes straddle on tiny-flux, 48x80, with rank 1
perturbed, 6 steps (measured: at step 3 rank 0's is 0.520, rank 1's 0.495, the world's 0.505; each at
least 0.01 from the threshold): decided locally, rank 0 would run the middle blocks and rank 1 not."""


def record_changes(cache) -> list[tuple[float | None, float | None]]:
    """A list that gets (this rank's relative L1 change, the world's) at each of `cache`'s decisions."""
    changes, agree = [], cache.agree

    def recorded(values: torch.Tensor) -> list[float]:
        mine, everyone = values.tolist(), agree(values)
        changes.append((mine[0] / mine[1] if mine[1] else None, everyone[0] / everyone[1] if everyone[1] else None))
        return everyone

    cache.agree = recorded
    return changes


def straddled(ranks_changes: list[list[tuple]], threshold: float) -> list[int]:
    """The decisions at which the ranks' own changes fall on both sides of `threshold`."""
    local = [[mine for mine, _ in changes] for changes in ranks_changes]
    return [s for s in range(len(local[0])) if None not in (local[0][s], local[1][s])
            and (local[0][s] < threshold) != (local[1][s] < threshold)]


def perturb_rank_1(pipe) -> None:
    """Rank 1's transformer weights scaled by 1 + PERTURBATION x noise (seeded): rank-divergent data."""
    if dist.get_rank() != 1:
        return
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for weight in pipe.transformer.parameters():
            weight.mul_(1.0 + PERTURBATION * torch.randn(weight.shape, generator=g))


def run_flux(spec: str | None, perturb: bool, steps: int, runs: int = 1) -> dict:
    """tiny-flux under Ulysses over 2 ranks with `spec` (`runs` times, the last one's figures); this
    rank's latents, and the local and agreed relative L1 change of every decision."""
    pipe, encoder = load_pipeline("tiny-flux", seed=0)
    pipe.set_progress_bar_config(disable=True)
    if perturb:
        perturb_rank_1(pipe)
    parallel = parallelize(pipe, ParallelConfig(cache=spec))
    changes = record_changes(parallel.cache) if parallel.cache is not None else []
    for _ in range(runs):
        changes.clear()
        latents = pipe(
            **pipeline_inputs(pipe, encoder, "a small green star"), height=HEIGHT, width=WIDTH,
            num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="latent",
        ).images
    return {"latents": latents, "changes": changes, "report": parallel.cache.report() if parallel.cache else None}


def run_flux_cases() -> dict:
    return {"plain": run_flux(None, False, 2), "zero": run_flux("dbcache:F1B1W1,0", False, 2),
            "divergent": run_flux(DIVERGENT, True, 6)}


@pytest.mark.slow
def test_threshold_zero_is_exact_and_rank_divergent_changes_are_agreed():
    """Threshold 0 never skips: the output is bit-equal to the uncached run. With rank-divergent
    data the ranks' own changes straddle the threshold: decided locally, one rank would skip the
    middle blocks (and their all-to-alls) while the other ran them, and the collectives would
    desynchronize. Agreed through the all-reduce, the run completes, it skips, and every rank ends
    with the same latents."""
    ranks = spawn(run_flux_cases, 2, timeout_s=RANK_TIMEOUT_S)
    for rank in ranks:
        assert torch.equal(rank["zero"]["latents"], rank["plain"]["latents"])
        assert rank["zero"]["report"] == {"spec": "dbcache:F1B1W1,0", "computed_steps": 2, "skipped_steps": 0}
    divergent = [rank["divergent"] for rank in ranks]
    assert torch.equal(divergent[0]["latents"], divergent[1]["latents"])
    assert divergent[0]["report"] == divergent[1]["report"] and divergent[0]["report"]["skipped_steps"] >= 1
    changes = [d["changes"] for d in divergent]
    assert straddled(changes, parse_cache(DIVERGENT).threshold), changes  # the case is the divergent one


PLAN_SPEC = "dbcache:F1B0W1,0.6"
"""Skips some steps of tiny-flux at 48x80 under every 2-rank plan below, rank 1 perturbed."""


def run_flux_plans(steps: int) -> dict:
    """tiny-flux, two images, rank 1's weights perturbed, under a ring (u1r2) and a batch plan
    (b2u1: each rank denoises its own image, its own residuals): this rank's latents and report."""
    results = {}
    for plan in ("u1r2", "b2u1"):
        pipe, _ = load_pipeline("tiny-flux", seed=0)
        pipe.set_progress_bar_config(disable=True)
        perturb_rank_1(pipe)
        parallel = parallelize(pipe, ParallelConfig(plan=plan, cache=PLAN_SPEC), images=2)
        latents = pipe(["a small green star", "a red circle"], height=HEIGHT, width=WIDTH, num_inference_steps=steps,
                       generator=torch.Generator().manual_seed(0), output_type="latent").images
        results[plan] = {"latents": latents, "report": parallel.cache.report()}
    return results


@pytest.mark.slow
def test_ring_and_batch_plans_with_a_cache_complete_and_agree():
    """Ring and batch plans under a cache with rank-divergent data: the runs complete (an unmatched
    collective would hang or crash them), both ranks report the same skips and end with the same latents."""
    ranks = spawn(run_flux_plans, 2, 5, timeout_s=RANK_TIMEOUT_S)
    for plan in ("u1r2", "b2u1"):
        first, second = (rank[plan] for rank in ranks)
        assert first["report"] == second["report"] and first["report"]["skipped_steps"] >= 1, (plan, first["report"])
        assert torch.equal(first["latents"], second["latents"]), plan


def run_flux_v_major(steps: int) -> dict:
    """tiny-flux on 2 nodes of 2, TAPA with V-Major (linear) and a cache, rank 1's weights
    perturbed: a skipped step sends nothing, a computed one sends V-Major's rows."""
    pipe, encoder = load_pipeline("tiny-flux", seed=0)
    pipe.set_progress_bar_config(disable=True)
    perturb_rank_1(pipe)
    parallel = parallelize(pipe, ParallelConfig(comm="tapa", v_major="linear", ranks_per_node=2, cache=PLAN_SPEC))
    latents = pipe(**pipeline_inputs(pipe, encoder, "a small green star"), height=HEIGHT, width=WIDTH,
                   num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="latent").images
    return {"latents": latents, "report": parallel.cache.report(), "saved": parallel.stats.other_node_bytes["a2a_in"]}


@pytest.mark.slow
def test_v_major_under_a_cache_completes_and_agrees():
    """V-Major keeps per-layer mirrors of what each peer last received; a step the cache skips
    runs none of the middle blocks on any rank, so no mirror moves and none goes stale. With
    rank-divergent data the ranks agree on every skip and end with the same latents."""
    ranks = spawn(run_flux_v_major, 4, 6, timeout_s=RANK_TIMEOUT_S)
    reports = [rank["report"] for rank in ranks]
    assert all(r == reports[0] for r in reports) and reports[0]["skipped_steps"] >= 1, reports
    assert all(torch.equal(rank["latents"], ranks[0]["latents"]) for rank in ranks)


CFG_SPEC = "dbcache:F1B0W1,0.67"
"""Straddled by the two branches' own changes on tiny-qwen-image, 48x80, 6 steps (measured at the
first decision after warm-up: rank 0's 0.647, rank 1's 0.683, the world's 0.665): decided locally,
rank 0 would skip and rank 1 compute."""


def run_cfg_pairs(steps: int) -> dict:
    """tiny-qwen-image (true CFG: two calls per step) under `c2`: each rank runs one branch."""
    pipe, encoder = load_pipeline("tiny-qwen-image", seed=0)
    pipe.set_progress_bar_config(disable=True)
    parallel = parallelize(pipe, ParallelConfig(plan="c2", cache=CFG_SPEC))
    changes = record_changes(parallel.cache)
    latents = pipe(
        **pipeline_inputs(pipe, encoder, "a small green star"), height=HEIGHT, width=WIDTH, num_inference_steps=steps,
        generator=torch.Generator().manual_seed(0), output_type="latent",
    ).images
    return {"latents": latents, "report": parallel.cache.report(), "pairs": parallel.transformer.forward.pairs,
            "changes": changes}


@pytest.mark.slow
def test_cfg_groups_agree_on_one_decision_per_pair():
    """Under a CFG plan the two ranks run different branches (different residuals), one call per
    step once the calls are paired; their own changes straddle the threshold, and the decision is
    the world's: both skip or neither does (decided locally, their counts would differ)."""
    ranks = spawn(run_cfg_pairs, 2, 6, timeout_s=RANK_TIMEOUT_S)
    assert ranks[0]["pairs"] == 5  # every step but the first runs the branches side by side
    assert torch.equal(ranks[0]["latents"], ranks[1]["latents"])
    assert straddled([rank["changes"] for rank in ranks], parse_cache(CFG_SPEC).threshold)
    assert ranks[0]["report"] == ranks[1]["report"] and ranks[0]["report"]["skipped_steps"] >= 1


def test_variant_suffixes():
    from cocodiff.config.variants import parse_variant, parse_variants

    names = [v.name for v in parse_variants("flat,tapa+vfirst+dbcache,u2:flat+cache=dbcache:F1B0,0.08,flat+cache=fbcache")]
    assert names == ["flat", "tapa+vfirst+dbcache", "u2:flat+cache=dbcache:F1B0,0.08", "flat+cache=fbcache"]
    names = [v.name for v in parse_variants("flat+cache=teacache:0.3,W2MC3,tapa+cache=taylorseer:N3O2,c2u2:flat")]
    assert names == ["flat+cache=teacache:0.3,W2MC3", "tapa+cache=taylorseer:N3O2", "c2u2:flat"]  # options after a ',
    variant = parse_variant("u2:flat+cache=dbcache:F1B0,0.08")
    assert (variant.plan, variant.comm, variant.cache, variant.cached) == ("u2", "flat", "dbcache:F1B0,0.08", True)
    assert parse_variant("tapa+dbcache").cache == "dbcache" and parse_variant("tapa+dbcache") == parse_variant("tapa+cache=dbcache")
    stacked = parse_variant("tapa+vmajor+dbcache")  # a skipped step sends nothing, a computed one V-Major's rows
    assert stacked.cached and stacked.lossy
    for bad, message in [("tapa+cache=lru", "'lru' is not a step cache"), ("diffusers-ulysses+dbcache", "does not combine with diffusers-ulysses"),
                         ("tapa+dbcache+cache=fbcache", "one step cache at most")]:
        with pytest.raises(UsageError, match=message):
            parse_variant(bad)


@pytest.mark.slow
def test_verify_with_a_cache_reports_its_error_as_lossy(tmp_path):
    from test_cli import cocodiff

    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-shapes", "--nproc", "2", "--steps", "8",
                   "--cache", "dbcache:F1B0W2,0.3", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    assert "OK (LOSSY mode" in run.stdout and "step cache (LOSSY)" in run.stdout
    result = json.loads(figures.read_text())
    assert result["ok"] is True and result["lossy"] is True
    assert result["cache"]["spec"] == "dbcache:F1B0W2,0.3" and result["cache"]["skipped_steps"] >= 1
    assert result["max_rel_diff"] > result["tolerance"]  # its error is reported, not failed on
