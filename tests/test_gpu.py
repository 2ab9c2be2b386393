"""The GPU suite: what one CUDA device can check (`pytest -m gpu`; skipped without one).

One GPU cannot host two NCCL ranks, so the engine's multi-rank paths run as rank 0 of torch's
`fake` process group on real CUDA tensors (collectives move nothing; every kernel, layout and
sync is real), and end to end as several gloo ranks sharing the GPU. Figures go to the JSON named
by COCODIFF_GPU_JSON (default docs/results/gpu-<device>.json), with the GPU named; every time is
from CUDA events or a synchronized host clock.

    kernels   SDPA backends at the engine's layouts (FLUX's fused Q/K halves, SD3.5 Large's shards)
    ring      ring attention's block kernels at real shapes: time, peak memory, error vs fp32,
              against the score-matrix path it replaced
    placement every family x plan x exchange on CUDA with torch.cuda.set_sync_debug_mode("error")
    every_rank  every rank of each world (2 to 12) computing on the GPU in turn, on a `cuda:fake`
              group, its records checked against the other ranks' (tests/every_rank.py), and
              the host syncs of each call counted by where they are
    v_first_cublas  V-First's V told by values in bf16 on cuBLAS, as in fp32 on the CPU
    attention_backends  every installed backend of diffusers' dispatcher per call at FLUX.1-dev's
              shapes (`--attention-backend`), with its error against fp32
    numerics  is a bf16 Linear / SDPA on token or head shards bitwise the whole? (verify's tolerance)
    model     a FLUX.1-dev-config transformer (random bf16 weights): device vs host time per call,
              one GPU and rank 0 of fake 8/16/24-rank worlds per plan
    vae       FLUX VAE decode peak memory and time at 1024/2048/4096, against footprint's estimate

`scripts/device_check.sh` runs this suite and a GPU training of tiny-shapes in one call.

Not here: several gloo ranks sharing the GPU (gloo's point-to-point sends fail on CUDA tensors:
"writev: Bad address", torch 2.11), so no multi-rank run on one GPU; docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from every_rank import call_site
from test_fake_device import FLUX_DEV

from cocodiff.engine.families.sample_inputs import forward_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU suite needs a CUDA device (none visible)"),
]

RESULTS: dict = {}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def results_file():
    """After every test, the figures so far (a run cut short keeps what it measured)."""
    name = torch.cuda.get_device_name(0)
    RESULTS.setdefault("device", {
        "name": name, "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "clock": "cuda events",
    })
    yield
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    path = Path(os.environ.get("COCODIFF_GPU_JSON", ROOT / "docs" / "results" / f"gpu-{slug}.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RESULTS, indent=1) + "\n")


def cuda_ms(fn, repeat: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of `fn()` on the device (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def peak_extra_bytes(fn) -> int:
    """Peak device memory `fn()` allocates beyond what was held before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


# -- kernels ---------------------------------------------------------------------------------------

def _layouts():
    """(name, q, k, v) at the layouts the engine hands SDPA, bf16."""
    dev, bf16 = "cuda", torch.bfloat16
    out = []
    for res, tokens in ((1024, 4096 + 512), (2048, 16384 + 512)):
        qk = torch.randn(1, 3, tokens, 256, device=dev, dtype=bf16)  # u8: 3 of 24 heads, Q and K fused on the last dim
        out.append((f"flux-{res}-u8-fused-qk", qk[..., :128], qk[..., 128:], torch.randn(1, 3, tokens, 128, device=dev, dtype=bf16)))
    sd3 = [torch.randn(2, 5, 4429, 64, device=dev, dtype=bf16) for _ in range(3)]  # SD3.5 Large u8 (38 heads), CFG batch
    out.append(("sd35l-1024-u8", *sd3))
    return out


def test_kernels_at_the_engines_layouts():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = {}
    for name, q, k, v in _layouts():
        row = {"shape": list(q.shape), "q_strides": list(q.stride())}
        names = {int(value): name for name, value in SDPBackend.__members__.items()}
        row["default"] = names.get(int(torch._fused_sdp_choice(q, k, v)), "unknown")
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel([backend]):
                    row[f"{backend.name.lower()}_ms"] = round(cuda_ms(lambda: F.scaled_dot_product_attention(q, k, v)), 3)
            except RuntimeError as error:
                row[f"{backend.name.lower()}_ms"] = f"unusable: {str(error).splitlines()[0][:120]}"
        rows[name] = row
    RESULTS["kernels"] = rows
    assert all(row["default"] != "MATH" for row in rows.values()), rows


# -- ring attention --------------------------------------------------------------------------------

RING_CASES = [  # (name, heads per rank, tokens per chunk, ring degree): FLUX.1 (24 heads, 512 text tokens)
    ("flux-1024-u24r2", 1, (4096 + 512) // 2, 2),
    ("flux-2048-u8r2", 3, (16384 + 512) // 2, 2),
    ("flux-2048-u1r8", 24, (16384 + 512) // 8, 8),
    ("flux-4096-u24r4", 1, (65536 + 512) // 4, 4),
]


def _score_matrix_block(q, k, v):
    """The ring block as it was before the fused kernels: an fp32 (Sq, Sk) score matrix."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.float()
    return out, lse


def _ring_layer(block_fn, q, ks, vs):
    from cocodiff.engine.attention.ring import merge

    out = lse = None
    for k, v in zip(ks, vs):
        part = block_fn(q, k, v)
        out, lse = part if out is None else merge(out, lse, *part)
    return out


@pytest.mark.parametrize("name, heads, chunk, ring", RING_CASES)
def test_ring_blocks_at_real_shapes(name, heads, chunk, ring):
    from cocodiff.engine.attention import ring as ring_module
    from cocodiff.engine.attention.ring import attend_block, block_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, chunk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ks = [torch.randn(1, heads, chunk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(ring)]
    vs = [torch.randn(1, heads, chunk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(ring)]
    row = {"kernel": block_kernel(q, False), "q": list(q.shape), "ring": ring}
    row["fused_ms"] = round(cuda_ms(lambda: _ring_layer(attend_block, q, ks, vs)), 3)
    row["fused_peak_mib"] = round(peak_extra_bytes(lambda: _ring_layer(attend_block, q, ks, vs)) / 2**20, 1)
    k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    exact = F.scaled_dot_product_attention(q.float(), k_all.float(), v_all.float())  # fp32 one-shot
    for kernel in ("cudnn", "flash", "efficient"):  # each fused kernel forced: time and error
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ring_module, "block_kernel", lambda *_: kernel)
            try:
                row[f"{kernel}_ms"] = round(cuda_ms(lambda: _ring_layer(attend_block, q, ks, vs)), 3)
                row[f"{kernel}_max_err_vs_fp32"] = float((_ring_layer(attend_block, q, ks, vs) - exact).abs().max())
            except RuntimeError as error:
                row[f"{kernel}_ms"] = f"unusable: {str(error).splitlines()[0][:120]}"
    try:
        row["score_matrix_ms"] = round(cuda_ms(lambda: _ring_layer(_score_matrix_block, q, ks, vs), repeat=3, warmup=1), 3)
        row["score_matrix_peak_mib"] = round(peak_extra_bytes(lambda: _ring_layer(_score_matrix_block, q, ks, vs)) / 2**20, 1)
    except torch.OutOfMemoryError:
        row["score_matrix_ms"] = "out of memory"
    torch.cuda.empty_cache()
    one_shot = F.scaled_dot_product_attention(q, k_all, v_all).float()  # bf16 one-shot (flash)
    fused = _ring_layer(attend_block, q, ks, vs)
    row["fused_max_err_vs_fp32"] = float((fused - exact).abs().max())
    row["one_shot_bf16_max_err_vs_fp32"] = float((one_shot - exact).abs().max())
    RESULTS.setdefault("ring", {})[name] = row
    assert row["fused_max_err_vs_fp32"] <= 2 * row["one_shot_bf16_max_err_vs_fp32"] + 1e-3, row
    assert row["fused_peak_mib"] < 0.25 * heads * chunk * chunk * 4 / 2**20 * ring + 64, row  # never a score matrix


def test_ring_masked_blocks_on_the_efficient_kernel():
    """A key mask (Qwen-Image's text padding) with one block fully masked for one item: the
    efficient kernel's padded log-sum-exp is sliced, nothing is NaN, the result is exact."""
    from cocodiff.engine.attention.ring import attend_block, block_kernel, merge

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 4, 1500, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 4, 1500, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.rand(2, 1500, device="cuda", generator=g) > 0.3
    mask[1, :700] = False
    out = lse = None
    for sl in (slice(0, 700), slice(700, 1500)):
        part = attend_block(q, k[:, :, sl], v[:, :, sl], mask[:, sl])
        out, lse = part if out is None else merge(out, lse, *part)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :])
    err = float((out - exact).abs().max())
    RESULTS["ring_masked"] = {"kernel": block_kernel(q, True), "max_err_vs_fp32": err, "finite": bool(torch.isfinite(out).all())}
    assert torch.isfinite(out).all() and err < 3e-2


# -- placement and syncs: every plan on CUDA tensors -----------------------------------------------

def _fake_world(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("cpu:fake,cuda:fake", store=FakeStore(), rank=0, world_size=world)


@pytest.mark.timeout(540)
def test_every_plan_on_cuda_without_host_syncs(monkeypatch):
    import test_fake_device as harness

    failures, runs = [], 0
    for world in (2, 8, 24):
        _fake_world(world)
        try:
            for model in harness.FAMILIES:
                for plan in harness.PLANS[world]:
                    for comm, v_first in harness.EXCHANGES if world > 2 else harness.EXCHANGES[:2]:
                        runs += 1
                        transformer, inputs = harness._prepare(model, world, plan, comm, v_first, "cuda", torch.bfloat16)
                        torch.cuda.synchronize()
                        torch.cuda.set_sync_debug_mode("error")  # the forward alone: loading copies from the host
                        try:
                            with torch.no_grad():
                                transformer(**inputs, return_dict=False)
                        except Exception as error:  # noqa: BLE001 - recorded, then asserted below
                            # Where it happened: the innermost frame outside torch, ours or diffusers'.
                            frames = [f for f in traceback.extract_tb(error.__traceback__) if "/torch/" not in f.filename]
                            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
                            owner = "engine" if frames and "/cocodiff/" in frames[-1].filename else "diffusers"
                            failures.append({"case": f"{model} {world} {plan} {comm}{'+vfirst' if v_first else ''}",
                                             "error": str(error).splitlines()[0][:200], "where": where, "in": owner})
                        finally:
                            torch.cuda.set_sync_debug_mode(0)
                            torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()
    engine = [f for f in failures if f["in"] == "engine"]
    RESULTS["placement"] = {"runs": runs, "engine_syncs": engine, "diffusers_syncs": sorted({f["where"] for f in failures}
                            - {f["where"] for f in engine}), "diffusers_sync_runs": len(failures) - len(engine)}
    assert not engine, engine[:5]


# -- every rank computing on the device (the every-rank NCCL stand-in on CUDA tensors) --------------

def _every_rank_cases() -> list[tuple[str, str, str, str, dict]]:
    """(model, plan, levels, exchange, options): FLUX.1 under every plan shape of the stand-in, the
    families past it under one of each axis, a stage with per-layer marks (`bench e2e`'s timeline),
    fp8 across nodes, displaced patches and V-Major at a fixed share. Not the features whose agreed
    decisions read values (step caches, V-Major's adaptive share, the trials of `auto`): a fake
    group agrees nothing, so each rank would decide alone."""
    from test_every_rank import CASES, DISPATCHED, SOME

    plain = {"tiny-flux": CASES, **{m: [c for c in CASES if c[0] in SOME] for m in ("tiny-sd3", "tiny-qwen-image", "tiny-wan",
             "tiny-hunyuanvideo15", *DISPATCHED)}, "tiny-zimage": [c for c in CASES if c[0] in SOME and not set(c[0]) & set("cbp")]}
    cases = [(model, *case, {}) for model, chosen in plain.items() for case in chosen if (model, case[0]) != ("tiny-ltx", "u4r3")]
    return cases + [
        ("tiny-minimax-h3", "u4", "node=2,rank=2", "tapa", {}), ("tiny-minimax-h3", "p2u2", "node=2,rank=2", "flat", {}),
        ("tiny-ltx2", "u4", "node=2,rank=2", "tapa", {}), ("tiny-ltx2", "p2u2", "node=2,rank=2", "flat", {}),
        ("tiny-flux", "p2u2", "node=2,rank=2", "tapa", {"timeline": True}),
        ("tiny-flux", "u4r2", "node=2,rank=4", "tapa", {"wire": "node=fp8"}),
        ("tiny-flux", "p2u2", "node=2,rank=2", "flat", {"wire": "node=fp8"}),
        ("tiny-flux", "p2u2", "node=2,rank=2", "flat", {"pipe_patches": 2}),
        ("tiny-flux", "u4", "node=2,rank=2", "tapa", {"v_major": "constant:0.5"}),  # a fixed share: no agreed decision
    ]


ONCE_A_CALL = ("timestep_value",)
"""The engine's host reads by design, once a call at the transformer's entry: V-Major's timestep."""


@contextlib.contextmanager
def host_syncs(device: str, sites: Counter):
    """Inside: every synchronizing CUDA call (torch's sync debug mode, as warnings) counted in
    `sites` by where it was made (every_rank.py `call_site`). Nothing on another device."""
    if device != "cuda":
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return shown(message, category, filename, lineno, file, line)
            sites[call_site(traceback.extract_stack()[:-1]) or "?"] += 1

        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


def every_rank_on(device: str, cases: list | None = None) -> dict:
    """The every-rank stand-in (tests/every_rank.py) with each rank's model and inputs on `device`
    in bf16, its fake group bound to `device` alone (a CPU tensor in a collective fails, as on NCCL):
    each rank of each world computes its two calls in turn, the ranks' records are checked against
    each other, and the host syncs of each rank's calls are counted by where they are: its first
    (where a module settles what it decides by values: V-First's V, token counts, a mask's form)
    and its second (`engine_syncs`: the engine's, none expected; tests/test_every_rank.py checks
    the same on the CPU)."""
    from every_rank import check, simulate
    from test_every_rank import _calls, _world

    cases = cases if cases is not None else _every_rank_cases()
    first, later = Counter(), Counter()
    calls = iter(range(10**6))
    mismatches, ranks, started = {}, 0, time.perf_counter()
    for model, plan, levels, comm, options in cases:
        run = _calls(model, plan, levels, comm, device=device, **options,  # each rank's two calls in turn
                     watch=lambda: host_syncs(device, later if next(calls) % 2 else first))
        records = simulate(_world(levels), run, device=device)
        ranks += len(records)
        problems = check(records)
        if problems:
            mismatches[f"{model} {plan} {levels} {comm} {options or ''}".strip()] = problems[:3]
    return {"cases": len(cases), "ranks": ranks, "mismatches": mismatches, "s": round(time.perf_counter() - started, 1),
            "engine_syncs": {s: n for s, n in later.items() if s.startswith("cocodiff/") and s.split()[-1] not in ONCE_A_CALL},
            "once_a_call": {s: n for s, n in later.items() if s.split()[-1] in ONCE_A_CALL},
            "other_syncs": {s: n for s, n in later.items() if not s.startswith("cocodiff/")},
            "first_call_syncs": dict(first)}


@pytest.mark.timeout(540)
def test_every_rank_on_cuda_tensors():
    """Every rank of each world (2 to 12 ranks) computing on the GPU: the same groups, collectives
    and sends on every rank (0 mismatches), and no host sync made by the engine in a call after a
    rank's first."""
    RESULTS["every_rank"] = row = every_rank_on("cuda")
    assert not row["mismatches"], row["mismatches"]
    assert not row["engine_syncs"], row["engine_syncs"]


V_FIRST_MODELS = ["tiny-flux2", "tiny-ltx", "tiny-wan", "tiny-hunyuanvideo15", "tiny-ltx2", "tiny-minimax-h3", "tiny-cogview4"]
"""Families whose stock processors V-First reaches through the dispatcher, where which projection
is V is told by its values on a module's first call (engine/attention/dispatch.py `_settle`)."""


def v_first_constructions(model: str, device: str, dtype: torch.dtype) -> dict[str, str | None]:
    """How each attention module's V was found to be built, on rank 0 of a fake 2-rank world under
    `u2` with V-First, the preset's transformer and first call on `device` in `dtype`."""
    import copy
    from types import SimpleNamespace

    from every_rank import simulate
    from test_every_rank import _model

    from cocodiff import ParallelConfig, parallelize
    from cocodiff.config.plan import parse_plan
    from cocodiff.distributed.topology import Topology

    base, inputs = _model(model, device, dtype)
    found: dict[str, str | None] = {}

    def run(_rank: int) -> None:
        transformer = copy.deepcopy(base)
        topology = Topology.from_env(device=torch.device(device))
        parallel = parallelize(transformer, ParallelConfig(plan=parse_plan("u2"), v_first=True), topology,
                               scheduler=SimpleNamespace(timesteps=torch.arange(1), step_index=None))
        with torch.no_grad():
            transformer(**inputs)
        found.update({path: how[0] if how else None for path, how in parallel.dispatched.construction.items()})

    (record,) = simulate(2, run, ranks=[0], device=device)
    assert record.error is None, f"{model}: {record.error}"
    return found


@pytest.mark.timeout(300)
def test_v_first_finds_v_on_cublas_in_bf16():
    """V-First tells V by values on a module's first call: in bf16 on cuBLAS (two GEMMs whose last
    bits differ: V's rows alone and the fused projection's) it finds the V it finds in fp32 on the CPU."""
    rows = {}
    for model in V_FIRST_MODELS:
        gpu = v_first_constructions(model, "cuda", torch.bfloat16)
        cpu = v_first_constructions(model, "cpu", torch.float32)
        rows[model] = {"found": sum(how is not None for how in gpu.values()), "modules": len(gpu),
                       "as_on_the_cpu": gpu == cpu, **({} if gpu == cpu else {"cuda_bf16": gpu, "cpu_fp32": cpu})}
    RESULTS["v_first_cublas"] = rows
    assert all(row["as_on_the_cpu"] for row in rows.values()), rows


# -- attention backends at FLUX.1-dev's shapes ------------------------------------------------------

FLUX_DEV_ATTENTION = {"1024-u1": (24, 4096 + 512), "1024-u8": (3, 4096 + 512), "1024-u24": (1, 4096 + 512),
                      "2048-u8": (3, 16384 + 512)}
"""(heads, tokens) of one rank's attention call at FLUX.1-dev's 1024² and 2048², by Ulysses degree
(24 heads of 128; 512 text tokens)."""


def backend_times(device: str, shapes: dict[str, tuple[int, int]], timed: Callable[[Callable[[], Any]], float]) -> dict:
    """Every backend of diffusers' dispatcher that is installed (`--attention-backend NAME`), one
    call of (1, heads, tokens, 128) bf16 q, k, v at each of `shapes`: milliseconds (`timed`) and the
    largest difference from fp32 attention; what did not run, in its own words."""
    from cocodiff.engine.attention.backends import _installed, _names, kernel

    rows: dict[str, Any] = {}
    g = torch.Generator(device=device).manual_seed(3)
    for name in _names():
        if name.endswith("_hub"):
            continue
        missing = _installed(name)
        if missing is not None:
            rows[name] = f"not installed: {missing[:120]}"
            continue
        row = rows[name] = {}
        for label, (heads, tokens) in shapes.items():
            q, k, v = (torch.randn(1, heads, tokens, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
            try:
                attend, function = kernel(name)
                with torch.no_grad():
                    out = attend(q, k, v, None)
                    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
                    row[label] = {"ms": round(timed(lambda: attend(q, k, v, None)), 3), "function": function,
                                  "max_err_vs_fp32": float((out.float() - exact).abs().max())}
            except Exception as error:  # noqa: BLE001 - recorded: which backend runs which call is the figure
                row[label] = f"unusable: {str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__}"
    return rows


@pytest.mark.timeout(300)
def test_attention_backends_at_flux_dev_shapes():
    """Each installed backend per call at FLUX.1-dev's shapes (CUDA events), with its error against
    fp32: what `--attention-backend` chooses between on this GPU."""
    RESULTS["attention_backends"] = rows = backend_times("cuda", FLUX_DEV_ATTENTION, cuda_ms)
    ran = [name for name, row in rows.items() if isinstance(row, dict)
           and any(isinstance(cell, dict) for cell in row.values())]
    assert "native" in ran, rows
    assert all(cell["max_err_vs_fp32"] < 3e-2 for name in ran for cell in rows[name].values() if isinstance(cell, dict)), rows


# -- bf16 numerics of sharding ---------------------------------------------------------------------

def test_bf16_shards_against_the_whole():
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 4608, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    linear = torch.nn.Linear(3072, 9216, device="cuda", dtype=torch.bfloat16)
    whole = linear(x)
    rows = {}
    for parts in (8, 24):
        shards = torch.cat([linear(s) for s in x.tensor_split(parts, dim=1)], dim=1)
        rows[f"linear_tokens_1/{parts}"] = {"bitwise": bool(torch.equal(shards, whole)),
                                            "max_abs_diff": float((shards - whole).abs().max())}
    q, k, v = (torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v)
    heads = torch.cat([F.scaled_dot_product_attention(q[:, h : h + 3], k[:, h : h + 3], v[:, h : h + 3]) for h in range(0, 24, 3)], 1)
    rows["sdpa_heads_3_of_24"] = {"bitwise": bool(torch.equal(heads, whole)), "max_abs_diff": float((heads - whole).abs().max())}
    RESULTS["numerics"] = rows


# -- a FLUX.1-dev-size transformer: host vs device time per call -----------------------------------

def _flux_dev() -> tuple[torch.nn.Module, dict]:
    """FLUX.1-dev's transformer (its config, random bf16 weights: 24 GB) on the GPU, and one
    1024x1024 call's arguments."""
    from diffusers import FluxTransformer2DModel

    torch.set_default_dtype(torch.bfloat16)  # made in bf16: 24 GB, not 48 first
    try:
        with torch.device("cuda"):
            transformer = FluxTransformer2DModel(**FLUX_DEV).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    inputs = forward_inputs(transformer, "cuda", torch.bfloat16, h=64, w=64, text=512, batch=1)
    return transformer, {**inputs, "return_dict": False}


def _call_times(transformer, inputs, repeat: int = 5) -> dict:
    """Host time to enqueue one call against its device time (CUDA events), medians, ms."""
    with torch.no_grad():
        for _ in range(2):
            transformer(**inputs)
        torch.cuda.synchronize()
        host, device = [], []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            transformer(**inputs)
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            device.append(start.elapsed_time(end))
    host_ms, device_ms = sorted(host)[repeat // 2], sorted(device)[repeat // 2]
    return {"host_ms": round(host_ms, 2), "device_ms": round(device_ms, 2), "cpu_bound": host_ms > 0.9 * device_ms}


@pytest.mark.timeout(540)
def test_flux_dev_config_host_and_device_time(monkeypatch):
    from cocodiff import ParallelConfig, parallelize
    from cocodiff.config.levels import parse_levels
    from cocodiff.config.plan import parse_plan
    from cocodiff.distributed.topology import Topology

    transformer, inputs = _flux_dev()
    rows = {"params_b": round(sum(p.numel() for p in transformer.parameters()) / 1e9, 2)}
    rows["1024-world1"] = _call_times(transformer, inputs)
    cases = {8: [("u8", "flat", True), ("u8", "flat", False)],
             16: [("u16", "flat", True), ("u16", "tapa", True), ("u8r2", "flat", True)],
             24: [("u24", "flat", True), ("u24", "tapa", True), ("u24", "flat", False)]}
    for world, plans in cases.items():
        _fake_world(world)
        try:
            for plan, comm, v_first in plans:
                levels = parse_levels(f"node={world // 8},rank=8") if comm == "tapa" else None
                topology = Topology.from_env(levels=levels, device=torch.device("cuda"))
                config = ParallelConfig(comm=comm, v_first=v_first, plan=parse_plan(plan))
                parallel = parallelize(transformer, config, topology)
                try:
                    rows[f"1024-world{world}-{plan}-{comm}{'+vfirst' if v_first else ''}"] = _call_times(transformer, inputs)
                finally:
                    parallel.undo()
        finally:
            dist.destroy_process_group()
    RESULTS["model"] = rows


@pytest.mark.timeout(540)
def test_flux_dev_config_compiled_blocks(monkeypatch):
    """The same transformer under `--compile` (regional, functional collectives) as rank 0 of a
    fake 8-rank world, u8 flat with V-First: host and device time per call against eager."""
    from cocodiff import ParallelConfig, parallelize
    from cocodiff.config.plan import parse_plan
    from cocodiff.distributed.topology import Topology

    transformer, inputs = _flux_dev()
    rows = {}
    _fake_world(8)
    try:
        for compiled in (False, True):
            topology = Topology.from_env(device=torch.device("cuda"))
            parallel = parallelize(transformer, ParallelConfig(plan=parse_plan("u8"), compile=compiled), topology)
            try:
                start = time.perf_counter()
                with torch.no_grad():
                    transformer(**inputs)  # compiles (one eager call per layout counts its bytes, then compiled)
                    transformer(**inputs)
                torch.cuda.synchronize()
                row = _call_times(transformer, inputs)
                row["first_calls_s"] = round(time.perf_counter() - start, 1)
                rows["1024-world8-u8-flat+vfirst" + ("-compiled" if compiled else "")] = row
            finally:
                parallel.undo()
    finally:
        dist.destroy_process_group()
    RESULTS.setdefault("model_compiled", {}).update(rows)


# -- VAE decode ------------------------------------------------------------------------------------

FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False)


def test_vae_decode_peak_memory():
    from diffusers import AutoencoderKL

    from cocodiff.footprint.estimate import DECODE_FACTOR

    with torch.device("cuda"):
        vae = AutoencoderKL(**FLUX_VAE).to(torch.bfloat16).eval()
    rows = {}
    for res in (1024, 2048, 4096):
        z = torch.randn(1, 16, res // 8, res // 8, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            try:
                ms = cuda_ms(lambda: vae.decode(z).sample, repeat=1, warmup=1)
                peak = peak_extra_bytes(lambda: vae.decode(z).sample)
            except torch.OutOfMemoryError:
                rows[str(res)] = "out of memory"
                continue
        estimate = res * res * 128 * 2 * DECODE_FACTOR
        rows[str(res)] = {"ms": round(ms, 1), "peak_gib": round(peak / 2**30, 2), "footprint_gib": round(estimate / 2**30, 2)}
        torch.cuda.empty_cache()
    RESULTS["vae"] = rows
