"""Ring attention's pieces: the log-sum-exp merge against one-shot attention, and the plan grammar."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cocodiff import UsageError
from cocodiff.engine.attention.ring import attend_block, merge
from cocodiff.config.plan import Plan, default_plan, parse_plan


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    queries=st.integers(1, 9),
    blocks=st.lists(st.integers(0, 7), min_size=1, max_size=5).filter(lambda b: sum(b) > 0),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_merged_blocks_equal_one_shot_attention(batch, heads, queries, blocks, masked, seed):
    """Folding uneven (even empty) key blocks in any order equals attention over all keys; masked
    keys get no weight, also when a whole block is masked for an item."""
    g = torch.Generator().manual_seed(seed)
    keys, dim = sum(blocks), 8
    q = torch.randn(batch, heads, queries, dim, generator=g)
    k = torch.randn(batch, heads, keys, dim, generator=g)
    v = torch.randn(batch, heads, keys, dim, generator=g)
    mask = None
    if masked:
        mask = torch.rand(batch, keys, generator=g) > 0.5
        mask[:, torch.randint(keys, (1,), generator=g)] = True  # every item attends to something
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :] if masked else None)
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    order = torch.randperm(len(blocks), generator=g).tolist()
    out = lse = None
    for i in order:
        sl = slice(starts[i], starts[i] + blocks[i])
        part = attend_block(q, k[:, :, sl], v[:, :, sl], mask[:, sl] if masked else None)
        out, lse = part if out is None else merge(out, lse, *part)
    # fp32: the fold rescales by exp(lse differences), ~1e-7 relative per fold.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(lse).all()


def test_fully_masked_block_gets_no_weight():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    out, lse = attend_block(q, k, v * 1e6, torch.zeros(1, 3, dtype=torch.bool))
    assert torch.isneginf(lse).all() and (out == 0).all()
    good = attend_block(q, k, v)
    merged, _ = merge(*good, out, lse)
    assert torch.equal(merged, good[0])


@pytest.mark.parametrize(
    "text, plan",
    [
        ("u4r2", Plan(ulysses=4, ring=2, order=("ulysses", "ring", "cfg", "batch"))),
        ("r2u4", Plan(ulysses=4, ring=2, order=("ring", "ulysses", "cfg", "batch"))),
        ("ring=2,ulysses=4", Plan(ulysses=4, ring=2, order=("ring", "ulysses", "cfg", "batch"))),
        ("u1r8", Plan(ring=8, order=("ulysses", "ring", "cfg", "batch"))),
        ("U8", Plan(ulysses=8, order=("ulysses", "cfg", "batch", "ring"))),
        ("p2u4", Plan(pipe=2, ulysses=4, order=("pipe", "ulysses", "cfg", "batch", "ring"))),
        ("u2p2r2", Plan(pipe=2, ulysses=2, ring=2, order=("ulysses", "pipe", "ring", "cfg", "batch"))),
        ("pipe=4,ulysses=2", Plan(pipe=4, ulysses=2, order=("pipe", "ulysses", "cfg", "batch", "ring"))),
    ],
)
def test_plan_grammar(text, plan):
    parsed = parse_plan(text)
    assert parsed == plan and parsed.ranks == 8
    assert parse_plan(parsed.short) == parsed  # the short form round-trips, placement included


@pytest.mark.parametrize(
    "text, message",
    [
        ("u4x2", "is not a plan"),
        ("u4u2", "ulysses is given twice"),
        ("ring=2,heads=4", "'heads=4' is not AXIS=DEGREE"),
        ("u0r8", "ulysses=0 must be at least 1"),
        ("", "is not a plan"),
    ],
)
def test_bad_plans_are_one_line_errors(text, message):
    with pytest.raises(UsageError, match=message):
        parse_plan(text)


def test_plan_checks_ranks_and_heads():
    with pytest.raises(UsageError, match="multiply to 6, not to the 8 ranks"):
        parse_plan("u3r2").check(8, heads=4)
    with pytest.raises(UsageError, match="Ulysses degree 8 is larger than the 4 attention heads; .* --plan r2u4"):
        parse_plan("u8").check(8, heads=4)
    parse_plan("u4r2").check(8, heads=4)


def test_default_plan_places_ring_where_it_sends_less():
    assert default_plan(4, heads=4).short == "u4"
    # 8 ranks, 5 heads: Ulysses 4 (the widest divisor of 8 within the heads), ring 2.
    one_node = default_plan(8, heads=5)
    assert (one_node.ulysses, one_node.ring) == (4, 2)
    # 2 nodes x 4: Ulysses inside the nodes sends ring's K and V blocks (a shard each) once
    # between nodes; Ulysses across them sends its 4 all-to-alls, 3/4 to other members of
    # which 2/3 on the other node: 2 shards either way, and the tie goes to the ring, whose
    # blocks travel under attention.
    assert default_plan(8, heads=4, ranks_per_node=4).short == "r2u4"
    assert "2.00 shards (r2u4) vs 2.00 (u4r2)" in default_plan(8, heads=4, ranks_per_node=4).reason
    # 2 nodes x 4, 2 heads: a ring of 4 inside each node sends nothing between nodes and
    # Ulysses-2 across them sends 4 tensors x 1/2 = 2 shards; a ring of 4 across nodes passes
    # K and V 3 times (6 shards): Ulysses outermost sends less.
    assert default_plan(8, heads=2, ranks_per_node=4).short == "u2r4"
    # 4 nodes x 2: a ring of 4 crosses nodes either way; Ulysses-2 inside the nodes adds nothing.
    assert default_plan(8, heads=2, ranks_per_node=2).short == "r4u2"
    assert "estimated inter-node traffic" in default_plan(8, heads=2, ranks_per_node=2).reason


def test_auto_plan_puts_cfg_and_batch_groups_outermost():
    from cocodiff.config.plan import auto_plan

    # Guided, 4 ranks on 2 nodes x 2: CFG across the nodes, Ulysses 2 inside each.
    assert auto_plan(4, heads=4, ranks_per_node=2, cfg=True).short == "c2u2"
    # Unguided, one image: nothing to share but the sequence.
    assert auto_plan(4, heads=4, ranks_per_node=2).short == "u4"
    # Unguided, 4 images on 8 ranks: 4 batch groups of Ulysses 2.
    assert auto_plan(8, heads=4, ranks_per_node=4, images=4).short == "b4u2"
    # Guided, one image, 8 ranks with 2 heads: CFG 2, and the 4 sequence ranks past the heads:
    # Ulysses 2 x ring 2.
    plan = auto_plan(8, heads=2, ranks_per_node=4, cfg=True)
    assert (plan.cfg, plan.batch, plan.ring, plan.ulysses) == (2, 1, 2, 2) and plan.order[:2] == ("cfg", "batch")
    assert plan.reason.startswith("auto: CFG 2 (guided), batch 1 of 1 image(s)")
    # 3 images on the 4 ranks of each CFG group: 2 batch groups (3 images shared 2 and 1).
    assert auto_plan(8, heads=2, ranks_per_node=4, cfg=True, images=3).short == "c2b2u2"


def test_plan_auto_tries_the_rule_then_fewer_ranks_per_image_then_plain_sequence_parallelism():
    from cocodiff.config.plan import auto_plan, trial_plans

    def shorts(*args, **kwargs):
        return [p.short for p in trial_plans(*args, **kwargs)]

    # Guided: the rule's CFG x Ulysses, one rank per image (c2b2u1: one image's call of two
    # branches runs whole on each of the four groups), and Ulysses over all four ranks.
    assert shorts(4, heads=4, ranks_per_node=2, cfg=True) == ["c2u2", "c2b2u1", "u4"]
    # Unguided, one image: the rule's u4, then two and four replicas of narrower groups.
    assert shorts(4, heads=4, ranks_per_node=2) == ["u4", "b2u2", "b4u1"]
    reasons = {p.short: p.reason for p in trial_plans(4, 4, 2)}  # no CFG groups: no branch to speak of
    assert reasons["b2u2"].endswith("sequence parallel over 2 of 4 ranks")
    assert {p.short: p.reason for p in trial_plans(4, 4, 2, True)}["c2b2u1"].endswith("over 1 of 2 ranks per CFG branch")
    # Past the heads: the rule's ring hybrid first, ring placed across the nodes.
    assert shorts(8, heads=4, ranks_per_node=4) == ["r2u4", "b2u4", "b4u2", "b8u1"]
    # The first candidate is the rule's plan (what the warm-up step runs), reasons included.
    for args in [(4, 4, 2, True, 1), (8, 4, 4, False, 4), (8, 2, 4, True, 3)]:
        assert trial_plans(*args)[0] == auto_plan(*args)
    assert shorts(1, heads=4) == ["u1"]  # one rank: nothing to try (no trials run)


@pytest.mark.parametrize(
    "ranks, heads, rpn, expected",
    [
        (16, 24, 8, "r2u8"),  # FLUX on 2 x 8: u16 leaves 2 heads on some ranks (1.33x); u8 splits 3 each
        (8, 38, 8, None),  # SD3.5 Large on 8: 5 or 4 heads (1.05x), even enough
        (4, 6, 2, "r2u2"),  # tiny-sd3 on 2 x 2
        (4, 5, 2, None),  # 5 heads: no degree of at least 2 divides both
        (48, 24, 8, None),  # past the heads: u24r2, even already
    ],
)
def test_even_heads_plan_for_auto(ranks, heads, rpn, expected):
    from cocodiff.config.plan import even_heads_plan, trial_plans

    plan = even_heads_plan(ranks, heads, rpn)
    assert (plan.short if plan else None) == expected
    shorts = [p.short for p in trial_plans(ranks, heads, rpn)]
    assert (expected in shorts) if expected else len(shorts) == len(set(shorts))


@pytest.mark.parametrize("text", ["p2u2", "u2p2", "c2p2u2", "r2p3u2", "u4"])
def test_a_ranks_place_on_each_axis_is_where_the_groups_put_it(text):
    """`Plan.place` (what serve names a stopped rank's stage by) against the grid `Topology.split` lays out."""
    import torch

    from cocodiff.config.plan import parse_plan

    plan = parse_plan(text)
    grid = torch.arange(plan.ranks).reshape([degree for _, degree in plan.mesh_dims])
    for rank in range(plan.ranks):
        where = [int(c) for c in (grid == rank).nonzero()[0]]
        assert plan.place(rank) == {axis: i for (axis, _), i in zip(plan.mesh_dims, where)}
    if plan.pipe > 1:
        last = plan.ranks - 1
        assert plan.rank_name(last) == f"rank {last} (stage {plan.place(last)['pipe']} of {plan.pipe})"
    assert parse_plan("u2p2").rank_name(1) == "rank 1 (stage 1 of 2)" and parse_plan("u4").rank_name(3) == "rank 3"
