"""`cocodiff matrix`: run the model x feature matrix, check every cell, write docs/matrix.md."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from ..errors import UsageError
from .cells import FEATURES

__all__ = ["add_parser", "main"]

COMPILE_BACKENDS = ("eager", "aot_eager", "inductor")
"""torch.compile's backends the compile column takes."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    matrix = commands.add_parser("matrix", help="run every preset with every feature: exact, lossy within its floor, "
                                                "or refused in one line; write docs/matrix.md")
    matrix.add_argument("--models", default=None, metavar="M,...", help="presets (default: every one)")
    matrix.add_argument("--features", default=None, metavar="F,...",
                        help=f"columns (default: every one: {', '.join(f.name for f in FEATURES)})")
    matrix.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="write the table (docs/matrix.md)")
    matrix.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every cell's figures")
    matrix.add_argument("--compile-backend", default="eager", metavar="NAME",
                        help="torch.compile's backend in the compile column: eager traces every graph (what fails to "
                             "trace fails the cell) without inductor's code generation, minutes per model on a CPU "
                             "(default eager; 'inductor' for the real thing; also aot_eager)")
    matrix.add_argument("--timeout", type=float, default=120.0, metavar="S", help="the longest a rank waits on a peer")


def _chosen(text: str | None, known: list[str], flag: str) -> list[str]:
    if text is None:
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names:
        raise UsageError(f"{flag} {text!r} names nothing; give one or more of {', '.join(known)}")
    if unknown:
        raise UsageError(f"{flag} {text!r}: {', '.join(unknown)} not among {', '.join(known)}")
    return names


def main(args: argparse.Namespace, parse) -> int:
    from ..models.presets import PRESETS
    from ..output.atomic import write_bytes
    from ..output.files import check_file, write_all
    from .report import markdown, summary_line, versions
    from .run import plan_cells, run_matrix

    models = _chosen(args.models, list(PRESETS), "--models")
    names = _chosen(args.features, [f.name for f in FEATURES], "--features")
    features = [f for f in FEATURES if f.name in names]
    check_file("--json", args.json)  # before any cell: a device, pipe or folder is never renamed over
    check_file("--markdown", args.markdown)
    if not 0 < args.timeout < 1e6:  # also NaN and infinity
        raise UsageError(f"--timeout {args.timeout:g} must be a positive number of seconds below 1e6")
    if args.compile_backend not in COMPILE_BACKENDS:
        raise UsageError(f"--compile-backend {args.compile_backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
    with tempfile.TemporaryDirectory(prefix="cocodiff-matrix-inputs-") as folder:
        cells = plan_cells(models, features, Path(folder))
        wall_s = run_matrix(cells, parse, timeout_s=args.timeout, compile_backend=args.compile_backend, report=lambda line: print(line, file=sys.stderr, flush=True))
    failed = [c for c in cells if not c.passed]
    for cell in failed:
        print(f"FAILED {cell.model} x {cell.feature.name}: expected {cell.expected}, got {cell.outcome}: {cell.message}",
              file=sys.stderr)
    print(f"cocodiff matrix: {summary_line(cells)} in {wall_s:.0f} s")
    selection = [f"--{name}={value}" for name, value in (("models", args.models), ("features", args.features)) if value]
    command = shlex.join(["cocodiff", "matrix", *selection])
    write_all(  # each one even when the other fails: no cell's figures lost to one bad path
        ("--json", args.json, lambda: write_bytes(
            args.json, json.dumps({"wall_s": wall_s, "cells": [c.to_json() for c in cells]}, indent=1, default=str).encode())),
        ("--markdown", args.markdown, lambda: write_bytes(
            args.markdown, markdown(cells, features, wall_s, command, versions()).encode())),
    )
    return 1 if failed else 0
