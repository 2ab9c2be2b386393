"""Bring an emulated cluster up and down with `ip netns`, veth, bridges and `tc tbf`.

Needs root and iproute2. `up` records the cluster in a state file that `run` and `status` read;
`down` deletes every namespace whose name starts with the prefix, so it also cleans up after a
crash, and is idempotent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config.env import CLUSTER_STATE_ENV
from ..errors import UsageError
from .fabric import Fabric, Iface, parse_rate, prefix

__all__ = ["state_file", "check_prerequisites", "commands", "down", "load_state", "status", "up"]

def state_file() -> Path:
    return Path(os.environ.get(CLUSTER_STATE_ENV, "/tmp/cocodiff-cluster.json"))


def check_prerequisites() -> None:
    """One clear line when the machine cannot host an emulated cluster."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"cocodiff cluster needs {' and '.join(missing)} from iproute2: apt-get install iproute2")
    if os.geteuid() != 0:
        raise UsageError("cocodiff cluster needs root to create network namespaces: run it as root (e.g. with sudo)")


def _tbf(ns: str, dev: str, rate: str) -> list[str]:
    # burst: 2 ms at line rate, at least 32 KiB (above one MTU; large GSO packets are split by tbf);
    # latency: how long a packet may queue before tbf drops it.
    burst = max(parse_rate(rate) // 8 // 500, 32 * 1024)
    return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]


def _iface(end: Iface) -> list[list[str]]:
    cmds = []
    if end.bridge:
        cmds.append(["ip", "-n", end.ns, "link", "set", end.name, "master", end.bridge])
    if end.addr:
        cmds.append(["ip", "-n", end.ns, "addr", "add", end.addr, "dev", end.name])
    cmds.append(["ip", "-n", end.ns, "link", "set", end.name, "up"])
    if end.rate:
        cmds.append(_tbf(end.ns, end.name, end.rate))
    return cmds


def commands(fabric: Fabric) -> list[list[str]]:
    """The `ip`/`tc` commands that build `fabric`, in order."""
    cmds: list[list[str]] = []
    for ns in fabric.namespaces:
        cmds += [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    for ns in fabric.routers:
        cmds.append(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    for ns, bridge, addr in fabric.bridges:
        cmds += [["ip", "-n", ns, "link", "add", bridge, "type", "bridge"], ["ip", "-n", ns, "link", "set", bridge, "up"]]
        if addr:
            cmds.append(["ip", "-n", ns, "addr", "add", addr, "dev", bridge])
    for a, b in fabric.links:
        # Created directly inside both namespaces: no interface ever appears in the root namespace.
        cmds.append(["ip", "link", "add", a.name, "netns", a.ns, "type", "veth", "peer", "name", b.name, "netns", b.ns])
        cmds += _iface(a) + _iface(b)
    for ns, rate in fabric.shaped_loopbacks:
        cmds.append(_tbf(ns, "lo", rate))
    for ns, dest, how in fabric.routes:
        cmds.append(["ip", "-n", ns, "route", "add", dest, *how.split()])
    return cmds


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def ours() -> list[str]:
    """Namespaces that carry our prefix."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(prefix())]


def up(fabric: Fabric) -> None:
    check_prerequisites()
    if ours():
        raise UsageError("an emulated cluster is already up (cocodiff cluster status); run `cocodiff cluster down` first")
    try:
        for cmd in commands(fabric):
            _run(cmd)
    except BaseException:
        down()
        raise
    state_file().write_text(json.dumps(asdict(fabric), indent=1))


def down() -> list[str]:
    """Delete every namespace we made (veths and qdiscs go with them). Idempotent."""
    check_prerequisites()
    removed = []
    for ns in ours():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        removed.append(ns)
    state_file().unlink(missing_ok=True)
    return removed


def load_state() -> Fabric:
    if not state_file().exists() or not ours():
        raise UsageError("no emulated cluster is up: start one with `cocodiff cluster up --nodes N --ranks-per-node G --fabric rail|shared`")
    data = json.loads(state_file().read_text())
    data["links"] = [(Iface(**a), Iface(**b)) for a, b in data["links"]]
    return Fabric(**data)


def status() -> dict[str, Any]:
    check_prerequisites()
    namespaces = ours()
    if not namespaces or not state_file().exists():
        return {"up": False, "namespaces": namespaces}
    fabric = load_state()
    return {"up": True, "fabric": fabric.describe(), "ranks": fabric.world_size, "namespaces": namespaces}
