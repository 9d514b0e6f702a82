"""scripts/test.sh runs the suite with pytest-xdist's --dist loadgroup: the tests of an
xdist_group (a Ray cluster, a server's port, the in-place native build) must run on one
worker, in turn. pytest 9.2 silently broke that with pytest-xdist 3.8 (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """import os, pytest
pytestmark = pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
@pytest.mark.parametrize("i", range(4))
def test_free(i):
    pass
"""


def test_a_groups_tests_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    workers = tmp_path / "workers.txt"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning",
         str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "WORKERS_FILE": str(workers)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ran = workers.read_text().split()
    assert len(ran) == 4 and len(set(ran)) == 1, ran
