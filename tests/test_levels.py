"""Topologies of any depth (`--levels node=2,card=2,tile=2`): the levels as data, the device mesh
and groups built from them, bytes per level, and TAPA with one phase per level against flat.

The mesh tests run in this process on torch's fake process group (no ranks: only the groups'
membership is checked). The exchanges run on 6 and 8 gloo ranks; every rank builds the same
full tensor from a seed and checks what comes back against the flat exchange and against
slicing: the exchanges only move data, so equality is bitwise.
"""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S

from cocodiff.distributed.comm import (
    CommStats,
    FlatExchange,
    TapaExchange,
    TapaFullExchange,
    make_exchange,
    split_sizes,
)
from cocodiff.distributed.comm.auto import AutoExchange, Candidate, candidates
from cocodiff.config.parallel import ParallelConfig
from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn
from cocodiff.config.levels import link_level, member_levels, parse_levels, two_levels
from cocodiff.config.plan import parse_plan
from cocodiff.distributed.topology import Topology

CPU = torch.device("cpu")
THREE = parse_levels("node=2,card=2,tile=2")


def test_parse_levels_and_its_errors():
    assert parse_levels("node=2, card=4 ,tile=2") == (("node", 2), ("card", 4), ("tile", 2))
    assert two_levels(8, 4) == (("node", 2), ("rank", 4))
    for bad in ("node=2,card", "node=0", "node=2,node=2", "2=node", "ring=2,tile=4"):
        with pytest.raises(UsageError):
            parse_levels(bad)
    assert ParallelConfig(levels="node=2,card=2,tile=2", ranks_per_node=4).levels == THREE
    with pytest.raises(UsageError, match="disagrees"):
        ParallelConfig(levels="node=2,card=2,tile=2", ranks_per_node=2)


def test_link_level_is_the_outermost_level_that_differs():
    # Rank 5 is node 1, card 0, tile 1.
    assert [link_level(THREE, 5, r) for r in range(8)] == ["node"] * 4 + ["tile", None, "card", "card"]


def test_member_levels_of_plan_groups():
    assert member_levels(range(8), THREE) == THREE
    assert member_levels([1, 3, 5, 7], THREE) == (("node", 2), ("card", 2), ("tile", 1))  # u4r2: ring inside
    assert member_levels([4, 5, 6, 7], THREE) == (("node", 1), ("card", 2), ("tile", 2))  # r2u4: one node
    # 2 nodes of 3 cards of 2 tiles, a group cut across cards unevenly: the card boundary goes.
    levels = parse_levels("node=2,card=3,tile=2")
    assert member_levels([4, 5, 6, 7], levels) == (("node", 2), ("card", 1), ("tile", 2))
    assert member_levels([0, 4, 8], parse_levels("node=1,card=2,tile=6")) == (("node", 1), ("card+tile", 3))
    assert member_levels([0, 1, 4], THREE) is None  # 2 members on one node, 1 on the other


@pytest.fixture
def fake_world():
    """A default process group of 8 ranks in this process (torch's fake backend: groups, no data);
    this process is rank 5."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def test_mesh_and_groups_from_levels(fake_world):
    t = Topology.from_env(levels=THREE, device=CPU)
    assert set(t.groups) == {"node", "card", "tile", "intra"}
    assert (t.nodes, t.ranks_per_node, t.node, t.local_rank, t.hierarchical) == (2, 4, 1, 1, True)
    assert [ranks(t.level_group(d)) for d in range(3)] == [[1, 5], [5, 7], [4, 5]]
    assert [t.level_peers(d) for d in range(3)] == [[1, 5], [5, 7], [4, 5]]
    assert ranks(t.intra_group) == [4, 5, 6, 7] and ranks(t.inter_group) == [1, 5]
    assert "levels node=2,card=2,tile=2" in t.describe()
    # The two-level shorthand keeps its groups.
    two = Topology.from_env(ranks_per_node=4, device=CPU)
    assert two.levels == (("node", 2), ("rank", 4)) and set(two.groups) == {"node", "rank"}
    assert ranks(two.intra_group) == [4, 5, 6, 7] and ranks(two.inter_group) == [1, 5]
    with pytest.raises(UsageError, match="multiply"):
        Topology.from_env(levels=parse_levels("node=2,card=2"), device=CPU)


def test_the_launchers_levels_come_from_the_environment(fake_world, monkeypatch):
    monkeypatch.setenv("COCODIFF_LEVELS", "node=2,card=2,tile=2")
    assert Topology.from_env(device=CPU).levels == THREE
    assert Topology.from_env(ranks_per_node=2, device=CPU).levels == (("node", 4), ("rank", 2))  # the flag wins


def test_plan_groups_keep_their_members_levels(fake_world):
    t = Topology.from_env(levels=THREE, device=CPU)
    across = t.split(parse_plan("u4r2")).ulysses  # Ulysses over nodes and cards, ring between tiles
    assert across.members == (1, 3, 5, 7) and across.levels == (("node", 2), ("card", 2), ("tile", 1))
    assert ranks(across.level_group(0)) == [1, 5] and ranks(across.level_group(1)) == [5, 7]
    assert ranks(across.intra_group) == [5, 7] and across.link_level(0) == "node" and across.link_level(3) == "card"
    inside = t.split(parse_plan("r2u4")).ulysses  # Ulysses over one node's cards and tiles
    assert inside.levels == (("node", 1), ("card", 2), ("tile", 2)) and inside.rank == 1
    assert [ranks(inside.level_group(d)) for d in (1, 2)] == [[5, 7], [4, 5]]
    # Full-depth TAPA differs from two-level TAPA inside one node (two hops, no node hop) ...
    assert type(make_exchange("tapa-full", inside)) is TapaFullExchange
    assert type(make_exchange("tapa", inside)) is FlatExchange
    # ... and is two-level TAPA where the group has two levels of more than one rank.
    assert type(make_exchange("tapa-full", across)) is TapaExchange


def test_full_depth_tapa_is_a_candidate_of_auto_past_two_levels():
    three = Topology(rank=0, world_size=8, ranks_per_node=4, device=CPU, levels=THREE)
    two = Topology(rank=0, world_size=8, ranks_per_node=4, device=CPU)
    assert [c.name for c in candidates(three, v_first=True)] == ["flat+vfirst", "tapa+vfirst", "tapa-full+vfirst"]
    assert [c.comm for c in candidates(two)] == ["flat", "flat", "tapa", "tapa"]
    auto = AutoExchange(three)
    for comm, kind in (("flat", FlatExchange), ("tapa", TapaExchange), ("tapa-full", TapaFullExchange)):
        auto.trials.choice = Candidate(comm, False)
        assert type(auto.current) is kind
    assert auto.tapa_full.hops()[0].size == 2 and [h.size for h in auto.tapa_full.hops()] == [2, 2, 2]


def test_stats_count_bytes_at_the_outermost_level_that_differs():
    t = Topology(rank=5, world_size=8, ranks_per_node=4, device=CPU, levels=THREE)
    stats = CommStats()
    stats.record_send("a2a_in", t, [1, 2, 4, 8, 16, 32, 64, 128])
    assert stats.by_level() == {"node": 15, "tile": 16, "card": 64 + 128}
    assert stats.other_node_bytes["a2a_in"] == 15 and stats.same_node_bytes["a2a_in"] == 16 + 64 + 128
    assert stats.by_level(("gather",)) == {"node": 0, "tile": 0, "card": 0}
    stats.reset()
    assert stats.by_level() == {}


# ---- exchanges on gloo ranks -------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _full(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def level_checks(layouts: list[str], cases: int) -> list[tuple]:
    """For each layout of the ranks: full-depth and two-level TAPA equal flat bit for bit (seq_to_head,
    head_to_seq, gather_seq), on random uneven shapes; full depth takes one phase per level of more
    than one rank; every exchange crosses nodes with the same bytes; bytes per level add up."""
    failures = []
    for layout in layouts:
        levels = parse_levels(layout)
        topology = Topology.from_env(levels=levels)
        P, r = topology.world_size, topology.rank
        stats = {name: CommStats() for name in ("flat", "tapa", "tapa-full")}
        flat = FlatExchange(topology, stats["flat"])
        tapa, full = make_exchange("tapa", topology, stats["tapa"]), make_exchange("tapa-full", topology, stats["tapa-full"])
        rng = torch.Generator().manual_seed(len(layout))
        for case in range(cases):
            B, S, D = (int(torch.randint(1, hi, (), generator=rng)) for hi in (3, 30, 6))
            H = int(torch.randint(P, 2 * P + 3, (), generator=rng))
            dtype = DTYPES[case % len(DTYPES)]
            whole = _full((B, S, H, D), dtype, seed=case)
            seq, heads = split_sizes(S, P), split_sizes(H, P)
            mine = whole[:, sum(seq[:r]) : sum(seq[: r + 1])]
            expected = whole[:, :, sum(heads[:r]) : sum(heads[: r + 1])].permute(0, 2, 1, 3)
            for exchange in (flat, tapa, full):
                pending, phases = exchange.seq_to_head(mine, seq), 0
                while not pending.done:  # one phase per hop, each a step of its own
                    pending.advance()
                    phases += 1
                want = len(exchange.hops()) if isinstance(exchange, TapaExchange) else 1
                if phases != want:
                    failures.append((layout, exchange.name, "phases", phases, want))
                if not torch.equal(pending.wait(), expected):
                    failures.append((layout, exchange.name, "seq_to_head", (B, S, H, D), dtype))
                if not torch.equal(exchange.head_to_seq(expected, seq, H).wait(), mine):
                    failures.append((layout, exchange.name, "head_to_seq", (B, S, H, D), dtype))
                if not torch.equal(exchange.gather_seq(mine, 1, seq), whole):
                    failures.append((layout, exchange.name, "gather", (B, S, H, D), dtype))
        if type(full) is TapaFullExchange and [h.size for h in full.hops()] != [s for _, s in levels if s > 1]:
            failures.append((layout, "hops", [h.size for h in full.hops()]))
        sums = torch.tensor(
            [[sum(s.other_node_bytes.values()), sum(s.same_node_bytes.values()), sum(s.by_level().values())]
             for s in stats.values()], dtype=torch.float64,
        )
        dist.all_reduce(sums)
        if len(set(sums[:, 0].tolist())) != 1:  # every chunk crosses nodes once, or never
            failures.append((layout, "inter-node bytes", sums[:, 0].tolist()))
        if not torch.equal(sums[:, 0] + sums[:, 1], sums[:, 2]):
            failures.append((layout, "bytes by level", sums.tolist()))
        dist.barrier()
    return failures


def coded_round_trip(layout: str) -> list[tuple]:
    """Full-depth TAPA with V-Major's codec on its node phase: step 0 sends all; at step 1 only
    the tokens that changed (at most the half the schedule keeps) differ, so the result is exact
    again with fewer inter-node bytes; the inner phases send in full (same bytes every step)."""
    from cocodiff.engine.vmajor.codec import VMajorCodec
    from cocodiff.config.vmajor import parse_schedule
    from cocodiff.engine.vmajor.state import VMajor

    topology = Topology.from_env(levels=parse_levels(layout))
    P, r = topology.world_size, topology.rank
    vm, stats = VMajor(parse_schedule("constant:0.5")), CommStats()
    exchange = TapaFullExchange(topology, stats, VMajorCodec(vm))
    B, S, H, D = 2, 6 * P + 3, P + 1, 4  # uneven tokens and heads
    seq, heads = split_sizes(S, P), split_sizes(H, P)
    x0 = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(7))
    x1 = x0.clone()
    for rank in range(P):
        x1[:, sum(seq[:rank]) : sum(seq[:rank]) + seq[rank] // 2] += 1.0
    failures, other, same = [], [], []
    for step, x in enumerate((x0, x1)):
        vm.begin_call(step, 3, 1000.0 - step)
        stats.reset()
        got = exchange.seq_to_head(x[:, sum(seq[:r]) : sum(seq[: r + 1])], seq, ("layer0", "v", vm.call)).wait()
        if not torch.equal(got, x[:, :, sum(heads[:r]) : sum(heads[: r + 1])].permute(0, 2, 1, 3)):
            failures.append((layout, "coded round trip", step))
        other.append(stats.other_node_bytes["a2a_in"])
        same.append(stats.same_node_bytes["a2a_in"])
    if not other[1] < 0.75 * other[0] or same[1] != same[0]:
        failures.append((layout, "coded bytes", other, same))
    return failures


def eight_rank_checks(layouts: list[str], cases: int) -> list[tuple]:
    return level_checks(layouts, cases) + coded_round_trip(layouts[0])


@pytest.mark.slow
def test_tapa_over_levels_equals_flat_on_8_ranks():
    """Depths 3, 2 and 1 (2x2x2, 2x4, 8; and one node of 2 cards of 4 ranks), uneven sizes; and
    the codec on the node phase of three levels."""
    layouts = ["node=2,card=2,tile=2", "node=2,rank=4", "node=8", "node=1,card=2,tile=4"]
    assert spawn(eight_rank_checks, 8, layouts, 4, timeout_s=RANK_TIMEOUT_S * 2) == [[]] * 8


def test_tapa_over_levels_equals_flat_on_6_ranks():
    """3 nodes x 2, as two levels and as three (a card level of one rank), and 3 cards x 2 tiles in one node."""
    layouts = ["node=3,tile=2", "node=3,card=1,tile=2", "node=1,card=3,tile=2"]
    assert spawn(level_checks, 6, layouts, 3, timeout_s=RANK_TIMEOUT_S * 2) == [[]] * 6


# ---- a model over three levels -----------------------------------------------------------------

# fp32. Sharded matmuls and attention over keys in another order round differently from one
# process (~1e-7 relative per operation); 1e-4 of the output's magnitude leaves room for that to
# compound over the layers, while a wrong token, head or position gives differences of order 1e-1.
RTOL_OF_SCALE = 1e-4


def flux_8_heads() -> tuple[torch.nn.Module, dict]:
    """A tiny FLUX transformer with 8 heads (no preset has 8: Ulysses over 8 ranks needs them),
    seeded, and forward inputs of 15 image and 7 text tokens (uneven over 8 ranks)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=8,
        joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4),
    ).eval()
    g = torch.Generator().manual_seed(1)
    h, w, txt = 3, 5, 7
    ids = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
    inputs = {
        "hidden_states": torch.randn(1, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, txt, 32, generator=g),
        "pooled_projections": torch.randn(1, 16, generator=g),
        "timestep": torch.tensor([0.6]),
        "img_ids": torch.cat([torch.zeros(h * w, 1), ids.float()], dim=1),
        "txt_ids": torch.zeros(txt, 3),
    }
    return model, inputs


def flux_over_levels(levels: str) -> dict:
    """The 8-head FLUX forward under full-depth TAPA (V-First on) and under flat, on every rank."""
    from cocodiff import parallelize

    outputs, hops = {}, None
    for comm in ("tapa-full", "flat"):
        model, inputs = flux_8_heads()
        parallel = parallelize(model, ParallelConfig(comm=comm, levels=levels))
        if comm == "tapa-full":
            exchange = parallel.ctx.exchange
            hops = (exchange.name, [h.size for h in exchange.hops()], parallel.stats)
        with torch.no_grad():
            outputs[comm] = model(**inputs, return_dict=False)[0]
    name, sizes, stats = hops
    return {**outputs, "exchange": name, "hops": sizes, "bytes_by_level": stats.by_level(("a2a_in", "a2a_out"))}


@pytest.mark.slow
def test_flux_with_tapa_over_three_levels_equals_one_process():
    model, inputs = flux_8_heads()
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
    runs = spawn(flux_over_levels, 8, "node=2,card=2,tile=2", timeout_s=RANK_TIMEOUT_S * 2)
    scale = expected.abs().max().item()
    for rank, run in enumerate(runs):
        assert (run["exchange"], run["hops"]) == ("tapa-full", [2, 2, 2])
        assert set(run["bytes_by_level"]) == {"node", "card", "tile"}
        assert torch.equal(run["tapa-full"], run["flat"]), f"rank {rank}: full-depth TAPA is not bitwise flat"
        diff = (run["tapa-full"] - expected).abs().max().item()
        assert diff <= RTOL_OF_SCALE * scale, f"rank {rank}: max abs diff {diff:.3e} at scale {scale:.3e}"


@pytest.mark.slow
def test_verify_with_full_depth_tapa_on_three_levels(tmp_path):
    """`cocodiff verify` on 8 ranks as 2 nodes x 2 cards x 2 tiles. tiny-flux has 4 heads and no
    preset has 8, so the ring hybrid r2u4: each Ulysses group is one node's 2 cards x 2 tiles,
    and full-depth TAPA runs on those levels (tile hop, then card hop); ring spans the nodes."""
    from cocodiff.cli import main

    out = tmp_path / "verify.json"
    code = main(["verify", "--model", "tiny-flux", "--nproc", "8", "--levels", "node=2,card=2,tile=2",
                 "--comm", "tapa-full", "--plan", "r2u4", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["ok"] and result["plan"] == "r2u4"
    assert result["exchange"]["name"] == "tapa-full" and result["exchange"]["hops"] == [2, 2]
    assert result["levels"] == "node=2,card=2,tile=2"
    levels, axes = result["bytes_by_level"], result["bytes_by_axis"]
    # Ulysses stays inside each node: the node links carry ring's blocks and the output gather only.
    assert levels["node"] == axes["ring"]["inter_node"] + axes["output"]["inter_node"]
    assert levels["card"] + levels["tile"] == sum(axis["intra_node"] for axis in axes.values())
