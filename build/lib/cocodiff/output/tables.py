"""What every command prints and writes: a rich table, numbers in its cells, and the JSON file.

The commands (`cli.py`, `bench/cli.py`, `simulate/cli.py`) all use these, so none imports
another's CLI. A table's headers and cells wrap between words and are never cut (the table is wider than the
terminal if its words need it); rich is imported on first use, keeping `simulate` quick to start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["fixed", "print_table", "write_json"]


def fixed(value: float, digits: int = 1, sign: bool = False) -> str:
    """`value` with `digits` decimals (a leading + if `sign`), never "-0.0": a value that rounds to
    zero prints as zero, whichever side of it it lies."""
    text = f"{value:{'+' if sign else ''}.{digits}f}"
    if float(text) == 0.0:
        return f"{0.0:{'+' if sign else ''}.{digits}f}"
    return text


def print_table(title: str, header: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> None:
    """A rich table; without a header, the first column is the row's name.

    The console is as wide as the terminal (at least 100 columns) when the table fits there with
    every column at least as wide as its longest word (in its header or a cell), wrapping between
    words; otherwise as wide as the table with nothing wrapped. Either way no word is cut.
    """
    from rich.cells import cell_len
    from rich.console import Console
    from rich.measure import Measurement
    from rich.segment import Segment
    from rich.table import Table

    table = Table(title=title, show_header=header is not None)
    for i, name in enumerate(header or ["", ""]):
        words = [word for text in (name, *(row[i] for row in rows)) for word in text.split()]
        table.add_column(name, style="bold" if i == 0 else None, justify="left" if i == 0 else "right" if header else "left",
                         min_width=max((cell_len(word) for word in words), default=None))
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(100, Console().width))
    lines = Segment.split_lines(console.render(table, console.options))
    if max((Segment.get_line_length(line) for line in lines), default=0) > console.width:  # a column kept its longest word
        console = Console(width=Measurement.get(console, console.options.update_width(10**5), table).maximum)
    console.print(table)


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    """Write `figures` as one indented JSON object to `path` (nothing when `path` is None), atomically.

    The path was checked before the run (`output.files.check_file`); if the write still fails (a full
    disk), the JSON goes to stdout instead and a one-line `RunFailed` says so.
    """
    if path is None:
        return
    from ..errors import RunFailed
    from .atomic import write_bytes

    text = json.dumps(figures, indent=2) + "\n"
    try:
        write_bytes(path, text.encode())
    except OSError as error:
        sys.stdout.write(text)
        sys.stdout.flush()
        raise RunFailed(f"--json {path} could not be written ({error.strerror or type(error).__name__}); "
                        f"the JSON is on stdout above") from None
