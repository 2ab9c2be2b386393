"""`cocodiff cluster up|run|down|status`."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "main"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser("cluster", help="an emulated multi-node cluster on this machine (root)")
    actions = cluster.add_subparsers(dest="action", required=True, parser_class=type(cluster))
    up = actions.add_parser("up", help="create namespaces, links and shaping")
    up.add_argument("--nodes", type=int, default=None, help="emulated nodes (default 2)")
    up.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default 2)")
    up.add_argument("--levels", default=None, metavar="NAME=SIZE,...",
                    help="the hierarchy, outermost (nodes) first, e.g. node=2,card=2,tile=2 (rail only; instead of "
                         "--nodes and --ranks-per-node); `cluster run` hands it to the ranks")
    up.add_argument("--level-rates", default=None, metavar="NAME=RATE,...",
                    help="bandwidth per level, e.g. node=400mbit,card=1gbit,tile=4gbit: the node level's is the "
                         "rails' (--inter-node-rate), the next the node bridge's (--intra-node-rate), deeper ones "
                         "their own bridges' (default: unshaped)")
    up.add_argument("--fabric", choices=["shared", "rail"], default="rail",
                    help="shared: one uplink per node; rail: one rail per local index and a spine")
    up.add_argument("--inter-node-rate", default="400mbit", help="node uplink (shared) or rail (rail) bandwidth")
    up.add_argument("--spine-rate", default="100mbit", help="rail only: bandwidth of each rail's spine link")
    up.add_argument("--intra-node-rate", default=None, help="intra-node bandwidth (default: unshaped)")
    run = actions.add_parser("run", help="run a cocodiff command on every rank: cocodiff cluster run -- verify ...")
    run.add_argument("--timeout", type=float, default=1800.0,
                     help="seconds before every rank is stopped (the whole run; the command's own --timeout bounds each wait on a peer)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the cocodiff command and its flags")
    actions.add_parser("down", help="remove everything `up` made (idempotent)")
    actions.add_parser("status", help="show the cluster that is up, if any")


def main(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from . import build_fabric, down, run, status, up

    if args.action == "up":
        try:
            fabric = build_fabric(args.fabric, *_shape(args), args.inter_node_rate, args.spine_rate, args.intra_node_rate,
                                  *_levels(args))
        except ValueError as error:
            raise UsageError(str(error)) from None
        up(fabric)
        print(f"cluster up: {fabric.describe()}, {fabric.world_size} ranks in {len(fabric.namespaces)} namespaces")
        return 0
    if args.action == "run":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            raise UsageError("cocodiff cluster run needs a command: cocodiff cluster run -- verify --comm tapa")
        return run(command, args.timeout)
    if args.action == "down":
        removed = down()
        print(f"cluster down: removed {len(removed)} namespaces")
        return 0
    state = status()
    print(f"cluster up: {state['fabric']}, {state['ranks']} ranks" if state["up"] else "no cluster is up")
    return 0


def _levels(args: argparse.Namespace) -> tuple:
    """(levels, rates per level) from `--levels` and `--level-rates`, or (None, None)."""
    from ..config.levels import parse_levels
    from .fabric import parse_level_rates

    if args.levels is None:
        if args.level_rates is not None:
            raise ValueError("--level-rates needs --levels")
        return None, None
    levels = parse_levels(args.levels)
    return levels, parse_level_rates(args.level_rates, levels) if args.level_rates else None


def _shape(args: argparse.Namespace) -> tuple[int, int]:
    """(nodes, ranks per node): the flags', or the levels' (which the flags, if given, must match)."""
    import math

    from ..config.levels import parse_levels

    if args.levels is None:
        return args.nodes or 2, args.ranks_per_node or 2
    levels = parse_levels(args.levels)
    nodes, per_node = levels[0][1], math.prod(size for _, size in levels[1:])
    if args.nodes not in (None, nodes) or args.ranks_per_node not in (None, per_node):
        raise ValueError(f"--levels {args.levels} is {nodes} node(s) x {per_node}: drop --nodes / --ranks-per-node or match them")
    return nodes, per_node
