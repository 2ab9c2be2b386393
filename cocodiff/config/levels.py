"""Topology levels: the hierarchy of links a rank's peers sit behind, as plain data.

A cluster is a list of levels, outermost first, each a name and a size: `node=2,card=2,tile=2`
is 2 nodes of 2 cards of 2 tiles, 8 ranks. The sizes multiply to the ranks, which are numbered
in mixed radix, outermost digit first (node-major, as torchrun numbers them):

    rank = ((node * cards + card) * tiles + tile)          block(d) = product of the sizes inside level d

Two ranks talk over the link of the outermost level at which their digits differ (another node,
another card of this node, the other tile of this card). The outermost level is always the node
level: "other node" in every report means "differs at level 0". `--ranks-per-node N` is the
two-level shorthand `node=world/N,rank=N`.

A launcher that knows the levels (`cocodiff cluster run` on a fabric brought up with `--levels`)
hands them to the ranks in `COCODIFF_LEVELS`, as LOCAL_WORLD_SIZE hands over the ranks per node;
`Topology.from_env` reads it when the command gives neither `--levels` nor `--ranks-per-node`.

Nothing here touches torch.distributed: config parsing and the plan's unit tests use it alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..errors import UsageError
from .env import LEVELS_ENV
from .plan import AXES, equal_runs
from .sizes import digits

__all__ = [
    "LEVELS_ENV", "Levels", "RESERVED_NAMES", "block", "digit", "format_levels", "link_level", "member_levels", "parse_levels",
    "two_levels",
]

Levels = tuple[tuple[str, int], ...]
"""(name, size) per level, outermost first."""
RESERVED_NAMES = frozenset({*AXES, "intra"})
"""Names a level cannot take: a plan's mesh dims sit next to the levels' in one device mesh."""
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def parse_levels(text: str) -> Levels:
    """`node=2,card=2,tile=2` -> (("node", 2), ("card", 2), ("tile", 2)). Raises UsageError."""
    levels: list[tuple[str, int]] = []
    for item in text.strip().lower().split(","):
        name, _, size = (part.strip() for part in item.partition("="))
        if not _NAME.fullmatch(name) or not digits(size) or int(size) < 1:
            raise UsageError(f"--levels {text!r}: {item.strip()!r} is not NAME=SIZE (e.g. node=2,card=2,tile=2)")
        if name in RESERVED_NAMES:
            raise UsageError(f"--levels {text!r}: {name!r} names a plan axis; call the level something else")
        if name in (n for n, _ in levels):
            raise UsageError(f"--levels {text!r}: {name} is given twice")
        levels.append((name, int(size)))
    return tuple(levels)


def two_levels(world_size: int, ranks_per_node: int) -> Levels:
    """The `--ranks-per-node` shorthand: nodes, then the ranks of one node."""
    return (("node", world_size // ranks_per_node), ("rank", ranks_per_node))


def format_levels(levels: Levels) -> str:
    """(("node", 2), ("card", 4)) -> 'node=2,card=4' (the flag's own form)."""
    return ",".join(f"{name}={size}" for name, size in levels)


def block(levels: Levels, d: int) -> int:
    """Ranks under one member of level d - 1 that share digits 0..d-1: the sizes of levels d.. multiplied."""
    return math.prod(size for _, size in levels[d:])


def digit(levels: Levels, rank: int, d: int) -> int:
    """`rank`'s digit at level d (its card, its tile, ...)."""
    return rank // block(levels, d + 1) % levels[d][1]


def link_level(levels: Levels, a: int, b: int) -> str | None:
    """Name of the outermost level at which ranks `a` and `b` differ (the link between them);
    None for one rank."""
    for d in range(len(levels)):
        if a // block(levels, d + 1) != b // block(levels, d + 1):
            return levels[d][0]
    return None


def member_levels(members: Sequence[int], levels: Levels) -> Levels | None:
    """The levels of a group whose `members` (ranks under `levels`, in group order) form a mixed
    radix of their own: as many digits as `levels`, each the group's spread at that level.

    At every level boundary d the members must come in equal, consecutive runs of the same
    digits 0..d-1 (`plan.equal_runs`): then group index = mixed radix of the runs, which is what
    TAPA's phases and a device mesh need. A boundary that does not (a group cut across cards
    unevenly) is dropped and its two levels act as one, named `outer+inner`; None when the node
    boundary itself fails (the group's members do not share nodes evenly).
    """
    runs = [len(members)]  # members per run of equal digits 0..d-1, at each kept boundary d
    starts = [0]
    for d in range(1, len(levels)):
        run = equal_runs([m // block(levels, d) for m in members])
        if run is None:
            if d == 1:
                return None
            continue
        runs.append(run)
        starts.append(d)
    ends = [*starts[1:], len(levels)]
    sizes = [outer // inner for outer, inner in zip(runs, [*runs[1:], 1])]
    return tuple(("+".join(name for name, _ in levels[s:e]), size) for s, e, size in zip(starts, ends, sizes))
