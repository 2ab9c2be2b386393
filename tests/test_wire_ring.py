"""Wire formats on the ring's K/V hops and the CFG / batch gathers, on 4 gloo ranks: only what
crosses the named level is packed; everything else arrives bit for bit as the exact run's.

The ring's expected blocks are built hop by hop (each packed hop rounds what the sender holds,
a block forwarded over a hop of the same formats keeps the bytes it arrived in); the expected
output folds them in the ring's order with the same kernel, so it must match exactly."""

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S

from cocodiff.engine.attention.ring import Ring, attend_block, merge
from cocodiff.distributed.comm import CommStats
from cocodiff.distributed.comm.group import PeerGroup
from cocodiff.distributed.comm.wire import pack, unpack
from cocodiff.run.launch import spawn
from cocodiff.config.levels import link_level
from cocodiff.distributed.topology import Topology
from cocodiff.config.wire import parse_wire

B, H, D = 2, 3, 8


def _round_trip(x: torch.Tensor, formats: tuple[str, ...], block: int) -> torch.Tensor:
    return unpack(pack(x, formats, block), formats, x.numel(), block, x.dtype).view(x.shape)


def _kv(chunk: int, tokens: int) -> torch.Tensor:
    """Chunk `chunk`'s (B, H, tokens, 2D) K|V block, the same on every rank."""
    return torch.randn(B, H, tokens, 2 * D, generator=torch.Generator().manual_seed(chunk)) * 10


def _arrived(group: PeerGroup, source: int, me: int, block: torch.Tensor) -> torch.Tensor:
    """Chunk `source`'s block as ring index `me` holds it after the hops source -> ... -> me."""
    R, carried, hop = group.size, None, source
    while hop != me:
        formats = _hop_formats(group, group.members[hop], group.members[(hop + 1) % R])
        if formats is None:
            carried = None
        elif carried != formats:
            block, carried = _round_trip(block, formats, D), formats
        hop = (hop + 1) % R
    return block


def _hop_formats(group: PeerGroup, sender: int, receiver: int) -> tuple[str, ...] | None:
    """The formats (K, V) of a ring block from global rank `sender` to `receiver`."""
    levels = group.topology.link_levels
    formats = tuple(group.wire.format_for(link_level(levels, sender, receiver), levels[0][0], role) for role in ("k", ""))
    return None if formats == ("exact", "exact") else formats


def ring_checks(ranks_per_node: int, wire_text: str, ring: tuple[int, ...]) -> list[tuple]:
    topology = Topology.from_env(ranks_per_node)
    me = ring.index(topology.rank) if topology.rank in ring else None
    failures = []
    if me is not None:
        wire = parse_wire(wire_text)
        stats, exact_stats = CommStats(), CommStats()
        sizes = [5, 0, 3, 4][: len(ring)]  # uneven, one chunk with no tokens
        q = torch.randn(B, H, 6, D, generator=torch.Generator().manual_seed(100 + me))
        k, v = _kv(me, sizes[me]).split(D, dim=-1)
        packed_ring = Ring(topology, None, ring, me, stats, wire=wire)
        got = packed_ring.attention(q, k, v, sizes, [None] * len(ring))
        exact = Ring(topology, None, ring, me, exact_stats).attention(q, k, v, sizes, [None] * len(ring))
        out = lse = None
        for step in range(len(ring)):
            source = (me - step) % len(ring)
            key, value = _arrived(packed_ring, source, me, _kv(source, sizes[source])).split(D, dim=-1)
            part = attend_block(q, key, value)
            out, lse = part if out is None else merge(out, lse, *part)
        if not torch.equal(got, out.to(q.dtype)):
            failures.append(("ring output", topology.rank, (got - out).abs().max().item()))
        crosses = any(packed_ring.formats_to(r, ("",)) is not None for r in ring)
        if crosses == torch.equal(got, exact):
            failures.append(("the wire changed the output", torch.equal(got, exact), "expected", crosses))
        if not crosses and stats.level_bytes != exact_stats.level_bytes:
            failures.append(("exact ring bytes", stats.level_bytes, exact_stats.level_bytes))
    dist.barrier()
    return failures


def gather_checks(wire_text: str) -> list[tuple]:
    topology = Topology.from_env(2)
    r = topology.rank
    group = PeerGroup(topology, None, (0, 1, 2, 3), r, CommStats(), wire=parse_wire(wire_text))
    sizes = [2, 1, 0, 3]  # uneven batch shares, one empty
    pieces = [torch.randn(n, 5, 8, generator=torch.Generator().manual_seed(i)) * 10 for i, n in enumerate(sizes)]
    got = group.gather(pieces[r], 0, sizes, kind="data", packed=True)
    named = dict(group.wire.levels)
    expected = [p if topology.link_level(i) not in named else _round_trip(p, (named[topology.link_level(i)],), 8)
                for i, p in enumerate(pieces)]
    failures = [] if torch.equal(got, torch.cat(expected)) else [("gather", r)]
    if not torch.equal(group.gather(pieces[r], 0, sizes), torch.cat(pieces)):  # not packed unless asked
        failures.append(("exact gather", r))
    dist.barrier()
    return failures


RING_CASES = [
    (2, "node=fp8", (0, 1, 2, 3)),  # hops alternate: inside a node exact, between nodes fp8 (K bf16)
    (1, "node=int8", (0, 1, 2, 3)),  # every hop between nodes: blocks forwarded as they arrived
    (2, "rank=fp8", (0, 2)),  # a ring across the nodes only, the format inside them: bit for bit exact
]


def all_checks() -> list[tuple]:
    """Every case on one set of ranks (starting ranks is the slow part)."""
    failures = [f for case in RING_CASES for f in ring_checks(*case)]
    return failures + [f for wire in ("node=fp8", "rank=int8") for f in gather_checks(wire)]


@pytest.mark.slow
def test_ring_and_data_gather_pack_only_the_named_level():
    assert spawn(all_checks, 4, timeout_s=RANK_TIMEOUT_S) == [[]] * 4
