"""`cocodiff bench a2a|e2e|quality|serve|graphs|host|pack`."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..errors import UsageError
from ..output.files import write_all
from . import serve as serve_bench

__all__ = ["add_parser", "main"]

UNITS = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "b": 1}


def parse_size(text: str) -> int:
    """'64KiB' -> 65536."""
    lowered = text.strip().lower()
    for unit, scale in UNITS.items():
        if lowered.endswith(unit):
            try:
                value = float(lowered[: -len(unit)]) * scale
            except ValueError:
                break
            if value >= 1:
                return int(value)
            break
    raise argparse.ArgumentTypeError(f"size {text!r} is not a positive number with a unit (B, KiB, MiB, GiB)")


def add_parser(commands: argparse._SubParsersAction) -> None:
    from ..config.parallel import DTYPE_NAMES
    from ..run.lifetime import add_timeout_argument

    bench = commands.add_parser("bench", help="benchmarks (median of alternated runs; --json for the figures)")
    kinds = bench.add_subparsers(dest="kind", required=True, parser_class=type(bench))
    a2a = kinds.add_parser("a2a", help="flat vs TAPA all-to-all across message sizes")
    a2a.add_argument("--min-size", type=parse_size, default="64KiB", help="smallest message per rank")
    a2a.add_argument("--max-size", type=parse_size, default="16MiB", help="largest message per rank (sizes double)")
    a2a.add_argument("--repeat", type=int, default=5, help="timed runs per size and mechanism")
    a2a.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (ignored under torchrun/cluster run)")
    a2a.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the launcher's; local: 2)")
    a2a.add_argument("--auto-budget", type=float, default=20.0, help="seconds the `auto` calibration may take")
    a2a.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    add_timeout_argument(a2a)
    a2a.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG plot (default: next to --json)")

    e2e = kinds.add_parser("e2e", help="latency per denoising step of several variants, alternated in one launch")
    e2e.add_argument("--model", default="tiny-flux", help="preset or local directory / hub id")
    e2e.add_argument("--variants", default="flat,tapa,tapa+vfirst",
                     help="comma-separated: flat|tapa|auto, optionally +vfirst, and for tapa or flat +vmajor or +vmajorqk "
                          "(LOSSY: linear V-Major schedule on V, or on V, Q and K), e.g. flat,tapa+vfirst,tapa+vfirst+vmajor; "
                          "cocodiff = tapa+vfirst+vmajor (LOSSY); +fp8: messages between nodes in fp8, K in bf16 "
                          "(LOSSY), e.g. tapa+vfirst+fp8; "
                          "diffusers-ulysses: diffusers' own ContextParallelConfig(ulysses_degree=P) as a baseline "
                          "(needs token counts divisible by P, e.g. --model tiny-shapes); xdit-ulysses: xDiT's own "
                          "FLUX.1 Ulysses as a baseline (xfuser installed beside cocodiff: bench/xdit.py)")
    e2e.add_argument("--steps", type=int, default=4, help="denoising steps per run")
    e2e.add_argument("--height", type=int, default=256, help="image height")
    e2e.add_argument("--width", type=int, default=256, help="image width")
    e2e.add_argument("--batch", type=int, default=1, help="images per prompt")
    e2e.add_argument("--frames", type=int, default=None, metavar="N", help="video models: frames per clip (default: the preset's)")
    e2e.add_argument("--image", type=Path, action="append", default=None, metavar="PATH",
                     help="an edit model's reference image, repeat for several (others: the image to start from, "
                          "at --height x --width)")
    e2e.add_argument("--last-frame", type=Path, default=None, metavar="PATH",
                     help="Wan's image-to-video (2.1 FLF2V, 2.2 A14B I2V): the clip's last frame, --image its first")
    e2e.add_argument("--repeat", type=int, default=3, help="timed runs per variant (after one warm-up)")
    e2e.add_argument("--seed", type=int, default=0, help="seed of weights and noise")
    e2e.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                     help="compute dtype; auto: a checkpoint's bfloat16 on GPUs, float32 for presets and on the CPU")
    e2e.add_argument("--compile", action="store_true", help="compile every variant's repeated blocks (as +compile on each)")
    e2e.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (ignored under torchrun/cluster run)")
    e2e.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the launcher's)")
    from ..config.flags import add_offload_argument, add_shard_weights_argument

    add_shard_weights_argument(e2e)
    add_offload_argument(e2e)
    e2e.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    add_timeout_argument(e2e)

    quality = kinds.add_parser("quality", help="V-Major schedules, step caches, wire formats and displaced patches "
                                               "(LOSSY) against the exact run: PSNR, SSIM, bytes saved")
    quality.add_argument("--task", default="text", choices=["text", "inpaint"],
                         help="text: one text-to-image generation; inpaint: held-out tiny-shapes scenes with one object "
                              "masked out, redrawn, and also compared with the ground truth")
    quality.add_argument("--cases", type=int, default=None, help="--task inpaint: how many held-out scenes (default: 50)")
    quality.add_argument("--model", default="tiny-shapes", help="preset or local directory / hub id (default: the trained preset)")
    quality.add_argument("--schedules", default=None,
                         help="comma-separated V-Major schedules: off|linear|constant:R|warmup:N,linear|adaptive:EPS "
                              "(default: off,linear,constant:0.5; with --task inpaint linear,adaptive:0.05,adaptive:0.1)")
    quality.add_argument("--tensors", default="v", choices=["v", "vqk"], help="skip V only, or V, Q and K")
    quality.add_argument("--cache", "--caches", dest="caches", action="append", default=[], metavar="SPEC[;SPEC...]",
                         help="a step cache (LOSSY) to compare too, as the entry cache=SPEC: fbcache, dbcache, "
                              "taylorseer, teacache or magcache with settings as --cache takes them (generate --help); "
                              "repeat the flag or separate specs by ';' "
                              "(with no --schedules, only off runs besides: the exact TAPA bytes)")
    quality.add_argument("--wire", "--wires", dest="wires", action="append", default=[], metavar="SPEC[;SPEC...]",
                         help="wire formats (LOSSY) to compare too, as the entry wire=SPEC on TAPA: node=fp8, node=int8, "
                              "fp8 (the slowest level, as +fp8), or on a V-Major schedule: linear+fp8; several separated by ';'")
    quality.add_argument("--patches", action="append", default=[], metavar="SPEC[;SPEC...]",
                         help="displaced patch pipelining (LOSSY) to compare too, as the entry "
                              "patches=M,warmup=K,text=T: M[,warmup=K][,text=whole|patched] (as --pipe-patches, "
                              "--pipe-warmup, --pipe-text take them, and their defaults), on two pipeline stages with "
                              "Ulysses inside (p2u2 on 4 ranks); several separated by ';'")
    quality.add_argument("--steps", type=int, default=None, help="denoising steps (default: the preset's)")
    quality.add_argument("--height", type=int, default=None, help="image height (default: the preset's)")
    quality.add_argument("--width", type=int, default=None, help="image width (default: the preset's)")
    quality.add_argument("--seed", type=int, default=0, help="seed of weights and noise")
    quality.add_argument("--v-first", action=argparse.BooleanOptionalAction, default=True, help="V-First scheduling")
    quality.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (ignored under torchrun/cluster run)")
    quality.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the launcher's, locally 2)")
    quality.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    add_timeout_argument(quality)
    quality.add_argument("--grid", type=Path, default=None, metavar="PATH", help="PNG of the images side by side")
    serve_bench.add_parser(kinds)
    graphs = kinds.add_parser("graphs", help="graphs and graph breaks per transformer block under --compile, per exchange")
    graphs.add_argument("--model", default="tiny-flux", help="preset")
    graphs.add_argument("--nproc", type=int, default=4, help="ranks of the fake world (two nodes); even, at least 4")
    graphs.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    host = kinds.add_parser("host", help="the host's microseconds per exchange call (rank 0 of a fake world)")
    host.add_argument("--nproc", type=int, default=24, help="ranks of the fake world (two nodes); even, at least 4")
    host.add_argument("--v-major", default=None, metavar="SCHEDULE",
                      help="time V-Major's selective V exchange under this schedule instead (e.g. constant:0.5; on meta)")
    host.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    pack = kinds.add_parser("pack", help="values per second this CPU packs and unpacks each wire format (one thread)")
    pack.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")


def main(args: argparse.Namespace) -> int:
    from ..output.files import check_file, check_plot

    check_file("--json", args.json)  # every kind writes one; checked before any rank starts
    for flag in ("plot", "grid"):  # a2a's plot, quality's grid: next to --json unless given
        given = getattr(args, flag, False)
        if given is not False:
            check_plot(f"--{flag}", given or (args.json.with_suffix(".png") if args.json else None))
    return {"a2a": main_a2a, "e2e": main_e2e, "quality": main_quality, "serve": serve_bench.main,
            "graphs": main_graphs, "host": main_host, "pack": main_pack}[args.kind](args)


def main_host(args: argparse.Namespace) -> int:
    from ..output.tables import print_table, write_json
    from ..engine.vmajor import parse_schedule
    from .host import host_cost, v_major_cost

    if args.nproc < 4 or args.nproc % 2:
        raise UsageError(f"--nproc {args.nproc} must be even and at least 4 (two nodes for TAPA)")
    if args.v_major is not None:
        if parse_schedule(args.v_major).off:
            raise UsageError(f"--v-major {args.v_major} sends every token: bench host times a selective step")
        rows = v_major_cost(args.nproc, schedule=args.v_major)
        print_table(f"bench host: one V exchange of V-Major {args.v_major}'s second step, rank 0 of {args.nproc} "
                    "(fake process group, meta tensors), host time",
                    ["exchange", "us per call"], [(r["exchange"], f"{r['us_per_call']:.0f}") for r in rows])
        write_json(args.json, {"nproc": args.nproc, "clock": "host perf_counter", "v_major": args.v_major, "rows": rows})
        return 0
    rows = host_cost(args.nproc)
    print_table(f"bench host: one seq_to_head call, rank 0 of {args.nproc} (fake process group), host time",
                ["exchange", "byte counting", "us per call"],
                [(r["exchange"], "on" if r["counting"] else "off", f"{r['us_per_call']:.0f}") for r in rows])
    write_json(args.json, {"nproc": args.nproc, "clock": "host perf_counter", "rows": rows})
    return 0


def main_pack(args: argparse.Namespace) -> int:
    from ..output.tables import print_table, write_json
    from .pack import BLOCK, pack_rates

    rows = pack_rates()
    print_table(f"bench pack: wire formats of 1 Mi values in blocks of {BLOCK}, one thread, M values/s (median)",
                ["in", "format", "pack", "unpack"],
                [(r["dtype"], r["format"], f"{r['pack_mvalues_per_s']:.0f}", f"{r['unpack_mvalues_per_s']:.0f}")
                 for r in rows])
    write_json(args.json, {"clock": "host perf_counter", "threads": 1, "block": BLOCK, "rows": rows})
    return 0


def main_graphs(args: argparse.Namespace) -> int:
    from ..engine.families.sample_inputs import forward_inputs
    from ..models.presets import PRESETS, check_model
    from ..output.tables import print_table, write_json
    from .graphs import GraphsSpec, graph_breaks

    check_model(args.model)
    if args.model not in PRESETS:
        raise UsageError(f"--model {args.model}: bench graphs traces a preset's blocks; one of {', '.join(PRESETS)}")
    if args.nproc < 4 or args.nproc % 2:
        raise UsageError(f"--nproc {args.nproc} must be even and at least 4 (two nodes for TAPA)")
    u = max(d for d in range(1, PRESETS[args.model].heads + 1) if args.nproc % d == 0)  # widest Ulysses the heads allow
    widest = f"u{u}" + (f"r{args.nproc // u}" if u < args.nproc else "")
    cases = [(widest, "flat"), (widest, "tapa"), (f"u{args.nproc // 2}r2", "flat")]
    rows = graph_breaks(GraphsSpec(model=args.model, ranks=args.nproc, cases=tuple(cases)),
                        lambda _model, transformer: forward_inputs(transformer))
    print_table(f"bench graphs: {args.model}, rank 0 of {args.nproc} (fake process group), torch._dynamo.explain per block",
                ["plan", "exchange", "collectives", "block", "graphs", "breaks", "first reasons"],
                [(r["plan"], r["comm"], r["collectives"], r["block"], str(r["graphs"]), str(r["breaks"]),
                  "; ".join(r["reasons"])[:90] or "-") for r in rows])
    write_json(args.json, {"model": args.model, "nproc": args.nproc, "rows": rows})
    return 0


def main_quality(args: argparse.Namespace) -> int:
    from ..config.parallel import ParallelConfig
    from ..run.launch import run_ranks
    from ..models.source import resolve_model
    from ..run.spec import GenerateSpec
    from ..output.tables import print_table, write_json
    from .report import lossy_subject, saved_cell, skipped_cell
    from .quality import QualitySpec, grid, parse_caches, parse_patches, parse_schedules, parse_wires, quality_job

    if args.nproc < 2:
        raise UsageError(f"--nproc {args.nproc}: V-Major needs at least 2 ranks on 2 nodes")
    if args.task != "inpaint" and args.cases is not None:
        raise UsageError("--cases needs --task inpaint")
    from ..run.launch import under_launcher

    ranks_per_node = args.ranks_per_node
    if ranks_per_node is None and not under_launcher():
        ranks_per_node = 2
    resolve_model(args.model)
    gen = GenerateSpec(model=args.model, steps=args.steps, height=args.height, width=args.width, seed=args.seed,
                       parallel=ParallelConfig(ranks_per_node=ranks_per_node, v_first=args.v_first))
    caches, wires, patches = parse_caches(args.caches), parse_wires(args.wires), parse_patches(args.patches)
    if args.task == "inpaint":
        return _main_inpaint(args, gen, caches, wires, patches)
    default = "off" if caches or wires or patches else "off,linear,constant:0.5"  # these alone: off, the exact TAPA bytes
    spec = QualitySpec(generate=gen, schedules=parse_schedules(args.schedules or default), tensors=args.tensors,
                       caches=caches, wires=wires, patches=patches)
    result = run_ranks(quality_job, args.nproc, spec, timeout_s=args.timeout)
    if result is None:
        return 0
    images = result.pop("images")
    rows = [
        (
            name + (" (LOSSY)" if s["lossy"] else " (exact)"),
            f"{s['psnr']:.2f}",
            f"{s['ssim']:.4f}",
            f"{s['mse']:.2e}",
            f"{s['latent_rel_error']:.2e}",
            saved_cell(s),
            f"{s['cache_bytes'] / 2**20:.2f}",
            skipped_cell(s),
        )
        for name, s in result["schedules"].items()
    ]
    title = (f"bench quality: {result['model']} {result['height']}x{result['width']}, {result['steps']} steps, "
             f"{lossy_subject(result)}; {result['nproc']} ranks = {result['nodes']} nodes x "
             f"{result['ranks_per_node']}; against the exact flat run")
    print_table(title, ["schedule", "PSNR dB", "SSIM", "MSE", "latent rel err", "inter-node proj. bytes saved",
                        "cache MiB/rank", "calls skipped"], rows)
    grid_path = args.grid or (args.json.with_suffix(".png") if args.json else None)
    write_all(("--grid", grid_path, lambda: (grid(images, grid_path, title), print(f"grid: {grid_path}"))),
              ("--json", args.json, lambda: write_json(args.json, result)))
    return 0


def _found(figures: dict[str, float]) -> str:
    return f"{100 * figures['object_found_rate']:.0f}% ({100 * figures['colour_found_rate']:.0f}%)"


def _main_inpaint(args: argparse.Namespace, gen, caches, wires, patches) -> int:
    from ..run.launch import run_ranks
    from ..output.tables import print_table, write_json
    from .report import lossy_subject, saved_cell, skipped_cell
    from .inpaint import InpaintSpec, inpaint_job
    from .quality import grid_rows, parse_schedules

    default = "off" if caches or wires or patches else "linear,adaptive:0.05,adaptive:0.1"  # as the text task's
    spec = InpaintSpec(generate=gen, schedules=parse_schedules(args.schedules or default), tensors=args.tensors,
                       cases=50 if args.cases is None else args.cases, caches=caches, wires=wires, patches=patches)
    result = run_ranks(inpaint_job, args.nproc, spec, timeout_s=args.timeout)
    if result is None:
        return 0
    grid = result.pop("grid")
    exact = result["exact"]
    rows = [("exact (flat)", "-", "-", f"{exact['psnr_gt']:.2f}", "-", f"{exact['ssim_gt']:.4f}",
             f"{exact['psnr_gt_masked']:.2f}", _found(exact), "-", "-", "-")]
    rows += [
        (
            name + (" (LOSSY)" if s["lossy"] else " (exact)"),
            f"{s['psnr']:.2f}",
            f"{s['ssim']:.4f}",
            f"{s['psnr_gt']:.2f}",
            f"{s['psnr_gt_delta']:+.2f}",
            f"{s['ssim_gt']:.4f}",
            f"{s['psnr_gt_masked']:.2f}",
            _found(s),
            saved_cell(s),
            f"{s['cache_bytes'] / 2**20:.2f}",
            skipped_cell(s),
        )
        for name, s in result["schedules"].items()
    ]
    title = (f"bench quality --task inpaint: {result['model']} {result['height']}x{result['width']}, {result['steps']} "
             f"steps, {result['cases']} held-out cases (one object masked, strength {result['strength']:g}), "
             f"{lossy_subject(result)}; {result['nproc']} ranks = {result['nodes']} nodes x {result['ranks_per_node']}; means "
             f"over the cases (masked object found in {100 * result['ground_truth_object_found_rate']:.0f}% of ground truths)")
    print_table(title, ["run", "PSNR vs exact", "SSIM vs exact", "PSNR vs truth", "vs exact run", "SSIM vs truth",
                        "PSNR masked box", "object found (colour)", "inter-node proj. bytes saved", "cache MiB/rank",
                        "calls skipped"], rows)
    grid_path = args.grid or (args.json.with_suffix(".png") if args.json else None)
    caption = (f"inpainting: ground truth, mask, exact, each entry ({result['model']}, {result['steps']} "
               f"steps, {lossy_subject(result)})")
    write_all(("--grid", grid_path, lambda: (grid_rows(grid, grid_path, caption), print(f"grid: {grid_path}"))),
              ("--json", args.json, lambda: write_json(args.json, result)))
    return 0


def main_e2e(args: argparse.Namespace) -> int:
    from ..config.parallel import ParallelConfig
    from ..run.launch import run_ranks
    from ..models.source import resolve_model
    from .report import KIND_LABELS
    from ..run.spec import GenerateSpec, check_run, image_source, run_world
    from ..output.tables import print_table, write_json
    from ..config.variants import BASELINES, XDIT_ULYSSES, parse_variant, parse_variants
    from .e2e import E2ESpec, e2e_job, variant_config
    from .xdit import check_installed
    from ..engine.attention.backends import check_backend

    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat} must be at least 1")
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc} must be at least 1")
    resolve_model(args.model)
    gen = GenerateSpec(model=args.model, steps=args.steps, height=args.height, width=args.width, batch=args.batch,
                       seed=args.seed, frames=args.frames, dtype=args.dtype, source=image_source(args), parallel=ParallelConfig(ranks_per_node=args.ranks_per_node, shard_weights=args.shard_weights,
                                               offload_text_encoders=args.offload_text_encoders))
    variants = parse_variants(args.variants)
    if args.compile:  # every variant compiled: `+compile` on each, under generate's rules (ParallelConfig's)
        ParallelConfig(shard_weights=args.shard_weights, offload_text_encoders=args.offload_text_encoders, compile=True)
        variants = [parse_variant(f"{v.name}+compile") if not v.compile else v for v in variants]
    world = run_world(args.nproc)
    for v in variants:  # each as `generate` would refuse it, before any rank starts
        try:
            check_backend(v.attention)
            if v.comm == XDIT_ULYSSES:
                check_installed()
            check_run(gen if v.baseline else replace(gen, parallel=variant_config(v, args.ranks_per_node, gen.parallel.shard_weights),
                                                     quantize=v.quantize), world)
        except UsageError as error:
            raise UsageError(f"variant {v.name!r}: {error}") from None
    spec = E2ESpec(generate=gen, variants=variants, repeat=args.repeat)
    result = run_ranks(e2e_job, args.nproc, spec, timeout_s=args.timeout)
    if result is None:
        return 0
    mib = 2**20
    rows = [
        (
            name + (" (LOSSY)" if v["lossy"] else ""),
            f"{v['step_ms']:.1f}",
            f"{v['speedup_vs_flat']:.2f}x",
            f"{v['inter_node_bytes'] / mib:.2f}",
            f"{v['intra_node_bytes'] / mib:.2f}",
            f"{v['exposed_comm_ms']:.1f} ({100 * v['comm_share']:.0f}%)",
        )
        for name, v in result["variants"].items()
    ]
    title = (f"bench e2e: {result['model']} {result['height']}x{result['width']}"
             f"{'x' + str(result['frames']) + ' frames' if result.get('frames') else ''} batch {result['batch']}, "
             f"{result['steps']} steps x {result['repeat']}; {result['fabric']}; {result['nproc']} ranks = "
             f"{result['nodes']} nodes x {result['ranks_per_node']}")
    header = ["variant", "ms / step", f"vs {result['baseline']}", "inter-node MiB/step", "intra-node MiB/step",
              "exposed comm ms/step"]
    if any(v.cached for v in variants):  # bimodal steps: the median flatters a cache, a whole image does not
        header += ["ms / image", f"vs {result['baseline']} per image"]
        rows = [(*row, f"{v['image_ms']:.0f}", f"{v['speedup_per_image_vs_flat']:.2f}x")
                for row, v in zip(rows, result["variants"].values())]
    for comm, peer in BASELINES.items():
        if any(v.comm == comm for v in variants):
            header += [f"vs {comm}", f"max |diff| vs {comm}"]
            rows = [(*row, f"{v[f'speedup_vs_{peer}']:.2f}x", f"{v[f'max_abs_diff_vs_{peer}']:.1e}")
                    for row, v in zip(rows, result["variants"].values())]
    print_table(title, header, rows)
    plans = {name: v for name, v in result["variants"].items() if "plan_description" in v}
    if any(v["plan"] != f"u{result['nproc']}" for v in plans.values()):
        print_table(
            "plans (axes outermost first; ring hidden = share of K/V blocks' time in flight no rank waited for)",
            ["variant", "plan", "ring hidden"],
            [(name, v["plan_description"], f"{100 * v['ring_hidden_share']:.0f}%" if "ring_hidden_share" in v else "-")
             for name, v in plans.items()],
        )
    for name, v in result["variants"].items():
        if v.get("auto_choice"):  # `auto`: what its trial steps measured (slowest rank, median per candidate)
            from ..distributed.comm.auto import trials_summary

            auto = v["auto_choice"]
            if auto["chosen"] is None:
                print(f"{name}: the trials did not finish in {auto['trial_steps']} trial steps ({trials_summary(auto) or 'none timed'}): "
                      "its figures mix the candidates; more --steps or --repeat let it choose")
            else:
                print(f"{name}: chose {auto['chosen']} after {auto['trial_steps']} trial steps ({trials_summary(auto)})")
    for name, v in result["variants"].items():
        if "vs_fastest_fixed" in v:
            from .report import auto_versus_fixed

            print(f"{name}: {auto_versus_fixed(v, result['variants'])}")
    if result["nodes"] == 1 and any("tapa" in name for name in result["variants"]):
        print("one node: TAPA's phases cross no slower link here, so it only adds copies; its gain needs "
              "several nodes (--ranks-per-node, --levels, or `cocodiff cluster run`)")
    kinds = sorted({k for v in result["variants"].values() for k in v.get("exposed_comm_ms_by_kind", {})})
    if kinds:
        print_table(
            "where a step goes (ms/step, means): compute = mean step - exposed communication; waits by collective",
            ["variant", "compute", *(f"wait {KIND_LABELS.get(k, k)}" for k in kinds)],
            [
                (name, f"{v['step_ms_mean'] - v['exposed_comm_ms']:.1f}",
                 *(f"{v['exposed_comm_ms_by_kind'].get(k, 0.0):.1f}" for k in kinds))
                for name, v in result["variants"].items()
            ],
        )
    if result["v_first"]:
        print_table(
            "V-First: V's all-to-all hidden under Q/K norm + RoPE (per layer, summed)",
            ["variant", "against", "T_comm(V) ms", "overlap ms (min of T_comm(V), T_compute(QK))", "hidden ms",
             "hidden / overlap", "layers with T_comm(V) <= T_compute(QK)"],
            [
                (name, r["against"], f"{r['t_comm_v_ms']:.2f}", f"{r['overlap_ms']:.2f}", f"{r['hidden_ms']:.2f}",
                 f"{100 * r['hidden_over_overlap']:.0f}%", f"{r['layers_meeting_condition']} / {len(r['layers'])}")
                for name, r in result["v_first"].items()
            ],
        )
    write_json(args.json, result)
    return 0


def main_a2a(args: argparse.Namespace) -> int:
    from ..run.launch import run_ranks, under_launcher
    from ..output.tables import print_table, write_json
    from .a2a import A2ASpec, a2a_job, plot

    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat} must be at least 1")
    if args.min_size > args.max_size:
        raise UsageError(f"--min-size {args.min_size} is larger than --max-size {args.max_size}")
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc} must be at least 1")
    ranks_per_node = args.ranks_per_node
    if ranks_per_node is None and not under_launcher():
        ranks_per_node = 2 if args.nproc % 2 == 0 and args.nproc > 2 else args.nproc
    spec = A2ASpec(min_bytes=args.min_size, max_bytes=args.max_size, repeat=args.repeat,
                   ranks_per_node=ranks_per_node, auto_budget_s=args.auto_budget)
    result = run_ranks(a2a_job, args.nproc, spec, timeout_s=args.timeout)
    if result is None:
        return 0
    rows = [
        (
            f"{r['bytes_per_rank'] / 1024:.0f} KiB",
            f"{r['flat_ms']:.2f}",
            f"{r['tapa_ms']:.2f}",
            f"{r['flat_algbw_MBps']:.1f}",
            f"{r['tapa_algbw_MBps']:.1f}",
            f"{r['speedup']:.2f}x",
        )
        for r in result["results"]
    ]
    title = f"bench a2a: {result['fabric']}; {result['nproc']} ranks = {result['nodes']} nodes x {result['ranks_per_node']}, median of {result['repeat']}"
    print_table(title, ["per rank", "flat ms", "TAPA ms", "flat MB/s", "TAPA MB/s", "TAPA speedup"], rows)
    from ..distributed.comm.auto import summary

    print(f"auto would choose: {summary(result['auto_choice']['buckets'])}")
    if result["tapa_is_flat"]:
        print("one node or one rank per node: TAPA is the flat all-to-all here")
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else None)
    write_all(("--plot", plot_path, lambda: (plot(result, plot_path), print(f"plot: {plot_path}"))),
              ("--json", args.json, lambda: write_json(args.json, result)))
    return 0
