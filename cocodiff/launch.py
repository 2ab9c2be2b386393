"""Starting ranks: under torchrun (any number of nodes) or spawned locally by the command itself.

`run_ranks(fn, nproc, *args)` calls `fn(*args)` on every rank with the default process group
initialized and returns rank 0's result. Under torchrun (RANK/WORLD_SIZE set) it runs `fn` in
this process; otherwise it spawns `nproc` local processes with torch's own spawn, rendezvous
through a TCPStore on a free port, and tears everything down when one rank fails or the time
limit passes, so no rank is left behind.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import UsageError
from .topology import backend_for, default_device

__all__ = ["RankError", "under_launcher", "init_distributed", "run_ranks", "spawn", "print0"]

HOST = "127.0.0.1"


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def print0(*args: Any, **kwargs: Any) -> None:
    """print on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def init_distributed(timeout_s: float = 300.0, store: dist.Store | None = None) -> None:
    """Initialize the default process group for this rank's device (nccl, xccl or gloo)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = default_device(int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        init_method=None if store is not None else "env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 600.0) -> Any:
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


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Spawn `nproc` local ranks running `fn(*args)`; return every rank's result, by rank."""
    if nproc < 1:
        raise UsageError(f"--nproc {nproc} must be at least 1")
    store = dist.TCPStore(HOST, 0, nproc + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    threads = max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory(prefix="cocodiff-") as out_dir:
        context = mp.start_processes(
            _worker,
            args=(nproc, store.port, threads, timeout_s, out_dir, fn, args),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
            raise _first_failure(Path(out_dir)) or failure from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        return [torch.load(Path(out_dir) / f"{rank}.pt", weights_only=False) for rank in range(nproc)]


class RankError(RuntimeError):
    """A rank raised; the message is the traceback of the rank that failed first."""


def _first_failure(out_dir: Path) -> Exception | None:
    """The error of the rank that failed first: the others usually fail because it went away."""
    failures = [json.loads(path.read_text()) for path in out_dir.glob("*.error")]
    if not failures:
        return None
    first = min(failures, key=lambda f: f["time"])
    if first["usage"]:
        return UsageError(first["message"])
    return RankError(f"rank {first['rank']} failed first:\n{first['traceback']}")


def _worker(
    local_rank: int, nproc: int, port: int, threads: int, timeout_s: float, out_dir: str, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    store = dist.TCPStore(HOST, port, nproc + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
    init_distributed(timeout_s, store=store)
    try:
        result = fn(*args)
    except BaseException as error:
        failure = {
            "rank": local_rank,
            "time": time.time(),
            "usage": isinstance(error, UsageError),
            "message": str(error),
            "traceback": traceback.format_exc(),
        }
        (Path(out_dir) / f"{local_rank}.error").write_text(json.dumps(failure))
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"{local_rank}.pt")
