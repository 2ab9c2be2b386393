"""`cocodiff bench a2a`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError

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
    a2a.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG plot (default: next to --json)")


def main(args: argparse.Namespace) -> int:
    from ..cli import print_table, write_json
    from ..launch import run_ranks, under_launcher
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
    result = run_ranks(a2a_job, args.nproc, spec)
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
    from ..comm.auto import summary

    print(f"auto would choose: {summary(result['auto_choice']['buckets'])}")
    if result["tapa_is_flat"]:
        print("one node or one rank per node: TAPA is the flat all-to-all here")
    write_json(args.json, result)
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if plot_path is not None:
        plot(result, plot_path)
        print(f"plot: {plot_path}")
    return 0
