"""Wire formats (LOSSY): pack/unpack round trips and their error bounds, the `--wire` grammar."""

from __future__ import annotations

import math

import pytest
import torch

from cocodiff.cli import main
from cocodiff.distributed.comm.wire import pack, packed_bytes, unpack
from cocodiff.config.parallel import ParallelConfig
from cocodiff.errors import UsageError
from cocodiff.config.variants import FP8_WIRE, parse_variant
from cocodiff.config.wire import Wire, parse_wire

BLOCK = 8


def _round_trip(x: torch.Tensor, formats: tuple[str, ...], block: int = BLOCK) -> torch.Tensor:
    data = pack(x, formats, block)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert data.numel() == packed_bytes(x.numel(), formats, block, x.element_size())
    return unpack(data, formats, x.numel(), block, x.dtype).view(x.shape)


def _values(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Blocks of very different ranges, as heads after QK norm and RoPE are.
    return torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1] // BLOCK).repeat_interleave(BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_within_e4m3_bound(dtype):
    x = _values((5, 3, 4 * BLOCK)).to(dtype)
    y = _round_trip(x, ("fp8",))
    assert y.shape == x.shape and y.dtype == dtype
    blocks, err = x.float().view(-1, BLOCK), (y.float() - x.float()).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 448
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) the
    # step is 2^-9 of the scale. The last term covers rounding into a bf16 result.
    bound = blocks.abs() * 2**-4 + scale * 2**-10 + (blocks.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    assert (err.abs() <= bound * (1 + 1e-6)).all()


def test_int8_round_trip_within_half_a_step():
    x = _values((7, 2 * BLOCK))
    y = _round_trip(x, ("int8",))
    blocks, err = x.view(-1, BLOCK), (y - x).view(-1, BLOCK)
    step = blocks.abs().amax(dim=1, keepdim=True) / 127
    assert (err.abs() <= step / 2 * (1 + 1e-5)).all()  # rounding to the nearest step; fp32 ops add ~1e-7


def test_bf16_round_trip_and_exact():
    x = _values((6, 2 * BLOCK))
    assert torch.equal(_round_trip(x, ("bf16",)), x.to(torch.bfloat16).float())
    assert torch.equal(_round_trip(x, ("exact",)), x)
    b = x.to(torch.bfloat16)
    assert torch.equal(_round_trip(b, ("bf16",)), b)  # a bf16 run loses nothing


def test_packed_sizes():
    assert packed_bytes(64, ("fp8",), 8, 4) == 64 + 8 * 4
    assert packed_bytes(64, ("int8",), 16, 2) == 64 + 4 * 4
    assert packed_bytes(64, ("bf16",), 8, 4) == 128
    assert packed_bytes(64, ("fp8", "bf16"), 8, 4) == (32 + 4 * 4) + 64
    with pytest.raises(ValueError):
        packed_bytes(12, ("fp8",), 8, 4)  # not whole blocks


@pytest.mark.parametrize("fmt", ["fp8", "int8", "bf16"])
def test_zeros_are_exact_and_empty_packs_to_nothing(fmt):
    z = torch.zeros(3, 2 * BLOCK)
    z[1, :BLOCK] = 1.5  # a block beside all-zero ones
    y = _round_trip(z, (fmt,))
    assert torch.equal(y[0], z[0]) and torch.equal(y[1, BLOCK:], z[1, BLOCK:])
    assert torch.equal(y[1, :BLOCK], z[1, :BLOCK])  # 1.5 is representable in all three
    empty = torch.empty(0, 4, BLOCK)
    assert pack(empty, (fmt,), BLOCK).numel() == 0
    assert _round_trip(empty, (fmt,)).shape == empty.shape


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_non_finite_values_arrive_as_nan_and_spare_their_block(fmt):
    x = torch.linspace(-2, 2, 3 * BLOCK).view(3, BLOCK)
    x[0, 1], x[1, 2], x[1, 3] = float("inf"), float("-inf"), float("nan")
    y = _round_trip(x, (fmt,))
    assert y[0, 1].isnan() and y[1, 2].isnan() and y[1, 3].isnan()
    finite = torch.isfinite(x)
    assert torch.isfinite(y[finite]).all()
    # The rest of those blocks is scaled by its own finite maximum, as a clean block would be.
    clean = x.clone()
    clean[~finite] = 0
    assert torch.equal(y[finite], _round_trip(clean, (fmt,))[finite])


def test_bf16_keeps_inf_and_nan():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0] * 2)
    y = _round_trip(x, ("bf16",))
    assert y[0] == math.inf and y[1] == -math.inf and y[2].isnan() and y[3] == 1.0


def test_interleaved_roles_pack_each_in_its_format():
    """Fused Q|K rows: Q's blocks in fp8, K's in bf16, reassembled in place."""
    q, k = _values((4, BLOCK), 1), _values((4, BLOCK), 2)
    rows = torch.cat([q, k], dim=-1)  # (4, 2 * BLOCK)
    y = _round_trip(rows, ("fp8", "bf16"))
    assert torch.equal(y[:, BLOCK:], k.to(torch.bfloat16).float())
    assert torch.equal(y[:, :BLOCK], _round_trip(q, ("fp8",)))


def test_uneven_pieces_each_round_trip():
    """Messages of different lengths (uneven splits), one of them empty, packed one by one."""
    x = _values((9, BLOCK))
    pieces = list(x.split([4, 0, 5]))
    data = [pack(p, ("fp8",), BLOCK) for p in pieces]
    back = torch.cat([unpack(d, ("fp8",), p.numel(), BLOCK, p.dtype).view(p.shape) for d, p in zip(data, pieces)])
    assert torch.equal(back, _round_trip(x, ("fp8",)))  # per-block scales: the cut does not matter


def test_parse_wire():
    wire = parse_wire("node=fp8, card=bf16")
    assert wire == Wire((("node", "fp8"), ("card", "bf16"))) and wire.text == "node=fp8,card=bf16" and wire.lossy
    assert parse_wire("") is None and parse_wire("exact") is None
    assert wire.format_for("node", "node") == "fp8" and wire.format_for("tile", "node") == "exact"
    assert wire.format_for("node", "node", "k") == "bf16"  # K at least at the K floor
    assert wire.format_for(None, "node") == "exact"
    slowest = parse_wire("slowest=int8")
    assert slowest.format_for("rack", "rack") == "int8" and slowest.format_for("card", "rack") == "exact"


@pytest.mark.parametrize("text, message", [
    ("node=fp4", "format 'fp4' is not one of bf16, fp8, int8"),
    ("node", "'node' is not LEVEL=FORMAT"),
    ("node=fp8,node=bf16", "level 'node' is given twice"),
])
def test_parse_wire_errors(text, message):
    with pytest.raises(UsageError, match=message):
        parse_wire(text)


def test_wire_levels_checked_against_the_run():
    parse_wire("node=fp8,card=bf16").check(["node", "card", "tile"])
    with pytest.raises(UsageError, match="level 'rack' is not one of the run's levels \\(node, rank\\)"):
        parse_wire("rack=fp8").check(["node", "rank"])


def exit_status(argv: list[str]) -> int:
    """What `cocodiff ARGV` exits with: `main`'s return value, or the code argparse exits with inside it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def test_parallel_config_wire():
    config = ParallelConfig(wire="node=fp8", ranks_per_node=2)
    assert config.wire == parse_wire("node=fp8") and config.lossy
    assert not ParallelConfig().lossy and ParallelConfig().wire is None
    with pytest.raises(UsageError, match="level 'card' is not one of the run's levels \\(node, rank\\)"):
        ParallelConfig(wire="card=fp8", ranks_per_node=2)
    ParallelConfig(wire="card=fp8", levels="node=2,card=2")
    with pytest.raises(UsageError, match="does not combine with --compile"):
        ParallelConfig(wire="node=fp8", compile=True)
    # `auto` chooses exchanges and plans, never a lossy format: only the user's wire is there.
    assert ParallelConfig(comm="auto", plan="auto").wire is None and not ParallelConfig(comm="auto", plan="auto").lossy


def test_fp8_variant():
    v = parse_variant("tapa+vfirst+fp8")
    assert v.wire == FP8_WIRE and v.packed and v.canonical == "tapa+vfirst+fp8" and v == parse_variant("tapa+fp8+vfirst")
    assert not parse_variant("tapa+vfirst").packed
    assert parse_variant("cocodiff+fp8".replace("cocodiff", "tapa+vfirst+vmajor")).packed  # stacks with V-Major
    for bad, message in [("diffusers-ulysses+fp8", "does not combine with diffusers-ulysses"), ("tapa+fp8+compile", "does not combine with \\+compile"),
                         ("tapa+fp8+fp8", "given twice"), ("tapa+fp4", "option 'fp4' is not one of")]:
        with pytest.raises(UsageError, match=message):
            parse_variant(bad)


@pytest.mark.parametrize("argv, message", [
    (["verify", "--wire", "node=fp4"], "--wire 'node=fp4': format 'fp4' is not one of bf16, fp8, int8"),
    (["generate", "--nproc", "2", "--ranks-per-node", "1", "--wire", "rack=fp8"],
     "--wire 'rack=fp8': level 'rack' is not one of the run's levels (node, rank)"),
    (["bench", "e2e", "--variants", "flat,tapa+fp4"], "option 'fp4' is not one of"),
])
def test_bad_wire_is_one_line_exit_2(argv, message, capsys):
    assert exit_status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cocodiff: error: ") and message in err[0], err


def test_bench_pack_rates_every_format_and_input():
    from cocodiff.bench.pack import FORMATS, pack_rates

    rows = pack_rates(values=1 << 12, rounds=1)
    assert {(r["dtype"], r["format"]) for r in rows} == {(d, f) for d in ("float32", "bfloat16") for f in FORMATS}
    assert all(r["pack_mvalues_per_s"] > 0 and r["unpack_mvalues_per_s"] > 0 for r in rows)
