"""The incast term of Aurora's collective library, fitted to the paper's own microbenchmark.

The CoCoDiff paper (arXiv:2604.14561, "TAPA") times oneCCL's flat all-to-all against TAPA on Aurora: 48 MB per
rank 25.5 ms -> 6.0 ms (3.9x), 24 MB ~3x, 6 MB ~1.1x, with TAPA's second phase "two 6-rank
all-to-alls, one per tile index": one node, 12 tiles. On that node both move the same bytes over
the same Xe Links (the link-load model of network.py predicts them equal, 1.0x at every size), so
the gain is not in the links. Of the three usual causes:

- per-peer message cost (latency, a handshake per message): flat sends 11 messages per rank,
  TAPA 1 + 5, so such a cost weighs most at small sizes and its gain would shrink with size; the
  paper's grows with size (1.1x -> 3.9x). Not this.
- a flat algorithm that leaves links idle (one peer at a time, a schedule that is not staggered):
  it would lose from the smallest size on; at 6 MB flat is as fast as TAPA. Not this alone.
- incast: every flat receiver has 11 senders at once, TAPA's at most 5. A fabric absorbs the
  first bytes of a burst in its buffers whatever the fan-in, so small exchanges run at link
  rate; past that, a receiver that cannot serve all its senders backs up into the shared links,
  and the more senders, the slower. This gives a gain that starts near 1x and grows with the
  size: the shape the paper reports. This is the term modelled (system.Incast: `flows` a
  receiver serves at once, `buffer_MB` absorbed first).

`fit_incast` fits both figures to the three reported ratios (least squares on their logs, the
absolute times left to the links) and says how far the fit misses; `aurora.toml`'s `[incast]`
holds its result (a test checks they agree). The fitted law cannot give more than flat's fan-in
over TAPA's (11 / 5 = 2.2x on one node) on the congested bytes: the paper's 3.9x at 48 MB is
above what incast alone explains, and that residual is printed, not absorbed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .network import phase_load, routing, swap_matrix, tapa_matrices
from .system import Incast, LinkParams, System, load_system

__all__ = ["MICROBENCHMARK", "IncastFit", "a2a_times", "fit_incast"]

MICROBENCHMARK: tuple[tuple[int, float, float | None, float | None], ...] = (
    # (bytes per rank, flat / TAPA, flat ms, TAPA ms): the paper, unverified
    (6_000_000, 1.1, None, None),
    (24_000_000, 3.0, None, None),
    (48_000_000, 3.9, 25.5, 6.0),  # the paper's own ratio (its times give 4.25x)
)
"""The paper's all-to-all microbenchmark on one Aurora node (12 tiles), flat (oneCCL) vs TAPA."""
FLOWS = tuple(float(f) for f in range(1, 12))
BUFFERS_MB = tuple(float(b) for b in np.round(np.geomspace(0.5, 40.0, 121), 2))


def a2a_times(system: System, params: LinkParams, bytes_per_rank: int) -> tuple[float, float]:
    """Seconds of one flat all-to-all and one TAPA (groups of `system.tapa_group`) with
    `bytes_per_rank` bytes per rank, spread evenly over the peers."""
    P = system.ranks
    route = routing(system)
    gather, scatter, unit = [1] * P, [1] * P, bytes_per_rank / P  # T[r, s] = bytes_per_rank / P
    flat = phase_load(route, swap_matrix(gather, scatter, unit)).time(params)[0]
    tapa = sum(phase_load(route, T).time(params)[0] for T in tapa_matrices(gather, scatter, unit, system.tapa_group))
    return flat, tapa


@dataclass(frozen=True, slots=True)
class IncastFit:
    incast: Incast
    points: list[dict[str, float | None]]
    """Per microbenchmark size: reported and predicted flat / TAPA ratio (and ms where reported)."""
    rms_log_error: float


def _points(system: System, params: LinkParams) -> list[dict[str, float | None]]:
    out = []
    for size, ratio, flat_ms, tapa_ms in MICROBENCHMARK:
        flat, tapa = a2a_times(system, params, size)
        out.append({"bytes_per_rank": size, "reported_ratio": ratio, "predicted_ratio": flat / tapa,
                    "reported_flat_ms": flat_ms, "predicted_flat_ms": flat * 1e3,
                    "reported_tapa_ms": tapa_ms, "predicted_tapa_ms": tapa * 1e3})
    return out


def fit_incast(system: System | None = None) -> IncastFit:
    """The incast figures that best give the paper's flat / TAPA ratios on one node of `system`
    (default: the shipped `aurora`, its nominal links): a grid over `flows` (whole transfers) and
    `buffer_MB`, least squares on the log ratios."""
    one = (system or load_system("aurora")).with_nodes(1)
    nominal = replace(one.nominal(), incast=None)
    best: tuple[float, Incast] | None = None
    for flows in FLOWS:
        for buffer in BUFFERS_MB:
            incast = Incast(flows=flows, buffer_MB=buffer)
            params = replace(nominal, incast=incast)
            error = sum(math.log(p["predicted_ratio"] / p["reported_ratio"]) ** 2 for p in _points(one, params))
            if best is None or error < best[0] - 1e-12:
                best = (error, incast)
    assert best is not None
    error, incast = best
    incast = replace(incast, source="fitted to the paper's microbenchmark (arXiv:2604.14561) by cocodiff.simulate.incast")
    return IncastFit(incast=incast, points=_points(one, replace(nominal, incast=incast)),
                     rms_log_error=math.sqrt(error / len(MICROBENCHMARK)))
