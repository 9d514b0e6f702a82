"""scripts/suite_times.py: time per file and the slowest tests, from pytest's JUnit XML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import suite_times

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_one" time="30.0" />
<testcase classname="tests.test_a" name="test_two[x]" time="60.0"><skipped /></testcase>
<testcase classname="tests.test_b" name="test_three" time="150.0"><failure /></testcase>
</testsuite></testsuites>"""


def test_files_ranked_by_time_and_the_slowest_tests(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    text = suite_times.report(suite_times.read(junit), wall=120.0, note="a run", top=2)
    assert "3 tests (1 failure, 1 passed, 1 skipped): 4.0 min of test time in 2.0 min" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == ["| `tests/test_b.py` | 1 | 2.50 | 62% |",
                    "| `tests/test_a.py` | 2 | 1.50 | 38% |",
                    "| `tests/test_b.py::test_three` | 150.0 |",
                    "| `tests/test_a.py::test_two[x]` | 60.0 |"]


def test_a_missing_file_is_named() -> None:
    done = subprocess.run([sys.executable, suite_times.__file__, "no-such.xml"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "junit: no file no-such.xml" in done.stderr


def test_several_runs_make_one_report(tmp_path: Path) -> None:
    """Runs of parts of the suite (two folders here) make one report."""
    first, second = tmp_path / "a.xml", tmp_path / "b.xml"
    first.write_text(JUNIT)
    second.write_text(JUNIT.replace("tests.test_", "tests.engine.test_"))
    done = subprocess.run([sys.executable, suite_times.__file__, str(first), str(second),
                           "--wall", "240"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "6 tests (2 failure, 2 passed, 2 skipped)" in done.stdout, done.stdout
    assert "| `tests/engine/test_b.py` | 1 | 2.50 |" in done.stdout
