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
- every tensor on the device; no rank raising where another went on;
- no device-wide synchronization (`distributed/clock.synchronize`) while a receive is posted.

On `meta`, the default, nothing is computed: a host read of a `meta` tensor (a step cache's agreed
sums, V-Major's timestep) reads zeros, the same on every rank, so a data-dependent decision takes
one branch everywhere. On a GPU (tests/test_gpu.py) the ranks compute: model and inputs on `cuda`,
the group `cuda:fake`, and what a collective or a receive fills is zeros, alike on every rank (the
fake group moves nothing). On either, a tensor made from numbers and sent (a pipeline stage's
output header) reads on its receiver as its sender made it, and each rank counts its host reads
of device tensors (`host_reads`). A `nonzero` of a `meta` tensor (a boolean index) takes every element
as nonzero (torch's `meta_nonzero_assume_all_nonzero`): HunyuanVideo 1.5's reorder of its text
streams, valid tokens then padding, then holds each stream twice, the same on every rank.

Where the dispatched attention all-gathers its ranks' token counts (engine/attention/dispatch.py
`_all_counts`: two streams' counts coincide on some rank, and only the others' counts tell which
streams a call holds), the gather runs and each rank reads the counts its peers give. A peer not
simulated yet in this pass gives what it gave in the pass before; in the first pass, the first
layout of the call's streams that fits the counts known. The ranks run again until a pass reads
no count that its peer then did not give (`simulate`, `Counts`): that pass is the one checked.

While ranks run, `meta` tensors take torch's C++ meta kernels where an op has one (`native_meta`):
the shape and dtype functions its CPU and CUDA kernels share. Torch's import puts Python
references in front of them for symbolic shapes, 0.3-6 ms an op against 4-20 us, and those were
nine tenths of the stand-in's time.
"""

from __future__ import annotations

import inspect
import math
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
    device: str = "meta"
    """Where its model and every tensor it hands a collective should be (the fake group's only backend)."""
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
    """Reads of a device tensor on the host (each a device sync on a GPU)."""
    waits_on_posted: list[str] = field(default_factory=list)
    """Device-wide synchronizations while a receive was posted and not yet waited for: on NCCL one
    waits for that receive, whose sender may be waiting for this rank. (A host read waits for the
    current stream only, which a receive not yet waited for is not on: HunyuanVideo 1.5 reads its
    image embedding at its entry, on a stage with its output's receive posted.)"""
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


class Counts:
    """The counts each rank gives to each gather of counts, over the passes of `simulate`: keyed
    (stage, data group, gather, place in the sequence)."""

    def __init__(self) -> None:
        self.given: dict[tuple, int] = {}
        self.before: dict[tuple, int] = {}
        self.read_as: list[tuple[tuple, int]] = []
        """Every count read, by every rank: (whose, as what)."""
        self.guessed = False

    def read(self, key: tuple, place: int, length: int, layouts: list[list[int]]) -> list[int]:
        """A gather's counts, read at `place`, which gives `length`: each peer's as it gave it in this
        pass, or else in the pass before, or else a layout of the call's streams that fits."""
        self.given[(*key, place)] = length
        every = [self.given.get((*key, p), self.before.get((*key, p))) for p in range(len(layouts[0]))]
        if None in every:
            self.guessed = True
            fits = [v for v in layouts if all(n is None or n == m for n, m in zip(every, v))]
            every = fits[0] if fits else [length if n is None else n for n in every]
        self.read_as += [((*key, p), n) for p, n in enumerate(every)]
        return every

    def settled(self) -> bool:
        """Whether this pass read every count as its peer gave it (else: the next pass)."""
        settled = not self.guessed and all(self.given.get(k) == n for k, n in self.read_as)
        self.before, self.given, self.read_as, self.guessed = self.given, {}, [], False
        return settled


class _Tracked:
    """A work whose `wait` is noted (`Recorder.tracked`); everything else is the work's."""

    def __init__(self, work: Any, waited: Callable[[], Any]) -> None:
        self._work, self._waited = work, waited

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._waited()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Recorder:
    """Wraps `torch.distributed`'s functions (the engine calls them as `dist.<name>`) to record one rank."""

    def __init__(self, rank: Rank, done: dict[int, Rank], counts: Counts | None = None) -> None:
        self.rank, self.done = rank, done
        self.counts = counts if counts is not None else Counts()
        self.gathers = 0
        self.received: dict[int, tuple[int, int]] = {}
        self.made: dict[int, list] = {}
        self.keep: list[torch.Tensor] = []
        """A received tensor (by id) -> (its sender, its place among the sender's sends to this rank)."""
        self.posted: dict[int, int] = {}
        """Receives posted and not yet waited for: a work (by id) -> how many receives it finishes."""
        self.batching = False

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
                if tensor.device.type != recorder.rank.device:
                    return real(tensor)
                recorder.rank.host_reads += 1
                payload = recorder.payload(tensor) if name == "tolist" else None
                if payload is not None:
                    return payload
                return real(torch.zeros(tensor.shape, dtype=tensor.dtype) if tensor.device.type == "meta" else tensor)

            return read

        for name in reads:
            setattr(torch.Tensor, name, host_read(name))
        make = torch.tensor

        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            made = make(data, *args, **kwargs)
            if made.device.type == recorder.rank.device and isinstance(data, (list, tuple)):
                recorder.made[id(made)] = list(data)
                recorder.keep.append(made)  # alive while recorded: its id is not reused
            return made

        torch.tensor = tensor
        from cocodiff.distributed import clock

        synchronize, batch = clock.synchronize, dist.batch_isend_irecv

        def synchronized(device: torch.device) -> None:
            recorder.waiting("a device-wide synchronize")
            synchronize(device)

        def batched(ops: list) -> list:
            recorder.batching = True
            try:
                works = batch(ops)
            finally:
                recorder.batching = False
            receives = sum(op.op is distributed_c10d.irecv for op in ops)
            return [recorder.tracked(work, receives if i == len(works) - 1 else 0) for i, work in enumerate(works)]

        clock.synchronize, dist.batch_isend_irecv = synchronized, batched
        from cocodiff.engine.attention.dispatch import DispatchedAttention

        gather_counts = DispatchedAttention._all_counts

        def all_counts(attention: Any, length: int) -> list[int]:
            gather_counts(attention, length)  # the collective, as every rank makes it
            groups = attention.ctx.groups
            key = (groups.stage_index, groups.data_index, recorder.gathers)
            recorder.gathers += 1
            layouts = [attention.ctx.joint_sizes(streams) for streams in attention._options()]
            return recorder.counts.read(key, groups.sp_index, length, layouts)

        DispatchedAttention._all_counts = all_counts
        try:
            with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
                yield
        finally:
            clock.synchronize, dist.batch_isend_irecv = synchronize, batch
            DispatchedAttention._all_counts = gather_counts
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
            filled = _tensors(a.get("tensor")) if name in ("irecv", "recv") else \
                [t for key in ("output", "output_tensor", "tensor_list") for t in _tensors(a.get(key))]
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
                if name == "irecv" and not self.batching:
                    return self.tracked(self._received(real(*args, **kwargs), filled), 1)
            else:
                tensors = [t for key, v in a.items() if key not in ("group",) for t in _tensors(v)]
                record.devices.update(t.device.type for t in tensors)
                if name == "all_to_all_single":
                    group = _members(a.get("group"))
                    rows = a["input"].shape[0]
                    ins = a["input_split_sizes"] or [rows // len(group)] * len(group)
                    outs = a["output_split_sizes"] or [a["output"].shape[0] // len(group)] * len(group)
                    row = math.prod(a["input"].shape[1:])  # a rank with no rows still sends and receives rows of this size
                    shape = (tuple(n * row for n in ins), tuple(n * row for n in outs))
                    record.collectives[group].append((name, str(a["input"].dtype), shape))
                elif name in ("all_gather_object", "broadcast_object_list"):
                    record.collectives[_members(a.get("group"))].append((name,))
                else:
                    record.collectives[_members(a.get("group"))].append(
                        (name, tuple(str(t.dtype) for t in tensors), tuple(tuple(t.shape) for t in tensors)))
            return self._received(real(*args, **kwargs), filled)

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

    @staticmethod
    def _received(result: Any, filled: list[torch.Tensor]) -> Any:
        """`result`, once what the call filled is zeros where the ranks compute: the fake group fills
        nothing from a peer (an all-to-all's output gets this rank's own input, memory left as it was
        NaNs among it), which would take each rank down another data-dependent branch (V-First's
        check of its V, V-Major's indices). Alike on every rank."""
        with torch.no_grad():
            for tensor in filled:
                if tensor.device.type != "meta":
                    tensor.zero_()
        return result

    def tracked(self, work: Any, receives: int) -> Any:
        """`work` with its `wait` noted: until then the receives it finishes are posted."""
        if work is None or not receives:
            return work
        self.posted[id(work)] = receives
        self.keep.append(work)  # alive while noted: its id is not reused
        return _Tracked(work, lambda: self.posted.pop(id(work), None))

    def waiting(self, what: str) -> None:
        if self.posted:
            self.rank.waits_on_posted.append(f"{what} with {sum(self.posted.values())} receives posted")

    def payload(self, tensor: torch.Tensor) -> list | None:
        """What a tensor received here holds, where its sender made it on the host from numbers (a
        pipeline stage's output header: engine/stages.py, its one host read per output signature,
        outside every layer): from the sender's record, simulated before this rank. None otherwise."""
        found = self.received.get(id(tensor))
        if found is None or found[0] not in self.done:
            return None
        src, index = found
        return self.done[src].payloads.get((src, self.rank.rank, index))


@contextmanager
def native_meta() -> Iterator[None]:
    """`meta` tensors on torch's C++ meta kernels while inside; the Python ones that torch's import
    registers over them (torch/_meta_registrations.py `activate_meta`) kept only for ops with no C++
    kernel, and all of them registered again on leaving."""
    import torch._meta_registrations as registered
    from torch._decomp import global_decomposition_table

    python = registered._meta_lib_dont_use_me_use_register_meta
    names = {name.rsplit("/", 1)[0].replace("/", "::", 1) for name in python._op_impls}
    kernels: dict = {}
    for kind in ("meta", "post_autograd", "pre_autograd"):  # activate_meta's order: the first one wins
        for op, kernel in global_decomposition_table[kind].items():
            if isinstance(op, torch._ops.OpOverload) and op.name() in names:
                kernels.setdefault(op, kernel)
    python._destroy()
    only_python = torch.library.Library("aten", "IMPL", "Meta")
    try:
        for op, kernel in kernels.items():
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
                only_python.impl(op, kernel)
        yield
    finally:
        only_python._destroy()
        again = torch.library.Library("aten", "IMPL", "Meta")
        for op, kernel in kernels.items():
            again.impl(op, kernel)
        registered._meta_lib_dont_use_me_use_register_meta = again


def simulate(world: int, run: Callable[[int], None], ranks: list[int] | None = None, passes: int = 4,
             device: str = "meta") -> list[Rank]:
    """`run(rank)` as each rank of a `world`-rank job in turn (all of them, or `ranks`), on a fake
    group bound to `device` only (`meta`; `cuda` on a GPU, where the ranks compute): what each did.
    The last rank first: a pipeline's last stage sends the headers the earlier stages read. Again
    while a rank read counts its peers did not give (`Counts`), at most `passes` times: the last
    pass's records."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    counts = Counts()
    with native_meta():
        for _ in range(passes):
            records, done = [], {}
            for rank in reversed(ranks if ranks is not None else range(world)):
                record = Rank(rank, device)
                dist.init_process_group(f"{device}:fake", store=FakeStore(), rank=rank, world_size=world)
                try:
                    with Recorder(record, done, counts).installed():
                        run(rank)
                except Exception as error:  # noqa: BLE001 - reported by `check`, with the rank
                    record.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                finally:
                    dist.destroy_process_group()
                records.append(record)
                done[rank] = record
            if counts.settled():
                break
        else:
            for record in records:
                record.error = record.error or f"the counts its peers gave did not settle in {passes} passes"
    return records[::-1]


def call_site(frames: list[Any]) -> str | None:
    """Where a call was made, from a stack (`traceback.extract_stack()`): the innermost frame outside
    torch, the tests and the standard library's wrappers, as 'ROOT/PATH:LINE FUNCTION' with ROOT
    cocodiff, diffusers or transformers (the whole path otherwise); None without such a frame."""
    outside = [f for f in frames if "/torch/" not in f.filename and "/tests/" not in f.filename
               and not f.filename.endswith(("warnings.py", "contextlib.py"))]
    if not outside:
        return None
    frame = outside[-1]
    path = frame.filename
    for root in ("cocodiff/", "diffusers/", "transformers/"):
        if f"/{root}" in path:
            path = root + path.rsplit(f"/{root}", 1)[1]
            break
    return f"{path}:{frame.lineno} {frame.name}"


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
    problems += [f"rank {r.rank} put a tensor on {sorted(r.devices - {r.device})}" for r in records if r.devices - {r.device}]
    problems += [f"rank {r.rank}: {r.waits_on_posted[0]} ({len(r.waits_on_posted)} such)" for r in records if r.waits_on_posted]
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
