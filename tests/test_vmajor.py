"""V-Major: selective inter-node exchange on 4 and 8 gloo ranks, and its schedules."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S
from model_cases import FAMILIES, HEIGHT, WIDTH, run_case

from cocodiff import ParallelConfig, UsageError, parallelize
from cocodiff.distributed.comm import (
    AutoExchange,
    CommStats,
    FlatExchange,
    TapaExchange,
    split_sizes,
)
from cocodiff.run.launch import spawn
from cocodiff.models.presets import load_pipeline, pipeline_inputs
from cocodiff.distributed.topology import Topology
from cocodiff.engine.vmajor import Schedule, VMajor, VMajorCodec, parse_schedule


def test_schedules():
    linear = parse_schedule("linear")
    assert [linear.ratio_at(s, 4) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert parse_schedule("constant:0.5").ratio_at(0, 8) == 0.0  # the first step always sends in full
    assert parse_schedule("constant:0.5").ratio_at(3, 8) == 0.5
    warm = parse_schedule("warmup:2,linear")
    assert [round(warm.ratio_at(s, 6), 3) for s in range(6)] == [0.0, 0.0, 0.2, 0.4, 0.6, 0.8]
    assert not parse_schedule("off").lossy and not parse_schedule("constant:0").lossy and linear.lossy
    for bad in ("sometimes", "constant:1.5", "warmup:x,linear"):
        with pytest.raises(UsageError, match="--v-major"):
            parse_schedule(bad)
    with pytest.raises(UsageError, match="use --comm tapa or flat, not auto"):
        ParallelConfig(comm="auto", v_major="linear")


def test_config_holds_the_schedule_parsed_once():
    """Text is parsed into a `Schedule` at construction; reports print it back as it was written."""
    for text in ("off", "linear", "constant:0.5", "adaptive:0.05", "warmup:2,linear", "Constant:0.50"):
        config = ParallelConfig(comm="tapa", v_major=text)
        assert isinstance(config.v_major, Schedule) and config.schedule == parse_schedule(text)
        assert str(config.v_major) == text
        assert config.lossy == (text != "off")
    given = parse_schedule("warmup:1,linear")
    assert ParallelConfig(comm="flat", v_major=given).v_major is given
    assert str(Schedule("constant", 0.25)) == "constant:0.25"  # built in code: the canonical text
    with pytest.raises(UsageError, match="--v-major"):
        ParallelConfig(comm="tapa", v_major="sometimes")


def test_exchanges_are_rebuilt_with_their_state_not_mutated():
    """`with_state` (what `parallelize` does with an exchange it is given) returns a new exchange
    with the stats and codec, sharing the rest (auto: its calibration); the original is unchanged."""
    topology = SimpleNamespace(nodes=2, ranks_per_node=2, hierarchical=True, active_levels=(0, 1), device=torch.device("cpu"))
    stats, codec = CommStats(), VMajorCodec(VMajor(parse_schedule("linear")))
    for exchange in (FlatExchange(topology), TapaExchange(topology)):
        copy = exchange.with_state(stats, codec)
        assert type(copy) is type(exchange) and copy is not exchange
        assert (copy.topology, copy.stats, copy.codec) == (topology, stats, codec)
        assert (exchange.stats, exchange.codec) == (None, None)
    auto = AutoExchange(topology, None)
    copy = auto.with_state(stats)
    assert copy is not auto and copy.trials is auto.trials  # a choice made once holds for every copy
    assert copy.stats is stats and copy.current.stats is stats and auto.current.stats is None
    with pytest.raises(ValueError, match="no codec"):
        auto.with_state(stats, codec)


def selective_round_trip(ranks_per_node: int, dtype_name: str, exchange_name: str = "tapa") -> list:
    """Step 0 sends all; at step 1 only `changed` tokens per rank differ from step 0 and the
    schedule keeps at least that many per piece, so the receiver's view must be exact again;
    at step 2 nothing is sent for the tokens that did not change, and the caches' bytes are
    the tensors held."""
    dtype = getattr(torch, dtype_name)
    topology = Topology.from_env(ranks_per_node)
    P, r = topology.world_size, topology.rank
    vm = VMajor(parse_schedule("constant:0.5"))
    stats = CommStats()
    exchange = {"tapa": TapaExchange, "flat": FlatExchange}[exchange_name](topology, stats, VMajorCodec(vm))
    failures = []
    B, S, H, D = 2, 6 * P + 3, P + 1, 4  # uneven tokens and heads
    seq, heads = split_sizes(S, P), split_sizes(H, P)
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(B, S, H, D, generator=g).to(dtype)
    x1 = x0.clone()
    # In every rank's shard, change at most half of the tokens (the ones vm.keep will send).
    for rank in range(P):
        start = sum(seq[:rank])
        x1[:, start : start + seq[rank] // 2] += 1.0
    def mine(x):
        return x[:, sum(seq[:r]) : sum(seq[: r + 1])]
    def expected(x):
        return x[:, :, sum(heads[:r]) : sum(heads[: r + 1])].permute(0, 2, 1, 3)
    sent = []
    for step, x in enumerate((x0, x1, x1)):
        vm.begin_call(step, 3, 1000.0 - step)
        stats.reset()
        got = exchange.seq_to_head(mine(x), seq, ("layer0", "v", vm.call)).wait()
        if not torch.equal(got, expected(x)):
            failures.append(("round trip", step, dtype_name, (got - expected(x)).abs().max().item()))
        sent.append(stats.other_node_bytes["a2a_in"])
    # Selective steps send about half the inter-node rows (plus their indices); intra-node is unchanged.
    if not sent[1] < 0.75 * sent[0] or sent[2] != sent[1]:
        failures.append(("inter-node bytes per step", sent))
    held = sum(t.numel() * t.element_size() for t in (*vm.mirrors.values(), *vm.caches.values()))
    if vm.cache_bytes() != held or held == 0:
        failures.append(("cache bytes", vm.cache_bytes(), held))
    # Summed over ranks, mirrors + caches are twice the bytes crossing nodes in one exchange,
    # which is what admission planned per rank.
    total = torch.tensor([float(vm.cache_bytes())])
    dist.all_reduce(total)
    if total.item() != vm.planned_bytes * P:
        failures.append(("planned", total.item(), vm.planned_bytes * P))
    return failures


@pytest.mark.parametrize("nproc, ranks_per_node", [(4, 2), pytest.param(8, 2, marks=pytest.mark.slow),
                                                    pytest.param(8, 4, marks=pytest.mark.slow)], ids=["2x2", "4x2", "2x4"])
def test_selective_exchange_round_trips(nproc, ranks_per_node):
    results = spawn(selective_round_trip, nproc, ranks_per_node, "float32", timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * nproc
    results = spawn(selective_round_trip, nproc, ranks_per_node, "bfloat16", timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * nproc


@pytest.mark.parametrize("nproc, ranks_per_node", [(4, 2), (4, 1)], ids=["2x2", "4x1"])
def test_selective_flat_exchange_round_trips(nproc, ranks_per_node):
    """The flat exchange's inter-node pieces, selectively (also with one rank per node)."""
    results = spawn(selective_round_trip, nproc, ranks_per_node, "float32", "flat", timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * nproc


def capped_layers(cap_layers: float) -> tuple[int, int, int]:
    """Two layers under a cap worth `cap_layers` layers: only the ones that fit cache."""
    topology = Topology.from_env(2)
    vm = VMajor(parse_schedule("linear"))
    exchange = TapaExchange(topology, None, VMajorCodec(vm))
    P, r = topology.world_size, topology.rank
    seq = split_sizes(10, P)
    x = torch.randn(1, seq[r], P, 8, generator=torch.Generator().manual_seed(r))
    vm.begin_call(0, 2, 1.0)
    exchange.seq_to_head(x, seq, ("a", "v", 0)).wait()
    per_layer = vm.planned_bytes
    vm.max_memory = int(cap_layers * per_layer)
    vm.clear()
    vm.begin_call(0, 2, 1.0)
    for layer in ("a", "b"):
        exchange.seq_to_head(x, seq, (layer, "v", 0)).wait()
    return sum(vm.admitted.values()), vm.planned_bytes, vm.max_memory


def test_memory_cap_is_honoured():
    admitted, planned, cap = spawn(capped_layers, 4, 1.5, timeout_s=RANK_TIMEOUT_S)[0]
    assert admitted == 1 and planned <= cap


def run_models(schedule: str, comm: str = "tapa") -> dict:
    """Every family under `comm` + V-Major on V, Q and K: a bare forward and a 2-step pipeline run."""
    config = ParallelConfig(comm=comm, ranks_per_node=2, v_major=schedule, v_major_tensors="vqk")
    return {model: run_case(model, config) for model in FAMILIES}


def test_off_and_constant_zero_are_exact_and_lossy_runs_complete():
    exact = spawn(run_models, 4, "off", timeout_s=RANK_TIMEOUT_S)[0]
    zero = spawn(run_models, 4, "constant:0", timeout_s=RANK_TIMEOUT_S)[0]
    lossy = spawn(run_models, 4, "constant:0.9", timeout_s=RANK_TIMEOUT_S)[0]
    for model in exact:
        for output in ("forward", "latents", "image"):
            assert torch.equal(zero[model][output], exact[model][output]), (model, output)
        assert not torch.equal(lossy[model]["latents"], exact[model]["latents"])  # it did reuse something
        assert torch.isfinite(lossy[model]["image"]).all()
    flat = spawn(run_models, 4, "constant:0.9", "flat", timeout_s=RANK_TIMEOUT_S)[0]
    for model in exact:
        assert not torch.equal(flat[model]["latents"], exact[model]["latents"])
        assert torch.isfinite(flat[model]["image"]).all()


PERTURBATION = 0.5
"""Relative noise on every weight of the perturbed rank."""
DIVERGENT_EPS = 0.05
"""adaptive:EPS of the rank-divergent run. With these seeds the ranks' own errors at step 2 straddle
it in every family (each within 0.015 of it) when rank 1 is perturbed, and all stay under it when
no rank is."""


def run_divergent(schedule: str, perturb_rank: int, steps: int) -> dict:
    """Every family under TAPA + V-Major for `steps` steps, with `perturb_rank`'s transformer weights
    perturbed: the ranks' projections, the tokens each picks and the errors each measures differ.
    Returns per family the final latents, the cache ratio of every step and this rank's own
    relative error per step (before the all-reduce)."""
    config = ParallelConfig(comm="tapa", ranks_per_node=2, v_major=schedule, v_major_tensors="vqk")
    results = {}
    for model in FAMILIES:
        pipe, encoder = load_pipeline(model, seed=0)
        pipe.set_progress_bar_config(disable=True)
        if dist.get_rank() == perturb_rank:
            g = torch.Generator().manual_seed(99)
            with torch.no_grad():
                for weight in pipe.transformer.parameters():
                    weight.mul_(1.0 + PERTURBATION * torch.randn(weight.shape, generator=g))
        parallel = parallelize(pipe, config)
        latents = pipe(
            **pipeline_inputs(pipe, encoder, "a small green star"), height=HEIGHT, width=WIDTH, num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0), output_type="latent",
        ).images
        vm = parallel.ctx.vmajor
        results[model] = {"latents": latents, "ratios": list(vm.ratios), "local_errors": vm.step_errors()}
    return results


def test_rank_divergent_data_keeps_decisions_agreed():
    """One rank computes with different weights, so the ranks' own errors straddle the target:
    decided locally, the ratios (and message sizes) would differ and the collectives would
    desynchronize. Agreed through the all-reduce, every rank takes the same ratios, the run
    completes, and every rank ends with the same latents."""
    steps = 4
    ranks = spawn(run_divergent, 4, f"adaptive:{DIVERGENT_EPS}", 1, steps, timeout_s=RANK_TIMEOUT_S)
    for model in FAMILIES:
        ratios = [rank[model]["ratios"] for rank in ranks]
        assert all(r == ratios[0] for r in ratios), (model, ratios)
        assert len(ratios[0]) == steps and max(ratios[0]) > 0, (model, ratios[0])  # it did reuse
        # The case is the divergent one: at some step one rank's own error is over EPS, another's within it.
        local = [rank[model]["local_errors"] for rank in ranks]
        verdicts = {tuple(errors[s] > DIVERGENT_EPS for errors in local) for s in range(1, len(local[0]))}
        assert any(len(set(v)) > 1 for v in verdicts), (model, local)
        for rank in ranks[1:]:
            assert torch.equal(rank[model]["latents"], ranks[0][model]["latents"]), model


def adaptive_ratios(eps: float, drift: float) -> tuple[list[float], list[float]]:
    """Six steps of a selective exchange under adaptive:EPS whose inputs move by `drift` (relative)
    at every step, one rank's ten times larger: every rank must still choose the same ratios."""
    topology = Topology.from_env(2)
    P, r = topology.world_size, topology.rank
    vm = VMajor(parse_schedule(f"adaptive:{eps}"))
    vm.agree = lambda values: _sum_over_ranks(values)
    exchange = TapaExchange(topology, None, VMajorCodec(vm))
    seq = split_sizes(12 * P, P)  # 12 tokens per piece: a ratio of 1/6 reuses 2 of them
    g = torch.Generator().manual_seed(r)
    scale = 10.0 if r == 0 else 1.0
    x = torch.randn(1, seq[r], P, 8, generator=g) * scale
    for step in range(6):
        vm.begin_call(step, 6, 1000.0 - step)
        x = x + drift * scale * torch.randn(x.shape, generator=g)
        exchange.seq_to_head(x, seq, ("layer0", "v", vm.call)).wait()
    return vm.ratios, vm.step_errors()


def _sum_over_ranks(values: torch.Tensor) -> list[float]:
    t = values.to(torch.float64, copy=True)
    dist.all_reduce(t)
    return t.tolist()


def test_adaptive_schedule_agrees_and_backs_off():
    tight = spawn(adaptive_ratios, 4, 1e-3, 1.0, timeout_s=RANK_TIMEOUT_S)
    loose = spawn(adaptive_ratios, 4, 0.5, 0.01, timeout_s=RANK_TIMEOUT_S)
    assert all(ratios == tight[0][0] for ratios, _ in tight)  # one decision on every rank
    assert all(ratios == loose[0][0] for ratios, _ in loose)
    # Inputs that change as much as they are: any reuse misses EPS, so the ratio rises by 1/6 after
    # a step within it and falls back to 0 (a full step) after one that missed it.
    assert tight[0][0] == pytest.approx([0.0, 1 / 6, 0.0, 1 / 6, 0.0, 1 / 6])
    # Inputs that drift by 1% per step stay far within EPS = 0.5: the ratio keeps rising.
    assert loose[0][0] == pytest.approx([0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])
    assert 0 < max(loose[0][1]) < 0.5
    with pytest.raises(UsageError, match="adaptive:0"):
        parse_schedule("adaptive:0")
