"""What an emulated cluster is made of: network namespaces, veth links, bridges, routes, shaping.

A `Fabric` is plain data computed from the cluster's shape; `netns.py` turns it into `ip` and `tc`
commands. Every name starts with `cdf-` and every address is in 10.213.0.0/16 - 10.215.0.0/16
(10.216.0.0/16 and up for the tiers of deeper levels), inside namespaces this module creates;
the root namespace is never touched (veths are created directly inside their namespaces).

shared: one namespace per node; its ranks share one uplink to a switch, shaped at
        `inter_node_rate` both ways; intra-node traffic stays on the node's loopback.

    cdf-n0 [ranks 0..G-1] --eth0==n0-- cdf-sw (bridge) --n1==eth0-- cdf-n1 [ranks G..2G-1]

rail:   one namespace per rank. The ranks of node n meet on a node bridge (cdf-node{n}; fast,
        optionally shaped at `intra_node_rate`). Rank k of every node sits on rail k (cdf-rail{k},
        a bridge and router; shaped at `inter_node_rate`). Cross-rail, cross-node traffic is
        routed through the spine (cdf-spine), whose links are shaped at `spine_rate`, as in
        rail-optimized GPU clusters with an oversubscribed spine.

    cdf-n{n}r{k}: nb0 -> cdf-node{n} bridge        (same node, other local index: host routes)
                  rail0 -> cdf-rail{k} bridge       (same local index, other node: on-link)
                  default via cdf-rail{k} -> cdf-spine -> cdf-rail{k'}   (everything else)

        Deeper levels (`--levels node=2,card=2,tile=2`, rail only) add one bridge tier per level
        inside the node: level d's groups (the ranks of one card, for d = tile) each get a
        bridge cdf-l{d}g{g}, every rank a link lv{d} to its group's bridge shaped at level d's
        rate, and a same-node peer's host route takes the tier of the innermost group the two
        share (the card's bridge for the other tile, the node bridge for another card). The
        node bridge carries level 1 (cards) at its rate; rails and spine stay the node level's.

    cdf-n{n}r{k}: lv2 -> cdf-l2g{card} bridge      (same card, other tile: host routes)
                  nb0 -> cdf-node{n} bridge        (same node, other card)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..config.env import CLUSTER_PREFIX_ENV
from ..config.levels import Levels, block, format_levels, link_level, two_levels

__all__ = ["Fabric", "Iface", "build_fabric", "parse_level_rates", "parse_rate", "prefix"]


def prefix() -> str:
    """Start of every namespace name; COCODIFF_CLUSTER_PREFIX lets a second cluster coexist (tests)."""
    return os.environ.get(CLUSTER_PREFIX_ENV, "cdf-")

FABRICS = ("shared", "rail")


def parse_rate(rate: str) -> int:
    """'400mbit' -> 400_000_000 bits/s (tc's units: bit, kbit, mbit, gbit)."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return int(value * scale)
            break
    raise ValueError(f"rate {rate!r} is not a positive number followed by bit, kbit, mbit or gbit (e.g. 400mbit)")


@dataclass(frozen=True)
class Iface:
    """One end of a veth pair (or a namespace's loopback when shaped)."""

    ns: str
    name: str
    addr: str | None = None
    """CIDR address, e.g. 10.213.1.1/24."""
    bridge: str | None = None
    """Bridge (in the same namespace) this end is enslaved to."""
    rate: str | None = None
    """tbf egress rate, e.g. 400mbit; None: unshaped."""


@dataclass
class Fabric:
    kind: str
    nodes: int
    ranks_per_node: int
    rates: dict[str, str | None]
    namespaces: list[str] = field(default_factory=list)
    bridges: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(namespace, bridge name, CIDR address or None)"""
    links: list[tuple[Iface, Iface]] = field(default_factory=list)
    shaped_loopbacks: list[tuple[str, str]] = field(default_factory=list)
    """(namespace, rate) whose loopback is shaped (shared fabric's intra-node rate)"""
    routes: list[tuple[str, str, str]] = field(default_factory=list)
    """(namespace, destination, 'via ADDR' or 'dev IFACE')"""
    routers: list[str] = field(default_factory=list)
    """namespaces that forward IPv4"""
    rank_ns: list[str] = field(default_factory=list)
    rank_addr: list[str] = field(default_factory=list)
    """the address each rank listens on (gloo's interface address)"""
    rank_iface: list[str] = field(default_factory=list)
    """GLOO_SOCKET_IFNAME for each rank"""
    levels: list[tuple[str, int]] = field(default_factory=list)
    """(name, size) per level, outermost (the nodes) first, when there are more than two; empty:
    nodes x ranks per node."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v}" for k, v in self.rates.items() if v)
        shape = format_levels(tuple(map(tuple, self.levels))) if self.levels else f"{self.nodes}x{self.ranks_per_node}"
        return f"{self.kind} {shape} ({rates or 'unshaped'})"


def parse_level_rates(text: str, levels: Levels) -> dict[str, str]:
    """`node=400mbit,card=1gbit,tile=4gbit` -> {level: rate}, each name one of `levels`'."""
    rates: dict[str, str] = {}
    names = [name for name, _ in levels]
    for item in text.split(","):
        name, _, rate = (part.strip() for part in item.partition("="))
        if name not in names or not rate:
            raise ValueError(f"--level-rates {text!r}: {item.strip()!r} is not LEVEL=RATE with LEVEL one of {', '.join(names)}")
        parse_rate(rate)
        rates[name] = rate
    return rates


def build_fabric(
    kind: str,
    nodes: int,
    ranks_per_node: int,
    inter_node_rate: str | None = "400mbit",
    spine_rate: str | None = "100mbit",
    intra_node_rate: str | None = None,
    levels: Levels | None = None,
    level_rates: dict[str, str] | None = None,
) -> Fabric:
    """The fabric of `kind` for `nodes` x `ranks_per_node`, or for `levels` (outermost first; then
    `level_rates` by level name: the node level's rate is the rails', level 1's the node bridge's,
    deeper ones their tier's; a rate given there wins over the flags' own)."""
    if kind not in FABRICS:
        raise ValueError(f"--fabric {kind!r} is not one of {', '.join(FABRICS)}")
    levels = tuple(levels) if levels else two_levels(nodes * ranks_per_node, ranks_per_node)
    nodes, ranks_per_node = levels[0][1], block(levels, 1)
    if not 1 <= nodes <= 16:
        raise ValueError(f"--nodes {nodes} must be between 1 and 16")
    if not 1 <= ranks_per_node <= 16:
        raise ValueError(f"--ranks-per-node {ranks_per_node} must be between 1 and 16")
    if len(levels) > 2 and kind != "rail":
        raise ValueError(f"--levels {format_levels(levels)}: levels inside a node need --fabric rail (a namespace per rank)")
    rates = dict(level_rates or {})
    inter_node_rate = rates.pop(levels[0][0], inter_node_rate)
    if len(levels) > 1:
        intra_node_rate = rates.pop(levels[1][0], intra_node_rate)
    for rate in (inter_node_rate, spine_rate, intra_node_rate, *rates.values()):
        if rate is not None:
            parse_rate(rate)
    if kind == "shared":
        return _shared(prefix(), nodes, ranks_per_node, inter_node_rate, intra_node_rate)
    fabric = _rail(prefix(), nodes, ranks_per_node, inter_node_rate, spine_rate, intra_node_rate)
    if len(levels) > 2:
        fabric.rates = {"rail": inter_node_rate, "spine": spine_rate, levels[1][0]: intra_node_rate}
        _add_tiers(fabric, prefix(), levels, rates)
    return fabric


def _shared(pre: str, nodes: int, gpn: int, inter: str | None, intra: str | None) -> Fabric:
    fabric = Fabric("shared", nodes, gpn, {"inter-node": inter, "intra-node": intra})
    switch = f"{pre}sw"
    fabric.namespaces.append(switch)
    fabric.bridges.append((switch, "br0", None))
    for n in range(nodes):
        ns = f"{pre}n{n}"
        addr = f"10.213.0.{n + 1}"
        fabric.namespaces.append(ns)
        fabric.links.append((Iface(ns, "eth0", f"{addr}/24", rate=inter), Iface(switch, f"n{n}", bridge="br0", rate=inter)))
        if intra:
            fabric.shaped_loopbacks.append((ns, intra))
        for _ in range(gpn):
            fabric.rank_ns.append(ns)
            fabric.rank_addr.append(addr)
            fabric.rank_iface.append("eth0")
    return fabric


def _rail(pre: str, nodes: int, gpn: int, inter: str | None, spine_rate: str | None, intra: str | None) -> Fabric:
    fabric = Fabric("rail", nodes, gpn, {"rail": inter, "spine": spine_rate, "intra-node": intra})
    spine = f"{pre}spine"
    fabric.namespaces.append(spine)
    fabric.routers.append(spine)
    for k in range(gpn):
        rail = f"{pre}rail{k}"
        fabric.namespaces.append(rail)
        fabric.routers.append(rail)
        fabric.bridges.append((rail, "br0", f"10.213.{k + 1}.254/24"))
        fabric.links.append(
            (Iface(rail, "up0", f"10.215.{k}.2/24", rate=spine_rate), Iface(spine, f"r{k}", f"10.215.{k}.1/24", rate=spine_rate))
        )
        fabric.routes.append((rail, "default", f"via 10.215.{k}.1"))
        fabric.routes.append((spine, f"10.213.{k + 1}.0/24", f"via 10.215.{k}.2"))
    for n in range(nodes):
        node = f"{pre}node{n}"
        fabric.namespaces.append(node)
        fabric.bridges.append((node, "br0", None))
        for k in range(gpn):
            ns = f"{pre}n{n}r{k}"
            addr = f"10.213.{k + 1}.{n + 1}"
            fabric.namespaces.append(ns)
            fabric.links.append((Iface(ns, "rail0", f"{addr}/24", rate=inter), Iface(f"{pre}rail{k}", f"p{n}", bridge="br0", rate=inter)))
            fabric.links.append((Iface(ns, "nb0", f"10.214.{n}.{k + 1}/24", rate=intra), Iface(node, f"p{k}", bridge="br0", rate=intra)))
            fabric.routes.append((ns, "default", f"via 10.213.{k + 1}.254"))
            for other in range(gpn):  # same node, other rail: straight over the node bridge
                if other != k:
                    fabric.routes.append((ns, f"10.213.{other + 1}.{n + 1}/32", "dev nb0"))
            fabric.rank_ns.append(ns)
            fabric.rank_addr.append(addr)
            fabric.rank_iface.append("rail0")
    return fabric


def _add_tiers(fabric: Fabric, pre: str, levels: Levels, rates: dict[str, str]) -> None:
    """Levels 2.. of a rail fabric: a bridge per group of each level, a shaped link from every
    rank to it, and same-node host routes over the tier of the innermost group two ranks share."""
    fabric.levels = [tuple(level) for level in levels]
    fabric.rates.update({name: rates.get(name) for name, _ in levels[2:]})
    for d in range(2, len(levels)):
        rate, size = rates.get(levels[d][0]), block(levels, d)
        for g in range(fabric.world_size // size):
            ns = f"{pre}l{d}g{g}"
            fabric.namespaces.append(ns)
            fabric.bridges.append((ns, "br0", None))
            for rank in range(g * size, (g + 1) * size):
                addr = f"10.{214 + d}.{g}.{rank % size + 1}/24"
                port = Iface(ns, f"p{rank % size}", bridge="br0", rate=rate)
                fabric.links.append((Iface(fabric.rank_ns[rank], f"lv{d}", addr, rate=rate), port))
    # Same node, other local index: over the bridge of the innermost group the two share.
    names = [name for name, _ in levels]
    for i, (ns, dest, how) in enumerate(fabric.routes):
        if how != "dev nb0":
            continue
        rank, peer = fabric.rank_ns.index(ns), fabric.rank_addr.index(dest.removesuffix("/32"))
        d = names.index(link_level(levels, rank, peer))
        fabric.routes[i] = (ns, dest, "dev nb0" if d == 1 else f"dev lv{d}")
