"""An every-rank stand-in for NCCL: each rank of a world simulated in turn, its collectives checked across ranks.

Each rank runs in this process on torch's `fake` process group bound to `meta` only (`meta:fake`:
no CPU backend, so a CPU tensor in a collective or a send fails as it does on NCCL), its model on
`meta` in bf16. Collectives complete at once and move nothing. Every call the engine makes through
`torch.distributed` is recorded per rank: `new_group` (its members), collectives (op, group, shapes,
dtypes, devices, split sizes), sends and receives (peer, shape, dtype). `check` then holds the
ranks' records against each other, as NCCL would need them to be:

- the same `new_group` sequence with the same members on every rank (each is a communicator split
  that every rank of the parent takes part in, in order);
- on each group, every member's collectives in the same order, with the same op, dtypes and
  shapes (an all-to-all's: what each rank sends each peer is what the peer receives from it);
- every send matched, in order, by a receive of the same shape and dtype on its peer, over the same group;
- every tensor on the device; no rank raising where another went on.

Nothing is computed: a host read of a `meta` tensor (a step cache's agreed sums, V-Major's
timestep) reads zeros, the same on every rank, so a data-dependent decision takes one branch
everywhere; a tensor made on the host from numbers and sent (a pipeline stage's output header)
reads on its receiver as its sender made it. Each rank counts its
host reads (`host_reads`). A `nonzero` of a `meta` tensor (a boolean index) takes every element
as nonzero (torch's `meta_nonzero_assume_all_nonzero`): HunyuanVideo 1.5's reorder of its text
streams, valid tokens then padding, then holds each stream twice, the same on every rank.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast", "barrier",
               "reduce_scatter_tensor", "gather", "all_gather_object", "broadcast_object_list")
POINT_TO_POINT = ("isend", "irecv", "send", "recv")


@dataclass
class Rank:
    """What one simulated rank did."""

    rank: int
    groups: list[tuple[int, ...]] = field(default_factory=list)
    """Each `new_group` call's members, in order (every rank makes every call)."""
    collectives: dict[tuple[int, ...], list[tuple]] = field(default_factory=lambda: defaultdict(list))
    """Per group (its members): (op, dtypes, shapes or split sizes) in order."""
    sends: dict[tuple[int, int], list[tuple]] = field(default_factory=lambda: defaultdict(list))
    receives: dict[tuple[int, int], list[tuple]] = field(default_factory=lambda: defaultdict(list))
    """Per (sender, receiver): (shape, dtype, the group's members) in order."""
    devices: set[str] = field(default_factory=set)
    payloads: dict[tuple[int, int, int], list] = field(default_factory=dict)
    """(sender, receiver, place among its sends) -> the numbers of a sent tensor made from them."""
    host_reads: int = 0
    """Reads of a `meta` tensor on the host (each a device sync on a GPU)."""
    error: str | None = None


def _members(group: Any) -> tuple[int, ...]:
    group = group if group is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Recorder:
    """Wraps `torch.distributed`'s functions (the engine calls them as `dist.<name>`) to record one rank."""

    def __init__(self, rank: Rank, done: dict[int, Rank]) -> None:
        self.rank, self.done = rank, done
        self.received: dict[int, tuple[int, int]] = {}
        self.made: dict[int, list] = {}
        self.keep: list[torch.Tensor] = []
        """A received tensor (by id) -> (its sender, its place among the sender's sends to this rank)."""

    @contextmanager
    def installed(self) -> Iterator[None]:
        from torch.distributed import distributed_c10d

        saved = {}
        for name in (*COLLECTIVES, *POINT_TO_POINT, "new_group", "new_subgroups_by_enumeration"):
            saved[name] = getattr(dist, name)
            wrapped = self._wrap(name, saved[name])
            setattr(dist, name, wrapped)
            if name in POINT_TO_POINT:  # `P2POp` checks its op against these; `batch_isend_irecv` calls them
                setattr(distributed_c10d, name, wrapped)
        reads = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__float__", "__int__", "__bool__")}
        recorder = self

        def host_read(name: str) -> Callable:
            real = reads[name]

            def read(tensor: torch.Tensor) -> Any:
                if tensor.device.type != "meta":
                    return real(tensor)
                recorder.rank.host_reads += 1
                payload = recorder.payload(tensor) if name == "tolist" else None
                return payload if payload is not None else real(torch.zeros(tensor.shape, dtype=tensor.dtype))

            return read

        for name in reads:
            setattr(torch.Tensor, name, host_read(name))
        make = torch.tensor

        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            made = make(data, *args, **kwargs)
            if made.device.type == "meta" and isinstance(data, (list, tuple)):
                recorder.made[id(made)] = list(data)
                recorder.keep.append(made)  # alive while recorded: its id is not reused
            return made

        torch.tensor = tensor
        try:
            with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
                yield
        finally:
            torch.tensor = make
            for name, real in reads.items():
                setattr(torch.Tensor, name, real)
            for name, real in saved.items():
                setattr(dist, name, real)
                if name in POINT_TO_POINT:
                    setattr(distributed_c10d, name, real)

    def _wrap(self, name: str, real: Callable) -> Callable:
        signature = inspect.signature(real)
        record = self.rank

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if name == "new_group":
                record.groups.append(tuple(sorted(a["ranks"])) if a.get("ranks") is not None else _members(None))
            elif name == "new_subgroups_by_enumeration":
                record.groups.extend(tuple(sorted(r)) for r in a["ranks_per_subgroup_list"])
            elif name in POINT_TO_POINT:
                peer = a["dst"] if "dst" in a else a["src"]
                if peer is None:  # a rank of the group (`batch_isend_irecv` passes those)
                    group_peer = a["group_dst"] if "group_dst" in a else a["group_src"]
                    peer = dist.get_global_rank(a.get("group") or dist.group.WORLD, group_peer)
                self._p2p(name, a["tensor"], peer, a.get("group"))
            else:
                tensors = [t for key, v in a.items() if key not in ("group",) for t in _tensors(v)]
                record.devices.update(t.device.type for t in tensors)
                if name == "all_to_all_single":
                    group = _members(a.get("group"))
                    rows = a["input"].shape[0]
                    ins = a["input_split_sizes"] or [rows // len(group)] * len(group)
                    outs = a["output_split_sizes"] or [a["output"].shape[0] // len(group)] * len(group)
                    row = a["input"][0].numel() if rows else 0
                    shape = (tuple(n * row for n in ins), tuple(n * row for n in outs))
                    record.collectives[group].append((name, str(a["input"].dtype), shape))
                elif name in ("all_gather_object", "broadcast_object_list"):
                    record.collectives[_members(a.get("group"))].append((name,))
                else:
                    record.collectives[_members(a.get("group"))].append(
                        (name, tuple(str(t.dtype) for t in tensors), tuple(tuple(t.shape) for t in tensors)))
            return real(*args, **kwargs)

        return wrapped

    def _p2p(self, op: str, tensor: torch.Tensor, peer: int, group: Any) -> None:
        me = self.rank.rank
        self.rank.devices.add(tensor.device.type)
        entry = (tuple(tensor.shape), str(tensor.dtype), _members(group))
        if op in ("isend", "send"):
            self.rank.sends[me, peer].append(entry)
            if id(tensor) in self.made:  # a tensor made on the host from numbers: its numbers go with it
                self.rank.payloads[me, peer, len(self.rank.sends[me, peer]) - 1] = self.made[id(tensor)]
        else:
            self.rank.receives[peer, me].append(entry)
            self.received[id(tensor)] = (peer, len(self.rank.receives[peer, me]) - 1)

    def payload(self, tensor: torch.Tensor) -> list | None:
        """What a tensor received here holds, where its sender made it on the host from numbers (a
        pipeline stage's output header: engine/stages.py, its one host read per output signature,
        outside every layer): from the sender's record, simulated before this rank. None otherwise."""
        found = self.received.get(id(tensor))
        if found is None or found[0] not in self.done:
            return None
        src, index = found
        return self.done[src].payloads.get((src, self.rank.rank, index))


def simulate(world: int, run: Callable[[int], None], ranks: list[int] | None = None) -> list[Rank]:
    """`run(rank)` as each rank of a `world`-rank job in turn (all of them, or `ranks`), on a
    device-only fake group: what each did. The last rank first: a pipeline's last stage sends the
    headers the earlier stages read."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    records, done = [], {}
    for rank in reversed(ranks if ranks is not None else range(world)):
        record = Rank(rank)
        dist.init_process_group("meta:fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            with Recorder(record, done).installed():
                run(rank)
        except Exception as error:  # noqa: BLE001 - reported by `check`, with the rank
            record.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        finally:
            dist.destroy_process_group()
        records.append(record)
        done[rank] = record
    return records[::-1]


def check(records: list[Rank]) -> list[str]:
    """Every mismatch between the ranks' records (empty: consistent, as NCCL needs them)."""
    problems = []
    failed = [r for r in records if r.error]
    if failed:
        went_on = [r.rank for r in records if not r.error]
        problems += [f"rank {r.rank} raised {r.error}" + (f" (ranks {went_on} went on)" if went_on else "") for r in failed]
    first = records[0]
    for r in records[1:]:
        if r.groups != first.groups:
            at = next((i for i, (a, b) in enumerate(zip(first.groups, r.groups)) if a != b), min(len(first.groups), len(r.groups)))
            problems.append(f"new_group: rank {r.rank} made {len(r.groups)} groups, rank {first.rank} {len(first.groups)}; "
                            f"they differ from call {at} on")
    problems += [f"rank {r.rank} put a tensor on {sorted(r.devices - {'meta'})}" for r in records if r.devices - {"meta"}]
    by_rank = {r.rank: r for r in records}
    groups = {g for r in records for g in r.collectives}
    for group in sorted(groups):
        members = [by_rank[m] for m in group if m in by_rank]
        calls = [m.collectives.get(group, []) for m in members]
        for m, seq in zip(members[1:], calls[1:]):
            mine = [c[:2] if c[0] == "all_to_all_single" else c for c in seq]
            theirs = [c[:2] if c[0] == "all_to_all_single" else c for c in calls[0]]
            if mine != theirs:
                at = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(mine), len(theirs)))
                problems.append(f"group {group}: rank {m.rank}'s collectives differ from rank {members[0].rank}'s at call {at} "
                                f"({mine[at] if at < len(mine) else 'none'} vs {theirs[at] if at < len(theirs) else 'none'})")
        if len(members) == len(group) and all(len(c) == len(calls[0]) for c in calls):
            for index, call in enumerate(calls[0]):
                if call[0] != "all_to_all_single":
                    continue
                sent = [c[index][2][0] for c in calls]
                received = [c[index][2][1] for c in calls]
                if any(sent[i][j] != received[j][i] for i in range(len(group)) for j in range(len(group))):
                    problems.append(f"group {group}: all_to_all_single {index}: what ranks send is not what their peers receive")
    for r in records:
        for (src, dst), sends in r.sends.items():
            if dst in by_rank and by_rank[dst].receives.get((src, dst), []) != sends:
                problems.append(f"rank {src} sends {sends[:3]}... to rank {dst}, which receives "
                                f"{by_rank[dst].receives.get((src, dst), [])[:3]}")
        for (src, dst), receives in r.receives.items():
            if src in by_rank and (src, dst) not in by_rank[src].sends:
                problems.append(f"rank {dst} receives {receives[:3]} from rank {src}, which sends it nothing")
    return problems
