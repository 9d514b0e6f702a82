"""scripts/replay_adaptive.py: adaptive trees on a GPU's cost curves, tested on this CPU.
The trees and the target's verdicts are traces recorded from the trained tiny pair in
vLLM's engine (docs/adaptive-replay/trace-tiny-pair.npz, and -jetspec.npz for its JetSpec
head); the costs are the H200 model
(flat verify cost to about 265 tokens, then compute-bound). The sizing and its calibration
are the engine's own functions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import replay_adaptive as replay  # noqa: E402

TRACE = REPO / "docs" / "adaptive-replay" / "trace-tiny-pair.npz"
CAP = 256


@pytest.fixture(scope="module", params=["", "-jetspec"])
def trace(request: pytest.FixtureRequest) -> replay.Trace:
    """The pair's DFlash drafter's trees, and its JetSpec head's (JetSpec's build)."""
    return replay.Trace.load(TRACE.with_name(f"trace-tiny-pair{request.param}.npz"))


def load(concurrency: int) -> tuple[tuple[int, int], ...]:
    return ((concurrency, concurrency * replay.TOKENS_PER_REQUEST),)


def test_the_trace_holds_whole_trees_and_paths(trace: replay.Trace) -> None:
    """Every row: a tree of CAP nodes most probable first, the target's path a chain of
    accepted nodes (as many as its depth at most), drafted nodes only."""
    scores, accepted = trace.scores, trace.accepted
    assert scores.shape[1] == CAP and len(scores) >= 500
    finite = np.isfinite(scores)
    assert (np.diff(np.where(finite, scores, -1e9), axis=1) <= 1e-2).all()
    assert not (accepted & ~finite).any()
    assert accepted.sum(axis=1).max() <= 7 and accepted.any()


def test_sizes_grow_to_the_cap_at_1_and_shrink_at_32(trace: replay.Trace) -> None:
    costs = replay.h200_costs()
    one, busy = [], []
    replay.replay_adaptive(trace, costs, load(1), CAP, one)
    replay.replay_adaptive(trace, costs, load(32), CAP, busy)
    assert np.median(one) >= 0.95 * CAP
    assert np.mean(busy) / 32 < 0.1 * np.mean(one)  # nodes a request: a tenth or less


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_within_3_percent_of_the_best_fixed_budget(trace: replay.Trace,
                                                   concurrency: int) -> None:
    """And of no speculation, with the expected accepted drafts (the calibration's)
    within 10% of the trace's."""
    modes = replay.compare(trace, replay.h200_costs(), load(concurrency), CAP)
    adaptive = modes.pop(f"adaptive, cap {CAP}")
    best = max(r.tokens_per_s for r in modes.values())
    assert adaptive.tokens_per_s >= 0.97 * best, (concurrency, {
        m: r.tokens_per_s for m, r in modes.items()}, adaptive.tokens_per_s)
    assert adaptive.predicted == pytest.approx(adaptive.realized, rel=0.1)


def test_above_the_best_fixed_budget_when_the_load_mixes(trace: replay.Trace) -> None:
    modes = replay.compare(trace, replay.h200_costs(), replay.MIXED, CAP)
    adaptive = modes.pop(f"adaptive, cap {CAP}")
    assert adaptive.tokens_per_s > 1.05 * max(r.tokens_per_s for r in modes.values())


def test_a_step_that_never_pays_for_drafts_serves_as_no_speculation(
        trace: replay.Trace) -> None:
    """Curves where a node costs as much as a token of its own (a CPU): adaptive pauses
    and serves within 5% of no speculation (its paused drafter still stores the context:
    0.1 ms of a 4.3 ms step, and probes); the fixed budgets fall behind."""
    costs = replay.h200_costs()
    costs.verify = replay.StepCosts().verify
    for n in (1, 4, 16, 64, 256, 1024, 8192):
        costs.verify.add(n, 0.5 * n, trusted=True)
    modes = replay.compare(trace, costs, load(8), CAP)
    none, adaptive = modes["none"], modes[f"adaptive, cap {CAP}"]
    assert adaptive.tokens_per_s >= 0.95 * none.tokens_per_s
    assert adaptive.paused > 0.9 * adaptive.steps
    assert all(modes[f"B={b}"].tokens_per_s < none.tokens_per_s for b in (4, 16))


@pytest.mark.slow
def test_measured_curves_replay(tmp_path: Path) -> None:
    """``measure`` writes an engine's profiled curves as gpu_check.sh takes them (at
    bench_gpu_throughput's shapes, dummy weights; here its tiny shape on this CPU) and
    ``replay --curves`` reads them: the table names them."""
    curves = tmp_path / "cpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_adaptive.py"),
                           "measure", "--shape", "tiny", "--out", str(curves),
                           "--concurrency", "4"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(curves.read_text())
    assert len(summary["verify_ms_by_tokens"]) >= 4 and summary["draft_ms_by_requests"]
    costs = replay.costs_from_json(summary)
    assert costs.ready
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_adaptive.py"),
                           "replay", "--trace", str(TRACE), "--curves", str(curves),
                           "--concurrency", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "replay-trace-tiny-pair-cpu.md").read_text()
    assert "`cpu.json`" in table and "| adaptive, cap 256 |" in table


@pytest.mark.slow
def test_record_writes_whole_trees_with_the_targets_verdicts(tmp_path: Path) -> None:
    """``record`` on two prompts: every row a whole tree (every drafted node verified),
    read back as a trace whose accepted nodes are drafted ones and form a path."""
    out = tmp_path / "trace.npz"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "replay_adaptive.py"),
                           "record", "--out", str(out), "--num-prompts", "2",
                           "--max-tokens", "12", "--concurrency", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = replay.Trace.load(out)
    assert len(trace.scores) >= 4 and trace.scores.shape[1] == CAP
    assert not (trace.accepted & ~np.isfinite(trace.scores)).any()
    assert trace.accepted.any() and trace.accepted.sum(axis=1).max() <= 7
