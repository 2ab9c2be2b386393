"""Where a CI run's time went: the seconds of each test file and the slowest tests, from pytest's
JUnit files (`.ci/run` keeps them in ci-results/)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def _file(classname: str) -> str:
    """The test file of a JUnit class name ('tests.test_x' or 'tests.test_x.TestCase')."""
    return next((part for part in classname.split(".") if part.startswith("test_")), classname)


def main(paths: list[str]) -> None:
    for path in paths:
        root = ET.parse(path).getroot()
        cases = [(case.get("classname", ""), case.get("name", ""), float(case.get("time", 0)))
                 for case in root.iter("testcase")]
        wall = sum(float(suite.get("time", 0)) for suite in root.iter("testsuite"))
        by_file = Counter()
        for classname, _name, seconds in cases:
            by_file[_file(classname)] += seconds
        total = sum(by_file.values())
        # With workers (pytest -n) the tests' seconds add up to more than the session's wall time.
        print(f"\n{path}: {len(cases)} tests, {wall / 60:.1f} min wall, {total / 60:.1f} min of test time")
        for name, seconds in by_file.most_common(12):
            print(f"  {seconds:7.1f} s  {name}")
        print("  slowest tests:")
        for classname, name, seconds in sorted(cases, key=lambda c: -c[2])[:8]:
            print(f"  {seconds:7.1f} s  {_file(classname)}::{name}")


if __name__ == "__main__":
    main(sys.argv[1:])
