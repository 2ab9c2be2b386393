"""The Ulysses exchange, the output gather and the byte counters, on 2 and 4 gloo ranks.

Every rank builds the same full tensor from a seed, takes its shard, and checks what the
collective returns against slicing the full tensor in one process: the exchange only moves data,
so equality is bitwise.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S

from cocodiff.distributed.comm import (
    CommStats,
    FlatExchange,
    TapaExchange,
    make_exchange,
    split_sizes,
)
from cocodiff.run.launch import spawn
from cocodiff.distributed.topology import Topology

# (B, S, H, D): odd sequence lengths, head counts that the degree does not divide, fewer tokens than ranks.
SHAPES = [(1, 16, 4, 8), (2, 7, 6, 3), (1, 3, 5, 2), (3, 1, 4, 1), (1, 267, 6, 16), (2, 9, 38, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _full(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def expected_bytes(topology, tapa, B, seq, heads, D, item) -> tuple[int, int]:
    """(same-node, other-node) bytes this rank sends in seq_to_head."""
    r, G, K, n, l = topology.rank, topology.ranks_per_node, topology.nodes, topology.node, topology.local_rank
    if not tapa:  # its shard's slice for every other rank's heads
        sent = {dst: B * seq[r] * heads[dst] * D * item for dst in range(topology.world_size) if dst != r}
        same = sum(b for dst, b in sent.items() if topology.node_of(dst) == n)
        return same, sum(sent.values()) - same
    # phase 1: to each local peer, the heads of its whole column (every node); phase 2: to each
    # same-index rank of another node, its heads for every token of this node.
    same = sum(sum(heads[k * G + j] for k in range(K)) * B * seq[r] * D * item for j in range(G) if j != l)
    other = sum(heads[k * G + l] * B * sum(seq[n * G + j] for j in range(G)) * D * item for k in range(K) if k != n)
    return same, other


def exchange_checks(ranks_per_node: int, comm: str = "flat") -> list[tuple]:
    topology = Topology.from_env(ranks_per_node)
    P, r = topology.world_size, topology.rank
    stats = CommStats()
    exchange = make_exchange(comm, topology, stats)
    failures = []
    for i, shape in enumerate(SHAPES):
        B, S, H, D = shape
        if H < P:
            continue
        for dtype in DTYPES:
            full = _full(shape, dtype, seed=i)
            seq, heads = split_sizes(S, P), split_sizes(H, P)
            mine = full[:, sum(seq[:r]) : sum(seq[: r + 1])]
            stats.reset()
            gathered = exchange.seq_to_head(mine, seq).wait()
            expected = full[:, :, sum(heads[:r]) : sum(heads[: r + 1])].permute(0, 2, 1, 3)
            if not torch.equal(gathered, expected):
                failures.append(("seq_to_head", shape, dtype))
            same, other = expected_bytes(topology, isinstance(exchange, TapaExchange), B, seq, heads, D, full.element_size())
            if (stats.same_node_bytes["a2a_in"], stats.other_node_bytes["a2a_in"]) != (same, other):
                failures.append(("stats", shape, dtype, dict(stats.same_node_bytes), dict(stats.other_node_bytes), same, other))
            back = exchange.head_to_seq(gathered, seq, H).wait()
            if not torch.equal(back, mine):
                failures.append(("head_to_seq", shape, dtype))
            whole = exchange.gather_seq(mine, 1, seq)
            if not torch.equal(whole, full):
                failures.append(("gather", shape, dtype))
            # Flat or in two hops, every rank's padded shard reaches every other rank once over each link class.
            padded = B * max(seq) * H * D * full.element_size()
            G = topology.ranks_per_node
            if (stats.same_node_bytes["gather"], stats.other_node_bytes["gather"]) != (padded * (G - 1), padded * (P - G)):
                failures.append(("gather stats", shape, dtype, stats.same_node_bytes["gather"], stats.other_node_bytes["gather"]))
    # Several exchanges in flight at once complete in issue order.
    full = [_full((2, 11, 4, 5), torch.float32, seed=100 + k) for k in range(3)]
    seq = split_sizes(11, P)
    pending = [exchange.seq_to_head(t[:, sum(seq[:r]) : sum(seq[: r + 1])], seq) for t in full]
    heads = split_sizes(4, P)
    for t, p in zip(full, pending):
        if not torch.equal(p.wait(), t[:, :, sum(heads[:r]) : sum(heads[: r + 1])].permute(0, 2, 1, 3)):
            failures.append(("async", r))
    if stats.wait_s["a2a_in"] <= 0:
        failures.append(("no wait time recorded", r))
    dist.barrier()
    return failures


@pytest.mark.parametrize("nproc, ranks_per_node", [(2, 1), (4, 2), (3, 3)])
def test_exchange_equals_slicing(nproc, ranks_per_node):
    results = spawn(exchange_checks, nproc, ranks_per_node, timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * nproc


def tapa_properties(ranks_per_node: int, cases: int) -> list[tuple]:
    """Random shapes and dtypes (the same on every rank): TAPA equals flat bit for bit, moves the
    same inter-node bytes in total, and its handle advances one phase at a time."""
    topology = Topology.from_env(ranks_per_node)
    P = topology.world_size
    flat_stats, tapa_stats = CommStats(), CommStats()
    flat, tapa = FlatExchange(topology, flat_stats), make_exchange("tapa", topology, tapa_stats)
    auto = make_exchange("auto", topology, CommStats())  # whichever it runs: exact
    rng = torch.Generator().manual_seed(1234)
    failures = []
    for case in range(cases):
        B, S, D = (int(torch.randint(1, hi, (), generator=rng)) for hi in (4, 40, 9))
        H = int(torch.randint(P, 3 * P + 2, (), generator=rng))
        dtype = DTYPES[case % len(DTYPES)]
        full = _full((B, S, H, D), dtype, seed=case)
        seq = split_sizes(S, P)
        r = topology.rank
        mine = full[:, sum(seq[:r]) : sum(seq[: r + 1])]
        pending = tapa.seq_to_head(mine, seq)
        phases = 0
        while not pending.done:
            pending.advance()
            phases += 1
        expected_phases = 2 if isinstance(tapa, TapaExchange) else 1
        if phases != expected_phases:
            failures.append(("phases", phases, expected_phases))
        got = pending.wait()
        if not torch.equal(got, flat.seq_to_head(mine, seq).wait()):
            failures.append(("seq_to_head", (B, S, H, D), dtype))
        for exchange in (tapa, flat):
            if not torch.equal(exchange.head_to_seq(got, seq, H).wait(), mine):
                failures.append(("head_to_seq", exchange.name, (B, S, H, D), dtype))
        if not torch.equal(auto.head_to_seq(auto.seq_to_head(mine, seq).wait(), seq, H).wait(), mine):
            failures.append(("auto round trip", (B, S, H, D), dtype))
        for exchange in (flat, tapa, auto):
            if not torch.equal(exchange.gather_seq(mine, 1, seq), full):
                failures.append(("gather", exchange.name, (B, S, H, D), dtype))
    failures += exchange_checks(ranks_per_node, "tapa")  # the fixed shapes, against slicing
    totals = torch.tensor(
        [sum(s.other_node_bytes.values()) for s in (flat_stats, tapa_stats)], dtype=torch.float64
    )
    dist.all_reduce(totals)
    # Both ran the same exchanges: TAPA relays inside nodes but crosses nodes with the same bytes.
    if totals[0] != totals[1]:
        failures.append(("inter-node bytes", totals.tolist()))
    return failures


@pytest.mark.parametrize("nproc, ranks_per_node", [(4, 2), (4, 1), (4, 4), (8, 2), (8, 4)],
                         ids=["2x2", "4x1", "1x4", "4x2", "2x4"])
def test_tapa_equals_flat_and_slicing(nproc, ranks_per_node):
    results = spawn(tapa_properties, nproc, ranks_per_node, 24, timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * nproc


def test_tapa_falls_back_to_flat_on_degenerate_topologies():
    one_node = Topology(rank=0, world_size=4, ranks_per_node=4, device=torch.device("cpu"))
    one_per_node = Topology(rank=0, world_size=4, ranks_per_node=1, device=torch.device("cpu"))
    assert type(make_exchange("tapa", one_node)) is FlatExchange
    assert type(make_exchange("tapa", one_per_node)) is FlatExchange


def test_split_sizes_follows_tensor_split():
    for n in range(0, 40):
        for parts in range(1, 9):
            expected = [len(c) for c in torch.arange(n).tensor_split(parts)]
            assert split_sizes(n, parts) == expected


def test_auto_trials_time_each_candidate_on_whole_steps_and_keep_the_fastest(monkeypatch):
    """`--comm auto`: after one warm-up step each candidate runs `repeats` whole steps (a step ends
    at the next timestep), each timed as the slowest rank's (`agree`), and the fastest median wins;
    a trial step cut short by a new run (a larger timestep) is not counted."""
    from cocodiff.distributed.comm.auto import Candidate, StepTrials

    candidates = [Candidate("flat", False), Candidate("flat", True), Candidate("tapa", False), Candidate("tapa", True)]
    cost = {candidates[0]: 4.0, candidates[1]: 3.0, candidates[2]: 2.0, candidates[3]: 1.0}
    trials, clock, agreed = StepTrials(candidates, repeats=2), [0.0], []
    monkeypatch.setattr("cocodiff.distributed.comm.auto.time.perf_counter", lambda: clock[0])

    def run(timesteps: list[float]) -> list[Candidate]:
        ran = []
        for t in timesteps:
            for _call in range(2):  # two transformer calls per step (true CFG): one boundary
                trials.step_boundary(t, lambda s: agreed.append(s) or s + 0.5)  # the slowest rank: +0.5
            ran.append(trials.current)
            clock[0] += cost[trials.current]
        return ran

    first = run([1000.0, 900.0, 800.0, 700.0])  # warm-up, then 3 trials; the run ends mid-trial
    assert first == [candidates[0], *candidates[:3]] and agreed == [4.0, 3.0]  # the 3rd trial was cut short
    assert trials.choice is None
    clock[0] += 100.0  # between runs: decoding, the next request
    run([1000.0, 900.0, 800.0, 700.0, 600.0, 500.0, 400.0, 300.0])
    assert trials.choice == candidates[3] and agreed == [4.0, 3.0, 2.0, 1.0, 4.0, 3.0, 2.0, 1.0]
    assert {c["name"]: c["step_ms"] for c in trials.report()["candidates"]} == {
        "flat": 4500.0, "flat+vfirst": 3500.0, "tapa": 2500.0, "tapa+vfirst": 1500.0,
    }
    assert run([1000.0, 900.0]) == [candidates[3]] * 2 and len(agreed) == 8  # decided: no more trials
    assert trials.report()["confirmed"] == []  # 1.5 ms against 2.5 ms: clear, nothing timed again


def test_auto_trials_time_close_candidates_again_before_choosing(monkeypatch):
    """Candidates within 5% of the best after the first rounds run `confirm` more steps each,
    alternating, and the fastest over all their steps decides; a candidate's slow first step (its
    one-off costs) does not count against it."""
    from cocodiff.distributed.comm.auto import Candidate, StepTrials

    steady, later, warming, slow = (Candidate("flat", False), Candidate("tapa", False), Candidate("tapa", True),
                                    Candidate("tapa-full", False))
    costs = {steady: [1.0] * 5, later: [1.03, 1.04, 0.95, 0.95, 0.95], warming: [3.0, 1.01, 1.0, 1.0, 1.0], slow: [2.0] * 5}
    trials, clock, ran = StepTrials([steady, later, warming, slow], repeats=2, confirm=3), [0.0], []
    monkeypatch.setattr("cocodiff.distributed.comm.auto.time.perf_counter", lambda: clock[0])
    for t in range(1000, 0, -25):
        trials.step_boundary(float(t), lambda s: s)
        ran.append(trials.current)
        warm_up_or_decided = len(ran) == 1 or trials.choice is not None
        clock[0] += 1.0 if warm_up_or_decided else costs[trials.current].pop(0)
    assert ran[1:9] == [steady, later, warming, slow] * 2  # fastest steps 1.0, 1.03, 1.01 (its first was 3.0), 2.0
    assert ran[9:18] == [steady, later, warming] * 3  # the three within 5% of 1.0, again; slow is out
    assert trials.choice == later and trials.report()["confirmed"] == ["flat", "tapa", "tapa+vfirst"]
    assert {c["name"]: c["steps"] for c in trials.report()["candidates"]} == {
        "flat": 5, "tapa": 5, "tapa+vfirst": 5, "tapa-full": 2,
    }


def test_calibrate_chooses_full_depth_tapa_where_it_is_the_fastest_by_the_margin(monkeypatch):
    """`bench a2a`'s auto buckets past two levels weigh full-depth TAPA too: chosen when 5% faster
    than the better of flat and two-level TAPA, not when it is only as fast."""
    from types import SimpleNamespace

    import cocodiff.distributed.comm.auto as auto

    timings = iter([[[10.0], [6.0], [4.0]], [[10.0], [6.0], [5.9]], [[10.0], [9.8], [9.7]]] + [[[1.0], [1.0], [1.0]]] * 2)
    monkeypatch.setattr(auto, "time_exchanges", lambda exchanges, size, repeats: next(timings))
    monkeypatch.setattr(auto, "full_depth_differs", lambda topology: True)
    for name in ("FlatExchange", "TapaExchange", "TapaFullExchange"):
        monkeypatch.setattr(auto, name, lambda topology: None)
    monkeypatch.setattr(auto, "all_reduce", lambda *args, **kwargs: None)
    topology = SimpleNamespace(hierarchical=True, device="cpu", world_group=None)
    choices = auto.calibrate(topology, budget_s=1e9)
    assert [c.choice for c in choices[:3]] == ["tapa-full", "tapa", "flat"]
    assert choices[0].tapa_full_ms == 4000.0 and choices[1].tapa_ms == 6000.0
