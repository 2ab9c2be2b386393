"""`cocodiff simulate`: per-step latency of a real model on a real cluster, predicted.

    cocodiff simulate --system aurora --model sd35-large --resolution 2304 --nodes 1,2,4,8
    cocodiff simulate --system dgx-h100 --model wan21-14b --resolution 720x1280 --frames 81 --nodes 1,2,4,8
    cocodiff simulate --system rail-2x2 --calibrate docs/results/a2a-rail2x2.json \\
                      --validate docs/results/e2e-rail2x2-512.json
    cocodiff simulate --system dgx-h100 --model flux1-dev --nodes 2 --no-cfg --batch 4 \\
                      --variants u16:tapa+vfirst,p2u8:tapa+vfirst,p2u8:tapa+vfirst+patches=4
    cocodiff simulate --paper

Every figure printed says where it comes from: `nominal` (the system's TOML file), `fitted`
(--calibrate, from bench a2a), or `measured` (a bench e2e file).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError
from ..output.files import check_file, check_plot, save_figure, write_all
from ..output.tables import fixed, print_table, write_json

__all__ = ["add_parser", "main"]

DEFAULT_VARIANTS = "flat,tapa,tapa+vfirst,cocodiff"


def add_parser(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser("simulate", help="predict per-step latency on a cluster you do not have (cost model)")
    sim.add_argument("--system", default="aurora",
                     help="a shipped system (aurora, dgx-h100, rail-2x2, shared-2x2) or a .toml file")
    sim.add_argument("--model", default=None,
                     help="flux1-dev, sd35-large, qwen-image, flux2-dev, zimage-turbo; video: wan21-14b, wan21-1.3b, "
                          "wan22-ti2v-5b, hunyuanvideo15, ltx-video; presets: tiny-flux, tiny-sd3, tiny-qwen-image (--list)")
    sim.add_argument("--resolution", default=None,
                     help="size in pixels: 2304 (square) or HEIGHTxWIDTH (default: the model's; 1024 square for images)")
    sim.add_argument("--frames", type=int, default=None,
                     help="video frames, t x k + 1 for a VAE temporal factor t (video models only; default: the model's)")
    sim.add_argument("--nodes", default=None, help="comma-separated node counts, e.g. 1,2,4,8 (default: the system's)")
    sim.add_argument("--variants", default=DEFAULT_VARIANTS,
                     help="comma-separated, as bench e2e names them: [PLAN:]flat|tapa, +vfirst, tapa +vmajor|+vmajorqk "
                          "(LOSSY), or cocodiff (= tapa+vfirst+vmajor, LOSSY), +fp8 (LOSSY: fp8 between nodes), +shard (weights sharded over each node's ranks: their all-gathers), "
                          "+patches=M (LOSSY: M displaced patches per step through the pipeline stages); PLAN places pipeline stages, cfg, batch, ring and Ulysses, "
                          "outermost first (c2u12:tapa, r2u24:tapa, u24r2:flat, p2u8:tapa+vfirst; auto: the engine's --plan auto; default: "
                          "the engine's plan); the auto exchange and diffusers-ulysses are measured, not modelled")
    sim.add_argument("--plan", default=None, metavar="auto|PLAN[,PLAN...]",
                     help="run every variant under each plan, side by side (c2u2, b2u2, u4r2, ...; auto = the "
                          "engine's --plan auto); the speedups stay over flat under the engine's default plan")
    sim.add_argument("--wire", default=None, metavar="LEVEL=FORMAT[,...]",
                     help="LOSSY: every variant sends the messages crossing LEVEL in FORMAT (bf16, fp8, int8), as "
                          "generate's --wire; levels: node (between nodes), then the system's own (--list); a variant's "
                          "+fp8 is node=fp8")
    sim.add_argument("--stage-cut", default="engine", choices=("engine", "compute"),
                     help="pipeline stages (p): cut the blocks as the engine does, by the weights each block's image "
                          "tokens read (engine), or what-if by their modelled compute (compute)")
    sim.add_argument("--pipe-warmup", type=int, default=1, metavar="K",
                     help="+patches=M: the first K steps run whole, as generate's --pipe-warmup")
    sim.add_argument("--pipe-text", default="whole", choices=("whole", "patched"),
                     help="+patches=M: the whole text with every patch, or cut like the image, as generate's --pipe-text")
    sim.add_argument("--batch", type=int, default=1, help="images per prompt")
    sim.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the model's; bf16 for real models)")
    sim.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's; V-Major averages over them)")
    sim.add_argument("--no-cfg", action="store_true", help="leave out the model's classifier-free guidance")
    sim.add_argument("--link-efficiency", type=float, default=1.0, metavar="F",
                     help="what-if: multiply every nominal link bandwidth by F")
    sim.add_argument("--calibrate", type=Path, default=None, metavar="A2A.json",
                     help="fit link bandwidths and latencies to a `bench a2a --json` file of this system")
    sim.add_argument("--validate", type=Path, nargs="+", default=None, metavar="E2E.json",
                     help="predict every variant of `bench e2e --json` files and compare with the measurement")
    sim.add_argument("--compute-profile", type=Path, default=None, metavar="E2E.json",
                     help="replace the device's nominal throughput by the compute measured in a bench e2e file")
    sim.add_argument("--paper", action="store_true", help="the paper's settings on the system, beside the paper's figures")
    sim.add_argument("--list", action="store_true", help="list the systems and models")
    sim.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    sim.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG plot")


def _with_plans(variants: list, plans: str | None) -> list:
    """`--plan a,b`: every variant under each plan (a variant's own plan is replaced)."""
    from ..config.variants import parse_variant
    from .model import check_modelled

    if plans is None:
        return variants
    names = [p.strip() for p in plans.split(",") if p.strip()]
    if not names:
        raise UsageError(f"--plan {plans!r} names no plan: write auto or a plan like c2u2")
    out = []
    for plan in names:
        for v in variants:
            comm = v.name.split(":", 1)[-1]
            variant = check_modelled(parse_variant(f"{plan}:{comm}"))
            if variant not in out:
                out.append(variant)
    return out


def _with_wire(variants: list, text: str | None) -> list:
    """`--wire SPEC`: every variant with that wire (replacing a `+fp8`), named `NAME wire=SPEC`."""
    from dataclasses import replace

    from ..config.wire import parse_wire

    if text is None:
        return variants
    wire = parse_wire(text)
    if wire is None:
        return [replace(v, wire=None) for v in variants]
    return [replace(v, wire=wire.text, text=f"{v.name.removesuffix('+fp8')} wire={wire.text}") for v in variants]


def _nodes(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        nodes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        nodes = []
    if not nodes or min(nodes) < 1:
        raise UsageError(f"--nodes {text!r} must be node counts of at least 1, e.g. 1,2,4,8")
    return nodes


def _resolution(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise UsageError(f"--resolution {text!r} must be pixels, e.g. 2304 or 1536x1024 (height x width)")
    return (sides[0], sides[-1])


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"


def _pct(x: float) -> str:
    return f"{fixed(100 * x, sign=True)}%"


def main(args: argparse.Namespace) -> int:
    from .calibrate import measured_compute_scale, validate_e2e
    from .model import modelled_variants
    from .stages import StageOptions
    from .table import table_rows
    from ..config.flags import STEPS_LIMIT
    from .system import SYSTEMS, load_system
    from .workload import MODELS, Workload, get_model

    check_file("--json", args.json)  # before the simulation runs
    check_plot("--plot", args.plot)
    if args.list:
        print_table("systems", ["name", "description"], [(s, load_system(s).description) for s in SYSTEMS])
        print_table("models", ["name", "heads", "source"], [(m.name, str(m.heads), m.source) for m in MODELS.values()])
        return 0
    if not (args.model or args.paper or args.validate or args.calibrate):
        raise UsageError(f"give --model (one of {', '.join(MODELS)}), --paper, --validate or --calibrate")
    if not 0 < args.link_efficiency < float("inf"):  # NaN too
        raise UsageError(f"--link-efficiency {args.link_efficiency} must be a positive number (a factor on the links' rates)")
    if args.steps is not None and not 1 <= args.steps <= STEPS_LIMIT:
        raise UsageError(f"--steps {args.steps} must be from 1 to {STEPS_LIMIT}")
    system = load_system(args.system)
    stage_options = StageOptions(cut=args.stage_cut, warmup=args.pipe_warmup, text=args.pipe_text)
    nodes = _nodes(args.nodes, system.nodes)
    variants = _with_wire(_with_plans(modelled_variants(args.variants), args.plan), args.wire)
    model = get_model(args.model) if args.model else None
    figures: dict[str, Any] = {"system": system.name, "model": model.name if model else "", "rows": [], "validation": []}
    notes: list[str] = []

    params_for, link_source = _links(args, system, figures)
    compute_scale, compute_source = 1.0, (f"nominal: {system.device.name}, {system.device.peak_TFLOPs:g} TFLOP/s peak "
                                          f"x {system.device.efficiency:g} (assumed)")
    if args.compute_profile:
        compute_scale, profiled = measured_compute_scale(system, args.compute_profile)
        compute_source = (f"measured: flat step - exposed comm of {profiled.model.name} in {args.compute_profile.name} "
                          f"(nominal x {compute_scale:.3g})")

    if args.validate:
        for path in args.validate:
            try:
                figures["validation"] += validate_e2e(system, params_for, path, compute_scale if args.compute_profile else None)
            except UsageError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:  # its fields not of their kinds
                raise UsageError(f"{path}: not a bench e2e JSON file ({type(error).__name__}: {error})") from None
        _print_validation(figures["validation"], link_source)
        if model is None:
            figures["model"] = ", ".join(sorted({e["model"] for e in figures["validation"] if "model" in e}))

    if model is not None:
        height, width = _resolution(args.resolution) if args.resolution else model.default_size
        if args.frames is not None and not model.video:
            raise UsageError(f"--frames {args.frames}: {model.name} makes images, not videos")
        workload = Workload(model=model, height=height, width=width, batch=args.batch, dtype=args.dtype or model.default_dtype,
                            steps=args.steps or model.default_steps, cfg=not args.no_cfg, frames=args.frames)
        rows, skipped = table_rows(workload, system, nodes, variants, params_for, compute_scale, stage_options)
        figures.update(resolution=[height, width], frames=workload.frames, tokens=workload.image_tokens, batch=workload.batch, dtype=workload.dtype, steps=workload.steps,
                       workload=workload.describe(), rows=rows, not_runnable=skipped)
        title = (f"simulate: {workload.describe()}; {system.name} ({system.ranks_per_node} ranks/node); "
                 f"links {link_source}; compute {compute_source.split(':')[0]}")
        _print_rows(title, rows)
        for s in skipped:
            print(f"  {s['nodes']} node(s){' ' + s['variant'] if 'variant' in s else ''}: not runnable: {s['reason']}")
        if any(v.lossy for v in variants):
            print("  LOSSY variants (V-Major): cached projections are reused on the slow links; bytes averaged over "
                  f"{workload.steps} steps of the linear schedule")
        if any(v.packed for v in variants):
            print(f"  LOSSY variants (wire formats): {_codec_note(system)}")
        if any(v.displaced for v in variants):
            print(f"  LOSSY variants (displaced patches): each patch attends to the last step's keys and values where this "
                  f"step's are not there yet; the first {args.pipe_warmup} step(s) run whole; text {args.pipe_text}")
        notes.append(f"model: {model.source}")
        print(f"  numbers: links {link_source}; compute {compute_source}")
    figures["sources"] = {"links": link_source, "compute": compute_source,
                          "validation_compute": compute_source if args.compute_profile
                          else "measured: each file's flat step_ms - exposed_comm_ms"}
    figures["links"] = _links_json(params_for(system.with_nodes(nodes[0])))

    if args.paper:
        from .paper import PAPER_REPORTED, paper_figures, paper_table

        paper = paper_table(system, params_for, compute_scale)
        reported = paper_figures(paper, system, params_for)
        _print_paper(system, paper, reported)
        figures["paper"] = {**paper, "reported": PAPER_REPORTED}
        figures["average_speedup"] = paper["summary"]["average"]
        figures["peak_speedup"] = paper["summary"]["peak"]
        if not figures["rows"]:  # --paper alone: the rows are the paper's figures (DESIGN.md)
            figures["settings"] = paper["rows"]
            figures["rows"] = reported
            figures["model"] = "paper settings"
    figures["notes"] = notes
    write_all(("--plot", args.plot, lambda: (_plot(figures, args.plot), print(f"plot: {args.plot}"))),
              ("--json", args.json, lambda: write_json(args.json, figures)))
    return 0


def _links(args: argparse.Namespace, system, figures: dict[str, Any]) -> tuple[Callable, str]:
    """(link figures for a system at any node count, where they come from): the TOML file's,
    scaled by --link-efficiency, or fitted by --calibrate (printed, and kept in `figures`)."""
    from .calibrate import fit_a2a, fitted_params_for

    if args.calibrate:
        at, fit = fit_a2a(system, args.calibrate)
        _print_fit(at, fit, args.calibrate)
        figures["calibration"] = {
            "file": str(args.calibrate), "nodes": at.nodes, "fitted": list(fit.fitted), "determined_by_data": fit.determined,
            "rms_log_error": fit.rms_log_error,
            "nominal": _links_json(fit.nominal), "result": _links_json(fit.params), "points": fit.points,
        }
        return fitted_params_for(fit), f"fitted to {args.calibrate.name}"
    factor = args.link_efficiency
    if factor == 1.0:
        return (lambda at: at.nominal()), "nominal (TOML)"
    return (lambda at: at.nominal().scaled(factor)), f"nominal (TOML) x {factor:g}"


def _links_json(params) -> dict[str, Any]:
    return {"source": params.source, "bandwidth_GBps": {k: v / 1e9 for k, v in params.bandwidth.items()},
            "latency_us": {k: v * 1e6 for k, v in params.latency.items()}}


def _print_fit(system, fit, path: Path) -> None:
    def set_by(name: str) -> str:
        if name not in fit.fitted:
            return "nominal (no traffic)"
        return "fitted" if fit.determined[name] else "fitted, weakly: stays near nominal"

    rows = [(f"{c} bandwidth", _rate(v), _rate(fit.params.bandwidth[c]), set_by(f"bw:{c}"))
            for c, v in fit.nominal.bandwidth.items()]
    rows += [(f"{c} latency / message", f"{v * 1e6:.0f} us", f"{fit.params.latency[c] * 1e6:.0f} us", set_by(f"lat:{c}"))
             for c, v in fit.nominal.latency.items()]
    print_table(f"calibration: {system.name} at {system.nodes} nodes, fitted to {path.name} "
                f"(rms error {100 * fit.rms_log_error:.0f}% in log time)", ["link figure", "nominal", "used", "source"], rows)
    print_table("calibration: per point (measured vs fitted model)",
                ["per rank", "flat ms", "model", "error", "TAPA ms", "model", "error"],
                [(f"{p['bytes_per_rank'] // 1024} KiB", f"{p['flat_ms']:.2f}", f"{p['flat_pred_ms']:.2f}",
                  _pct(p["flat_pred_ms"] / p["flat_ms"] - 1), f"{p['tapa_ms']:.2f}", f"{p['tapa_pred_ms']:.2f}",
                  _pct(p["tapa_pred_ms"] / p["tapa_ms"] - 1)) for p in fit.points])


def _print_validation(entries: list[dict[str, Any]], link_source: str) -> None:
    mib = 2**20
    rows = []
    for e in entries:
        if "skipped" in e:
            rows.append((e["file"], e["variant"], "-", "-", "skipped", "-", "-", "-"))
            continue
        rows.append((
            e["file"], e["variant"] + (" (LOSSY)" if e["lossy"] else ""), fixed(e["measured_ms"]), fixed(e["predicted_ms"]),
            _pct(e["error"]) + ("" if e["within_target"] else " !"),
            f"{e['measured_inter_node_bytes'] / mib:.3f}" if e.get("measured_inter_node_bytes") else "-",
            f"{e['predicted_inter_node_bytes'] / mib:.3f}", _pct(e["bytes_error"]) if "bytes_error" in e else "-",
        ))
    print_table(f"validation: measured (bench e2e) vs predicted ms/step; compute measured (flat step - exposed comm), "
                f"links {link_source}; target within 25% (! = outside)",
                ["file", "variant", "measured ms", "predicted ms", "error", "inter-node MiB meas.", "predicted", "error"], rows)
    if any(e.get("lossy") for e in entries):
        print("  LOSSY rows: V-Major's token selection and cache updates (per piece, on the sender and receiver) cost "
              "time that is not modelled, so their predictions are optimistic")


def _print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    ring = any("ring_exposed_ms" in r for r in rows)
    shard = any("shard_exposed_ms" in r for r in rows)
    stages = any("stage_ms" in r for r in rows)
    print_table(title, ["nodes x ranks", "plan", "variant", "ms / step", "vs flat", "compute", "exposed intra", "exposed inter",
                        "comm share", "inter-node MiB"] + ["ring exposed / hidden"] * ring
                + ["weight gathers exposed / all ms", "GiB / rank"] * shard + ["bubble ms", "boundary MiB"] * stages, [
        (f"{r['nodes']} x {r['ranks'] // r['nodes']}", r["plan"], r["variant"] + (" (LOSSY)" if r["lossy"] else ""),
         fixed(r["step_ms"]), f"{r['speedup_vs_flat']:.2f}x", fixed(r["compute_ms"]), fixed(r["exposed_intra_ms"]),
         fixed(r["exposed_inter_ms"]), f"{fixed(100 * r['comm_share'], 0)}%", fixed(r["inter_node_bytes"] / 2**20, 0))
        + ((f"{fixed(r['ring_exposed_ms'])} / {fixed(r['ring_hidden_ms'])}" if "ring_exposed_ms" in r else "-",) if ring else ())
        + (_shard_cells(r) if shard else ())
        + (_stage_cells(r) if stages else ())
        for r in rows
    ])
    if shard:
        print("  +shard: the transformer's weights sharded over each node's ranks; every call all-gathers each block's "
              "(bytes received per rank and step; the next block's gather hidden behind the current block's compute)")
    if stages:
        print("  pipeline stages: bubble = the slowest stage's wait for the others (fill and drain); boundary = the hidden "
              "states handed on and the output sent back, per step")
    _print_stages(rows)
    _print_plans(rows)


def _stage_cells(row: dict[str, Any]) -> tuple[str, str]:
    if "stage_ms" not in row:
        return ("-", "-")
    return (fixed(row["bubble_ms"]), f"{sum(row['boundary_bytes'].values()) / 2**20:.1f}")


def _print_stages(rows: list[dict[str, Any]]) -> None:
    """One line per pipelined row: the cut, one micro-batch's time per stage, each stage's busy share."""
    for r in rows:
        if "stage_ms" not in r:
            continue
        blocks = ", ".join(f"{a}-{b - 1}" for a, b in r["stage_blocks"])
        jobs = f"{r['patches']} patches" if "patches" in r else f"{r['micro_batches']} micro-batch(es)"
        links = ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in r["boundary_bytes"].items()) or "none"
        print(f"  {r['nodes']} node(s) {r['variant']}: blocks {blocks} ({r['stage_cut']} cut); {jobs} per call, "
              f"{' / '.join(fixed(t) for t in r['stage_ms'])} ms each per stage, busy "
              f"{' / '.join(f'{100 * b:.0f}%' for b in r['stage_busy'])}; boundary per step: {links}")


def _shard_cells(row: dict[str, Any]) -> tuple[str, str]:
    if "shard_exposed_ms" not in row:
        return ("-", "-")
    return (f"{fixed(row['shard_exposed_ms'])} / {fixed(row['shard_gather_ms'])}", f"{row['shard_gather_bytes_per_step'] / 2**30:.2f}")


def _print_plans(rows: list[dict[str, Any]]) -> None:
    """One line per ring plan: its axes, placement and why (the engine's default when not written)."""
    described: dict[tuple[int, str], str] = {}
    for r in rows:
        if "plan_description" in r:
            described.setdefault((r["nodes"], r["plan"]), r["plan_description"])
    for (nodes, _), text in described.items():
        print(f"  {nodes} node(s): plan {text}")


def _fp8_cells(fp8: dict[str, Any] | None, full: dict[str, Any]) -> tuple[str, str, str]:
    if fp8 is None:
        return ("-", "-", "-")
    return (f"{fp8['step_ms']:.0f}", _x(fp8["speedup_vs_flat"]), f"{full['step_ms'] / fp8['step_ms']:.3f}x")


def _codec_note(system) -> str:
    """Where the pack and unpack rates of the wire formats come from (simulate/wire.py)."""
    from .wire import CPU_RATES

    if system.device.codec == "cpu":
        return ("packed at the measured CPU rates (one thread; M values/s pack / unpack: "
                + ", ".join(f"{f} {p / 1e6:.0f} / {u / 1e6:.0f}" for f, (p, u) in CPU_RATES.items())
                + "; bf16 assumed at fp8's)")
    return (f"packing assumed memory-bound: one read and one write per value at {system.device.memory_GBps:g} GB/s "
            f"({system.device.name}); K at bf16")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _print_paper(system, paper: dict[str, Any], reported: list[dict[str, Any]]) -> None:
    from .paper import FP8_VARIANT, TOLERANCE

    by_setting: dict[tuple, dict[str, Any]] = {}
    for r in paper["rows"]:
        by_setting.setdefault((r["model"], r["resolution"], r["nodes"], r["ranks"]), {})[r["variant"]] = r
    rows = [
        (m, f"{res}", str(n), str(p), v["flat"]["plan"], f"{v['flat']['step_ms']:.0f}", f"{100 * v['flat']['comm_share']:.0f}%",
         _x(v["tapa"]["speedup_vs_flat"]), _x(v["tapa+vfirst"]["speedup_vs_flat"]), _x(v["cocodiff"]["speedup_vs_flat"]),
         *_fp8_cells(v.get(FP8_VARIANT), v["cocodiff"]))
        for (m, res, n, p), v in by_setting.items()
    ]
    print_table(f"paper settings on {system.name}: predicted speedup over flat (batch 1, default steps; plan: "
                f"u = Ulysses, r = ring, outermost first)",
                ["model", "res", "nodes", "ranks", "plan", "flat ms", "flat comm", "tapa", "tapa+vfirst", "cocodiff (LOSSY)",
                 "+fp8 ms", "+fp8 vs flat", "+fp8 vs cocodiff"], rows)
    fp8 = paper["summary"].get("fp8_over_cocodiff")
    if fp8:
        print(f"  +fp8 (not in the paper): cocodiff with fp8 on the inter-node links ({FP8_VARIANT}; "
              f"{_codec_note(system)}): {paper['summary']['fp8_average']:.2f}x over flat on average, "
              f"{fp8['mean']:.3f}x over cocodiff ({fp8['min']:.3f}-{fp8['max']:.3f}x; 1.000x on one node)")
    figures = [r for r in reported if not r["figure"].startswith("best plan")]
    print_table(f"paper settings: predicted vs reported (the CoCoDiff paper, arXiv:2604.14561); a residual beyond {100 * TOLERANCE:.0f}% says why",
                ["figure", "predicted", "paper", "residual", "reason"], [
        (r["figure"], _num(r["predicted"]), _num(r["reported"]),
         "-" if r["predicted"] is None else _pct(r["predicted"] / r["reported"] - 1), r["reason"] or "")
        for r in figures])
    best = paper.get("best_plans", [])
    if best:
        print_table("best plan per setting, flat exchanges (plan choice, not in the paper; vs flat under the "
                    "engine's default plan)", ["model", "res", "nodes", "default", "best", "vs flat", "candidates ms"], [
            (b["model"], str(b["resolution"]), str(b["nodes"]), b["default_plan"], b["plan"], _x(b["speedup_vs_flat"]),
             ", ".join(f"{k} {v:.0f}" for k, v in b["candidates_ms"].items())) for b in best])
    ring = sorted({(r["model"], r["nodes"], r["plan"]) for r in paper["rows"] if "plan_description" in r})
    if ring:
        print("  more ranks than attention heads: Ulysses x ring (the paper falls back to ring attention there too): "
              + "; ".join(f"{m} on {n} nodes {plan}" for m, n, plan in ring))
    for skip in paper["not_runnable"]:
        print(f"  not runnable, left out of the averages: {skip['model']} {skip['resolution']}^2 on {skip['nodes']} "
              f"node(s): {skip['reason']}")


def _plot(figures: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures.get("settings") or figures["rows"]
    checks = [v for v in figures["validation"] if "error" in v]
    if not rows and checks:  # validation only: measured vs predicted per variant
        fig, ax = plt.subplots(figsize=(10, 4))
        x = range(len(checks))
        ax.bar([i - 0.2 for i in x], [v["measured_ms"] for v in checks], 0.4, label="measured (bench e2e)")
        ax.bar([i + 0.2 for i in x], [v["predicted_ms"] for v in checks], 0.4, label="predicted")
        ax.set_xticks(list(x), [f"{v['file'].removesuffix('.json')}\n{v['variant']}" for v in checks], fontsize=6, rotation=30)
        ax.set(ylabel="ms / step", title=f"cocodiff simulate --validate on {figures['system']} ({figures['sources']['links']})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save_figure(fig, path, dpi=110)
        plt.close(fig)
        return
    fig, (ax_ms, ax_x) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = r["variant"] if "model" not in r else f"{r['model']} {r['resolution']} {r['variant']}"
        series.setdefault(label, []).append(r)
    for label, points in series.items():
        if "model" in points[0] and points[0]["variant"] != "cocodiff":
            continue  # paper plot: one line per setting, the full method only
        nodes = [p["nodes"] for p in points]
        ax_ms.plot(nodes, [p["step_ms"] for p in points], "o-", label=label)
        ax_x.plot(nodes, [p["speedup_vs_flat"] for p in points], "o-", label=label)
    ax_ms.set(xlabel="nodes", ylabel="ms / step (predicted)", title="latency per step", yscale="log")
    ax_x.axhline(1.0, color="grey", lw=0.8)
    ax_x.set(xlabel="nodes", ylabel="flat time / variant time", title="speedup over flat")
    for ax in (ax_ms, ax_x):
        ax.set_xticks(sorted({r["nodes"] for r in rows}))
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(f"cocodiff simulate: {figures['system']}, {figures['model']} ({figures['sources']['links']})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
