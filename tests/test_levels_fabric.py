"""The emulated cluster with more than two levels (`cluster up --levels node=2,card=2,tile=2
--level-rates ...`): its plan (no root needed) and, as root, a live up and down without ranks."""

import json
import os
import shutil
import subprocess

import pytest

from cocodiff.config.levels import parse_levels

THREE = parse_levels("node=2,card=2,tile=2")

RATES = {"node": "400mbit", "card": "1gbit", "tile": "4gbit"}


def test_three_level_rail_fabric_plan(monkeypatch):
    """Tiles of a card meet on their card's bridge, cards of a node on the node bridge, nodes on
    the rails (and the spine): each tier shaped at its level's rate, every command in our namespaces."""
    from cocodiff.cluster.fabric import build_fabric
    from cocodiff.cluster.netns import commands

    monkeypatch.setenv("COCODIFF_CLUSTER_PREFIX", "cdt-")
    fabric = build_fabric("rail", 2, 4, spine_rate="100mbit", levels=THREE, level_rates=RATES)
    assert fabric.describe() == "rail node=2,card=2,tile=2 (rail 400mbit, spine 100mbit, card 1gbit, tile 4gbit)"
    assert len(fabric.rank_ns) == 8 and {f"cdt-l2g{g}" for g in range(4)} <= set(fabric.namespaces)
    routes = {(ns, dest): how for ns, dest, how in fabric.routes}
    # Rank 1 (node 0, card 0, tile 1): rank 0 is its card's other tile, ranks 2, 3 the other card.
    assert fabric.rank_ns[1] == "cdt-n0r1"
    assert routes["cdt-n0r1", fabric.rank_addr[0] + "/32"] == "dev lv2"
    assert routes["cdt-n0r1", fabric.rank_addr[2] + "/32"] == routes["cdt-n0r1", fabric.rank_addr[3] + "/32"] == "dev nb0"
    assert routes["cdt-n0r1", "default"] == "via 10.213.2.254"  # other nodes: its rail (and the spine)
    rates = {(a.ns, a.name): (a.rate, b.ns) for a, b in fabric.links}
    assert rates["cdt-n0r1", "lv2"] == ("4gbit", "cdt-l2g0") and rates["cdt-n1r3", "lv2"] == ("4gbit", "cdt-l2g3")
    assert rates["cdt-n0r1", "nb0"] == ("1gbit", "cdt-node0") and rates["cdt-n0r1", "rail0"] == ("400mbit", "cdt-rail1")
    for cmd in commands(fabric):
        if cmd[:3] == ["ip", "link", "add"]:
            assert cmd.count("netns") == 2, cmd
        elif cmd[:2] == ["ip", "netns"]:
            assert cmd[3].startswith("cdt-"), cmd
        else:
            assert cmd[1] == "-n" and cmd[2].startswith("cdt-"), cmd
    # Two levels through --levels are the plain rail fabric.
    assert build_fabric("rail", 2, 2, levels=parse_levels("node=2,rank=2")) == build_fabric("rail", 2, 2)


def test_bad_level_fabrics():
    from cocodiff.cli import build_parser
    from cocodiff.cluster.cli import _levels, _shape
    from cocodiff.cluster.fabric import build_fabric, parse_level_rates

    with pytest.raises(ValueError, match="need --fabric rail"):
        build_fabric("shared", 2, 4, levels=THREE)
    with pytest.raises(ValueError, match="LEVEL one of node, card, tile"):
        parse_level_rates("rack=1gbit", THREE)
    with pytest.raises(ValueError, match="is not a positive number"):
        parse_level_rates("tile=fast", THREE)
    parser = build_parser()
    args = parser.parse_args(["cluster", "up", "--levels", "node=2,card=2,tile=2", "--nodes", "4"])
    with pytest.raises(ValueError, match="is 2 node"):
        _shape(args)
    args = parser.parse_args(["cluster", "up", "--level-rates", "node=1gbit"])
    with pytest.raises(ValueError, match="needs --levels"):
        _levels(args)
    args = parser.parse_args(["cluster", "up", "--levels", "node=2,card=2,tile=2", "--level-rates", "tile=4gbit"])
    assert _shape(args) == (2, 4) and _levels(args) == (THREE, {"tile": "4gbit"})


def _out(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True).stdout


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="emulated clusters need root and iproute2")
def test_three_level_cluster_up_and_down_are_idempotent(tmp_path, monkeypatch, capsys):
    """Live, no ranks: up builds the tiers (a card's tiles route over its bridge, tbf at the
    tile rate), a second up is refused, down removes everything and can run again."""
    from cocodiff.cli import main

    monkeypatch.setenv("COCODIFF_CLUSTER_PREFIX", "cdl-")
    monkeypatch.setenv("COCODIFF_CLUSTER_STATE", str(tmp_path / "state.json"))
    up = ["cluster", "up", "--levels", "node=2,card=2,tile=2", "--level-rates", "node=400mbit,card=1gbit,tile=4gbit"]
    try:
        assert main(up) == 0
        assert main(["cluster", "status"]) == 0 and "rail node=2,card=2,tile=2" in capsys.readouterr().out
        assert main(up) == 2 and "already up" in capsys.readouterr().err
        state = json.loads((tmp_path / "state.json").read_text())
        assert state["levels"] == [["node", 2], ["card", 2], ["tile", 2]]
        assert " dev lv2 " in _out("ip", "-n", "cdl-n0r1", "route", "get", state["rank_addr"][0])
        assert " dev nb0 " in _out("ip", "-n", "cdl-n0r1", "route", "get", state["rank_addr"][2])
        assert "rate 4Gbit" in _out("tc", "-n", "cdl-n0r1", "qdisc", "show", "dev", "lv2")
    finally:
        assert main(["cluster", "down"]) == 0
    assert "cdl-" not in _out("ip", "netns", "list")
    assert main(["cluster", "down"]) == 0  # idempotent
