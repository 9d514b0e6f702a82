"""scripts/bench_acceptance.py runs every mode side by side and writes its table, JSON and
plots (on the random tiny pair, briefly: this checks the benchmark, not the numbers)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(tiny_models: Path, tmp_path: Path, *args: str) -> tuple[Path, dict]:
    """scripts/bench_acceptance.py on the random tiny pair, two prompts of 6 tokens: OUT and
    its acceptance.json."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n    return", "The name of the file is"]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_acceptance.py"),
         "--target", str(tiny_models / "target"), "--drafter", str(tiny_models / "drafter"),
         "--prompts", str(prompts), "--max-tokens", "6", *args, "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "acceptance.json").read_text())


@pytest.mark.slow
def test_bench_acceptance_side_by_side(tiny_models: Path, tmp_path: Path) -> None:
    out, data = bench(tiny_models, tmp_path, "--budgets", "4", "8", "--repeats", "2",
                      "--dynamic", "8:6")
    assert data["identical_greedy_outputs"] is True
    results = {r["mode"]: r for r in data["results"]}
    assert list(results) == ["none", "dflash", "ddtree B=4 spine", "ddtree B=8 spine",
                             "ddtree B=4", "ddtree B=8", "ddtree B=8 spine, 6 tokens/step"]
    none = results.pop("none")
    assert none["verify_steps"] == 0 and none["acceptance_length"] == 1.0
    assert none["target_forwards_per_token"] == 1.0  # one forward per token, prefill included
    for mode, r in results.items():
        assert r["verify_steps"] > 0, mode
        assert sum(r["accepted_length_histogram"]) == r["verify_steps"], mode
        depth = r["per_depth_acceptance"]
        assert all(a >= b for a, b in zip(depth, depth[1:])), mode
        assert r["acceptance_length"] == pytest.approx(1 + sum(depth))
        assert r["tokens_per_s"] > 0 and len(r["tokens_per_s_runs"]) == 2
        assert "verify forward" in r["breakdown_ms_per_forward"]
        if mode.startswith("ddtree"):
            assert "walk + compaction" in r["breakdown_ms_per_forward"]
            # Every step builds (a spine of at most the drafter's 7 positions builds the chain).
            assert "tree build" in r["breakdown_ms_per_forward"], mode
    table = (out / "acceptance.md").read_text()
    assert "| ddtree B=8 | 1 |" in table and "identical across modes: yes" in table
    speed = table.split("Tokens/s over the dflash chain's:")[1]
    for mode in list(results)[1:]:
        ratio = results[mode]["tokens_per_s"] / results["dflash"]["tokens_per_s"]
        assert f"| {mode} | {ratio:.2f}x | {'met' if ratio >= 1.35 else 'not met'} |" in speed
    for png in ("acceptance_vs_budget_c1.png", "accepted_length_histogram_c1.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_adaptive_modes_report_what_the_sizing_chose(tiny_models: Path,
                                                     tmp_path: Path) -> None:
    """--adaptive: the adaptive mode's row carries the sizing's counters and the costs it
    chose by; greedy output as no speculation's."""
    _, data = bench(tiny_models, tmp_path, "--adaptive", "16", "--repeats", "1", "--modes",
                    "none", "ddtree adaptive, cap 16")
    assert data["identical_greedy_outputs"] is True
    results = {r["mode"]: r for r in data["results"]}
    assert "adaptive" not in results["none"]
    chosen = results["ddtree adaptive, cap 16"]["adaptive"]
    assert chosen["steps"] + chosen["paused_steps"] > 0, chosen
    assert chosen["costs"]["verify_ms_by_tokens"], chosen


def test_step_token_schedule_keeps_verify_steps_near_the_target() -> None:
    from bench_acceptance import step_token_schedule
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = step_token_schedule(64, budget=16, max_reqs=40)
    assert schedule == [(1, 3, 16), (4, 4, 15), (5, 8, 7), (9, 16, 3), (17, 40, 1)]
    lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=40,
                                              vllm_num_speculative_tokens=16)
    for reqs in range(1, 41):
        assert reqs * (lookup[reqs] + 1) <= max(64, 2 * reqs)


def test_the_control_engine_is_not_a_mode_compared_with() -> None:
    """--control: a second no-speculation engine; the adaptive verdicts never take it as
    the fastest other mode, and report it over none (the run's resolution)."""
    from bench_acceptance import CONTROL, adaptive_vs_best, modes

    names = [name for name, _ in modes("d", [4], 7, control=True)]
    assert names[:3] == ["none", CONTROL, "dflash"]
    assert CONTROL not in [name for name, _ in modes("d", [4], 7)]
    rate = {"none": 100.0, CONTROL: 110.0, "dflash": 80.0, "ddtree adaptive, cap 256": 99.0}
    lines = adaptive_vs_best([{"mode": m, "concurrency": 1, "tokens_per_s": v}
                              for m, v in rate.items()])
    row = next(line for line in lines if line.startswith("| ddtree adaptive"))
    assert row == "| ddtree adaptive, cap 256 | 1 | none | 0.99x | 0.99x | met | 1.10x |"


def test_interleaved_verdicts_say_when_the_run_cannot_tell() -> None:
    """Interleaved, the k-th passes of two modes pair up: the goal is met where the paired
    ratios' 95% interval clears it, not met where it falls short, else unresolved, even
    where the ratio of the medians alone would call it."""
    from bench_acceptance import adaptive_vs_best, median_interval

    assert median_interval(range(60)) == (21, 38)  # ranks 22 and 39 of 60
    assert median_interval([3, 1, 2]) == (1, 3)  # too few for 95%: the range
    drift = [100.0, 60.0, 140.0, 80.0, 120.0, 90.0, 110.0, 70.0, 130.0, 100.0]

    def row(factors: list[float]) -> str:
        results = [{"mode": m, "concurrency": 1, "interleaved": True,
                    "tokens_per_s": statistics.median(runs), "tokens_per_s_runs": runs}
                   for m, runs in (("none", drift),
                                   ("ddtree adaptive, cap 256",
                                    [x * f for x, f in zip(drift, factors)]))]
        return next(line for line in adaptive_vs_best(results)
                    if line.startswith("| ddtree adaptive"))

    assert row([0.99] * 10).endswith("| met | - |")  # the machine's drift pairs away
    assert row([0.95] * 10).endswith("| not met | - |")
    straddling = [0.93, 1.01] * 5
    assert row(straddling).endswith("| unresolved | - |")
    assert "| none | 0.97x (0.970x, 0.930-1.010) |" in row(straddling)


@pytest.mark.slow
def test_interleaved_modes_report_what_one_at_a_time_does(tiny_models: Path,
                                                          tmp_path: Path) -> None:
    """--interleave: every mode's engine at once, their timed passes in turn; each mode's
    counters and breakdown still its own (taken on an engine of its own, alone)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n    return", "The name of the file is"]))
    data = {}
    for interleave in (False, True):
        out = tmp_path / f"out{interleave}"
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "bench_acceptance.py"),
             "--target", str(tiny_models / "target"), "--drafter", str(tiny_models / "drafter"),
             "--prompts", str(prompts), "--max-tokens", "6", "--budgets", "4",
             "--repeats", "2", "--modes", "ddtree B=4 spine", "none",
             "--out", str(out)] + ["--interleave"] * interleave,
            capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        data[interleave] = json.loads((out / "acceptance.json").read_text())
    alone, turns = ({r["mode"]: r for r in data[i]["results"]} for i in (False, True))
    assert list(turns) == ["none", "ddtree B=4 spine"] == list(alone)
    assert data[True]["identical_greedy_outputs"] is True
    for mode, r in turns.items():
        assert len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s"] > 0
        for key in ("acceptance_length", "verify_steps", "per_depth_acceptance",
                    "target_forwards_per_token"):
            assert r[key] == alone[mode][key], (mode, key)
    assert turns["none"]["verify_steps"] == 0
    assert turns["ddtree B=4 spine"]["verify_steps"] > 0


@pytest.mark.slow
def test_constraints_run_every_mode_again(tiny_models: Path, tmp_path: Path) -> None:
    """--regex and --json-schema: each chosen mode again with every request under each
    (" + regex", " + json"), greedy outputs checked against no speculation under the same
    constraint, acceptance compared with the chain under the same constraint, and the drafts
    a verify step verified reported (the grammar's allowed nodes: below the budget; with
    --every-node, tree modes again verifying the forbidden nodes too)."""
    schema = '{"type": "object", "properties": {"code": {"type": "string"}}}'
    out, data = bench(tiny_models, tmp_path, "--budgets", "4", "--repeats", "1", "--modes",
                      "none", "dflash", "ddtree B=4 spine", "--regex", "( [a-z]+)+",
                      "--json-schema", schema, "--every-node")
    assert data["identical_greedy_outputs"] is True
    results = {r["mode"]: r for r in data["results"]}
    modes = ["none", "dflash", "ddtree B=4 spine"]
    every = "ddtree B=4 spine, every node"
    assert list(results) == modes + [m + " + regex" for m in modes] + [every + " + regex"] \
        + [m + " + json" for m in modes] + [every + " + json"]
    plain = results["ddtree B=4 spine"]["drafts_per_verify_step"]
    assert 3.5 < plain <= 4
    table = (out / "acceptance.md").read_text()
    for suffix in (" + regex", " + json"):
        # The random drafter's nodes are mostly ones the grammar forbids: not verified.
        tree, chain = results["ddtree B=4 spine" + suffix], results["dflash" + suffix]
        assert tree["drafts_per_verify_step"] < plain
        # --every-node: the forbidden nodes verified too (as under async scheduling).
        assert 3.5 < results[every + suffix]["drafts_per_verify_step"] <= 4
        ratio = f"{tree['acceptance_length'] / chain['acceptance_length']:.2f}x" \
            if tree["verify_steps"] else "-"
        assert f"| ddtree B=4 spine{suffix} | 1 | {tree['acceptance_length']:.2f} | " \
            f"{ratio} | {tree['drafts_per_verify_step']:.1f} |" in table
