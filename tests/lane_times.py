"""Where a `make test` run's time went: `python tests/lane_times.py DIR` reads the JUnit XML files that
`HPC_DDP_TEST_JUNIT=DIR make test` wrote (tests/run-lanes.sh: slurm.xml, local.xml, smoke-VERSION.xml) and
prints, for each, the total, the test files that took longest, and the slowest tests. Reads only; standard
library only (CONTRIBUTING.md, "Where the time goes")."""
from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def times(path: Path) -> list[tuple[str, str, float]]:
    """(file, test, seconds) for each test case in one JUnit XML file (setup and teardown included)."""
    rows = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "")
        rows.append((module.replace(".", "/") + ".py", case.get("name", ""), float(case.get("time") or 0)))
    return rows


def report(path: Path, files: int = 12, tests: int = 12) -> str:
    rows = times(path)
    by_file: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for file, _, seconds in rows:
        by_file[file] += seconds
        count[file] += 1
    # the sum of the tests' times: more than the lane's wall time where pytest-xdist ran it in workers
    lines = [f"## {path.name}: {len(rows)} tests, {sum(s for *_, s in rows) / 60:.1f} min of test time"]
    lines += [f"{seconds:8.1f} s  {count[file]:5d}  {file}" for file, seconds in by_file.most_common(files)]
    lines.append("slowest:")
    lines += [f"{seconds:8.1f} s  {file}::{name}" for file, name, seconds in
              sorted(rows, key=lambda row: -row[2])[:tests]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python tests/lane_times.py DIR   (the HPC_DDP_TEST_JUNIT folder of a make test run)",
              file=sys.stderr)
        return 2
    found = sorted(Path(argv[0]).glob("*.xml"))
    if not found:
        print(f"no *.xml under {argv[0]}: run HPC_DDP_TEST_JUNIT={argv[0]} make test first", file=sys.stderr)
        return 2
    reports = []
    for path in found:
        try:
            reports.append(report(path))
        except (ET.ParseError, ValueError) as e:   # a lane stopped part-way leaves its file unfinished
            reports.append(f"## {path.name}: not read ({e})")
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
