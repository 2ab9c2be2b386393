"""One device per process, and the nodes the ranks sit on, both taken from the launcher.

A rank's device is decided once, before the process group starts, from the launcher's local
rank, and the process group is bound to it (`init_process_group(device_id=...)`); everything
else (`Topology.device`, the pipeline, every tensor a collective touches) uses that same device.

    local rank:  LOCAL_RANK (torchrun), else SLURM_LOCALID (srun), OMPI_COMM_WORLD_LOCAL_RANK
                 (Open MPI), PALS_LOCAL_RANKID (Cray PALS: Aurora's mpiexec), MPI_LOCALRANKID
                 (MPICH/Intel MPI); none set and several devices visible: an error, since every
                 rank would take device 0
    device:      accelerator `local rank` of the visible ones (one visible: that one, as when
                 the launcher binds a device per task); CPU when there is none, or when
                 COCODIFF_DEVICE=cpu (emulated clusters, more local ranks than devices)
    nodes:       the ranks grouped by host name (all-gathered once), which must give equal,
                 node-major runs of ranks; COCODIFF_HOST names an emulated node instead
"""

from __future__ import annotations

import os
import socket
from typing import Mapping

import torch

from ..config.env import DEVICE_ENV, HOST_ENV, LOCAL_RANK_ENVS
from ..errors import UsageError

__all__ = [
    "DEVICE_ENV", "HOST_ENV", "LOCAL_RANK_ENVS", "accelerator_type", "backend_for", "device_count", "first_device", "host_name",
    "local_rank_from_env", "process_device", "ranks_per_node_from_hosts",
]



def accelerator_type(env: Mapping[str, str] = os.environ) -> str | None:
    """`cuda` or `xpu` when this process should use an accelerator of that kind, else None."""
    if env.get(DEVICE_ENV, "").lower() == "cpu":
        return None
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


def first_device(env: Mapping[str, str] = os.environ) -> torch.device:
    """The device a command judges by before its ranks start: the first accelerator of the kind the
    ranks will use (`accelerator_type`), else the CPU."""
    kind = accelerator_type(env)
    return torch.device(kind, 0) if kind is not None else torch.device("cpu")


def device_count(kind: str) -> int:
    """How many accelerators of `kind` (`cuda` or `xpu`) this process sees."""
    return torch.cuda.device_count() if kind == "cuda" else torch.xpu.device_count()


def local_rank_from_env(env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """(variable, value) of the first launcher variable that gives the local rank, or None."""
    for name in LOCAL_RANK_ENVS:
        value = env.get(name, "").strip()
        if value:
            try:
                return name, int(value)
            except ValueError:
                raise UsageError(f"{name}={value!r} is not a local rank (an integer)") from None
    return None


def process_device(env: Mapping[str, str] = os.environ, kind: str | None = None, count: int | None = None) -> torch.device:
    """This process's device (see the module's docstring); `kind` and `count` stand in for the
    machine's accelerators in tests."""
    kind = kind if kind is not None else accelerator_type(env)
    if kind is None:
        return torch.device("cpu")
    count = count if count is not None else device_count(kind)
    if count == 1:  # the launcher (or CUDA_VISIBLE_DEVICES) gave this process its one device
        return torch.device(kind, 0)
    local = local_rank_from_env(env)
    if local is None:
        raise UsageError(
            f"no local rank: none of {', '.join(LOCAL_RANK_ENVS)} is set and {count} {kind} devices are visible, "
            f"so every rank would take device 0; launch with torchrun, or set one of them per process"
        )
    name, index = local
    if not 0 <= index < count:
        raise UsageError(f"{name}={index} but only {count} {kind} devices are visible (0..{count - 1})")
    return torch.device(kind, index)


def backend_for(device: torch.device) -> str:
    """The collective library for a device: NCCL on NVIDIA, XCCL on Intel, gloo on CPU.

    Not gloo on GPU tensors: its point-to-point sends (the exchanges' path on gloo) fail on
    them ("writev: Bad address", torch 2.11 on an H200), so ranks sharing one GPU cannot work."""
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def host_name(env: Mapping[str, str] = os.environ) -> str:
    return env.get(HOST_ENV) or socket.gethostname()


def ranks_per_node_from_hosts(hosts: list[str]) -> int:
    """Ranks per node from every rank's host name (by rank): equal, node-major runs of ranks."""
    runs: list[tuple[str, int]] = []
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1] = (host, runs[-1][1] + 1)
        else:
            runs.append((host, 1))
    names = [host for host, _ in runs]
    if len(set(names)) != len(names):
        first = next(h for h in names if names.count(h) > 1)
        ranks = [r for r, h in enumerate(hosts) if h == first]
        raise UsageError(f"ranks are not numbered node by node: host {first} has ranks {ranks}; launch node-major "
                         f"(torchrun does), or give --ranks-per-node/--levels")
    sizes = {n for _, n in runs}
    if len(sizes) > 1:
        layout = ", ".join(f"{host}: {n}" for host, n in runs)
        raise UsageError(f"nodes of unequal size ({layout} ranks); launch the same number of ranks on every node")
    return runs[0][1]
