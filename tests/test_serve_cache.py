"""Step caches in `cocodiff serve` (LOSSY): a request's cache follows its rows through the step-level
batch, decided per request and agreed by every rank; the HTTP layer's `cache` field."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from cocodiff.engine.cache import parse_cache
from cocodiff.engine.cache.rows import RowCaches
from cocodiff.engine.cache.steps import apply_cache
from cocodiff.serve.api import create_app
from cocodiff.serve.protocol import Limits
from cocodiff.serve.scheduler import Scheduler


class ToyBlock(torch.nn.Module):
    """Takes and returns (text, image) like the diffusers blocks; `temb` has one row per image."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden_states, encoder_hidden_states, temb):
        text = encoder_hidden_states + self.weight * torch.tanh(encoder_hidden_states + temb)
        return text, hidden_states + self.weight * torch.tanh(hidden_states * temb)


class Toy(torch.nn.Module):
    """Rows are independent (elementwise blocks): a row computes the same alone or in any batch."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([ToyBlock(w) for w in (0.5, 0.4, 0.3, 0.2)])

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        text, temb = encoder_hidden_states, (timestep / 1000).view(-1, 1, 1)  # (B, 1, 1)
        for block in self.transformer_blocks:
            text, hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=text, temb=temb)
        return hidden_states


SPECS = {"a": "dbcache:F1B1W2MC2,0.5", "b": None, "c": "taylorseer:F1B1N3O1W1", "d": "teacache:W1,0.05"}
"""Four requests: a first-block cache, none, TaylorSeer (its extrapolated residual) and TeaCache
(deciding at the first block's entry, on its accumulated input change)."""
JOINS = {"a": 0, "b": 1, "c": 2, "d": 1}
STEPS = {"a": 7, "b": 4, "c": 5, "d": 6}
ROWS = {"a": 2, "b": 1, "c": 1, "d": 1}


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(ord(name))
    return torch.randn(ROWS[name], 6, 4, generator=g), torch.randn(ROWS[name], 3, 4, generator=g)


def _step_input(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's image and text tokens and timesteps: the inputs barely change from step to step."""
    x, text = _inputs(name)
    return x + 1e-3 * step, text, torch.full((ROWS[name],), 1000.0 - 10 * step)


def _alone(toy: Toy, name: str) -> list[torch.Tensor]:
    cache = apply_cache(toy, parse_cache(SPECS[name])) if SPECS[name] else None
    out = [toy(*_step_input(name, s)) for s in range(STEPS[name])]
    if cache is not None:
        cache.undo()
    return out


def _batched(toy: Toy, caches: RowCaches) -> tuple[dict[str, list[torch.Tensor]], dict]:
    """The three requests joining at their steps and leaving after their last, one call per step."""
    runs = {name: caches.run(parse_cache(spec)) for name, spec in SPECS.items() if spec}
    out: dict[str, list[torch.Tensor]] = {name: [] for name in SPECS}
    for tick in range(10):
        flying = [n for n in SPECS if JOINS[n] <= tick < JOINS[n] + STEPS[n]]
        if not flying:
            break
        parts = [_step_input(n, tick - JOINS[n]) for n in flying]
        rows, start = [], 0
        for n, (_, _, t) in zip(flying, parts):
            if n in runs:
                rows.append((runs[n], start, ROWS[n], float(t[0]) / 1000))
            start += ROWS[n]
        with caches.call(rows):
            result = toy(*(torch.cat(p) for p in zip(*parts)))
        for n, part in zip(flying, result.split([ROWS[n] for n in flying])):
            out[n].append(part)
    return out, {n: run.report() for n, run in runs.items()}


def test_each_request_in_a_batch_gets_its_cached_run_alone():
    """Requests with different caches (one without) join and leave one batch; each row equals its
    request's run alone under `generate`'s StepCache (bit for bit: the toy's rows are independent),
    and each request's steps computed and skipped are its run's alone."""
    toy = Toy()
    alone = {name: _alone(toy, name) for name in SPECS}
    reports = {}
    for name, spec in SPECS.items():
        if spec:
            cache = apply_cache(toy, parse_cache(spec))
            _ = [toy(*_step_input(name, s)) for s in range(STEPS[name])]
            reports[name] = cache.report()
            cache.undo()
    caches = RowCaches(toy)
    batched, batched_reports = _batched(toy, caches)
    caches.undo()
    assert batched_reports == reports
    assert all(reports[name]["skipped_steps"] > 0 for name in reports)  # every cache skipped some steps
    for name in SPECS:
        assert len(batched[name]) == STEPS[name]
        for step, (mine, theirs) in enumerate(zip(batched[name], alone[name])):
            assert torch.equal(mine, theirs), (name, step)


class _Sum:
    """Two in-process 'ranks' (threads) summing their decision values, as the world all-reduce does."""

    def __init__(self) -> None:
        self.barrier, self.values, self.calls = threading.Barrier(2, timeout=300), [None, None], [0, 0]

    def agree(self, rank: int):
        def agree(values: torch.Tensor) -> list[float]:
            self.values[rank] = values.clone()
            self.calls[rank] += 1
            self.barrier.wait()
            total = (self.values[0] + self.values[1]).tolist()
            self.barrier.wait()
            return total

        return agree


def test_ranks_holding_different_rows_agree_and_a_run_that_moves_recomputes():
    """Batch groups: rank 0 runs the first row of each call, rank 1 the rest. When an uncached
    request joins in front and leaves again, request "a"'s row moves to rank 1 and back: each rank
    decides on the world's sums, both take the same decisions step by step, and a run whose row
    comes back to a rank that did not hold it at its last step computes there (that rank's residual
    is old), even with a threshold that would skip."""
    toys, summed = [Toy(), Toy()], _Sum()
    caches, shares, running = [], [(0, 1), (1, 100)], [[None], [None]]
    for rank in range(2):
        # Weights differ by rank (as a perturbed rank): each decides on data the other does not see.
        for block in toys[rank].transformer_blocks:
            block.weight *= 1 + 0.3 * rank
        # The share is known only while the call runs, as `DataParallelForward.share` is.
        caches.append(RowCaches(toys[rank], agree=summed.agree(rank), share=lambda rank=rank: running[rank][0]))
    results: list = [None, None]

    def run(rank: int) -> None:
        results[rank] = _sharded(toys[rank], caches[rank], shares[rank], running[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert results[0] is not None and results[1] is not None
    assert results[0] == results[1]  # the same decisions on both ranks, step by step
    # "a": computed (no residual), skipped, computed at tick 2 (its row moved to rank 1, which has no
    # residual for it), computed at tick 3 (back on rank 0, whose residual is from tick 0), skipped;
    # "c" stays on rank 1: computed once, then skipped.
    assert results[0] == [(1, 0, 1, 0), (1, 1, 1, 1), (2, 1, 1, 2), (3, 1, 1, 3), (3, 2, 1, 4)]
    assert summed.calls[0] == summed.calls[1] > 0


def _sharded(toy: Toy, caches: RowCaches, share: tuple[int, int], running: list) -> list:
    """Requests "a" then "c" (a row each), cached with a threshold that skips whenever it may; "b"
    (uncached) is in front at tick 2 only, so "a" moves from rank 0 to rank 1 and back."""
    a, c = caches.run(parse_cache("fbcache:1e9")), caches.run(parse_cache("fbcache:1e9"))
    decisions = []
    for tick in range(5):
        layout = [("b", None, 1), ("a", a, 1), ("c", c, 1)] if tick == 2 else [("a", a, 1), ("c", c, 1)]
        batch = sum(rows for *_, rows in layout)
        start, count = share[0], min(share[1], batch - share[0])
        x = torch.linspace(-1, 1, batch * 24).view(batch, 6, 4) + 1e-3 * tick
        text = torch.ones(batch, 3, 4)
        rows, first = [], 0
        for _, run, n in layout:
            if run is not None:
                rows.append((run, first, n, 1.0 - 0.01 * tick))
            first += n
        with caches.call(rows):
            running[0] = (start, count)
            toy(x[start : start + count], text[start : start + count], torch.full((count,), 1000.0 - 10 * tick))
            running[0] = None
        decisions.append((a.computed_steps, a.skipped_steps, c.computed_steps, c.skipped_steps))
    return decisions


# -- the HTTP layer: the `cache` field ------------------------------------------------------------------

def _client(limits: Limits) -> tuple[TestClient, list]:
    """A client of an app whose fake executor records each request's `Work` and reports a cache."""
    scheduler, works = Scheduler(max_queue=8, max_batch=4, window_s=0), []

    def loop() -> None:
        while not scheduler.stopped:
            if (batch := scheduler.next_batch(0.05)) is not None:
                works.extend(batch.works)
                for work in batch.works:
                    if work.cache is not None:
                        scheduler.progress.cache(work.request_id, {"spec": str(work.cache), "computed_steps": 1,
                                                                   "skipped_steps": 1, "lossy": True})
                scheduler.execute(batch, lambda b: [b"png"] * b.images)

    threading.Thread(target=loop, daemon=True).start()
    client = TestClient(create_app(scheduler, limits))
    client.scheduler = scheduler
    return client, works


@pytest.mark.parametrize("cache, message", [
    ("bogus", "'bogus' is not a step cache"),
    ("dbcache:F1B0,x", "'x' is neither options"),
    ("dbcache:F3B2", "F3 + B2 blocks leave none to cache; this transformer has 4"),
    (7, "cache: Input should be a valid string"),
])
def test_a_bad_cache_is_a_400_in_openai_shape_and_never_queued(cache, message):
    client, works = _client(Limits(width=64, height=64, steps=2, size_multiple=4, cache_blocks=lambda: 4))
    with client:
        response = client.post("/v1/images/generations", json={"prompt": "a red circle", "cache": cache})
        client.scheduler.stop()
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "cache" and error["type"] == "invalid_request_error"
    assert works == []


@pytest.mark.parametrize("spec, message", [
    ("bogus", "--cache 'bogus' is not a step cache"),
    ("dbcache:F1", "F<n> and B<n> come together"),
])
def test_a_bad_server_cache_is_one_line_and_exit_2(capsys, spec, message):
    from test_cli import exit_status

    assert exit_status(["serve", "--cache", spec, "--nproc", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("cocodiff: error:") and len(err.strip().splitlines()) == 1


def test_the_server_default_a_request_override_and_opting_out():
    limits = Limits(width=64, height=64, steps=2, size_multiple=4, cache=parse_cache("fbcache"))
    client, works = _client(limits)
    bodies = [{}, {"cache": "taylorseer"}, {"cache": None}, {"cache": "off"}]
    with client:
        answers = [client.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 1, **body})
                   for body in bodies]
        client.scheduler.stop()
    assert [a.status_code for a in answers] == [200] * 4
    assert [str(w.cache) if w.cache else None for w in works] == ["fbcache", "taylorseer", None, None]
    assert [a.json().get("cache", {}).get("spec") for a in answers] == ["fbcache", "taylorseer", None, None]
    assert answers[0].json()["cache"]["lossy"] is True and len(answers[0].json()["data"]) == 1


def test_a_server_that_cannot_cache_refuses_a_request_cache():
    client, works = _client(Limits(width=64, height=64, steps=2, size_multiple=4, cache_refused="--compile"))
    with client:
        response = client.post("/v1/images/generations", json={"prompt": "a red circle", "cache": "dbcache"})
        client.scheduler.stop()
    assert response.status_code == 400 and "this server's --compile" in response.json()["error"]["message"]


# -- the stepper on tiny-shapes: cached and uncached requests, each equal to `generate` --------------

def test_served_requests_with_and_without_caches_equal_their_generate_runs():
    """tiny-shapes (true CFG: each request's two branches keep a cache run each, as the pipeline's
    two calls per step do): a cached and an uncached request join one running batch at different
    steps; each is answered once and equals the one-process `generate` run of its own spec, seed,
    steps and size within `verify`'s tolerance (batched matmuls round differently), with the same
    steps computed and skipped."""
    from cocodiff.models.presets import load_preset
    from cocodiff.serve.calls import Call, run_call
    from cocodiff.serve.stepper import Join, Stepper

    torch.manual_seed(0)
    pipe = load_preset("tiny-shapes")
    pipe.set_progress_bar_config(disable=True)
    joins = {0: Join(prompt="a red circle", seeds=(0,), width=32, height=32, steps=6, guidance=None,
                     cache=parse_cache("fbcache:0.3")),
             1: Join(prompt="a blue square", seeds=(3, 4), width=32, height=32, steps=3, guidance=None)}
    stepper = Stepper(pipe)
    images, reports, answered = {}, {}, []
    for step in range(7):
        for request, index, image in stepper.step([joins[step]] if step in joins else []):
            images[request, index] = image
            answered.append((request, index))
        reports |= stepper.reports
    stepper.caches.undo()
    assert sorted(answered) == [(0, 0), (1, 0), (1, 1)] and stepper.idle  # each image once
    assert list(reports) == [0]  # the uncached request has no cache report
    for request, join in joins.items():
        cache = apply_cache(pipe.transformer, join.cache, scheduler=pipe.scheduler) if join.cache else None
        alone = run_call(pipe, Call(prompts=[join.prompt] * len(join.seeds), seeds=list(join.seeds),
                                    width=32, height=32, steps=join.steps, guidance=None))
        if cache is not None:
            cache.undo()
            assert reports[request] == cache.report() | {"lossy": True}
            assert reports[request]["skipped_steps"] > 0  # the cache skipped something
        for index in range(len(join.seeds)):
            assert np.abs(images[request, index] - alone[index]).max() < 1e-4, (request, index)


# -- two ranks: Ulysses (every rank holds every row) and batch groups (rows split) -------------------

SERVED = {0: ("a red circle", (0,), 6, "fbcache:0.3"), 1: ("a blue square", (3,), 4, None),
          2: ("a green triangle", (5, 6), 5, "taylorseer")}
"""Joins by step: (prompt, seeds, steps, cache spec)."""


def _serve_on_ranks(plan: str) -> dict:
    """One rank of a served batch under `plan`: the stepper with the server's cache hooks."""
    import torch.distributed as dist

    from cocodiff import ParallelConfig, parallelize
    from cocodiff.models.presets import load_preset
    from cocodiff.serve.caching import Caching
    from cocodiff.serve.stepper import Join

    pipe = load_preset("tiny-shapes")
    pipe.set_progress_bar_config(disable=True)
    parallel = parallelize(pipe, ParallelConfig(plan=plan), time_plans=False)
    stepper = Caching.of(parallel).stepper(pipe, decode=dist.get_rank() == 0)
    images, reports = {}, {}
    for step in range(9):
        joins = []
        if step in SERVED:
            prompt, seeds, steps, spec = SERVED[step]
            joins = [Join(prompt=prompt, seeds=seeds, width=32, height=32, steps=steps, guidance=None,
                          cache=parse_cache(spec) if spec else None)]
        for request, index, image in stepper.step(joins):
            images[request, index] = image
        reports |= stepper.reports
    return {"images": images, "reports": reports}


@pytest.mark.slow
def test_two_ranks_serve_cached_requests_as_one_process_and_agree():
    """Under u2 every rank holds every row's shard: each request equals its one-process `generate`
    run within `verify`'s tolerance, with the same steps skipped. Under b2 the ranks run different
    rows (a request's rows could move when others join or leave): the run completes, each request is
    answered once, both ranks count the same steps computed and skipped, and the images are again
    the one-process runs'."""
    from conftest import RANK_TIMEOUT_S

    from cocodiff.run.launch import spawn
    from cocodiff.models.presets import load_preset
    from cocodiff.serve.calls import Call, run_call

    pipe = load_preset("tiny-shapes")
    pipe.set_progress_bar_config(disable=True)
    alone, expected = {}, {}
    for request, (prompt, seeds, steps, spec) in SERVED.items():
        cache = apply_cache(pipe.transformer, parse_cache(spec), scheduler=pipe.scheduler) if spec else None
        alone[request] = run_call(pipe, Call(prompts=[prompt] * len(seeds), seeds=list(seeds), width=32, height=32,
                                             steps=steps, guidance=None))
        if cache is not None:
            expected[request] = cache.report() | {"lossy": True}
            cache.undo()
    ulysses = spawn(_serve_on_ranks, 2, "u2", timeout_s=RANK_TIMEOUT_S)
    assert ulysses[0]["reports"] == ulysses[1]["reports"] == expected
    for (request, index), image in ulysses[0]["images"].items():
        assert np.abs(image - alone[request][index]).max() < 1e-4, (request, index)
    batch = spawn(_serve_on_ranks, 2, "b2", timeout_s=RANK_TIMEOUT_S)
    assert batch[0]["reports"] == batch[1]["reports"] == expected
    assert sorted(batch[0]["images"]) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    differences = {key: float(np.abs(image - alone[key[0]][key[1]]).max()) for key, image in batch[0]["images"].items()}
    # Measured: every image within 2e-5 of its one-process run here (a step cached or not differs
    # by less on these 32x32 images); the uncached request beside cached ones is its own run.
    assert max(differences.values()) < 1e-4, differences


def test_per_request_batching_runs_a_call_under_its_cache_then_undoes_it():
    """Pipelines the stepper does not know (tiny-sd3) batch per request: requests with different
    caches never share a call, and a call runs under its cache installed for that call only."""
    from dataclasses import replace

    from cocodiff.models.presets import load_preset
    from cocodiff.serve.caching import Caching
    from cocodiff.serve.calls import Call, run_call
    from cocodiff.serve.scheduler import Work

    scheduler = Scheduler(max_queue=8, max_batch=4, window_s=0)
    for spec in ("taylorseer", None, "taylorseer"):
        scheduler.submit(Work(prompt="a", width=32, height=32, steps=3, cache=parse_cache(spec) if spec else None))
    assert [len(scheduler.next_batch(0).works) for _ in range(2)] == [2, 1]  # the cached pair, then the other
    pipe = load_preset("tiny-sd3")
    pipe.set_progress_bar_config(disable=True)
    call = Call(prompts=["a red circle"], seeds=[0], width=32, height=32, steps=4, guidance=None,
                cache=parse_cache("taylorseer:N2W1"))
    plain = run_call(pipe, replace(call, cache=None))
    with Caching().call(pipe, call) as cache:
        cached = run_call(pipe, call)
    assert cache.report()["skipped_steps"] > 0 and not np.array_equal(cached, plain)
    assert np.array_equal(run_call(pipe, replace(call, cache=None)), plain)  # the blocks are their own again


@pytest.mark.parametrize("model, refused", [("tiny-zimage", True), ("tiny-flux2", False), ("tiny-wan", False)])
def test_a_preset_that_has_no_blocks_to_cache_refuses_request_caches_before_it_loads(model, refused):
    """The server's refusal of request caches comes from the preset's declaration (a 400 before the
    queue, as `--compile`'s), known before the ranks load anything; FLUX.2 and Wan cache."""
    from cocodiff.config.parallel import ParallelConfig
    from cocodiff.run.spec import GenerateSpec
    from cocodiff.serve.ranks import _cache_refused

    reason = _cache_refused(GenerateSpec(model=model, parallel=ParallelConfig()))
    assert (reason is not None) == refused
    if refused:
        assert "ZImageTransformer2DModel" in reason and "\n" not in reason
