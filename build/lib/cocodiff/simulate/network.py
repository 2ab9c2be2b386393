"""Collective phases as traffic matrices, routed over a system's links.

A phase is a traffic matrix T (P x P): T[r, s] bytes from rank r to rank s, all flows in flight at
once. Every flow is routed over the links of the system (see system.py); the bytes per link are
summed, and the phase takes

    max over links (bytes on the link / its bandwidth)  +  max over ranks (sum of the latencies
                                                           of the messages the rank sends)

This link-load model is what lets TAPA's parallel second-phase groups on disjoint rails count as
parallel, and what makes a flat all-to-all pay for the spine on a rail fabric. Where the system
names an incast term (system.Incast), the bandwidth part is multiplied by its factor, from each
receiver's fan-in (peers sending to it in the phase) and received bytes.

Ulysses exchange (`swap`): rank r holds gather[r] rows (tokens for Q/K/V, heads for the output)
of all scatter columns and ends with scatter[s] columns of all rows, so T[r, s] = gather[r] x
scatter[s] x unit, unit = B x D x bytes per element (x 2 for Q and K sent as one message).

TAPA with groups of g consecutive ranks (K = P / g groups), rank (n, l) = n g + l:

    phase 1  (n, l) -> (n, l'):   gather[n, l] x sum_n'' scatter[n'', l'] x unit
    phase 2  (n, l) -> (n', l):   sum_j gather[n, j] x scatter[n', l] x unit
             with V-Major, per piece j: kept_j tokens x scatter[n', l] x unit + 4 bytes x kept_j

Both phases move the same inter-node bytes as flat when groups are nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .system import PHASE, LinkParams, System

__all__ = ["PhaseLoad", "Routing", "gather_matrix", "phase_load", "routing", "swap_matrix", "tapa_matrices"]

INTER_CLASSES = ("nic", "uplink", "spine")


@dataclass(frozen=True, eq=False)
class Routing:
    """Every ordered rank pair's path over the links of one system at one node count."""

    ranks: int
    bw_classes: tuple[str, ...]
    lat_classes: tuple[str, ...]
    link_class: np.ndarray
    """(L,) bandwidth class of each link"""
    pair_index: np.ndarray
    """(E,) flattened r * P + s of each (flow, link) incidence"""
    link_index: np.ndarray
    """(E,) the link of each incidence"""
    msg_class: np.ndarray
    """(P, P) latency class of a message from r to s (-1 on the diagonal)"""
    same_node: np.ndarray
    """(P, P) bool"""


def _coords(local: int, sizes: list[int]) -> list[int]:
    out = []
    for size in sizes:
        local, c = divmod(local, size)
        out.append(c)
    return out


@lru_cache(maxsize=64)
def routing(system: System) -> Routing:
    """Route every flow: same node over the lowest level the two ranks share, else the network."""
    P, G = system.ranks, system.ranks_per_node
    sizes = [level.size for level in system.levels]
    net = system.network
    links: dict[tuple, int] = {}
    classes: list[str] = []

    def link(cls: str, *key) -> int:
        full = (cls, *key)
        if full not in links:
            links[full] = len(links)
            classes.append(cls)
        return links[full]

    lat_classes = tuple(level.name for level in system.levels) + ("network",)
    msg_class = np.full((P, P), -1, dtype=np.int64)
    pairs, hops = [], []
    for r in range(P):
        nr, lr = divmod(r, G)
        cr = _coords(lr, sizes)
        for s in range(P):
            if r == s:
                continue
            ns, ls = divmod(s, G)
            if nr == ns:
                cs = _coords(ls, sizes)
                top = max(i for i in range(len(sizes)) if cr[i] != cs[i])
                level = system.levels[top]
                mr, ms = tuple(cr[top:]), tuple(cs[top:])
                if level.link == "port":
                    path = [link(level.name, nr, mr, "tx"), link(level.name, nr, ms, "rx")]
                else:
                    path = [link(level.name, nr, mr, ms)]
                msg_class[r, s] = top
            else:
                kr, ks = system.nic_of(lr), system.nic_of(ls)
                cls = system.network_class
                path = [link(cls, nr, kr, "tx"), link(cls, ns, ks, "rx")]
                if net.kind == "rail" and kr != ks:
                    path += [link("spine", kr, "up"), link("spine", ks, "down")]
                msg_class[r, s] = len(lat_classes) - 1
            pairs += [r * P + s] * len(path)
            hops += path
    bw_classes = tuple(dict.fromkeys(classes))
    nodes = np.arange(P) // G
    return Routing(
        ranks=P, bw_classes=bw_classes, lat_classes=lat_classes,
        link_class=np.array([bw_classes.index(c) for c in classes], dtype=np.int64),
        pair_index=np.array(pairs, dtype=np.int64), link_index=np.array(hops, dtype=np.int64),
        msg_class=msg_class, same_node=nodes[:, None] == nodes[None, :],
    )


@dataclass(frozen=True, eq=False)
class PhaseLoad:
    """What one phase asks of the links, independent of their speed."""

    busiest: np.ndarray
    """(bandwidth classes,) bytes on the busiest link of each class"""
    messages: np.ndarray
    """(P, latency classes) messages each rank sends"""
    inter_node_bytes: float
    intra_node_bytes: float
    bw_classes: tuple[str, ...]
    lat_classes: tuple[str, ...]
    fan_in: np.ndarray
    """(P,) peers that send to each rank in this phase"""
    received: np.ndarray
    """(P,) bytes each rank receives in this phase"""
    codec_s: float = 0.0
    """Packing before the send and unpacking after the receive (wire formats; simulate/wire.py)"""

    def incast_factor(self, params: LinkParams) -> float:
        """The slowdown of this phase's bandwidth time by incast (1: none, or none modelled)."""
        return 1.0 if params.incast is None else params.incast.factor(self.fan_in, self.received)

    def time(self, params: LinkParams) -> tuple[float, str]:
        """(seconds, 'intra' or 'inter'): the phase's time and the kind of its bottleneck."""
        bw = np.array([params.bandwidth[c] for c in self.bw_classes])
        lat = np.array([params.latency[c] for c in self.lat_classes])
        per_class = self.busiest / bw * self.incast_factor(params)
        latency = float((self.messages @ lat).max()) if self.messages.size else 0.0
        if self.messages.any():  # a fixed cost per phase, where the system has one
            latency += params.latency.get(PHASE, 0.0)
        if per_class.size and per_class.max() > 0:
            where = self.bw_classes[int(per_class.argmax())]
            kind = "inter" if where in INTER_CLASSES else "intra"
        else:
            kind = "inter" if self.messages[:, -1].any() else "intra"
        return float(per_class.max(initial=0.0)) + latency + self.codec_s, kind

    @property
    def empty(self) -> bool:
        return not self.messages.any()


def phase_load(route: Routing, traffic: np.ndarray, codec_s: float = 0.0) -> PhaseLoad:
    """Route a (P, P) traffic matrix (bytes; the diagonal is ignored); `codec_s`: its wire
    formats' pack and unpack seconds."""
    T = np.array(traffic, dtype=np.float64)
    np.fill_diagonal(T, 0.0)
    loads = np.bincount(route.link_index, weights=T.ravel()[route.pair_index], minlength=len(route.link_class))
    busiest = np.zeros(len(route.bw_classes))
    np.maximum.at(busiest, route.link_class, loads)
    sending = T > 0
    messages = np.stack([(sending & (route.msg_class == c)).sum(1) for c in range(len(route.lat_classes))], axis=1)
    return PhaseLoad(
        busiest=busiest, messages=messages.astype(np.float64),
        inter_node_bytes=float(T[~route.same_node].sum()), intra_node_bytes=float(T[route.same_node].sum()),
        bw_classes=route.bw_classes, lat_classes=route.lat_classes,
        fan_in=sending.sum(0).astype(np.float64), received=T.sum(0), codec_s=codec_s,
    )


def swap_matrix(gather: list[int], scatter: list[int], unit: float) -> np.ndarray:
    """One flat Ulysses exchange: T[r, s] = gather[r] x scatter[s] x unit bytes."""
    T = np.outer(np.asarray(gather, dtype=np.float64), np.asarray(scatter, dtype=np.float64)) * unit
    np.fill_diagonal(T, 0.0)
    return T


def tapa_matrices(
    gather: list[int],
    scatter: list[int],
    unit: float,
    group: int,
    kept: np.ndarray | None = None,
    index_bytes: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """TAPA's two phases for groups of `group` consecutive ranks.

    kept[r], index_bytes[r]: with V-Major, the mean tokens of rank r's rows that phase 2 sends per
    piece, and the mean index bytes that come with them (None: everything, no indices).
    """
    g_arr, s_arr = np.asarray(gather, dtype=np.float64), np.asarray(scatter, dtype=np.float64)
    P = len(g_arr)
    K = P // group
    gath, scat = g_arr.reshape(K, group), s_arr.reshape(K, group)
    kept_rows = (gath if kept is None else np.asarray(kept, dtype=np.float64).reshape(K, group)).sum(1)
    index_rows = np.zeros(K) if index_bytes is None else np.asarray(index_bytes, dtype=np.float64).reshape(K, group).sum(1)
    T1, T2 = np.zeros((P, P)), np.zeros((P, P))
    per_local = scat.sum(0)  # (group,) columns bound for each local index, over all groups
    for n in range(K):
        block = np.outer(gath[n], per_local) * unit
        np.fill_diagonal(block, 0.0)
        T1[n * group:(n + 1) * group, n * group:(n + 1) * group] = block
    for local in range(group):
        idx = np.arange(K) * group + local
        block = np.outer(kept_rows, scat[:, local]) * unit + index_rows[:, None]
        np.fill_diagonal(block, 0.0)
        T2[np.ix_(idx, idx)] = block
    return T1, T2


def gather_matrix(ranks: int, shard_bytes: float) -> np.ndarray:
    """All-gather of padded shards: every rank sends its shard to every other rank."""
    T = np.full((ranks, ranks), float(shard_bytes))
    np.fill_diagonal(T, 0.0)
    return T
