"""The `cocodiff` command: a thin layer over `GenerateSpec`, the launcher and the rank jobs.

    cocodiff generate [--model tiny-shapes] [--nproc 4] ...   sequence-parallel generation, PNG + table
    cocodiff verify   [--model tiny-shapes] [--nproc 4] ...   parallel vs one process, exit 1 if they differ
    cocodiff train-tiny --out DIR                             train tiny-shapes from scratch (2 CPU cores)

Without torchrun the command spawns `--nproc` local ranks itself; under torchrun it uses the
launcher's ranks (any number of nodes). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(parser: argparse.ArgumentParser) -> None:
    from .config import COMM_CHOICES
    from .presets import PRESETS
    from .runner import DEFAULT_PROMPT, DTYPES

    parser.add_argument("--model", default="tiny-shapes", help=f"preset ({', '.join(PRESETS)}) or a local directory / hub id")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the preset's; 4 otherwise)")
    parser.add_argument("--height", type=int, default=None, help="image height in pixels (default: the preset's; 256 otherwise)")
    parser.add_argument("--width", type=int, default=None, help="image width in pixels (default: the preset's; 256 otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise (and of preset weights)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="compute dtype")
    parser.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="ranks sharing a node (default: the launcher's)")
    parser.add_argument("--comm", default="flat", choices=list(COMM_CHOICES), help="all-to-all mechanism")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cocodiff", description="Distributed inference for Diffusion Transformers (Ulysses sequence parallelism).")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    generate = commands.add_parser("generate", help="generate an image sequence-parallel and report per-step figures")
    _common(generate)
    generate.add_argument("--out", type=Path, default=Path("cocodiff.png"), help="where rank 0 writes the PNG")
    verify = commands.add_parser("verify", help="check that the parallel run equals one process")
    _common(verify)
    from .shapes.cli import add_train_arguments

    add_train_arguments(commands.add_parser("train-tiny", help="train the tiny-shapes preset from scratch (~30 min on 2 CPU cores)"))
    return parser


def _spec(args: argparse.Namespace):
    from .config import ParallelConfig
    from .errors import UsageError
    from .launch import under_launcher
    from .presets import PRESETS
    from .runner import GenerateSpec

    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc} must be at least 1")
    world = int(os.environ["WORLD_SIZE"]) if under_launcher() else args.nproc
    preset = PRESETS.get(args.model)
    if preset is not None and world > preset.heads:
        raise UsageError(f"{world} ranks is more than the {preset.heads} attention heads of {args.model}; use at most {preset.heads}")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or world % args.ranks_per_node):
        raise UsageError(f"--ranks-per-node {args.ranks_per_node} must be at least 1 and divide the {world} ranks")
    parallel = ParallelConfig(comm=args.comm, ranks_per_node=args.ranks_per_node)
    return GenerateSpec(
        model=args.model, prompt=args.prompt, steps=args.steps, height=args.height, width=args.width,
        seed=args.seed, dtype=args.dtype, parallel=parallel,
    )


def _write_json(path: Path | None, figures: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=2) + "\n")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def cmd_generate(args: argparse.Namespace) -> int:
    from PIL import Image

    from .launch import run_ranks
    from .runner import generate_job

    spec = _spec(args)
    result = run_ranks(generate_job, args.nproc, spec)
    if result is None:  # a torchrun rank other than 0
        return 0
    image, _ = result.pop("image"), result.pop("latents")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((image * 255).round().clip(0, 255).astype("uint8")).save(args.out)
    result["out"] = str(args.out)
    _print_table(
        f"cocodiff generate: {spec.model}, {spec.height}x{spec.width}",
        [
            ("ranks", f"{result['nproc']} ({result['nodes']} node(s) x {result['ranks_per_node']})"),
            ("comm", result["comm"]),
            ("steps", str(result["steps"])),
            ("latency / step (median)", f"{result['step_ms_median']:.1f} ms"),
            ("all-to-all / step, same node (all ranks)", _mb(result["a2a_same_node_bytes"])),
            ("all-to-all / step, other nodes (all ranks)", _mb(result["a2a_other_node_bytes"])),
            ("output gather / step (all ranks)", _mb(result["gather_bytes"])),
            ("time waiting on communication", f"{100 * result['comm_wait_share']:.1f} %"),
            ("image", str(args.out)),
        ],
    )
    _write_json(args.json, result)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .launch import run_ranks
    from .runner import verify_job

    spec = _spec(args)
    result = run_ranks(verify_job, args.nproc, spec)
    if result is None:
        return 0
    verdict = "OK" if result["ok"] else "FAILED"
    _print_table(
        f"cocodiff verify: {spec.model} on {result['nproc']} ranks vs one process: {verdict}",
        [
            ("ranks", f"{result['nproc']} ({result['nodes']} node(s) x {result['ranks_per_node']})"),
            ("comm", result["comm"]),
            ("final latents: max abs / rel diff", f"{result['latent']['max_abs_diff']:.3e} / {result['latent']['max_rel_diff']:.3e}"),
            ("image: max abs / rel diff", f"{result['image']['max_abs_diff']:.3e} / {result['image']['max_rel_diff']:.3e}"),
            ("tolerance (relative)", f"{result['tolerance']:.0e}"),
        ],
    )
    _write_json(args.json, result)
    return 0 if result["ok"] else 1


def cmd_train_tiny(args: argparse.Namespace) -> int:
    from .shapes.cli import train_from_args

    return train_from_args(args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    from .errors import UsageError
    from .launch import RankError

    try:
        return {"generate": cmd_generate, "verify": cmd_verify, "train-tiny": cmd_train_tiny}[args.command](args)
    except UsageError as error:
        print(f"cocodiff: error: {error}", file=sys.stderr)
        return 2
    except RankError as error:
        print(f"cocodiff: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
