"""No hang, no orphan: how ranks and their launcher live and die together (no torch needed).

A launcher (`launch.spawn`, `cocodiff cluster run`) runs its body under `exit_on_signals()`, so
SIGTERM takes the same path as a failure (its `finally` stops every rank), and starts each rank
with `die_with_parent`, so the ranks go even when the launcher is SIGKILLed. It starts and stops
its ranks under `held_signals()`: a signal then waits until the rank it interrupts is started and
recorded (or every rank stopped), so no rank ever escapes its launcher's clean-up. On the command
line (`launcher_signals`) every command is covered from its first moment (before its flags are
read), and a signal ends it in one line (`cocodiff: stopped by SIGTERM`, exit code 128 + the signal: 143, or
130 for SIGINT).

Each rank publishes the denoising step it is at (`Progress`) in the folder its launcher names in
`PROGRESS_ENV`; a rank that dies without a word (a signal) is reported by its launcher in one
line with that step (`exit_message`). A `PeerTimeout` raised during a pipeline call gets the
layer and step from the same `Progress`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..config.env import PROGRESS_ENV
from ..config.timeouts import DEFAULT_TIMEOUT_S
from ..errors import PeerTimeout
from .rank_server import under_launcher

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PROGRESS_ENV",
    "Progress",
    "STOP_SIGNALS",
    "Stopped",
    "add_timeout_argument",
    "alive",
    "die_with_parent",
    "exit_message",
    "exit_on_signals",
    "held_signals",
    "launcher_folder",
    "launcher_signals",
    "published_step",
    "quiet_foreign_warnings",
    "start_rank",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a launcher and, through its clean-up, its ranks."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def launcher_folder(kind: str) -> Path:
    """A launcher's temporary folder (its ranks' results, steps and logs): `$TMPDIR/cocodiff-KIND-PID-*`,
    named after this process. A launcher killed by SIGKILL cannot remove its own, so first the
    folders of launchers of this kind that are gone are removed (a folder whose PID has been
    taken by another process stays: nothing live is touched)."""
    base = Path(tempfile.gettempdir())
    for folder in base.glob(f"cocodiff-{kind}-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"cocodiff-{kind}-{os.getpid()}-", dir=base))


def alive(pid: int) -> bool:
    """Whether process `pid` on this machine runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def add_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """`--timeout SECONDS`, on every command that starts ranks."""
    parser.add_argument(
        "--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help=f"the longest any rank waits on a peer before the run fails with one line naming the collective "
             f"and the peers (default: {DEFAULT_TIMEOUT_S:g})",
    )


TIMEOUT_LIMIT_S = 1e9
"""The longest `--timeout` (about 32 years): what a `timedelta` and every timer take."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < TIMEOUT_LIMIT_S:  # also NaN and infinity, which no timer takes
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and below {TIMEOUT_LIMIT_S:g}")
    return value


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, of any cause (Linux only).

    The setting survives `exec` (so it also works as a `Popen` `preexec_fn` in front of
    `ip netns exec`). A parent that died before the call is caught by its pid changing.
    """
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def start_rank(parent_pid: int, interrupt: bool = True) -> None:
    """First thing in a rank its launcher started under `held_signals`: die with the launcher
    (`die_with_parent`), then take the stop signals the launcher held (a `Popen` child inherits
    its parent's signal mask, so they arrive blocked; works as a `preexec_fn`).

    `interrupt=False` ignores SIGINT: a Ctrl-C reaches the whole process group, and the launcher
    alone answers it (stopping the rank), so that no rank prints its own KeyboardInterrupt.
    """
    die_with_parent(parent_pid)
    if not interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


FOREIGN_WARNINGS = (
    # torch's own object collectives (all_gather_object, broadcast_object_list) unpickle with a
    # pytree spec check that torch itself deprecated; nothing the caller passes changes it.
    (FutureWarning, r"torch\.distributed\.distributed_c10d", r".*LeafSpec"),
    # diffusers' own Chroma transformer builds the rotary embedding it deprecated elsewhere
    (FutureWarning, r"diffusers\.models\.embeddings", r"`FluxPosEmbed` is deprecated"),
    # diffusers' own MiniMax-H3 audio VAE normalizes its convolutions' weights with the call torch deprecated
    (FutureWarning, r"torch\.nn\.utils\.weight_norm", r"`torch\.nn\.utils\.weight_norm` is deprecated"),
)
"""(category, module, message) of the warnings that libraries raise from their own code on every
rank and that this project cannot fix; each rank, and the command itself, ignores exactly these
(`quiet_foreign_warnings`)."""


def quiet_foreign_warnings() -> None:
    """Ignore `FOREIGN_WARNINGS`, by category, module and message, and no other warning: first
    thing in a rank, so that no rank prints them before a command's table."""
    for category, module, message in FOREIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class Stopped(SystemExit):
    """SIGTERM or SIGHUP (`exit_on_signals`); the exit status is 128 + the signal, as a shell reports it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class _Held:
    """The state of `held_signals`, process-wide like the signal handlers it serves."""

    depth = 0
    pending: int | None = None


def _stop(signum: int, frame: Any) -> None:
    """The handler `exit_on_signals` installs: raise now, or once the `held_signals` block ends, or
    once an import under way has ended (`_importing`)."""
    if _Held.depth:
        _Held.pending = _Held.pending or signum
        return
    if _importing(frame):
        threading.Timer(RESEND_S, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


RESEND_S = 0.02
"""A stop signal that came during an import is sent to this process again this much later."""


def _importing(frame: Any) -> bool:
    """Whether `frame` is inside an import: an exception raised there can reach a C extension's
    import (numpy's), which turns it into an ImportError and a traceback instead of the stop."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextmanager
def exit_on_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP raise `Stopped` (a SystemExit), SIGINT KeyboardInterrupt as ever,
    so `finally` blocks run; all three wait while `held_signals` holds them.

    Python's default for SIGTERM and SIGHUP ends the process on the spot, skipping the `finally`
    that stops the ranks. Installed only in the main thread and only over the default handlers
    (a command's own, such as `serve`'s, stay); the previous handlers come back on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = signal.signal(sig, _stop)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def held_signals() -> Iterator[None]:
    """Inside: the stop signals wait, and take effect on the way out (once, however many came).

    For steps that must not be cut in half: starting a rank and recording it, stopping every
    rank. Only the handlers of `exit_on_signals` wait (those of a command's own raise at once).
    The signals are also blocked in this thread; a process that `subprocess` starts inside
    inherits them blocked, and takes them when ready (`start_rank`).
    """
    main = threading.current_thread() is threading.main_thread()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if main else None
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a blocked signal is delivered here
        if not _Held.depth and _Held.pending is not None:
            signum, _Held.pending = _Held.pending, None
            _stop(signum, None)


@contextmanager
def launcher_signals() -> Iterator[None]:
    """The command line's part: a command that is not itself a rank under a launcher is under
    `exit_on_signals` from its first moment (before its flags are read: that imports the libraries,
    seconds), and a stop signal ends it in one line on stderr, with exit code 128 + the signal (143
    for SIGTERM, 130 for SIGINT), once every rank or child it started is stopped.
    """
    if under_launcher():
        yield
        return
    try:
        with exit_on_signals():
            yield
    except BaseException as error:
        stop = _stop_behind(error)
        if stop is None:
            raise
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        print(f"cocodiff: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None


def _stop_behind(error: BaseException) -> Stopped | KeyboardInterrupt | None:
    """The stop signal's exception `error` is, or was raised from: a signal that lands while the
    libraries import may surface wrapped (a class body's `__set_name__` turns it into a RuntimeError)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (Stopped, KeyboardInterrupt)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class Progress:
    """Where this rank is in one pipeline call: the denoising step and the attention layer.

    The step (counted from 1) is published for the launcher at every step (see `PROGRESS_ENV`);
    with `transformer` given, hooks on its attention modules (those with a `processor`) follow
    the layer in flight. `locate` writes both into a `PeerTimeout` on its way up.
    """

    def __init__(self, steps: int, transformer: Any = None, role: str | None = None) -> None:
        self.step, self.steps, self.layer = 1, steps, None
        self.role = role
        """What this rank is beside its number, for the launcher's line (e.g. "stage 1 of 2")."""
        self._hooks = []
        if transformer is not None:
            for name, module in transformer.named_modules():
                if hasattr(module, "processor"):
                    self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
                    self._hooks.append(module.register_forward_hook(self._leave))
        self._publish()

    def _enter(self, name: str):
        def hook(_module: Any, _args: Any) -> None:
            self.layer = name

        return hook

    def _leave(self, _module: Any, _args: Any, _output: Any) -> None:
        self.layer = None

    def step_ended(self, index: int) -> None:
        """Denoising step `index` (from 0, as diffusers counts) is done: the next one starts."""
        self.step = min(index + 2, self.steps)
        self._publish()

    def locate(self, error: PeerTimeout) -> None:
        error.layer = error.layer or self.layer
        error.step = error.step or (self.step, self.steps)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _publish(self) -> None:
        folder = os.environ.get(PROGRESS_ENV)
        if folder is None:
            return
        path = Path(folder) / f"{os.environ.get('RANK', '0')}.step"
        scratch = path.with_suffix(".part")
        record = {"step": self.step, "steps": self.steps, "pid": os.getpid(), **({"role": self.role} if self.role else {})}
        scratch.write_text(json.dumps(record))
        os.replace(scratch, path)  # a reader never sees half a record


def published_step(folder: Path, rank: int) -> dict[str, int] | None:
    """What rank `rank` last published in `folder` ({"step", "steps", "pid"}, and "role"), if anything."""
    try:
        return json.loads((folder / f"{rank}.step").read_text())
    except (OSError, ValueError):
        return None


def exit_message(rank: int, code: int, folder: Path) -> str:
    """One line for a rank that ended with exit status `code` (negative: killed by a signal)."""
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    record = published_step(folder, rank)
    when = f" at step {record['step']} of {record['steps']}" if record else ""
    role = f" ({record['role']})" if record and record.get("role") else ""
    return f"rank {rank}{role} {how}{when}"
