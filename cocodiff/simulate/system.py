"""Clusters as data: one TOML file per system under `systems/`, read with `tomllib`.

A system is a node repeated `nodes` times. Inside a node the ranks form a hierarchy of levels,
innermost first (Aurora: 2 tiles per GPU, 6 GPUs per node); rank = node x ranks_per_node + local,
and local = c0 + size0 x (c1 + size1 x ...) where c_i is the rank's index at level i. A level's
links are either

    port   one egress and one ingress port per member (a switch or bridge: NVSwitch, veth bridge)
    pair   one link per ordered pair of members (direct links: Xe Link between GPUs)

Between nodes the network is one of

    rail    NIC k serves the local ranks mapped to it (local x nics // ranks_per_node); NIC k of
            every node sits on rail k; same-rail traffic stays on its leaf, cross-rail traffic
            also crosses the spine link of both rails (a fixed `spine_GBps_per_rail`, or
            nodes x nic_GBps / `spine_oversubscription`)
    direct  any NIC reaches any NIC at full rate (a full-bisection or dragonfly network)
    shared  one uplink per node (`nics` = 1)

Bandwidths are GB/s (1e9 bytes/s) per direction; latencies are per message, in microseconds.
An optional `phase_us` is a fixed cost of every phase of a collective, whatever its messages
(the call itself, its copies and, where ranks share cores, the wait until every member of the
group runs again); it is the latency class `phase`, fitted with the others by `--calibrate`.

A system may also name how its collective library loses bandwidth to incast (`[incast]`, see
`Incast`); without that table a phase runs at its links' rate.

An emulation runs every rank on one host: `host_cores` names the cores they share. The device's
figures are then a rank's share while every rank computes; ranks that wait (pipeline stages,
stages.py) leave their cores to the others. Without it every rank has its own device.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import UsageError

__all__ = ["Device", "Incast", "Level", "LinkParams", "Network", "PHASE", "System", "SYSTEMS", "load_system"]

NETWORK_KINDS = ("rail", "direct", "shared")
PHASE = "phase"
CODECS = ("cpu", "memory")
"""The latency class of the fixed cost per collective phase (`phase_us`)."""
LINK_KINDS = ("port", "pair")


@dataclass(frozen=True, kw_only=True, slots=True)
class Level:
    name: str
    """Also the name of its link class."""
    size: int
    """Members of one group at this level (ranks at level 0, level-0 groups at level 1, ...)."""
    link: str
    GBps: float
    latency_us: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Network:
    kind: str
    nics: int
    nic_GBps: float
    latency_us: float
    spine_GBps_per_rail: float | None = None
    spine_oversubscription: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    name: str
    peak_TFLOPs: float
    efficiency: float
    memory_GBps: float
    codec: str = "memory"
    """How fast it packs wire formats (simulate/wire.py): `cpu` (measured rates) or `memory` (HBM-bound)."""

    @property
    def flops(self) -> float:
        """Effective FLOP/s of one rank: peak x efficiency."""
        return self.peak_TFLOPs * 1e12 * self.efficiency


@dataclass(frozen=True, kw_only=True, slots=True)
class Incast:
    """Incast: a receiver that more peers send to at once than it can serve slows every flow.

    A rank receives from `fan_in` peers at once in a phase. Up to `flows` concurrent incoming
    transfers it serves at its links' rate; the first `buffer_MB` it receives are absorbed by the
    fabric's buffering (credits, receive queues) whatever the fan-in. Past that, with
    fan_in > flows, the transfers it cannot serve back up into the links they share with other
    flows (head-of-line blocking on a lossless fabric) and the rest arrives at flows / fan_in of
    the link rate. A phase lasts as long as its worst receiver:

        link time x max over receivers (1 + (1 - buffer / received) x (fan_in / flows - 1))

    Flat all-to-all over P ranks has fan-in P - 1; TAPA's first phase 1 (the other tile), its
    second P / group - 1: the same bytes over the same links, fewer senders per receiver.
    """

    flows: float
    buffer_MB: float
    source: str = ""

    def factor(self, fan_in: np.ndarray, received: np.ndarray) -> float:
        """Slowdown of a phase whose receivers have these fan-ins and received bytes (1: none)."""
        buffer = self.buffer_MB * 1e6
        hit = (fan_in > self.flows) & (received > buffer)
        if not hit.any():
            return 1.0
        slow = 1.0 + (1.0 - buffer / received[hit]) * (fan_in[hit] / self.flows - 1.0)
        return float(slow.max())


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkParams:
    """Effective link figures of one system at one node count: bytes/s per link class, seconds
    per message per latency class (each level, and `network`)."""

    bandwidth: dict[str, float]
    latency: dict[str, float]
    source: str = "nominal"
    """`nominal` (the TOML file), `fitted` (--calibrate), or a description of a scaling."""
    incast: Incast | None = None
    """The collective library's incast (None: every phase at its links' rate)."""

    def scaled(self, factor: float) -> LinkParams:
        """Every bandwidth times `factor` (a what-if for collective efficiency)."""
        return replace(self, bandwidth={k: v * factor for k, v in self.bandwidth.items()},
                       source=f"{self.source} x {factor:g} bandwidth")


@dataclass(frozen=True, kw_only=True, slots=True)
class System:
    name: str
    description: str
    nodes: int
    levels: tuple[Level, ...]
    network: Network
    device: Device
    tapa_group: int
    phase_us: float = 0.0
    """Fixed cost of every collective phase (0: none modelled; see the module's docstring)."""
    """Ranks in one TAPA first-phase group (default: a node)."""
    incast: Incast | None = None
    """`[incast]` of the TOML file (None: none modelled)."""
    host_cores: int | None = None
    """Cores every rank shares (an emulation on one host; None: a device per rank)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes} must be at least 1")
        rpn = self.ranks_per_node
        if self.tapa_group < 1 or rpn % self.tapa_group:
            raise UsageError(f"{self.name}: tapa_group {self.tapa_group} must divide the {rpn} ranks per node")
        if self.network.nics < 1:
            raise UsageError(f"{self.name}: nics must be at least 1")
        if self.host_cores is not None and self.host_cores < 1:
            raise UsageError(f"{self.name}: host_cores must be at least 1")

    @property
    def ranks_per_node(self) -> int:
        return math.prod(level.size for level in self.levels)

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_nodes(self, nodes: int) -> System:
        return replace(self, nodes=nodes)

    def nic_of(self, local: int) -> int:
        return local * self.network.nics // self.ranks_per_node

    @property
    def network_class(self) -> str:
        return "uplink" if self.network.kind == "shared" else "nic"

    def nominal(self) -> LinkParams:
        """The link figures of the TOML file at this node count."""
        net = self.network
        bandwidth = {level.name: level.GBps * 1e9 for level in self.levels}
        bandwidth[self.network_class] = net.nic_GBps * 1e9
        if net.kind == "rail":
            if net.spine_GBps_per_rail is not None:
                bandwidth["spine"] = net.spine_GBps_per_rail * 1e9
            else:
                bandwidth["spine"] = self.nodes * net.nic_GBps * 1e9 / (net.spine_oversubscription or 1.0)
        latency = {level.name: level.latency_us * 1e-6 for level in self.levels}
        latency["network"] = net.latency_us * 1e-6
        if self.phase_us > 0:
            latency[PHASE] = self.phase_us * 1e-6
        return LinkParams(bandwidth=bandwidth, latency=latency, incast=self.incast)

    def describe(self) -> str:
        return f"{self.name}: {self.nodes} node(s) x {self.ranks_per_node} ranks ({self.description})"


def _systems_dir():
    return resources.files(__package__) / "systems"


SYSTEMS: tuple[str, ...] = tuple(sorted(p.name.removesuffix(".toml") for p in _systems_dir().iterdir()
                                        if p.name.endswith(".toml")))
"""The shipped systems, by name."""


def _require(table: dict, key: str, where: str):
    if key not in table:
        raise UsageError(f"{where}: missing key {key!r}")
    return table[key]


def parse_system(data: dict, where: str) -> System:
    levels = []
    for i, lv in enumerate(_require(data, "level", where)):
        spot = f"{where} [[level]] {i}"
        level = Level(name=str(_require(lv, "name", spot)), size=int(_require(lv, "size", spot)),
                      link=str(_require(lv, "link", spot)), GBps=float(_require(lv, "GBps", spot)),
                      latency_us=float(_require(lv, "latency_us", spot)))
        if level.link not in LINK_KINDS or level.size < 1 or level.GBps <= 0:
            raise UsageError(f"{spot}: link must be one of {', '.join(LINK_KINDS)}, size >= 1, GBps > 0")
        levels.append(level)
    net = _require(data, "network", where)
    network = Network(kind=str(_require(net, "kind", f"{where} [network]")), nics=int(net.get("nics", 1)),
                      nic_GBps=float(_require(net, "nic_GBps", f"{where} [network]")),
                      latency_us=float(_require(net, "latency_us", f"{where} [network]")),
                      spine_GBps_per_rail=net.get("spine_GBps_per_rail"),
                      spine_oversubscription=net.get("spine_oversubscription"))
    if network.kind not in NETWORK_KINDS:
        raise UsageError(f"{where} [network]: kind {network.kind!r} is not one of {', '.join(NETWORK_KINDS)}")
    if network.kind == "shared" and network.nics != 1:
        raise UsageError(f"{where} [network]: a shared uplink has nics = 1")
    dev = _require(data, "device", where)
    device = Device(name=str(_require(dev, "name", f"{where} [device]")),
                    peak_TFLOPs=float(_require(dev, "peak_TFLOPs", f"{where} [device]")),
                    efficiency=float(_require(dev, "efficiency", f"{where} [device]")),
                    memory_GBps=float(_require(dev, "memory_GBps", f"{where} [device]")),
                    codec=str(dev.get("codec", "memory")))
    if device.codec not in CODECS:
        raise UsageError(f"{where} [device]: codec {device.codec!r} is not one of {', '.join(CODECS)}")
    incast = None
    if "incast" in data:
        table, spot = data["incast"], f"{where} [incast]"
        incast = Incast(flows=float(_require(table, "flows", spot)), buffer_MB=float(_require(table, "buffer_MB", spot)),
                        source=str(table.get("source", "")))
        if incast.flows < 1 or incast.buffer_MB < 0:
            raise UsageError(f"{spot}: flows must be at least 1 and buffer_MB at least 0")
    rpn = math.prod(level.size for level in levels)
    return System(name=str(_require(data, "name", where)), description=str(data.get("description", "")),
                  nodes=int(data.get("nodes", 1)), levels=tuple(levels), network=network, device=device,
                  tapa_group=int(data.get("tapa_group", rpn)), incast=incast, phase_us=float(data.get("phase_us", 0.0)),
                  host_cores=int(data["host_cores"]) if "host_cores" in data else None)


def load_system(name: str, nodes: int | None = None) -> System:
    """A shipped system by name (see SYSTEMS) or a path to a TOML file, at `nodes` nodes."""
    path = Path(name)
    if name.endswith(".toml") and path.is_file():
        text, where = path.read_text(), str(path)
    elif name in SYSTEMS:
        text, where = (_systems_dir() / f"{name}.toml").read_text(), f"systems/{name}.toml"
    else:
        raise UsageError(f"--system {name!r} is not one of {', '.join(SYSTEMS)} (or a path to a .toml file)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{where}: {error}") from None
    system = parse_system(data, where)
    return system.with_nodes(nodes) if nodes is not None else system
