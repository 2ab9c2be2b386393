"""V-Major's choice of tokens: one top-k for all the inter-node pieces of an exchange, the same
tokens, bytes and caches as choosing piece by piece.

The codec is driven directly (no process group): each call's send buffer is fed back to its own
unpack, as if every peer had sent the same pieces, over a few denoising steps of drifting values.
The reference is the per-piece codec the batched choice replaced, kept here as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cocodiff.engine.vmajor import VMajor, VMajorCodec, parse_schedule
from cocodiff.engine.vmajor.codec import to_bytes

N, B, D = 2, 2, 8
# Pieces of an exchange: this node's (peer None) and other nodes' of uneven token counts (TAPA's
# sources hold 5 or 6 tokens), so that the pieces keep different counts (0.3: 4 of 5, 5 of 6).
LAYOUT = [(5, None), (6, (1, 0)), (5, (1, 1)), (6, None), (5, (2, 0)), (6, (2, 1))]


def _reference_select(piece: torch.Tensor, mirror: torch.Tensor, keep: int) -> torch.Tensor:
    """The per-piece choice: (N, B, M, D) new and held values -> the `keep` most-changed tokens."""
    change = (piece - mirror).float().square().sum(dim=(0, 1, 3))  # (M,)
    return change.topk(keep, sorted=False).indices.sort().values


class PerPieceCodec(VMajorCodec):
    """The codec as it was before the batched choice: a top-k per inter-node piece."""

    def _choose(self, key, pieces):
        vm = self.state
        layer, tensor, call = key
        chosen = {}
        for piece, peer in pieces:
            if peer is None:
                continue
            v_key = (layer, "v", call, *peer)
            tokens = piece.shape[2]
            k = vm.keep(tokens) if (*key, *peer) in vm.mirrors else tokens
            if tensor == "v" or v_key not in vm.indices or vm.indices[v_key][0] != tokens:
                mirror = vm.mirrors.get((*key, *peer))
                index = torch.arange(tokens, device=piece.device) if mirror is None else _reference_select(piece, mirror, k)
                if tensor == "v":
                    vm.indices[v_key] = (tokens, index)
            else:
                index = vm.indices[v_key][1]
            chosen[peer] = index
        return chosen


def _steps(codec: VMajorCodec, tensors: str, steps: int = 4) -> list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]:
    """Per step and tensor: the bytes `codec` sends, the whole pieces its unpack gives back, and the
    pieces it was given."""
    generator = torch.Generator().manual_seed(0)
    values = {kind: [torch.randn(N, B, m, D, generator=generator) for m, _ in LAYOUT] for kind in ("v", "qk")}
    out = []
    for step in range(steps):
        codec.state.begin_call(step, steps, 1.0 - step / steps)
        for kind in ("v", "qk") if tensors == "vqk" else ("v",):
            drift = [x + 0.1 * torch.randn(x.shape, generator=generator) for x in values[kind]]
            values[kind] = drift
            pieces = [(x, peer) for x, (_, peer) in zip(drift, LAYOUT)]
            send, _, _, unpack = codec.move((0, kind, 0), pieces, LAYOUT, N, B, D, torch.float32)
            # A copy: the receiver's cache, which unpack gives views of, changes at the next call.
            out.append((send, [w.clone() for w in unpack(send)], drift))
    return out


KEEP = {5: 4, 6: 5}
"""constant:0.3 after the first step: tokens a piece of 5 or 6 sends."""


def _received(tensors: str, sent: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """What the receiver should hold, per call of `_steps` (its pieces `sent`), worked out without
    the codec: pieces from this node whole; an inter-node piece whole the first time, then the new
    values at its KEEP most changed tokens (against what the receiver held; Q|K at the tokens V
    sent) and what it held before everywhere else."""
    held: dict[tuple[str, int], torch.Tensor] = {}
    chosen: dict[int, torch.Tensor] = {}
    out = []
    kinds = ("v", "qk") if tensors == "vqk" else ("v",)
    for call, pieces in enumerate(sent):
        kind = kinds[call % len(kinds)]
        whole = []
        for i, (piece, (tokens, peer)) in enumerate(zip(pieces, LAYOUT)):
            if peer is None or (kind, i) not in held:
                new = piece.clone()
            else:
                if kind == "v":
                    chosen[i] = _reference_select(piece, held[kind, i], KEEP[tokens])
                new = held[kind, i].clone()
                new[:, :, chosen[i]] = piece[:, :, chosen[i]]
                assert not torch.equal(new, piece)  # some tokens were not sent
            if peer is not None:
                held[kind, i] = new
            whole.append(new)
        out.append(whole)
    return out


@pytest.mark.parametrize("tensors", ["v", "vqk"])
def test_one_top_k_chooses_what_each_piece_chose(tensors):
    schedule = parse_schedule("constant:0.3")
    batched = _steps(VMajorCodec(VMajor(schedule, tensors)), tensors)
    reference = _steps(PerPieceCodec(VMajor(schedule, tensors)), tensors)
    expected = _received(tensors, [pieces for _, _, pieces in batched])
    for (send, whole, _), (ref_send, ref_whole, _), want in zip(batched, reference, expected, strict=True):
        assert torch.equal(send, ref_send)  # the same indices and rows on the wire
        assert all(torch.equal(a, b) for a, b in zip(whole, ref_whole))  # the same pieces used
        # ... and they are what the receiver should hold.
        assert [w.shape for w in whole] == [(w.numel(),) for w in want]
        assert all(torch.equal(a, b.flatten()) for a, b in zip(whole, want, strict=True))


class TopKCount(TorchFunctionMode):
    """Counts top-k calls, as a function or a method."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "") == "topk"
        return func(*args, **(kwargs or {}))


def test_one_top_k_per_exchange_call():
    """A selective step's V exchange takes one top-k for its four inter-node pieces; Q/K ('vqk')
    reuse V's tokens (none); a full step sends every token (none)."""
    state = VMajor(parse_schedule("constant:0.3"), "vqk")
    codec = VMajorCodec(state)
    pieces = [(torch.randn(N, B, m, D), peer) for m, peer in LAYOUT]
    counts = []
    for step in range(2):
        state.begin_call(step, 4, 1.0 - step / 4)
        for kind in ("v", "qk"):
            with TopKCount() as count:
                codec.move((0, kind, 0), pieces, LAYOUT, N, B, D, torch.float32)
            counts.append(count.calls)
    assert counts == [0, 0, 1, 0]


def test_pieces_of_unequal_counts_each_keep_their_own():
    """Each piece sends its own count of its most changed tokens, sorted (6 tokens keep 5, 5 keep 4)."""
    state = VMajor(parse_schedule("constant:0.3"))
    codec = VMajorCodec(state)
    held = [torch.zeros(N, B, m, D) for m, _ in LAYOUT]
    state.begin_call(0, 4, 1.0)
    codec.move((0, "v", 0), [(x, peer) for x, (_, peer) in zip(held, LAYOUT)], LAYOUT, N, B, D, torch.float32)
    state.begin_call(1, 4, 0.75)
    changed = [x.clone() for x in held]
    changed[1][:, :, [5, 0, 3]] = 1.0  # 6 tokens, keeps 5: these three and two unchanged ones
    changed[2][:, :, [4, 1]] = 2.0  # 5 tokens, keeps 4
    chosen = codec._choose((0, "v", 0), [(x, peer) for x, (_, peer) in zip(changed, LAYOUT)])
    assert set(chosen) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert {0, 3, 5} <= set(chosen[(1, 0)].tolist()) and len(chosen[(1, 0)]) == 5
    assert {1, 4} <= set(chosen[(1, 1)].tolist()) and len(chosen[(1, 1)]) == 4
    assert all(torch.equal(i, i.sort().values) for i in chosen.values())
    assert to_bytes(chosen[(1, 0)].to(torch.int32)).numel() == 5 * 4


def test_q_of_other_tokens_than_v_chooses_its_own():
    """Cross-attention (LTX-Video): K/V of the text, Q of the image. Q's pieces hold other tokens than
    V's, so Q keeps its own most changed tokens: what each piece sends is what its receiver expects
    (`keep` of its own count), and every index is in range."""
    state = VMajor(parse_schedule("constant:0.3"), "vqk")
    codec = VMajorCodec(state)
    text = [(3, peer) for _, peer in LAYOUT]  # 3 text tokens per piece: V keeps all 3 or 2
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        state.begin_call(step, 4, 1.0 - step / 4)
        for kind, layout in (("v", text), ("q", LAYOUT)):
            pieces = [(torch.randn(N, B, m, D, generator=generator), peer) for m, peer in layout]
            send, sent_sizes, recv_sizes, unpack = codec.move((0, kind, 0), pieces, layout, N, B, D, torch.float32)
            assert sent_sizes == recv_sizes  # every peer sends what the receiver expects
            whole = unpack(send)
            assert [w.numel() for w in whole] == [N * B * m * D for m, _ in layout]
