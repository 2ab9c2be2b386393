"""Wire formats in the exchanges, on 4 gloo ranks of 2 emulated nodes: only the messages over the
named level are packed; everything that stays off it arrives bit for bit as the exact exchange's.

(With TAPA and formats on two levels, a value may cross both links, each hop in its own format:
packed twice. The cases here have one packed hop per value.)"""

import json

import command
import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S

from cocodiff.distributed.comm import CommStats, make_exchange, split_sizes
from cocodiff.distributed.comm.wire import pack, unpack
from cocodiff.run.launch import spawn
from cocodiff.distributed.topology import Topology
from cocodiff.config.wire import parse_wire


def _round_trip(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """x (..., D) with D a multiple of `block`, each block through `fmt` (as the wire sends it)."""
    return unpack(pack(x, (fmt,), block), (fmt,), x.numel(), block, x.dtype).view(x.shape)


def wire_checks(comm: str, wire_text: str) -> list[tuple]:
    topology = Topology.from_env(2)
    P, r = topology.world_size, topology.rank
    exact, packed, exact_stats, stats = make_exchange(comm, topology), make_exchange(comm, topology), CommStats(), CommStats()
    exact, packed = exact.with_state(exact_stats), packed.with_state(stats)
    packed.set_wire(parse_wire(wire_text))
    packed_level = dict(packed.wire.levels)
    failures = []
    # (B, S, H, D): uneven sequence and head splits, a rank with no tokens, and fused Q|K rows.
    for i, (shape, key) in enumerate([((2, 13, 6, 8), None), ((1, 3, 5, 4), ("l", "v", 0)), ((1, 9, 4, 8), ("l", "qk", 0))]):
        B, S, H, D = shape
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 10
        seq, heads = split_sizes(S, P), split_sizes(H, P)
        mine = full[:, sum(seq[:r]) : sum(seq[: r + 1])]
        got = packed.seq_to_head(mine, seq, key).wait()
        want = exact.seq_to_head(mine, seq, key).wait()  # (B, H_r, S, D)
        # Tokens of each source: exact where the link to it is not packed, else as the wire sends them.
        expected = want.clone()
        for src in range(P):
            level = topology.link_level(src)
            if level not in packed_level:
                continue
            span = slice(sum(seq[:src]), sum(seq[: src + 1]))
            if key is not None and key[1] == "qk":  # Q in the level's format, K at bf16 at least
                q, k = want[:, :, span].chunk(2, dim=-1)
                expected[:, :, span] = torch.cat([_round_trip(q, packed_level[level], D // 2), _round_trip(k, "bf16", D // 2)], -1)
            else:
                expected[:, :, span] = _round_trip(want[:, :, span], packed_level[level], D)
            if torch.equal(expected[:, :, span], want[:, :, span]) and want[:, :, span].numel():
                failures.append(("the wire changed nothing", src, shape))
        if not torch.equal(got, expected):
            failures.append(("seq_to_head", comm, wire_text, shape, (got - expected).abs().max().item()))
        # The return all-to-all (a2a_out): this rank's tokens come back, the heads of each source
        # exact where the link to it is not packed, else as the wire sends them.
        back = packed.head_to_seq(want, seq, H).wait()  # (B, S_r, H, D)
        if not torch.equal(exact.head_to_seq(want, seq, H).wait(), mine):
            failures.append(("exact head_to_seq", shape))
        expected_back = mine.clone()
        for src in range(P):
            level = topology.link_level(src)
            span = slice(sum(heads[:src]), sum(heads[: src + 1]))
            if level not in packed_level or not mine[:, :, span].numel():
                continue
            expected_back[:, :, span] = _round_trip(mine[:, :, span], packed_level[level], D)
            if torch.equal(expected_back[:, :, span], mine[:, :, span]):
                failures.append(("the wire changed nothing on the way back", src, shape))
        if not torch.equal(back, expected_back):
            failures.append(("head_to_seq", comm, wire_text, shape, (back - expected_back).abs().max().item()))
    # Bytes: the packed level carries fp8 (1 byte + a 4-byte scale per block of D), the others exact fp32.
    for level, n in stats.level_bytes.items():
        sent, exact_sent = sum(n.values()), sum(exact_stats.level_bytes[level].values())
        if level in packed_level and not sent < exact_sent / 2:
            failures.append(("packed bytes", level, sent, exact_sent))
        if level not in packed_level and sent != exact_sent:
            failures.append(("exact bytes", level, sent, exact_sent))
    dist.barrier()
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("comm, wire", [("flat", "node=fp8"), ("tapa", "node=fp8"), ("flat", "rank=int8"), ("flat", "node=int8,rank=fp8")])
def test_only_the_named_level_is_packed(comm, wire):
    results = spawn(wire_checks, 4, comm, wire, timeout_s=RANK_TIMEOUT_S)
    assert results == [[]] * 4


@pytest.mark.slow
def test_bench_e2e_fp8_variant_packs_only_inter_node_bytes(tmp_path):
    out = tmp_path / "e2e.json"
    run = command.cocodiff("bench", "e2e", "--model", "tiny-sd3", "--variants", "tapa,tapa+fp8", "--steps", "1",
                           "--height", "48", "--width", "80", "--repeat", "1", "--nproc", "4", "--ranks-per-node", "2",
                           "--json", str(out), timeout=RANK_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    variants = json.loads(out.read_text())["variants"]
    exact, packed = variants["tapa"], variants["tapa+fp8"]
    assert packed["lossy"] and packed["wire"] == "slowest=fp8" and not exact["lossy"] and "tapa+fp8 (LOSSY)" in run.stdout
    assert packed["intra_node_bytes"] == exact["intra_node_bytes"]  # inside a node: exact, the same bytes
    # Between nodes: the all-to-alls in fp8 (K in bf16) plus scales; the output gather exact.
    assert packed["inter_node_bytes"] < exact["inter_node_bytes"] * 0.7
