"""An optional codec for the slow (inter-node) phase of the Ulysses exchange.

An exchange cuts what it sends into pieces, one per (destination, source) pair that travels in
one message, and knows which pieces cross nodes. Without a codec (`codec=None`) every piece is
sent as it is: the exchange is exact. With one, the exchange asks it, per call, whether this call
goes through it (`admits`), and if so hands it the pieces; the codec returns the bytes to send,
the size of every piece on the wire in both directions, and a function that turns the received
bytes back into whole pieces. Pieces that stay on the node are marked (peer `None`) and a codec
must send them as they are.

Both sides of every message must compute its size from the global layout and the codec's own
rank-agreed state alone: a size that depended on one rank's data would desynchronize the
collective. The exchange only moves the bytes; what the codec does to them (and what it keeps
between calls) is its own business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..topology import Topology

__all__ = ["Incoming", "Piece", "SlowPhaseCodec", "Unpack"]

Piece = tuple[torch.Tensor, tuple | None]
"""A piece to send: its (N, B, M, D) rows and its peer (how the exchange names the other end of an
inter-node piece), or None for a piece that stays on this node."""
Incoming = tuple[int, tuple | None]
"""A piece to receive: its source's token count M and its peer, or None for one from this node."""
Unpack = Callable[[torch.Tensor], list[torch.Tensor]]
"""Received bytes -> per incoming piece, in receive order, its whole values, flat, in the dtype."""


class SlowPhaseCodec(ABC):
    """What the flat and TAPA exchanges ask of a codec for their inter-node pieces."""

    @abstractmethod
    def admits(self, topology: Topology, key: tuple | None, rows: torch.Tensor, gather_sizes: list[int],
               scatter_sizes: list[int]) -> bool:
        """Whether this exchange goes through the codec (the same answer on every rank).

        `key` names the tensor exchanged, (layer, kind, call), or is None for traffic that must be
        sent as it is; `rows` is this rank's (N, B, M_r, D) send buffer and the sizes are the
        exchange's global layout (see `Exchange.swap`)."""

    @abstractmethod
    def move(self, key: tuple, pieces: list[Piece], incoming: list[Incoming], rows_here: int, B: int, D: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, list[int], list[int], Unpack]:
        """One collective's byte buffers from its pieces.

        pieces: per piece to send, in send order; incoming: per piece to receive, in receive order;
        every incoming piece is (rows_here, B, M, D) rows. Returns (send bytes, uint8, flat; bytes
        per piece sent; bytes per piece received; unpack)."""
