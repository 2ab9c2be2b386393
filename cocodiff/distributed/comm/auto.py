"""`--comm auto`, and the all-to-all microbenchmark behind `bench a2a`.

`--comm auto` times the candidates (flat, TAPA, full-depth TAPA on topologies of more than two
levels; each with or without V-First) on the run's own
denoising steps and keeps the fastest (`StepTrials`, `AutoExchange`).

`calibrate` times flat and TAPA alone at a few message sizes (buckets), alternating A B A B, for
`bench a2a`'s report. A collective takes as long as its slowest rank, so each timing is the
maximum over ranks (an all-reduce), which also means every rank holds the same numbers and makes
the same choice. The time spent is bounded: once the (rank-agreed) elapsed time passes the
budget, larger buckets inherit the last measured choice and are marked as not measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..clock import now
from ..topology import Topology
from cocodiff.config.wire import Wire
from .codec import SlowPhaseCodec
from .stats import CommStats
from .tapa import TapaExchange, TapaFullExchange, full_depth_differs
from .ulysses import Exchange, FlatExchange, Pending, all_reduce, bounded

__all__ = ["AutoChoice", "AutoExchange", "BUCKETS", "Candidate", "StepTrials", "calibrate", "candidates", "time_exchanges", "trials_summary"]

KiB = 1024
BUCKETS = [64 * KiB * 4**i for i in range(5)]  # 64 KiB .. 16 MiB per rank
TAPA_MARGIN = 0.95
"""TAPA is chosen only when it is at least 5% faster: flat makes fewer copies and one call."""


def probe(topology: Topology, bytes_per_rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[int]]:
    """A (1, S_r, H, 128) message of about `bytes_per_rank` bytes, with H = world size, and its layout."""
    P, D = topology.world_size, 128
    tokens = max(1, bytes_per_rank // (P * D * torch.finfo(dtype).bits // 8))
    seq = [tokens] * P
    return torch.randn(1, tokens, P, D, dtype=dtype, device=topology.device), seq


def time_exchanges(exchanges: list[Exchange], bytes_per_rank: int, repeats: int) -> list[list[float]]:
    """Seconds per `seq_to_head` for each exchange, `repeats` times, alternating; max over ranks."""
    topology = exchanges[0].topology
    x, seq = probe(topology, bytes_per_rank)
    for exchange in exchanges:  # warm-up: first use of a group and of large buffers
        exchange.seq_to_head(x, seq).wait()
    times = torch.zeros(repeats, len(exchanges), dtype=torch.float64)
    for rep in range(repeats):
        for i, exchange in enumerate(exchanges):
            bounded(dist.barrier(group=topology.world_group, async_op=True), "barrier before a timed exchange")
            start = now(topology.device)
            exchange.seq_to_head(x, seq).wait()
            times[rep, i] = now(topology.device) - start  # until the device has the result
    times = times.to(topology.device)
    all_reduce(times, topology.world_group, "exchange times (all-reduce)", op=dist.ReduceOp.MAX)
    return times.cpu().T.tolist()


@dataclass(frozen=True)
class AutoChoice:
    bytes_per_rank: int
    flat_ms: float | None
    tapa_ms: float | None
    choice: str
    measured: bool
    tapa_full_ms: float | None = None
    """Full-depth TAPA's time, on topologies where its hops differ from two-level TAPA's."""


def calibrate(topology: Topology, budget_s: float = 20.0, repeats: int = 3) -> list[AutoChoice]:
    """Time flat, TAPA (and full-depth TAPA past two levels) per bucket on this fabric; the same
    list on every rank. A TAPA decomposition is chosen only when it is `TAPA_MARGIN` faster than
    the simplest one before it."""
    if not topology.hierarchical:
        return [AutoChoice(b, None, None, "flat", False) for b in BUCKETS]  # TAPA would be flat here
    flat, tapa = FlatExchange(topology), TapaExchange(topology)
    full = [TapaFullExchange(topology)] if full_depth_differs(topology) else []
    choices: list[AutoChoice] = []
    start = time.perf_counter()
    for size in BUCKETS:
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=topology.device)
        all_reduce(elapsed, topology.world_group, "calibration time (all-reduce)", op=dist.ReduceOp.MAX)
        if elapsed.item() > budget_s and choices:
            choices.append(AutoChoice(size, None, None, choices[-1].choice, False))
            continue
        flat_s, tapa_s, *full_s = (sorted(t)[len(t) // 2] for t in time_exchanges([flat, tapa, *full], size, repeats))
        choice, best = ("tapa", tapa_s) if tapa_s < TAPA_MARGIN * flat_s else ("flat", flat_s)
        if full_s and full_s[0] < TAPA_MARGIN * best:
            choice = "tapa-full"
        full_ms = full_s[0] * 1e3 if full_s else None
        choices.append(AutoChoice(size, flat_s * 1e3, tapa_s * 1e3, choice, True, full_ms))
    return choices


@dataclass(frozen=True)
class Candidate:
    """One way to run the exchange: flat, TAPA or full-depth TAPA, V's exchange first (V-First) or not."""

    comm: str
    v_first: bool
    lossy: bool = False
    """With the wire format `--lossy-budget` allows (LOSSY; never without a budget)."""

    @property
    def name(self) -> str:
        return self.comm + ("+vfirst" if self.v_first else "") + ("+lossy" if self.lossy else "")


class StepTrials:
    """`--comm auto`: the run's own denoising steps, each under one candidate, then the fastest.

    A microbenchmark of the all-to-all alone misses what decides a step: V-First's overlap with
    the Q/K projections and the real mix of messages. So the first step is a warm-up (first use
    of groups and buffers), then each candidate runs whole steps (`repeats` rounds, alternating
    A B C D A B C D), and the candidate with the fastest step wins for every later step and run.
    The fastest, not the median: a candidate's first step carries its one-off costs (first use of
    its code paths and buffers; measured up to 3x a steady step with 8 ranks on 2 cores), and with
    two steps each the upper median is that first step. A step's time is the slowest rank's (all-reduce
    MAX on the world group at each trial step's end), so every rank holds the same numbers
    and commits to the same candidate. All candidates compute the same numbers (only the schedule
    differs), so the trial steps are real steps of the image, nothing is thrown away. A trial step
    cut short by the end of its run (the next call starts a new run: its step value is larger) is not
    counted. Steps are the step clock's (engine/steps.py), never read from timesteps.

    Two steps each cannot tell apart candidates a few percent apart on a noisy machine, so
    when others' fastest steps are within `CLOSE` of the best one, those candidates (the best
    included) run `confirm` more steps each, alternating, once; the fastest over all their steps
    decides. The decision to confirm is taken on the agreed times, so every rank takes it.

    The candidates are anything hashable with a `name`: exchanges (`Candidate`) here, plans for
    `--plan auto` (engine/plan_trials.py).
    """

    CLOSE = 0.05
    """Candidates whose fastest step is within this share of the best one's are timed again."""

    def __init__(self, candidates: list[Any], repeats: int = 2, confirm: int = 3, device: torch.device | None = None) -> None:
        if not candidates:
            raise ValueError("no candidates to try")
        self.candidates, self.repeats, self.confirm = candidates, repeats, confirm
        self.device = device or torch.device("cpu")
        """Where the steps run: a step's time is read once it has run there (clock.now)."""
        self.confirmed: list[Candidate] = []
        """The close candidates that were timed again (empty when the first rounds were clear)."""
        self.times: dict[Candidate, list[float]] = {c: [] for c in candidates}
        self.choice: Candidate | None = None if len(candidates) > 1 else candidates[0]
        self._order = [c for _ in range(repeats) for c in candidates]
        self._done = 0
        self._warm = False
        self._timestep: float | None = None
        self._running: Candidate | None = None
        self._start = 0.0

    @property
    def current(self) -> Candidate:
        """The candidate of the step running now."""
        return self.choice or self._running or self.candidates[0]

    def step_boundary(self, timestep: float, agree: Callable[[float], float]) -> bool:
        """Called before every transformer call with its step value (`StepClock.value`: equal within a
        step, falling through a run, larger at a new run); True when a new step begins.
        `agree(seconds)` returns the maximum over ranks (a collective every rank calls here)."""
        if timestep == self._timestep:
            return False
        new_run = self._timestep is None or timestep > self._timestep
        if self._running is not None and not new_run:
            self.times[self._running].append(agree(now(self.device) - self._start))
            self._done += 1
            if self._done == len(self._order):
                self._decide()
        self._running = None
        if self.choice is None:
            if self._warm:
                self._running = self._order[self._done]
            self._warm = True
        self._timestep, self._start = timestep, now(self.device)
        return True

    def _fastest(self, candidate: Candidate) -> float:
        return min(self.times[candidate], default=float("inf"))

    def _decide(self) -> None:
        """After the rounds: confirm the close candidates once, or choose the fastest."""
        ranked = sorted(self.candidates, key=lambda c: (self._fastest(c), self.candidates.index(c)))
        best = self._fastest(ranked[0])
        close = [c for c in self.candidates if self._fastest(c) <= best * (1 + self.CLOSE)]
        if len(close) > 1 and not self.confirmed and self.confirm > 0:
            self.confirmed = close
            self._order += [c for _ in range(self.confirm) for c in close]
            return
        self.choice = ranked[0]

    def report(self) -> dict[str, Any]:
        return {
            "name": "auto",
            "chosen": self.choice.name if self.choice else None,
            "trial_steps": self._done,
            "confirmed": [c.name for c in self.confirmed],
            "candidates": [
                {"name": c.name, "step_ms": self._fastest(c) * 1e3 if t else None, "steps": len(t)}
                for c, t in self.times.items()
            ],
        }


def candidates(topology: Topology, v_first: bool | None = None, lossy: bool = False) -> list[Candidate]:
    """Flat, TAPA where the topology has two levels, and full-depth TAPA ("tapa-full") where it
    has more (where its hops differ from two-level TAPA's), each with and without
    V-First (only with it when `v_first` is True, only without when False); with `lossy` (a
    `--lossy-budget` that allows a format), each also with that wire format on the nodes."""
    comms = ["flat", "tapa"] if topology.hierarchical else ["flat"]
    if full_depth_differs(topology):
        comms.append("tapa-full")
    orders = [False, True] if v_first is None else [v_first]
    packed = [False, True] if lossy and topology.nodes > 1 else [False]
    return [Candidate(comm, order, wire) for wire in packed for comm in comms for order in orders]


class AutoExchange(Exchange):
    """Flat, TAPA or full-depth TAPA for every message, as its `StepTrials` say: the candidate of the running step,
    then the chosen one. Copies (`with_state`) share the trials, so a choice holds for later runs."""

    name = "auto"

    def __init__(self, topology: Topology, stats: CommStats | None = None, trials: StepTrials | None = None,
                 v_first: bool | None = None, lossy_wire: Wire | None = None) -> None:
        super().__init__(topology, stats)
        self.lossy_wire = lossy_wire
        """The wire format a `--lossy-budget` allows (config/lossy_budget.py): candidates `+lossy` use it."""
        self.trials = trials or StepTrials(candidates(topology, v_first, lossy_wire is not None), device=topology.device)
        self.flat = FlatExchange(topology, stats)
        self.tapa = TapaExchange(topology, stats) if topology.hierarchical else self.flat
        self.tapa_full = TapaFullExchange(topology, stats) if full_depth_differs(topology) else self.tapa
        self.packed = {comm: type(e)(topology, stats) for comm, e in self._by_comm().items()} if lossy_wire else {}
        for exchange in self.packed.values():
            exchange.set_wire(lossy_wire)

    def _by_comm(self) -> dict[str, Exchange]:
        return {"flat": self.flat, "tapa": self.tapa, "tapa-full": self.tapa_full}

    def with_state(self, stats: CommStats | None, codec: SlowPhaseCodec | None = None) -> AutoExchange:
        """The same trials, counting into `stats` (a new object; no codec)."""
        if codec is not None:
            raise ValueError("the auto exchange takes no codec: which pieces cross nodes depends on its choice")
        exchange = AutoExchange(self.topology, stats, self.trials, lossy_wire=self.lossy_wire)
        exchange.set_wire(self.wire)
        return exchange

    def set_wire(self, wire: Wire | None) -> None:
        """The wire formats for whichever exchange the trials pick (given by the user: `auto` never
        chooses a lossy format itself, beyond what a `--lossy-budget` allows its `+lossy` candidates)."""
        self.wire = wire
        for exchange in {id(e): e for e in self._by_comm().values()}.values():
            exchange.set_wire(wire)

    @property
    def current(self) -> Exchange:
        candidate = self.trials.current
        return (self.packed if candidate.lossy else self._by_comm())[candidate.comm]

    def swap(
        self,
        x: torch.Tensor,
        gather_sizes: list[int],
        scatter_sizes: list[int],
        cache_key: tuple | None = None,
        kind: str = "a2a_in",
    ) -> Pending:
        return self.current.swap(x, gather_sizes, scatter_sizes, cache_key, kind)

    def gather_seq(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        return self.current.gather_seq(x, dim, sizes)

    def report(self) -> dict:
        return self.trials.report()


def trials_summary(report: dict[str, Any]) -> str:
    """`StepTrials.report()` in one line: each timed candidate's fastest step, e.g. 'flat 121.0 ms, tapa 64.6 ms'."""
    return ", ".join(f"{c['name']} {c['step_ms']:.1f} ms" for c in report["candidates"] if c["step_ms"] is not None)


def summary(choices: list[AutoChoice] | list[dict]) -> str:
    """One line: the choice per bucket, e.g. '64K flat, 256K tapa, ...'."""
    rows = [c if isinstance(c, dict) else asdict(c) for c in choices]
    return ", ".join(f"{r['bytes_per_rank'] // KiB}K {r['choice']}{'' if r['measured'] else '*'}" for r in rows)


