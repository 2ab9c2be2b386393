"""Calibration against `bench a2a`, validation against `bench e2e`.

Calibration (`--calibrate A2A.json`): the model predicts the time of every measured all-to-all
(flat and TAPA, each message size) from the system's link figures; the effective bandwidth of
every link class that carries traffic and the per-message latency of every latency class that
sends messages are fitted by least squares on the log of the times (each point counts alike,
small or large), with a weak pull (weight `PRIOR`) towards the nominal values so that figures
the data cannot tell apart (two links always loaded together) stay near the TOML file's. The
minimizer is a plain Nelder-Mead over the logs of the figures (numpy only).

The probe of `bench a2a` (cocodiff/distributed/comm/auto.py): a (1, T, P, 128) fp32 tensor with
T = bytes_per_rank // (P x 128 x 4) tokens per rank and one head per rank, sent `seq_to_head`;
TAPA groups are the file's nodes.

Validation (`--validate E2E.json`): the compute time per step is the measured `flat` variant's
step_ms - exposed_comm_ms (the measured profile: everything but the time blocked on
communication), split over layers in proportion to the FLOP model; communication comes from the
(calibrated) link model. Every variant of the file is predicted and compared with its measured
ms/step, and the predicted inter-node bytes per step with the measured ones. Plans with pipeline
stages take the same compute (stages.py; on an emulation, its `host_cores` shared by the stages).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import UsageError
from ..config.variants import parse_variant
from .model import NotRunnable, check_modelled, predict
from .network import PhaseLoad, phase_load, routing, swap_matrix, tapa_matrices
from .system import PHASE, LinkParams, System
from .workload import MODELS, Workload

__all__ = [
    "Fit", "fit_a2a", "fitted_params_for", "load_json", "measured_compute_scale", "nelder_mead", "predict_a2a", "validate_e2e",
]

PRIOR = 1e-3
"""Weight of the pull towards nominal, per squared log-ratio of a fitted figure."""
DETERMINED = 3.0
"""A figure is set by the data when its spread sqrt(diag((J^T J + PRIOR)^-1)) in log units (J: the
log-times' derivatives by the log-figures) is below this; above it the prior sets it. Without
data a figure's spread is 1 / sqrt(PRIOR) ~ 32."""
PROBE_HEAD_DIM, PROBE_BYTES = 128, 4
TARGET = 0.25
"""Validation target: predicted ms/step within 25% of the measured."""


def load_json(path: Path, kind: str, keys: tuple[str, ...]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: arrays nested past the parser's depth
        raise UsageError(f"{path}: cannot read a bench {kind} JSON file ({type(error).__name__}: {error})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a bench {kind} JSON file (a JSON {type(data).__name__}, not an object)")
    missing = [k for k in keys if k not in data]
    if missing:
        raise UsageError(f"{path}: not a bench {kind} JSON file (no {', '.join(missing)})")
    return data


def _check_topology(system: System, data: dict[str, Any], path: Path, links: bool = True) -> System:
    """`system` at the file's node count; the file must have its ranks per node and, when its
    `links` matter, its kind of fabric."""
    if data["ranks_per_node"] != system.ranks_per_node:
        raise UsageError(f"{path}: {data['ranks_per_node']} ranks per node, but {system.name} has {system.ranks_per_node}")
    fabric = str(data.get("fabric", ""))
    if links and system.network.kind in ("rail", "shared") and not fabric.startswith(system.network.kind):
        raise UsageError(f"{path}: measured on fabric {fabric!r}, not on a {system.network.kind} fabric like {system.name}")
    return system.with_nodes(int(data["nodes"]))


def _a2a_phases(system: System, bytes_per_rank: int, group: int) -> tuple[list[PhaseLoad], list[PhaseLoad]]:
    P = system.ranks
    tokens = max(1, bytes_per_rank // (P * PROBE_HEAD_DIM * PROBE_BYTES))
    gather, scatter, unit = [tokens] * P, [1] * P, PROBE_HEAD_DIM * PROBE_BYTES
    route = routing(system)
    flat = [phase_load(route, swap_matrix(gather, scatter, unit))]
    if system.nodes == 1 or group == 1:
        return flat, flat  # bench a2a times flat twice there
    return flat, [phase_load(route, T) for T in tapa_matrices(gather, scatter, unit, group)]


def predict_a2a(system: System, params: LinkParams, bytes_per_rank: int, group: int | None = None) -> tuple[float, float]:
    """Seconds of one flat and one TAPA `seq_to_head` of the bench a2a probe."""
    flat, tapa = _a2a_phases(system, bytes_per_rank, group or system.ranks_per_node)
    return sum(p.time(params)[0] for p in flat), sum(p.time(params)[0] for p in tapa)


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.5, iterations: int = 3000,
                tolerance: float = 1e-10) -> np.ndarray:
    """Minimize f from x0 (standard reflection / expansion / contraction / shrink)."""
    n = len(x0)
    simplex = [x0.astype(float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            inside = fr >= values[-1]
            contracted = centroid + (0.5 * (simplex[-1] - centroid) if inside else 0.5 * (reflected - centroid))
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


@dataclass(frozen=True)
class Fit:
    params: LinkParams
    nominal: LinkParams
    fitted: tuple[str, ...]
    """Names of the fitted figures: `bw:<class>` and `lat:<class>`."""
    determined: dict[str, bool]
    """Per fitted figure: whether the data set it (False: the data cannot tell it from others,
    it stays near nominal)."""
    points: list[dict[str, float]]
    """Per message size: measured and predicted flat and TAPA ms."""
    rms_log_error: float


def fit_a2a(system: System, path: Path, nominal: LinkParams | None = None) -> tuple[System, Fit]:
    """Fit the link figures of `system` to a bench a2a JSON file; returns the system at the file's
    node count and the fit."""
    data = load_json(path, "a2a", ("results", "nodes", "ranks_per_node"))
    system = _check_topology(system, data, path)
    nominal = nominal or system.nominal()
    rows = [r for r in data["results"] if r.get("flat_ms", 0) > 0 and r.get("tapa_ms", 0) > 0]
    if not rows:
        raise UsageError(f"{path}: no results to fit")
    group = data["ranks_per_node"]
    phases = [_a2a_phases(system, int(r["bytes_per_rank"]), group) for r in rows]
    measured = np.log([[r["flat_ms"] * 1e-3, r["tapa_ms"] * 1e-3] for r in rows])
    everything = [p for pair in phases for side in pair for p in side]
    # fit only what the data touches: classes with traffic, latency classes with messages
    loaded = {c for p in everything for c, b in zip(p.bw_classes, p.busiest) if b > 0}
    sending = {c for p in everything for c, m in zip(p.lat_classes, p.messages.T) if m.any()}
    bw_names = [c for c in nominal.bandwidth if c in loaded]
    lat_names = [c for c in nominal.latency if c in sending or c == PHASE]
    names = [f"bw:{c}" for c in bw_names] + [f"lat:{c}" for c in lat_names]
    x0 = np.log([nominal.bandwidth[c] for c in bw_names] + [nominal.latency[c] for c in lat_names])

    def params_of(x: np.ndarray) -> LinkParams:
        bandwidth, latency = dict(nominal.bandwidth), dict(nominal.latency)
        for c, v in zip(bw_names, x[: len(bw_names)]):
            bandwidth[c] = math.exp(v)
        for c, v in zip(lat_names, x[len(bw_names):]):
            latency[c] = math.exp(v)
        return LinkParams(bandwidth=bandwidth, latency=latency, source=f"fitted to {Path(path).name}", incast=nominal.incast)

    def predicted(params: LinkParams) -> np.ndarray:
        return np.array([[sum(p.time(params)[0] for p in side) for side in pair] for pair in phases])

    def cost(x: np.ndarray) -> float:
        residual = np.log(predicted(params_of(x))) - measured
        return float((residual ** 2).sum() + PRIOR * ((x - x0) ** 2).sum())

    best = x0
    for step in (1.0, 0.3):  # a restart from the first optimum escapes a collapsed simplex
        best = nelder_mead(cost, best, step=step)
    params = params_of(best)
    pred = predicted(params)
    jacobian = np.stack([(np.log(predicted(params_of(best + 1e-4 * e))) - np.log(pred)).ravel() / 1e-4
                         for e in np.eye(len(best))], axis=1)
    spread = np.sqrt(np.diag(np.linalg.inv(jacobian.T @ jacobian + PRIOR * np.eye(len(best)))))
    points = [
        {"bytes_per_rank": int(r["bytes_per_rank"]), "flat_ms": r["flat_ms"], "flat_pred_ms": pf * 1e3,
         "tapa_ms": r["tapa_ms"], "tapa_pred_ms": pt * 1e3}
        for r, (pf, pt) in zip(rows, pred)
    ]
    rms = float(np.sqrt(np.mean((np.log(pred) - measured) ** 2)))
    determined = {name: bool(x < DETERMINED) for name, x in zip(names, spread)}
    return system, Fit(params=params, nominal=nominal, fitted=tuple(names), determined=determined, points=points,
                       rms_log_error=rms)


def _workload(data: dict[str, Any], path: Path) -> Workload:
    if data["model"] not in MODELS:
        raise UsageError(f"{path}: model {data['model']!r} is not one of {', '.join(MODELS)}")
    # bench e2e runs in fp32 (GenerateSpec's default) unless the file says otherwise
    dtype = str(data.get("dtype", "fp32"))
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return Workload(model=MODELS[data["model"]], height=int(data["height"]), width=int(data["width"]),
                    batch=int(data.get("batch", 1)), steps=int(data.get("steps", 1)), dtype=dtype)


def validate_e2e(
    system: System, params_for: Callable[[System], LinkParams], path: Path, compute_scale: float | None = None,
) -> list[dict[str, Any]]:
    """Predicted vs measured ms/step and inter-node bytes for every variant of a bench e2e file.

    The compute per step is the file's own flat variant's, unless `compute_scale` is given (from
    another run, `--compute-profile`): then nothing of the file is used before the comparison, a
    held-out prediction."""
    data = load_json(path, "e2e", ("variants", "model", "height", "width", "nodes", "ranks_per_node"))
    system = _check_topology(system, data, path)
    params = params_for(system)
    if compute_scale is None:
        scale, workload = measured_compute_scale(system, path)
    else:
        scale, workload = compute_scale, _workload(data, path)
    out = []
    for name, measured in data["variants"].items():
        try:
            variant = check_modelled(parse_variant(name))
        except UsageError as error:  # e.g. `auto`, whose choice depends on a run-time measurement
            out.append({"file": Path(path).name, "variant": name, "skipped": str(error)})
            continue
        p = predict(workload, system, params, variant, compute_scale=scale)
        entry = {
            "file": Path(path).name, "fabric": data.get("fabric", ""), "model": workload.model.name,
            "height": workload.height, "width": workload.width, "batch": workload.batch, "steps": workload.steps,
            "nodes": system.nodes, "ranks_per_node": system.ranks_per_node, "variant": name, "plan": p.plan.short,
            "lossy": variant.lossy or variant.displaced,
            "measured_ms": measured["step_ms"], "predicted_ms": p.step_s * 1e3,
            "error": p.step_s * 1e3 / measured["step_ms"] - 1.0,
            "measured_exposed_comm_ms": measured.get("exposed_comm_ms"), "predicted_exposed_comm_ms": p.exposed_s * 1e3,
            "compute_ms": p.compute_s * 1e3,
            "measured_inter_node_bytes": measured.get("inter_node_bytes"), "predicted_inter_node_bytes": p.inter_node_bytes,
        }
        if measured.get("inter_node_bytes"):
            entry["bytes_error"] = p.inter_node_bytes / measured["inter_node_bytes"] - 1.0
        if p.stages is not None:  # the measured wait at the boundary holds the bubble too (fill, drain)
            entry.update(predicted_bubble_ms=p.stages.bubble_s * 1e3, predicted_boundary_exposed_ms=p.stages.boundary_exposed_s * 1e3,
                         measured_stage_wait_ms=measured.get("exposed_comm_ms_by_kind", {}).get("stage"))
        entry["within_target"] = abs(entry["error"]) <= TARGET
        out.append(entry)
    return out


def fitted_params_for(fit: Fit) -> Callable[[System], LinkParams]:
    """The fit at any node count: each bandwidth class keeps its fitted / nominal ratio (a spine
    that grows with the nodes keeps growing), latencies are the fitted values."""
    factors = {c: fit.params.bandwidth[c] / fit.nominal.bandwidth[c] for c in fit.nominal.bandwidth}

    def at(system: System) -> LinkParams:
        nominal = system.nominal()
        return LinkParams(bandwidth={c: v * factors.get(c, 1.0) for c, v in nominal.bandwidth.items()},
                          latency={c: fit.params.latency.get(c, v) for c, v in nominal.latency.items()},
                          source=fit.params.source, incast=nominal.incast)

    return at


def measured_compute_scale(system: System, path: Path) -> tuple[float, Workload]:
    """Measured / nominal compute per step of the `flat` variant of a bench e2e file (or of its
    baseline, when that is flat under a plan: `r2u4:flat`): the factor that turns the device's
    nominal throughput into the measured one (the measured profile). Returns it with the file's
    workload. The file may come from any fabric with the system's ranks per node (e.g. local
    ranks without emulated links): compute does not depend on the links."""
    data = load_json(path, "e2e", ("variants", "model", "height", "width", "nodes", "ranks_per_node"))
    system = _check_topology(system, data, path, links=False)
    workload = _workload(data, path)
    name = "flat" if "flat" in data["variants"] else str(data.get("baseline", "flat"))  # a run's baseline: `r2u4:flat`
    flat = data["variants"].get(name)
    variant = parse_variant(name) if flat is not None else None
    if variant is None or variant.comm != "flat" or variant.v_first or variant.lossy:
        raise UsageError(f"{path}: no `flat` variant, whose compute time is the measured profile")
    try:
        nominal = predict(workload, system, system.nominal(), check_modelled(variant))  # compute: links do not matter
    except NotRunnable as error:
        raise UsageError(f"{path}: {error}") from None
    if flat["exposed_comm_ms"] >= flat["step_ms"]:
        raise UsageError(f"{path}: {name}'s exposed_comm_ms {flat['exposed_comm_ms']:.1f} is not below its step_ms "
                         f"{flat['step_ms']:.1f}, so it gives no compute time to scale by")
    return (flat["step_ms"] - flat["exposed_comm_ms"]) * 1e-3 / nominal.compute_s, workload
