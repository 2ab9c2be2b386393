"""`cocodiff cluster run -- <cocodiff command>`: one process per rank, each inside its namespace.

Every rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR/PORT) plus GLOO_SOCKET_IFNAME, so the engine sees the emulated nodes as
nodes and gloo talks over the emulated links; on a fabric of more than two levels also
COCODIFF_LEVELS (config/levels.py), so it sees the cards and tiles too. Every rank runs on the CPU with
gloo (COCODIFF_DEVICE=cpu), whatever accelerators the machine has: the emulated links shape
sockets, which NCCL on one host would bypass; COCODIFF_HOST names its emulated node (distributed/devices.py). Rank 0's output is shown as it comes; the others'
is kept and shown when they fail (the last lines of the first to fail). The first rank to fail
takes the others down; no rank outlives the command: SIGTERM and SIGINT stop every rank, at any
moment, and each rank is killed by the kernel if this command dies of anything else (see
run/lifetime.py). A rank killed by a signal is named in one line with the denoising step it was at.
The folder of rank logs (`$TMPDIR/cocodiff-cluster-PID-*`) goes when the command ends, failed or not
(a SIGKILLed command's, at the next `cluster run`: run/lifetime.py's `launcher_folder`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from ..config.env import DEVICE_ENV, FABRIC_ENV, HOST_ENV, LEVELS_ENV, PROGRESS_ENV
from ..config.levels import format_levels
from ..run.lifetime import exit_message, exit_on_signals, held_signals, launcher_folder, start_rank
from .netns import check_prerequisites, load_state

__all__ = ["run", "FABRIC_ENV"]

MASTER_PORT = 29511
GRACE_S = 1.0


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run(args: list[str], timeout_s: float = 1800.0) -> int:
    """Run `cocodiff ARGS` on every rank of the cluster; return the first non-zero exit code."""
    check_prerequisites()
    fabric = load_state()
    if args and args[0] == "cocodiff":
        args = args[1:]
    world, gpn = fabric.world_size, fabric.ranks_per_node
    threads = max(1, (os.cpu_count() or 1) // world)
    processes: list[subprocess.Popen] = []
    logs = None
    with exit_on_signals():
        try:
            logs = launcher_folder("cluster")
            for rank in range(world):
                env = dict(
                    os.environ,
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_RANK=str(rank % gpn),
                    LOCAL_WORLD_SIZE=str(gpn),
                    GROUP_RANK=str(rank // gpn),
                    MASTER_ADDR=fabric.rank_addr[0],
                    MASTER_PORT=str(MASTER_PORT),
                    GLOO_SOCKET_IFNAME=fabric.rank_iface[rank],
                    OMP_NUM_THREADS=str(threads),
                    TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),  # no DNS in the namespaces
                    **{FABRIC_ENV: fabric.describe(), PROGRESS_ENV: str(logs), DEVICE_ENV: "cpu",
                       HOST_ENV: f"emulated-node{rank // gpn}"},
                    **({LEVELS_ENV: format_levels(tuple(map(tuple, fabric.levels)))} if fabric.levels else {}),
                )
                out = None if rank == 0 else open(logs / f"rank{rank}.log", "w")
                cmd = ["ip", "netns", "exec", fabric.rank_ns[rank], sys.executable, "-m", "cocodiff", *args]
                with held_signals():  # a signal waits until this rank is in the list that the clean-up stops
                    processes.append(
                        subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         start_new_session=True, preexec_fn=partial(start_rank, os.getpid()))
                    )
                if out is not None:
                    out.close()  # the rank has its own copy
            return _wait(processes, logs, timeout_s)
        finally:
            with held_signals():
                for p in processes:
                    _kill(p)
                if logs is not None:
                    shutil.rmtree(logs, ignore_errors=True)


def _wait(processes: list[subprocess.Popen], logs: Path, timeout_s: float) -> int:
    """0 once every rank has succeeded; else the first failure's exit code, after saying why."""
    deadline = time.monotonic() + timeout_s
    first, failed_since = None, 0.0
    while True:
        codes = [p.poll() for p in processes]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed and first is None:
            first, failed_since = failed[0], time.monotonic()
        # A rank killed by a signal comes first: the others' errors follow from it, and may be
        # seen a moment before its exit status is (GRACE_S).
        killed = [(rank, code) for rank, code in failed if code < 0]
        if killed or (first is not None and time.monotonic() - failed_since > GRACE_S):
            rank, code = killed[0] if killed else first
            for p in processes:
                _kill(p)
            if code < 0:
                print(f"cocodiff cluster run: {exit_message(rank, code, logs)}", file=sys.stderr)
                return 128 - code
            if rank != 0:
                tail = (logs / f"rank{rank}.log").read_text().splitlines()[-20:]
                print("\n".join(f"[rank {rank}] {line}" for line in tail), file=sys.stderr)
            return code
        if all(code == 0 for code in codes):
            return 0
        if time.monotonic() > deadline:
            print(f"cocodiff cluster run: ranks did not finish within {timeout_s:.0f} s", file=sys.stderr)
            return 124
        time.sleep(0.1)
