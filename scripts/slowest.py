"""The slowest tests of a run, from pytest's JUnit XML files: ``python scripts/slowest.py N FILE...``."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def slowest(n: int, files: list[str]) -> list[tuple[float, str]]:
    """The ``n`` longest test cases in ``files``, longest first, as (seconds, "suite: file::test")."""
    cases = []
    for f in files:
        if not Path(f).is_file():
            continue  # a step that failed before pytest wrote its report
        for suite in ET.parse(f).iter("testsuite"):
            for case in suite.iter("testcase"):
                name = case.get("name", "")
                if name.rfind("@") > name.rfind("]"):  # --dist loadgroup's "@group" suffix
                    name = name[:name.rfind("@")]
                where = case.get("classname", "").replace(".", "/") + ".py::" + name
                cases.append((float(case.get("time", 0)), f"{suite.get('name')}: {where}"))
    return sorted(cases, reverse=True)[:n]


def main(argv: list[str]) -> int:
    n, files = int(argv[0]), argv[1:]
    rows = slowest(n, files)
    print(f"=== the {len(rows)} slowest tests")
    for seconds, where in rows:
        print(f"  {seconds:8.1f}s  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
