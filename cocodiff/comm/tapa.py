"""TAPA: the Ulysses all-to-all in two phases along the node hierarchy.

With G ranks per node and K nodes (rank = node * G + local), every chunk from rank s to rank d
travels in two hops:

    phase 1, inside each node: rank (n, l) gives local peer (n, l') every chunk bound for local
             index l' on any node  -> one all-to-all per node over the fast links
    phase 2, between nodes:    rank (n, l') forwards to (n', l') the chunks of all its node's
             ranks bound for (n', l')  -> G all-to-alls in parallel, one per local index, each
             on its own rail

Inter-node bytes are the same as a flat all-to-all; what changes is that every inter-node
message goes between ranks of the same local index (same rail, no spine), and there are G times
fewer, G times larger messages. Two layout transforms (copies) pay for it: the first is folded
into the copy a flat exchange makes anyway, the second reorders phase 1's output. This is
Tutel's 2DH and DeepSpeed-MoE's hierarchical all-to-all; the result is bit-for-bit the flat one.
The output all-gather at the transformer's exit takes the same two hops (`gather_seq`).

With a codec (codec.py), phase 2 - the only inter-node traffic - goes through it, chunk by chunk
(a chunk from this node's local source j to node n' is the piece named (n', j)); phase 1 always
sends in full.
"""

from __future__ import annotations

import itertools

import torch

from .ulysses import Exchange, Pending, _pad_to, _trim_cat

__all__ = ["TapaExchange"]


class TapaExchange(Exchange):
    name = "tapa"

    def _move(self, rows, gather_sizes, scatter_sizes, finish, cache_key=None, kind="a2a_in") -> Pending:
        t = self.topology
        G, K, n, l = t.ranks_per_node, t.nodes, t.node, t.local_rank
        _, B, M_r, D = rows.shape
        starts = [0, *itertools.accumulate(scatter_sizes)]

        # Layout 1: destinations ordered (local index, node), so each local peer's share is contiguous.
        order = [node * G + local for local in range(G) for node in range(K)]
        send1 = torch.cat([rows[starts[d] : starts[d + 1]] for d in order]).flatten()  # (N, B, M_r, D) reordered
        send1_sizes = [sum(scatter_sizes[node * G + local] for node in range(K)) * B * M_r * D for local in range(G)]
        column = [scatter_sizes[node * G + l] for node in range(K)]  # rows bound for local index l on each node
        source_rows = [gather_sizes[n * G + local] for local in range(G)]  # dim-1 rows of each local source
        recv1_sizes = [sum(column) * B * m * D for m in source_rows]
        work1, recv1 = self._all_to_all(send1, send1_sizes, recv1_sizes, t.intra_group, [n * G + j for j in range(G)], kind)
        coded = self.codec is not None and self.codec.admits(t, cache_key, rows, gather_sizes, scatter_sizes)

        def phase2() -> Pending:
            # recv1: for each local source, its chunks for (node', l), node' = 0..K-1.
            # Layout 2: regroup by destination node, sources in local order within each.
            chunks = [buf.split([c * B * m * D for c in column]) for buf, m in zip(recv1.split(recv1_sizes), source_rows)]
            if coded:
                return self._coded_phase2(chunks, column, source_rows, gather_sizes, scatter_sizes, B, D, finish, cache_key, kind)
            send2 = torch.cat([chunks[local][node] for node in range(K) for local in range(G)])
            send2_sizes = [sum(column[node] * B * m * D for m in source_rows) for node in range(K)]
            recv2_sizes = [
                sum(scatter_sizes[t.rank] * B * gather_sizes[node * G + local] * D for local in range(G)) for node in range(K)
            ]
            work2, recv2 = self._all_to_all(send2, send2_sizes, recv2_sizes, t.inter_group, [node * G + l for node in range(K)], kind)
            # recv2 is ordered (source node, source local) = global source rank, as `finish` expects.
            return Pending(work2, lambda: finish(recv2), self.stats, kind)

        return Pending(work1, phase2, self.stats, kind, phases=2)

    def gather_seq(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """The output all-gather in the same two hops: inside each node, then node blocks between
        ranks of the same local index (same rail, no spine). Same bytes per link class as flat."""
        t = self.topology
        G, K, n, l = t.ranks_per_node, t.nodes, t.node, t.local_rank
        mine = _pad_to(x, dim, max(sizes))
        node_block = torch.stack(self._all_gather(mine, t.intra_group, [n * G + j for j in range(G)]))
        blocks = self._all_gather(node_block, t.inter_group, [k * G + l for k in range(K)])
        return _trim_cat([shard for block in blocks for shard in block.unbind(0)], dim, sizes)  # global rank order

    def _coded_phase2(self, chunks, column, source_rows, gather_sizes, scatter_sizes, B, D, finish, cache_key, kind) -> Pending:
        """Phase 2 through the codec: the same messages, each piece encoded (same-node ones as they are)."""
        t = self.topology
        G, K, n, l = t.ranks_per_node, t.nodes, t.node, t.local_rank
        # Pieces by (destination node, source local); a piece names its peer (node, local), or
        # None where it stays on this node (sent in full).
        pieces = [
            (chunks[local][node].view(column[node], B, source_rows[local], D), None if node == n else (node, local))
            for node in range(K) for local in range(G)
        ]
        incoming = [
            (gather_sizes[node * G + local], None if node == n else (node, local)) for node in range(K) for local in range(G)
        ]
        send2, piece_sizes, recv_piece_sizes, unpack = self.codec.move(
            cache_key, pieces, incoming, scatter_sizes[t.rank], B, D, chunks[0][0].dtype
        )
        send2_sizes = [sum(piece_sizes[node * G : (node + 1) * G]) for node in range(K)]
        recv2_sizes = [sum(recv_piece_sizes[node * G : (node + 1) * G]) for node in range(K)]
        work2, recv2 = self._all_to_all(send2, send2_sizes, recv2_sizes, t.inter_group, [node * G + l for node in range(K)], kind)
        return Pending(work2, lambda: finish(torch.cat(unpack(recv2))), self.stats, kind)
