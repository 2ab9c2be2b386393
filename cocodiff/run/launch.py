"""Starting ranks: under torchrun (any number of nodes) or spawned locally by the command itself.

`run_ranks(fn, nproc, *args)` calls `fn(*args)` on every rank with the default process group
initialized and returns rank 0's result. Under torchrun (RANK/WORLD_SIZE set) it runs `fn` in
this process; otherwise it starts `nproc` local processes, rendezvous through a TCPStore on a
free port, and tears everything down when one rank fails, so no rank is
left behind: nor when this process is terminated (SIGTERM, SIGINT) at any moment, the start of
the ranks included, or killed (see run/lifetime.py). It starts them with multiprocessing itself (not
torch's `start_processes`, whose ranks leave a `pytorch-errorfile-*.pickle` in the temporary
folder each time one raises): a run leaves nothing behind. Before it starts them, it refuses a
number of ranks whose memory clearly exceeds the machine's (`check_host_memory`).

Ranks on the CPU are forked from a server process that holds torch, diffusers, transformers
and this package imported (`multiprocessing`'s forkserver, `PRELOAD`; a fork of the command
itself, `rank_server.fork_ready`): a rank then starts in a tenth of a second instead of
re-importing the world (about 7 s of CPU each). The launcher hands each
rank its environment and its standard output and error as they are at the launch, as a freshly
spawned process would have them, and the ranks still die with their launcher: the server leaves
when the launcher goes, and each rank dies with the server. Ranks on accelerators are spawned
afresh, so that no process forks after a library touched the device driver.

`timeout_s` (`--timeout`) is the process group's timeout: the longest any rank waits on a peer
(`topology.peer_timeout_s`), rendezvous included; a rank that cannot reach the rendezvous in that
time fails in one line naming itself, the address and the timeout.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing import forkserver, reduction
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..config.env import DEVICE_ENV, PROGRESS_ENV
from ..config.timeouts import DEFAULT_TIMEOUT_S
from ..distributed.devices import (
    accelerator_type,
    backend_for,
    device_count,
    process_device,
)
from ..distributed.memory import available_bytes
from ..distributed.topology import set_peer_timeout
from ..errors import RankError, RunFailed, UsageError
from ..models.presets import load_plugins
from . import rank_server
from .rank_server import under_launcher
from .lifetime import exit_message, exit_on_signals, held_signals, launcher_folder, quiet_foreign_warnings, start_rank

__all__ = ["RANK_HOST_BYTES", "RankError", "check_host_memory", "under_launcher", "init_distributed", "run_ranks", "spawn"]

HOST = "127.0.0.1"
RANK_HOST_BYTES = 400 * 10**6
"""Host memory a local rank needs at the least: a rank of tiny-shapes at its default size peaks at
0.46 GB resident, 0.33 GB of it its own and the rest libraries that every rank shares (torch 2.13
on the CPU); a rank of a real checkpoint needs far more, a rank that loads no pipeline less."""



def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.Store | None = None) -> None:
    """Initialize the default process group, bound to this rank's device (distributed/devices.py): nccl,
    xccl or gloo."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = process_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "xpu":
        torch.xpu.set_device(device)
    set_peer_timeout(timeout_s)
    backend = backend_for(device)
    with rendezvous_errors(rank, os.environ.get("MASTER_ADDR", HOST), os.environ.get("MASTER_PORT", "?"), timeout_s):
        dist.init_process_group(
            backend,
            store=store,
            init_method=None if store is not None else "env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend in ("nccl", "xccl") else None,
        )


@contextmanager
def rendezvous_errors(rank: int, addr: str, port: int | str, timeout_s: float) -> Iterator[None]:
    """torch's rendezvous errors (a store that cannot be reached, ranks that never join) as one line."""
    try:
        yield
    except (dist.DistNetworkError, dist.DistStoreError) as error:
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RunFailed(
            f"rank {rank}: the rendezvous at {addr}:{port} failed within --timeout {timeout_s:g} s ({why})"
        ) from None


def check_host_memory(nproc: int) -> None:
    """Refuse `nproc` local ranks when even `RANK_HOST_BYTES` each exceeds the available memory."""
    available = available_bytes(torch.device("cpu"))
    needed = nproc * RANK_HOST_BYTES
    if available is not None and needed > available:
        raise UsageError(
            f"--nproc {nproc} local ranks need about {needed / 1e9:.1f} GB of host memory "
            f"({RANK_HOST_BYTES / 1e9:.1f} GB each), more than the {available / 1e9:.1f} GB available on this "
            f"machine; use fewer ranks"
        )


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run `fn(*args)` on every rank.

    Under torchrun every process returns its own rank's result; spawned locally, the caller gets
    rank 0's.
    """
    if under_launcher():
        quiet_foreign_warnings()  # this process is the rank
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
    check_host_memory(nproc)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    kind = accelerator_type()
    if kind is not None and nproc > device_count(kind):
        # More local ranks than devices: one device cannot host two NCCL ranks; run them on the CPU.
        os.environ[DEVICE_ENV] = "cpu"
    context = _rank_context(kind is not None and os.environ.get(DEVICE_ENV, "").lower() != "cpu")
    server_pid = rank_server.forked_from() if context.get_start_method() == "forkserver" else None
    processes: list[BaseProcess] = []
    out_dir = None
    with exit_on_signals():
        try:
            out_dir = launcher_folder("ranks")
            store = dist.TCPStore(HOST, 0, nproc + 1, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s))
            for rank in range(nproc):
                with held_signals():  # a signal waits until this rank is in the list that the clean-up stops
                    process = context.Process(
                        target=_worker, name=f"rank {rank}",
                        args=(rank, nproc, store.port, threads, timeout_s, str(out_dir), os.getpid(), server_pid,
                              dict(os.environ), (_Fd(1), _Fd(2)), fn, args),
                    )
                    process.start()
                    processes.append(process)
            failure = _watch(processes, out_dir)
            if failure is not None:
                raise failure
            return [torch.load(out_dir / f"{rank}.pt", weights_only=False) for rank in range(nproc)]
        finally:
            with held_signals():
                for process in processes:
                    if process.is_alive():
                        process.kill()
                for process in processes:
                    process.join()
                if out_dir is not None:
                    shutil.rmtree(out_dir, ignore_errors=True)


def _rank_context(on_accelerator: bool) -> multiprocessing.context.BaseContext:
    """How ranks start: forked from the rank server (`PRELOAD`) on the CPU, spawned afresh on
    accelerators (a process must not fork once the device's driver is loaded)."""
    if on_accelerator:
        return multiprocessing.get_context("spawn")
    return rank_server.start()


class _Fd:
    """A file descriptor of the launcher, handed to the rank as `multiprocessing` hands its own
    (a rank forked from the server has the server's, not the launcher's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _received, (reduction.DupFd(self.fd),)


def _received(handle: Any) -> int:
    return handle.detach()


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
    rank: int,
    nproc: int,
    port: int,
    threads: int,
    timeout_s: float,
    out_dir: str,
    launcher_pid: int,
    server_pid: int | None,
    env: dict[str, str],
    stdio: tuple[int, int],
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    """One local rank: `fn(*args)`, its result saved as `RANK.pt` in `out_dir`, or its error as
    `RANK.error` (JSON) and exit code 1.

    Forked from the rank server (`server_pid`), it dies with the server, which leaves when the
    launcher goes; it takes the launcher's environment and standard streams as they were at the
    launch."""
    start_rank(server_pid or launcher_pid, interrupt=False)
    if server_pid is not None:
        # The server leaves once no process holds the write end of its "alive" pipe; each child
        # gets a copy, which would keep the server, and so this rank, alive after the launcher.
        alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            forkserver._forkserver._forkserver_alive_fd = None
        try:
            os.kill(launcher_pid, 0)  # gone before this rank could die with the server: go too
        except ProcessLookupError:
            os._exit(1)
        for fd, launcher_fd in zip((1, 2), stdio):
            os.dup2(launcher_fd, fd)
            os.close(launcher_fd)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # the server's, if it asked: this rank's comes from TMPDIR
        load_plugins()
    quiet_foreign_warnings()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        **{PROGRESS_ENV: out_dir},
    )
    torch.set_num_threads(threads)
    # Progress bars lock across threads only: tqdm's default lock across processes is a named
    # semaphore, which a killed rank leaves to the launcher's resource tracker (a warning on exit).
    tqdm.set_lock(threading.RLock())
    try:
        with rendezvous_errors(rank, HOST, port, timeout_s):
            store = dist.TCPStore(HOST, port, nproc + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
        init_distributed(timeout_s, store=store)
    except BaseException as error:
        _fail(rank, Path(out_dir), error)
    try:
        torch.save(fn(*args), Path(out_dir) / f"{rank}.pt")
    except BaseException as error:
        _fail(rank, Path(out_dir), error)  # before the process group goes: the others' errors follow from this one
    finally:
        dist.destroy_process_group()
    # Done, its result saved and its process group gone: out without the interpreter's teardown,
    # in which torch's C++ statics have aborted a finished rank now and then ("terminate called
    # without an active exception", SIGABRT), failing a run whose work was complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fail(rank: int, out_dir: Path, error: BaseException) -> NoReturn:
    """Record this rank's error as `RANK.error` (JSON) for the launcher, which reports it; exit 1."""
    kind = "usage" if isinstance(error, UsageError) else "run" if isinstance(error, RunFailed) else "bug"
    failure = {"rank": rank, "time": time.time(), "kind": kind, "message": str(error), "traceback": traceback.format_exc()}
    scratch = out_dir / f"{rank}.error.part"
    scratch.write_text(json.dumps(failure))
    scratch.rename(scratch.with_suffix(""))  # the launcher reads it as soon as it appears
    sys.exit(1)  # no traceback here: the launcher reports it
