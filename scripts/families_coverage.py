"""docs/families.md's table of diffusers' transformer classes with no `_cp_plan`, generated.

Runs every tiny case of tests/dit_cases_*.py through `parallelize` (its plan inferred) on 2 ranks
(Ulysses) and 4 (Ulysses, and Ulysses x ring), each against one process, and writes the outcome of each class
between the table's markers in docs/families.md:

    .venv/bin/python scripts/families_coverage.py

tests/test_plan_inference.py runs the same outcomes in CI (2 ranks by default, 4 in the slow suite).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_plan_inference import CASES, _coverage  # noqa: E402

from cocodiff.run.launch import spawn  # noqa: E402

BEGIN, END = "<!-- coverage: begin -->", "<!-- coverage: end -->"
RUNS = ((2, None, "2 ranks (u2)"), (4, "u4", "4 ranks (u4)"), (4, "u2r2", "4 ranks (u2r2)"))


def _cell(result: dict) -> str:
    if result["outcome"] == "exact":
        return f"exact ({result['diff']:.1e})"
    return result["outcome"]


def main() -> None:
    runs = [spawn(_coverage, ranks, ranks, plan, timeout_s=600)[0] for ranks, plan, _ in RUNS]
    rows = ["| class | " + " | ".join(label for _, _, label in RUNS) + " | why not |", "|---|" + "---|" * (len(RUNS) + 1)]
    for name in sorted(CASES, key=lambda n: (runs[0][n]["outcome"] != "exact", n)):
        why = next((r[name]["why"] for r in runs if r[name]["outcome"] == "refused"), "")
        why = re.sub(rf"^{name}:? ", "", why).replace("|", "\\|")
        rows.append(f"| `{name}` | " + " | ".join(_cell(r[name]) for r in runs) + f" | {why} |")
    exact = sum(all(r[n]["outcome"] == "exact" for r in runs[:2]) for n in CASES)
    ring = sum(all(r[n]["outcome"] == "exact" for r in runs) for n in CASES)
    table = "\n".join([f"{exact} of {len(CASES)} classes exact on 2 and 4 ranks, {ring} of them with a ring too (max "
                       f"difference from one process in brackets, fp32), the others refused in one line:", "", *rows])
    path = ROOT / "docs" / "families.md"
    text = path.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + table + "\n" + text[stop:])
    print(table)


if __name__ == "__main__":
    main()
