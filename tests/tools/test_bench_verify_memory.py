"""scripts/bench_verify_memory.py runs ddtree and the chain side by side, each in a fresh
engine process, and prints peak extra memory per node row (on the random tiny pair,
briefly: this checks the benchmark, not the numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_verify_memory_side_by_side(tiny_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_verify_memory.py"),
         "--models", str(tiny_models), "--requests", "3", "--budget", "8", "--max-tokens", "3",
         "--repeats", "1", "--logprobs", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert list(runs) == ["ddtree", "dflash"]
    (ddtree,), (chain,) = runs["ddtree"], runs["dflash"]
    assert (ddtree["rows_a_step"], chain["rows_a_step"]) == (3 * 9, 3 * 8)
    for run in (ddtree, chain):
        assert run["verify_steps"] > 0 and run["peak_extra_mb"] > 0
        assert run["mb_per_row"] == pytest.approx(run["peak_extra_mb"] / run["rows_a_step"])
    assert "| ddtree | tiny, random weights | 27 |" in proc.stdout  # says its weights
    assert "| dflash | tiny, random weights | 24 |" in proc.stdout
