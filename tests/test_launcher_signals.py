"""The launcher owns its ranks from the first fork: a signal at any moment of start-up or run ends
every rank and the command in one line; a failed run leaves nothing in the temporary folder; a
rendezvous that fails is one line; too many local ranks for the machine's memory are refused."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import RANK_TIMEOUT_S, patience
from rank_watch import alive, gone, ranks_at_step

from cocodiff.run import launch, rank_server
from cocodiff.errors import RunFailed, UsageError

RUNS_LONG = 3  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)

SCALE_S = RANK_TIMEOUT_S
"""Every wait below: generous, since the machine is shared; none is asserted on."""


# -- watching a launcher's process tree through /proc -----------------------------------------------

def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _children(pid: int) -> set[int]:
    found = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found |= {int(child) for child in (task / "children").read_text().split()}
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


class Tree:
    """Every process that descended from `root` while it was watched, with its start time (so that
    a reused pid is not taken for a survivor)."""

    def __init__(self, root: int) -> None:
        self.root, self.seen = root, {}

    def poll(self) -> set[int]:
        todo, now = [self.root], set()
        while todo:
            for child in _children(todo.pop()):
                started = _start_time(child)
                if started is not None and child not in now:
                    self.seen.setdefault(child, started)
                    now.add(child)
                    todo.append(child)
        return now

    def ranks(self) -> list[int]:
        """The rank processes among the current descendants: the children of the rank server (not
        multiprocessing's resource tracker, nor the server itself)."""
        ranks = []
        for pid in self.poll():
            try:
                parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                if _is_rank_server(int(parent)):
                    ranks.append(pid)
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
        return ranks

    def survivors(self) -> list[int]:
        """Those still running once given SCALE_S to go."""
        deadline = time.monotonic() + SCALE_S
        while True:
            left = [pid for pid, started in self.seen.items() if _start_time(pid) == started and alive(pid)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has its own SIGTERM handler installed (SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def _launch(tmp_path: Path, nproc: int) -> subprocess.Popen:
    """`cocodiff generate` on `nproc` local ranks, long enough to be interrupted at any moment; its
    ranks' step records land under tmp_path/tmp (its temporary folder: a short link to it, since the
    rank server's socket lives there and a socket's path is short; pytest's folders grow with its runs)."""
    (tmp_path / "tmp").mkdir()
    short = Path(tempfile.mkdtemp(prefix="cd-")) / "t"
    short.symlink_to(tmp_path / "tmp")
    env = dict(os.environ, TMPDIR=str(short), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cocodiff", "generate", "--model", "tiny-shapes", "--nproc", str(nproc), "--steps", "1000",
         "--height", "64", "--width", "64", "--timeout", "600", "--out", str(tmp_path / "img.png")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    launcher.short = short.parent  # type: ignore[attr-defined]  (removed by the test)
    return launcher


def _wait_until(launcher: subprocess.Popen, tree: Tree, ready) -> None:
    deadline = time.monotonic() + SCALE_S
    while not ready():
        tree.poll()
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the launcher did not reach the moment to signal"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    "moment, nproc, sig",
    [
        ("before the ranks", 2, signal.SIGTERM),
        ("while the ranks run", 2, signal.SIGTERM),
        ("while the ranks run", 2, signal.SIGINT),
        ("while the ranks start", 3, signal.SIGKILL),
    ],
)
def test_a_signal_at_any_moment_ends_every_rank(tmp_path, moment, nproc, sig):
    launcher = _launch(tmp_path, nproc)
    tree = Tree(launcher.pid)
    try:
        if moment == "before the ranks":
            _wait_until(launcher, tree, lambda: _catches_sigterm(launcher.pid))
        elif moment == "while the ranks start":
            _wait_until(launcher, tree, lambda: len(tree.ranks()) >= 1)
        else:
            ranks_at_step(tmp_path / "tmp", "cocodiff-*/*.step", launcher, nproc, 2)
        tree.poll()
        launcher.send_signal(sig)
        try:
            _, stderr = launcher.communicate(timeout=SCALE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {SCALE_S} s of {sig.name} {moment}")
        assert not tree.survivors(), f"processes {tree.seen} outlived their launcher ({sig.name} {moment})"
    finally:
        launcher.kill()
        launcher.communicate()
        shutil.rmtree(launcher.short, ignore_errors=True)
    if sig == signal.SIGKILL:
        return
    assert launcher.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr and "resource_tracker" not in stderr, stderr
    # One line of the launcher's own (rank 0's progress bar may share its line).
    assert re.findall(r"cocodiff: [^\r\n]*", stderr) == [f"cocodiff: stopped by {sig.name}"], stderr


def test_a_temporary_folder_too_long_for_the_ranks_socket_is_one_line(tmp_path):
    """The rank server's socket lives in the temporary folder; a path past a socket name's limit is
    one line naming the folder and what to do, exit 2 (it was a traceback)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    run = subprocess.run([sys.executable, "-m", "cocodiff", "generate", "--model", "tiny-shapes", "--nproc", "2"],
                         env=dict(os.environ, TMPDIR=str(deep)), capture_output=True, text=True, timeout=SCALE_S)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and f"the temporary folder {deep}" in run.stderr, run.stderr
    assert "set TMPDIR to a shorter folder" in run.stderr


# -- leftovers ------------------------------------------------------------------------------------

def raises_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed")
    dist.barrier()


def test_a_failed_run_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # The rank server, started first: its socket's folder is this process's, gone when it exits.
    launch._rank_context(on_accelerator=False)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # this process's
    monkeypatch.setenv("TMPDIR", str(scratch))  # the ranks'
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-cache"))  # torch's own cache, kept by design
    # What a SIGKILLed launcher left (its PID gone) goes; a live launcher's folder stays.
    gone_launcher = subprocess.Popen(["true"])
    gone_launcher.wait()
    (scratch / f"cocodiff-ranks-{gone_launcher.pid}-x1" / "sub").mkdir(parents=True)
    live = f"cocodiff-ranks-{os.getppid()}-x2"
    (scratch / live).mkdir()
    with pytest.raises(launch.RankError, match="rank 1 failed"):
        launch.spawn(raises_on_rank_one, 2, timeout_s=RANK_TIMEOUT_S)
    assert sorted(os.listdir(scratch)) == [live]


def test_cluster_run_removes_its_rank_logs(tmp_path, monkeypatch):
    """`cluster run`, its namespaces left out (each rank runs here): a failing command leaves no logs."""
    from cocodiff.cluster.fabric import build_fabric

    cluster_run = importlib.import_module("cocodiff.cluster.run")  # the module; the package exports its `run`

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(cluster_run, "check_prerequisites", lambda: None)
    monkeypatch.setattr(cluster_run, "load_state", lambda: build_fabric("rail", 1, 2, "400mbit", "100mbit", None))
    popen = subprocess.Popen
    monkeypatch.setattr(cluster_run.subprocess, "Popen", lambda cmd, **kw: popen(cmd[4:], **kw))  # no `ip netns exec NS`
    assert cluster_run.run(["cocodiff", "no-such-command"], timeout_s=SCALE_S) == 2
    assert sorted(os.listdir(scratch)) == []


# -- a rendezvous that fails: one line ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", [0, 1])  # rank 0 waits for a peer that never comes; rank 1 finds no rank 0
def test_a_failed_rendezvous_is_one_line(monkeypatch, rank):
    port = _free_port()
    monkeypatch.setattr(launch, "set_peer_timeout", lambda _s: None)  # this process's engine keeps its own
    for name, value in dict(RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(RunFailed) as failure:
        launch.init_distributed(timeout_s=2)
    message = str(failure.value)
    assert message.startswith(f"rank {rank}: the rendezvous at 127.0.0.1:{port} failed within --timeout 2 s (")
    assert "\n" not in message


# -- memory --------------------------------------------------------------------------------------

def test_too_many_ranks_for_the_memory_are_refused(monkeypatch, capsys):
    from cocodiff.cli import main

    monkeypatch.setattr(launch, "available_bytes", lambda _device: 22_500_000_000)  # this 24 GiB machine, idle
    for nproc in (1, 4, 8, 16):
        launch.check_host_memory(nproc)
    with pytest.raises(UsageError, match=r"^--nproc 64 local ranks need about 25\.6 GB of host memory \(0\.4 GB each\), "
                                         r"more than the 22\.5 GB available on this machine; use fewer ranks$"):
        launch.check_host_memory(64)
    monkeypatch.setattr(launch, "available_bytes", lambda _device: 1_000_000_000)
    assert main(["generate", "--model", "tiny-shapes", "--nproc", "4", "--steps", "1"]) == 2  # before any rank starts
    assert capsys.readouterr().err == (
        "cocodiff: error: --nproc 4 local ranks need about 1.6 GB of host memory (0.4 GB each), more than the 1.0 GB "
        "available on this machine; use fewer ranks\n"
    )
    monkeypatch.setattr(launch, "available_bytes", lambda _device: None)  # unknown: no check
    launch.check_host_memory(64)


def _is_rank_server(pid: int) -> bool:
    """A fork of its command (named so), or a fresh interpreter running multiprocessing's forkserver."""
    try:
        return (Path(f"/proc/{pid}/comm").read_bytes().strip() == rank_server.NAME
                or b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def _rank_servers(parent: int) -> set[int]:
    """The rank servers `parent` started (not those of other tests running beside this one)."""
    servers = set()
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and _is_rank_server(int(entry.name))
                    and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent):
                servers.add(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return servers


def test_the_rank_server_is_a_fork_of_its_command_and_leaves_with_a_refused_command(tmp_path):
    """A command that starts ranks forks the rank server from itself once its flags are read (its
    libraries imported: the server imports nothing more than the command has); refused after that,
    the command leaves no server behind."""
    env = dict(os.environ, TMPDIR=str(tmp_path), COCODIFF_DEVICE="cpu")
    command = subprocess.Popen([sys.executable, "-m", "cocodiff", "generate", "--nproc", "5", "--plan", "u5"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started, named = set(), set()
    while command.poll() is None:
        now = _rank_servers(command.pid)
        started |= now
        named |= {pid for pid in now if Path(f"/proc/{pid}/comm").read_bytes().strip() == rank_server.NAME}
        time.sleep(0.05)
    stderr = command.stderr.read()
    assert command.returncode == 2 and "larger than the 4 attention heads" in stderr, stderr
    command.stdout.close()
    command.stderr.close()
    assert started and named == started, f"no rank server forked from the command: {started}"
    assert not any(alive(pid) for pid in started), f"the rank server {started} outlived its refused command"


@pytest.mark.parametrize("command", [["generate", "--nproc", "2"], ["footprint", "--model", "tiny-flux"]])
def test_a_stop_signal_while_the_flags_are_read_is_one_line(tmp_path, command):
    """Covered from the command's first moment, not once its libraries are imported (seconds): a
    command that starts ranks (no rank server yet: it comes once the flags are read) and one that
    does not."""
    env = dict(os.environ, TMPDIR=str(tmp_path), COCODIFF_DEVICE="cpu")
    launcher = subprocess.Popen([sys.executable, "-m", "cocodiff", *command], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + SCALE_S
    while not _catches_sigterm(launcher.pid):
        assert launcher.poll() is None and time.monotonic() < deadline, "the command never caught SIGTERM"
        time.sleep(0.01)
    assert "torch" not in Path(f"/proc/{launcher.pid}/maps").read_text(), "signalled after torch was loaded"
    started = _rank_servers(launcher.pid)
    assert not started, f"a rank server {started} before the flags were read"
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=SCALE_S)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip() == "cocodiff: stopped by SIGTERM", stderr
    assert gone(started, SCALE_S), f"the rank server {started} outlived its stopped command"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_training_outlives_train_tiny(tmp_path, sig):
    """`train-tiny` trains in a child process: stopped (one line, 143) or killed, the child goes too."""
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        command = subprocess.Popen([sys.executable, "-m", "cocodiff", "train-tiny", "--out", str(tmp_path / "run"),
                                    "--ae-steps", "100000", "--steps", "100000", "--no-samples"],
                                   stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + SCALE_S
        children: set[int] = set()
        while not (children := _children(command.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children, "no training child started"
        time.sleep(2)  # the child past its start, training
        command.send_signal(sig)
        command.wait(timeout=SCALE_S)
        lines = log.read_text().strip().splitlines()
        assert command.returncode == -sig if sig == signal.SIGKILL else (
            command.returncode == 128 + sig and lines[-1:] == ["cocodiff: stopped by SIGTERM"]), lines
        # 15 s: multiprocessing's resource tracker and the trainer go once they notice (a pipe's end, the
        # parent-death signal); with the matrix's ranks on both cores, 5 s was once too short.
        assert gone(children, patience(15)), f"the training {children} outlived train-tiny"
    finally:
        command.kill()
        command.wait()
        for pid in children or ():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_signal_that_lands_while_a_class_is_built_still_stops_in_one_line(capsys, monkeypatch):
    """SIGTERM while the command imports its libraries may surface wrapped: Python turns an exception
    raised in a class body's `__set_name__` into a RuntimeError raised from it (seen once in CI, exit
    1 with a traceback). It still ends the command as SIGTERM does: exit 143, one line."""
    from cocodiff.run import lifetime

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(lifetime, "under_launcher", lambda: False)

    class Field:
        def __set_name__(self, owner, name):
            lifetime._stop(signal.SIGTERM, None)

    with pytest.raises(SystemExit) as stopped:
        with lifetime.launcher_signals():
            type("Fabric", (), {"rank_ns": Field()})
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "cocodiff: stopped by SIGTERM\n"
    with pytest.raises(RuntimeError, match="no stop"):  # anything else goes on up as it was
        with lifetime.launcher_signals():
            raise RuntimeError("no stop")


def test_a_stop_signal_during_an_import_waits_for_the_import(tmp_path, monkeypatch):
    """A stop raised inside an import can reach a C extension's import (numpy's), which turns it
    into an ImportError and a traceback: the handler sends the signal again once the import is
    over, and raises at once anywhere else."""
    from cocodiff.run import lifetime

    (tmp_path / "being_imported.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inside = importlib.import_module("being_imported").FRAME
    resent = []
    monkeypatch.setattr(lifetime.threading, "Timer", lambda delay, kill, args: type(
        "Timer", (), {"start": lambda self: resent.append((delay, kill, args))})())
    lifetime._stop(signal.SIGTERM, inside)
    assert resent == [(lifetime.RESEND_S, os.kill, (os.getpid(), signal.SIGTERM))]
    with pytest.raises(lifetime.Stopped):
        lifetime._stop(signal.SIGTERM, sys._getframe())
