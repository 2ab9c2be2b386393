"""Starting ranks: under torchrun (any number of nodes) or spawned locally by the command itself.

`run_ranks(fn, nproc, *args)` calls `fn(*args)` on every rank with the default process group
initialized and returns rank 0's result. Under torchrun (RANK/WORLD_SIZE set) it runs `fn` in
this process; otherwise it spawns `nproc` local processes with torch's own spawn, rendezvous
through a TCPStore on a free port, and tears everything down when one rank fails, so no rank is
left behind: nor when this process is terminated (SIGTERM, SIGINT) or killed (see lifetime.py).

`timeout_s` (`--timeout`) is the process group's timeout: the longest any rank waits on a peer
(`topology.peer_timeout_s`), rendezvous included.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import RunFailed, UsageError
from .lifetime import DEFAULT_TIMEOUT_S, PROGRESS_ENV, die_with_parent, exit_message, exit_on_signals
from .devices import DEVICE_ENV, accelerator_type, backend_for, device_count, process_device
from .topology import set_peer_timeout

__all__ = ["RankError", "under_launcher", "init_distributed", "run_ranks", "spawn"]

HOST = "127.0.0.1"


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.Store | None = None) -> None:
    """Initialize the default process group, bound to this rank's device (devices.py): nccl,
    xccl or gloo."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = process_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "xpu":
        torch.xpu.set_device(device)
    set_peer_timeout(timeout_s)
    backend = backend_for(device)
    dist.init_process_group(
        backend,
        store=store,
        init_method=None if store is not None else "env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if backend in ("nccl", "xccl") else None,
    )


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run `fn(*args)` on every rank.

    Under torchrun every process returns its own rank's result; spawned locally, the caller gets
    rank 0's.
    """
    if under_launcher():
        init_distributed(timeout_s)
        try:
            return fn(*args)
        finally:
            dist.destroy_process_group()
    return spawn(fn, nproc, *args, timeout_s=timeout_s)[0]


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Spawn `nproc` local ranks running `fn(*args)`; return every rank's result, by rank.

    The first rank to fail ends the run: its error is raised here (`UsageError`, `RunFailed` as
    one line, else `RankError` with its traceback), every other rank is killed.
    """
    if nproc < 1:
        raise UsageError(f"--nproc {nproc} must be at least 1")
    if timeout_s <= 0:
        raise UsageError(f"--timeout {timeout_s:g} must be positive")
    store = dist.TCPStore(HOST, 0, nproc + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    threads = max(1, (os.cpu_count() or 1) // nproc)
    kind = accelerator_type()
    if kind is not None and nproc > device_count(kind):
        # More local ranks than devices: one device cannot host two NCCL ranks; run them on the CPU.
        os.environ[DEVICE_ENV] = "cpu"
    with tempfile.TemporaryDirectory(prefix="cocodiff-") as out_dir, exit_on_signals():
        context = mp.start_processes(
            _worker,
            args=(nproc, store.port, threads, timeout_s, out_dir, os.getpid(), fn, args),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        try:
            failure = _watch(context.processes, Path(out_dir))
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        if failure is not None:
            raise failure
        return [torch.load(Path(out_dir) / f"{rank}.pt", weights_only=False) for rank in range(nproc)]


class RankError(RuntimeError):
    """A rank raised; the message is the traceback of the rank that failed first."""


GRACE_S = 1.0
"""After a rank's error, how long to look for a rank that died without a word: a killed process
closes its sockets (so its peers fail) a moment before its exit status can be read."""

LAST_WORDS_S = 5.0
"""After a rank died without a word, how long the others may take to leave on their own (their
collectives fail at once; `serve`'s rank 0 first answers its requests 503) before being killed."""


def _watch(processes: list[BaseProcess], out_dir: Path) -> Exception | None:
    """Wait until every rank has finished (None) or one has failed (the error to raise)."""
    errors_since = None
    while True:
        codes = [process.exitcode for process in processes]
        # A rank gone without a word (a signal, os._exit) comes first: the others' errors follow from it.
        silent = [rank for rank, code in enumerate(codes) if code and not (out_dir / f"{rank}.error").exists()]
        if silent:
            failure = RunFailed(exit_message(silent[0], codes[silent[0]], out_dir))
            deadline = time.monotonic() + LAST_WORDS_S
            while any(process.exitcode is None for process in processes) and time.monotonic() < deadline:
                time.sleep(0.05)
            return failure
        if errors_since is None and any(out_dir.glob("*.error")):
            errors_since = time.monotonic()
        if errors_since is not None and time.monotonic() - errors_since > GRACE_S:
            return _first_failure(out_dir)
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.1)


def _first_failure(out_dir: Path) -> Exception:
    """The error of the rank that failed first: the others usually fail because it went away."""
    failures = [json.loads(path.read_text()) for path in out_dir.glob("*.error")]
    first = min(failures, key=lambda f: f["time"])
    if first["kind"] == "usage":
        return UsageError(first["message"])
    if first["kind"] == "run":
        return RunFailed(first["message"])
    return RankError(f"rank {first['rank']} failed first:\n{first['traceback']}")


def _worker(
    local_rank: int,
    nproc: int,
    port: int,
    threads: int,
    timeout_s: float,
    out_dir: str,
    parent_pid: int,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    die_with_parent(parent_pid)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        **{PROGRESS_ENV: out_dir},
    )
    torch.set_num_threads(threads)
    store = dist.TCPStore(HOST, port, nproc + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
    init_distributed(timeout_s, store=store)
    try:
        result = fn(*args)
    except BaseException as error:
        kind = "usage" if isinstance(error, UsageError) else "run" if isinstance(error, RunFailed) else "bug"
        failure = {
            "rank": local_rank,
            "time": time.time(),
            "kind": kind,
            "message": str(error),
            "traceback": traceback.format_exc(),
        }
        scratch = Path(out_dir) / f"{local_rank}.error.part"
        scratch.write_text(json.dumps(failure))
        scratch.rename(scratch.with_suffix(""))  # the launcher reads it as soon as it appears
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"{local_rank}.pt")
