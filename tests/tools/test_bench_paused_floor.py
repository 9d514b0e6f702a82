"""scripts/bench_paused_floor.py: no speculation beside an adaptive engine held paused and
vLLM's DFlash drafting nothing (on the random tiny pair, briefly: this checks the
benchmark, not the numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_paused_floor_side_by_side(tiny_models: Path, tmp_path: Path) -> None:
    pair = tmp_path / "pair"
    pair.mkdir()
    for model in ("target", "drafter"):
        (pair / model).symlink_to(tiny_models / model)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17]]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_paused_floor.py"), "--pair", str(pair),
         "--prompts", str(prompts), "--concurrency", "2", "--repeats", "2",
         "--max-tokens", "12", "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "paused-floor.json").read_text())
    assert [r["mode"] for r in rows] == ["none", "dflash, drafting nothing",
                                         "ddtree adaptive, held paused"]
    assert all(r["same_output"] and len(r["tokens_per_s_runs"]) == 2 for r in rows)
    assert rows[0]["x_none"] == 1.0
    held = rows[2]["adaptive"]
    # Three passes of 2 waves of 12 tokens: paused but for the warm-up's verify steps.
    assert held["paused_steps"] > 50 and held["probes"] <= 1 and held["steps"] <= 4
    # Its passes stored the drafter's context (every committed token's K/V): timed.
    assert 0 < rows[2]["context_share"] < 1
    assert rows[2]["context_ceiling"] == pytest.approx(1 / (1 + rows[2]["context_share"]))
    # Each pass split into its steps' parts; only speculative engines draft.
    assert all(0 < r["parts_ms"]["target forward"] < 1e3 * max(r["seconds_runs"])
               for r in rows)
    assert "drafting (the speculator's propose)" not in rows[0]["parts_ms"]
    assert rows[2]["parts_ms"]["drafting (the speculator's propose)"] > 0
    table = (out / "paused-floor.md").read_text()
    assert "| mode | conc. | schedule | inputs | target forward |" in table
    assert "held paused (synthetic costs: the drafter priced out) | 2 |" in table
