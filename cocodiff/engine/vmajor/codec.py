"""V-Major's index+rows codec: the slow-phase codec (`comm.codec`) of the flat and TAPA exchanges.

A piece is what one rank sends to one inter-node peer in one exchange: (N, B, M, D) rows, M the
source's tokens. The sender sends only `keep` of its M tokens (the most changed against its
mirror of what the receiver holds) with their int32 indices, and the receiver writes them into
its cache and uses the cache whole. Pieces to ranks on the sender's own node are always sent in
full. Both sides compute every piece's size from the global layout and the schedule alone, so
message sizes agree without any data-dependent exchange.

Keys: a piece is named by (layer, tensor, call, *peer), `peer` being whatever the exchange uses
to tell its pieces apart (the flat exchange: the other rank; TAPA: node and local index). The
sender's mirror and the receiver's cache of one piece are created in the same call, so "has a
mirror" on one side and "has a cache" on the other agree, and so does `keep`.

With a wire format on the node level (`--wire node=fp8`, `+fp8`; distributed/comm/wire.py), the kept rows
travel packed in it (indices stay int32); the mirror holds what the receiver decoded, so the next
choice of tokens measures the change against what the receiver really has.
"""

from __future__ import annotations

import torch

from cocodiff.config.wire import Wire
from cocodiff.distributed.comm.codec import Incoming, Piece, SlowPhaseCodec, Unpack
from cocodiff.distributed.comm.wire import pack, packed_bytes, unpack
from cocodiff.distributed.topology import Topology

from .state import VMajor, select_tokens

__all__ = ["INDEX_BYTES", "VMajorCodec", "to_bytes"]

INDEX_BYTES = 4  # int32 token indices


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """Any tensor -> its bytes, uint8, flat."""
    return t.contiguous().view(torch.uint8).flatten()


class VMajorCodec(SlowPhaseCodec):
    """Selective sends of the inter-node pieces, through the caches of one `VMajor` state."""

    def __init__(self, state: VMajor, wire: tuple[Wire, str] | None = None) -> None:
        self.state = state
        self.wire = wire
        """The wire formats and the node level's name, to pack the inter-node rows (None: exact)."""

    def _formats(self, tensor: str, D: int) -> tuple[tuple[str, ...], int]:
        """How a tensor's inter-node rows are packed: the format per role of a row, and the block
        (fused Q|K rows: Q's and K's halves; exact without a wire)."""
        roles, block = (("", "k"), D // 2) if tensor == "qk" else (("k",) if tensor == "k" else ("",), D)
        if self.wire is None:
            return ("exact",) * len(roles), block
        wire, node = self.wire
        return tuple(wire.format_for(node, node, role) for role in roles), block

    def admits(self, topology: Topology, key: tuple | None, rows: torch.Tensor, gather_sizes: list[int],
               scatter_sizes: list[int]) -> bool:
        """Whether this exchange sends selectively: a selective tensor of a layer that fits the
        memory cap (decided at the layer's first call, from the global layout)."""
        vm = self.state
        if key is None or vm.schedule.off or not vm.selective(key[1]):
            return False
        _, B, _, D = rows.shape

        def cost() -> int:
            """Mirror + cache bytes per rank: twice the bytes crossing nodes in this exchange, summed
            over ranks (all pairs minus same-node pairs), over the ranks; known to all."""
            G = topology.ranks_per_node
            same = sum(sum(gather_sizes[k * G : (k + 1) * G]) * sum(scatter_sizes[k * G : (k + 1) * G]) for k in range(topology.nodes))
            inter = (sum(gather_sizes) * sum(scatter_sizes) - same) * B * D * rows.element_size()
            return 2 * inter // topology.world_size

        return vm.admit(key[:2], cost)

    def move(self, key: tuple, pieces: list[Piece], incoming: list[Incoming], rows_here: int, B: int, D: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, list[int], list[int], Unpack]:
        """Pieces to send -> (send bytes, bytes per piece sent, bytes per piece received, unpack);
        inter-node pieces carry indices + kept rows, the others their rows (see `comm.codec`)."""
        item = torch.empty((), dtype=dtype).element_size()
        chosen = self._choose(key, pieces)
        parts = [to_bytes(piece) if peer is None else self._encode(piece, key, peer, chosen[peer], D) for piece, peer in pieces]
        layout = [(tokens, peer, tokens if peer is None else self._kept(key, peer, tokens)) for tokens, peer in incoming]
        recv_sizes = [
            rows_here * B * tokens * D * item if peer is None else self._piece_bytes(key, k, rows_here, B, D, item)
            for tokens, peer, k in layout
        ]

        def unpack(recv: torch.Tensor) -> list[torch.Tensor]:
            return [
                part.clone().view(dtype) if peer is None else self._decode(part, key, peer, k, (rows_here, B, D), dtype)
                for (tokens, peer, k), part in zip(layout, recv.split(recv_sizes))
            ]

        return torch.cat(parts), [p.numel() for p in parts], recv_sizes, unpack

    def _choose(self, key: tuple, pieces: list[Piece]) -> dict[tuple, torch.Tensor]:
        """Sender side: per inter-node peer, the token indices its piece sends this call: every
        token the first time (or when all are kept), Q/K the tokens V sent ('vqk'), else the most
        changed against the mirror, chosen for all pieces at once (`select_tokens`: one top-k)."""
        vm = self.state
        layer, tensor, call = key
        chosen: dict[tuple, torch.Tensor] = {}
        selective = []
        for piece, peer in pieces:
            if peer is None:
                continue
            tokens = piece.shape[2]
            sent = vm.indices.get((layer, "v", call, *peer))
            if tensor != "v" and sent is not None and sent[0] == tokens:  # Q/K of the tokens V sent
                chosen[peer] = sent[1]
                continue
            # V, or a piece of other tokens than V's (cross-attention: Q of the image, K/V of the text)
            mirror = vm.mirrors.get((*key, *peer))
            if mirror is None or vm.keep(tokens) == tokens:
                chosen[peer] = torch.arange(tokens, device=piece.device)
            else:
                selective.append((peer, piece, mirror, vm.keep(tokens)))
        if selective:
            peers, changed, mirrors, keeps = zip(*selective)
            chosen.update(zip(peers, select_tokens(list(changed), list(mirrors), list(keeps))))
        if tensor == "v":
            for piece, peer in pieces:
                if peer is not None:
                    vm.indices[(layer, "v", call, *peer)] = (piece.shape[2], chosen[peer])
        return chosen

    def _encode(self, piece: torch.Tensor, key: tuple, peer: tuple, index: torch.Tensor, D: int) -> torch.Tensor:
        """Sender side: (N, B, M, D) piece for an inter-node peer and the tokens it sends -> bytes
        to send (indices + kept rows)."""
        vm = self.state
        layer, tensor, call = key
        piece_key = (layer, tensor, call, *peer)
        rows = piece[:, :, index]
        formats, block = self._formats(tensor, D)
        data = pack(rows, formats, block)
        if self.wire is not None:  # the mirror holds what the receiver will have
            rows = unpack(data, formats, rows.numel(), block, rows.dtype).view(rows.shape)
        if piece_key in vm.mirrors:
            vm.mirrors[piece_key][:, :, index] = rows
        else:
            vm.mirrors[piece_key] = rows  # first time: every token, in order (a new tensor)
        if tensor == "v":
            vm.record_error(piece, vm.mirrors[piece_key])
        # A full step sends every token in order: no indices needed (both sides know).
        return data if vm.full_step else torch.cat([to_bytes(index.to(torch.int32)), data])

    def _kept(self, key: tuple, peer: tuple, tokens: int) -> int:
        """Receiver side: tokens of a piece from an inter-node peer that arrive this call."""
        vm = self.state
        return vm.keep(tokens) if (*key, *peer) in vm.caches else tokens

    def _piece_bytes(self, key: tuple, k: int, rows_here: int, B: int, D: int, item: int) -> int:
        """Bytes of a selective piece carrying k tokens of (rows_here, B, ., D) rows."""
        formats, block = self._formats(key[1], D)
        return (0 if self.state.full_step else k * INDEX_BYTES) + packed_bytes(rows_here * B * k * D, formats, block, item)

    def _decode(self, part: torch.Tensor, key: tuple, peer: tuple, k: int, shape: tuple[int, int, int],
                dtype: torch.dtype) -> torch.Tensor:
        """Receiver side: bytes of a piece from an inter-node peer -> the whole piece, flat, from the cache.

        `shape` is (rows_here, B, D) of the piece's (rows_here, B, tokens, D) layout."""
        vm = self.state
        rows_here, B, D = shape
        split = 0 if vm.full_step else k * INDEX_BYTES
        index = part[:split].clone().view(torch.int32).long() if split else torch.arange(k, device=part.device)
        formats, block = self._formats(key[1], D)
        rows = unpack(part[split:], formats, rows_here * B * k * D, block, dtype).view(rows_here, B, k, D)
        piece_key = (*key, *peer)
        if piece_key in vm.caches:
            vm.caches[piece_key][:, :, index] = rows
        else:
            vm.caches[piece_key] = rows.clone()  # first time: every token was sent
        return vm.caches[piece_key].flatten()
