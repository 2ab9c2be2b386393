"""The Ulysses exchange, the output gather and the byte counters, on 2 and 4 gloo ranks.

Every rank builds the same full tensor from a seed, takes its shard, and checks what the
collective returns against slicing the full tensor in one process: the exchange only moves data,
so equality is bitwise.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S

from cocodiff.comm import CommStats, FlatExchange, gather_seq, split_sizes
from cocodiff.launch import spawn
from cocodiff.topology import Topology

# (B, S, H, D): odd sequence lengths, head counts that the degree does not divide, fewer tokens than ranks.
SHAPES = [(1, 16, 4, 8), (2, 7, 6, 3), (1, 3, 5, 2), (3, 1, 4, 1), (1, 267, 6, 16), (2, 9, 38, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _full(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def exchange_checks(ranks_per_node: int) -> list[tuple]:
    topology = Topology.from_env(ranks_per_node)
    P, r = topology.world_size, topology.rank
    stats = CommStats()
    exchange = FlatExchange(topology, stats)
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
            # Bytes this rank sends: its shard's slice for every other rank's heads.
            item = full.element_size()
            sent = {dst: B * seq[r] * heads[dst] * D * item for dst in range(P) if dst != r}
            same = sum(n for dst, n in sent.items() if topology.node_of(dst) == topology.node)
            other = sum(n for dst, n in sent.items() if topology.node_of(dst) != topology.node)
            if (stats.same_node_bytes["a2a"], stats.other_node_bytes["a2a"]) != (same, other):
                failures.append(("stats", shape, dtype, dict(stats.same_node_bytes), dict(stats.other_node_bytes), same, other))
            back = exchange.head_to_seq(gathered, seq, H).wait()
            if not torch.equal(back, mine):
                failures.append(("head_to_seq", shape, dtype))
            whole = gather_seq(mine, 1, seq, topology, stats)
            if not torch.equal(whole, full):
                failures.append(("gather", shape, dtype))
    # Several exchanges in flight at once complete in issue order.
    full = [_full((2, 11, 4, 5), torch.float32, seed=100 + k) for k in range(3)]
    seq = split_sizes(11, P)
    pending = [exchange.seq_to_head(t[:, sum(seq[:r]) : sum(seq[: r + 1])], seq) for t in full]
    heads = split_sizes(4, P)
    for t, p in zip(full, pending):
        if not torch.equal(p.wait(), t[:, :, sum(heads[:r]) : sum(heads[: r + 1])].permute(0, 2, 1, 3)):
            failures.append(("async", r))
    if stats.wait_s["a2a"] <= 0:
        failures.append(("no wait time recorded", r))
    dist.barrier()
    return failures


@pytest.mark.parametrize("nproc, ranks_per_node", [(2, 1), (4, 2), (3, 3)])
def test_exchange_equals_slicing(nproc, ranks_per_node):
    results = spawn(exchange_checks, nproc, ranks_per_node, timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * nproc


def test_split_sizes_follows_tensor_split():
    for n in range(0, 40):
        for parts in range(1, 9):
            expected = [len(c) for c in torch.arange(n).tensor_split(parts)]
            assert split_sizes(n, parts) == expected
