#!/usr/bin/env python3
"""Where the test suite's time goes, from the JUnit XML a pytest run wrote (scripts/test.sh
writes .test-times.xml): test time per file (setup, call and teardown summed over the
file's tests; with parallel workers the files share the wall time) and the slowest tests,
as markdown.

    scripts/suite_times.py .test-times.xml --wall 1500 \
        --note "scripts/test.sh, 2 workers" --out docs/test-suite-times.md

Several files (runs of parts of the suite) make one report.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read(junit: Path) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) of every test case in ``junit``."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")),
                       "passed")
        cases.append((path, case.get("name", ""), float(case.get("time", 0)), outcome))
    return cases


def report(cases: list[tuple[str, str, float, str]], wall: float | None, note: str,
           top: int = 15) -> str:
    total = sum(t for _, _, t, _ in cases)
    outcomes = collections.Counter(o for *_, o in cases)
    by_file: dict[str, list[float]] = collections.defaultdict(list)
    for path, _, seconds, _ in cases:
        by_file[path].append(seconds)
    lines = [f"# Where the test suite's time goes\n\nWritten by `scripts/suite_times.py` "
             f"from one run: {note}.\n",
             f"{len(cases)} tests ({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))})"
             f": {total / 60:.1f} min of test time"
             + (f" in {wall / 60:.1f} min of wall time (pytest alone)" if wall else "") + ".\n",
             "## By file\n", "| file | tests | minutes | share |", "|---|---:|---:|---:|"]
    for path, times in sorted(by_file.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| `{path}` | {len(times)} | {sum(times) / 60:.2f} | "
                     f"{100 * sum(times) / total:.0f}% |")
    lines += [f"\n## The {top} slowest tests\n", "| test | seconds |", "|---|---:|"]
    for path, name, seconds, _ in sorted(cases, key=lambda c: -c[2])[:top]:
        lines.append(f"| `{path}::{name}` | {seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, nargs="+", help="the JUnit XML pytest wrote")
    parser.add_argument("--wall", type=float, default=None,
                        help="pytest's wall time, s (all the runs')")
    parser.add_argument("--note", default="scripts/test.sh",
                        help="which run: command, date, machine")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (else stdout)")
    args = parser.parse_args()
    for junit in args.junit:
        if not junit.is_file():
            parser.error(f"junit: no file {junit}")
    text = report([case for junit in args.junit for case in read(junit)], args.wall,
                  args.note)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
