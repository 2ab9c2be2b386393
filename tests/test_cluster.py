"""The emulated cluster: its plan (no root needed) and, as root, a real 2x2 rail cluster."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import RANK_TIMEOUT_S, patience
from rank_watch import alive, ranks_at_step

from cocodiff import UsageError
from cocodiff.cluster.fabric import build_fabric, parse_rate
from cocodiff.cluster.netns import check_prerequisites, commands

RUNS_LONG = 1  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


@pytest.mark.parametrize("kind", ["shared", "rail"])
def test_every_command_stays_inside_our_namespaces(kind, monkeypatch):
    monkeypatch.setenv("COCODIFF_CLUSTER_PREFIX", "cdt-")
    fabric = build_fabric(kind, nodes=2, ranks_per_node=4, intra_node_rate="10gbit")
    assert all(ns.startswith("cdt-") for ns in fabric.namespaces)
    assert len(fabric.rank_ns) == 8 and set(fabric.rank_ns) <= set(fabric.namespaces)
    for cmd in commands(fabric):
        if cmd[:3] == ["ip", "link", "add"]:  # veths are born inside their two namespaces
            assert cmd.count("netns") == 2, cmd
        elif cmd[:2] == ["ip", "netns"]:
            assert cmd[3].startswith("cdt-"), cmd
        else:
            assert cmd[1] == "-n" and cmd[2].startswith("cdt-"), cmd


def test_rail_fabric_routes_cross_rail_traffic_through_the_spine():
    fabric = build_fabric("rail", nodes=2, ranks_per_node=2, inter_node_rate="400mbit", spine_rate="100mbit")
    assert fabric.rank_addr == ["10.213.1.1", "10.213.2.1", "10.213.1.2", "10.213.2.2"]
    routes = {(ns, dest): how for ns, dest, how in fabric.routes}
    assert routes["cdf-n0r0", "default"] == "via 10.213.1.254"  # its rail's router, then the spine
    assert routes["cdf-n0r0", "10.213.2.1/32"] == "dev nb0"  # same node, other rail: node bridge
    assert routes["cdf-spine", "10.213.2.0/24"] == "via 10.215.1.2"
    rates = {(a.ns, a.name): a.rate for link in fabric.links for a in link}
    assert rates["cdf-spine", "r0"] == rates["cdf-rail0", "up0"] == "100mbit"
    assert rates["cdf-n0r0", "rail0"] == rates["cdf-rail0", "p0"] == "400mbit"
    assert rates["cdf-n0r0", "nb0"] is None


def test_bad_cluster_shapes_and_rates():
    assert parse_rate("400mbit") == 400_000_000 and parse_rate("1.5gbit") == 1_500_000_000
    for bad in ("fast", "-3mbit", "400"):
        with pytest.raises(ValueError, match="is not a positive number followed by bit"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="--fabric 'torus' is not one of shared, rail"):
        build_fabric("torus", 2, 2)
    with pytest.raises(ValueError, match="--nodes 0 must be between 1 and 16"):
        build_fabric("rail", 0, 2)


def test_missing_prerequisites_are_named(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(UsageError, match="needs ip and tc from iproute2: apt-get install iproute2"):
        check_prerequisites()
    monkeypatch.undo()
    if shutil.which("ip") and shutil.which("tc"):
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        with pytest.raises(UsageError, match="needs root"):
            check_prerequisites()


def cocodiff(*args, env):
    return subprocess.run([sys.executable, "-m", "cocodiff", *args], capture_output=True, text=True,
                          env=env, timeout=RANK_TIMEOUT_S)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"), reason="emulated clusters need root and iproute2"
)


@needs_root
def test_verify_tapa_on_an_emulated_rail_cluster(tmp_path):
    env = dict(os.environ, COCODIFF_CLUSTER_PREFIX="cdt-", COCODIFF_CLUSTER_STATE=str(tmp_path / "state.json"))
    assert "no emulated cluster is up" in cocodiff("cluster", "run", "--", "verify", env=env).stderr
    try:
        up = cocodiff("cluster", "up", "--nodes", "2", "--ranks-per-node", "2", "--fabric", "rail",
                      "--inter-node-rate", "400mbit", "--spine-rate", "100mbit", env=env)
        assert up.returncode == 0, up.stderr
        assert "rail 2x2" in cocodiff("cluster", "status", env=env).stdout
        again = cocodiff("cluster", "up", env=env)
        assert again.returncode == 2 and "already up" in again.stderr
        out = tmp_path / "verify.json"
        run = cocodiff("cluster", "run", "--", "cocodiff", "verify", "--model", "tiny-qwen-image", "--comm", "tapa",
                       "--steps", "2", "--height", "48", "--width", "80", "--json", str(out), env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        result = json.loads(out.read_text())
        assert result["ok"] and (result["nodes"], result["ranks_per_node"], result["comm"]) == (2, 2, "tapa")
        # A failing rank (bad flag on every rank) ends the run with its exit code, leaving nothing behind.
        failed = cocodiff("cluster", "run", "--", "verify", "--height", "30", env=env)
        assert failed.returncode == 2
    finally:
        down = cocodiff("cluster", "down", env=env)
    assert down.returncode == 0, down.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "cdt-" not in left
    assert cocodiff("cluster", "down", env=env).returncode == 0  # idempotent


@needs_root
@pytest.mark.slow
def test_a_link_down_fails_in_one_line_and_no_rank_outlives_cluster_run(tmp_path):
    """A rail link taken down mid-run: every wait on that rank ends within --timeout, in one line.
    `cluster run` terminated mid-run: its ranks go with it."""
    timeout_s = 15
    env = dict(os.environ, COCODIFF_CLUSTER_PREFIX="cdt-", COCODIFF_CLUSTER_STATE=str(tmp_path / "state.json"))
    generate = ["cluster", "run", "--", "generate", "--model", "tiny-flux", "--comm", "tapa", "--steps", "400",
                "--height", "32", "--width", "32", "--timeout", str(timeout_s), "--out", str(tmp_path / "img.png")]

    def start(name: str) -> subprocess.Popen:
        (tmp_path / name).mkdir()
        return subprocess.Popen([sys.executable, "-m", "cocodiff", *generate], env=dict(env, TMPDIR=str(tmp_path / name)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    try:
        up = cocodiff("cluster", "up", "--nodes", "2", "--ranks-per-node", "2", "--fabric", "rail", env=env)
        assert up.returncode == 0, up.stderr
        fabric = json.loads((tmp_path / "state.json").read_text())
        # Terminated mid-run: no rank outlives the launcher.
        launcher = start("terminated")
        try:
            pids = ranks_at_step(tmp_path / "terminated", "cocodiff-cluster-*/*.step", launcher, 4, 2)
            launcher.terminate()
            launcher.wait(timeout=patience(30))
            deadline = time.monotonic() + patience(15)
            while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(alive(pid) for pid in pids.values()), f"ranks {pids} outlived `cluster run`"
        finally:
            launcher.kill()
            launcher.communicate()
        # Rank 3's rail link goes down mid-run: the run fails within the timeout, in one line.
        launcher = start("link-down")
        try:
            ranks_at_step(tmp_path / "link-down", "cocodiff-cluster-*/*.step", launcher, 4, 2)
            ns, iface = fabric["rank_ns"][3], fabric["rank_iface"][3]
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", iface, "down"], check=True)
            down_at = time.monotonic()
            _, stderr = launcher.communicate(timeout=timeout_s + 60)
            took = time.monotonic() - down_at
        finally:
            launcher.kill()
        assert launcher.returncode not in (0, 2), stderr
        assert took < timeout_s + 30, took
        assert "Traceback" not in stderr, stderr
        errors = [line for line in stderr.replace("\r", "\n").splitlines() if "cocodiff: error:" in line]
        assert errors and f"timed out after {timeout_s} s waiting for rank" in errors[0], stderr
    finally:
        down = cocodiff("cluster", "down", env=env)
    assert down.returncode == 0, down.stderr


def test_cluster_commands_load_neither_torch_nor_diffusers(tmp_path):
    """`cocodiff cluster status|up|down` build their own parser only: no preset, no torch."""
    env = dict(os.environ, COCODIFF_CLUSTER_STATE=str(tmp_path / "state.json"))
    probe = ("import sys; from cocodiff.cli import main; code = main(['cluster', 'status']); "
             "print(code, sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=RANK_TIMEOUT_S)
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr
