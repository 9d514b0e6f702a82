"""scripts/bench_gpu_throughput.py at tiny shapes on CPU: every mode runs, each row says
synthetic acceptance, speedups follow from the rows, measured acceptance follows the requested
lengths, a mode that fails is recorded and the run goes on, and a tiny time budget skips (and
names) all but the first mode. This checks the
benchmark, not the numbers (CPU timings here are noise)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_gpu_throughput.py"
# Synthetic acceptance draws 0/1 per step around a fixed schedule: the measured mean of a few
# dozen verify steps (and the last, possibly cut, step of each request) stays well within this.
ACCEPTANCE_TOLERANCE = 0.5


def bench(out: Path, models: Path, *args: str, env: dict | None = None, shape: str = "tiny"
          ) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", shape, "--out", str(out),
         "--models-dir", str(models), "--repeats", "1", *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return (json.loads((out / "throughput.json").read_text()),
            (out / "throughput.md").read_text())


@pytest.mark.slow
def test_bench_gpu_throughput_tiny(tmp_path: Path) -> None:
    data, table = bench(tmp_path / "full", tmp_path / "models", "--concurrency", "1", "2",
                        "--output-len", "64", "--tree", "16:5.5", "4:9.0", "--dynamic",
                        "16:24")
    # A 4-node tree is at most 4 deep: acceptance 9 is refused at config time.
    assert [f["mode"] for f in data["failed"]] == ["ddtree B=4"]
    assert "synthetic_acceptance_length" in data["failed"][0]["reason"]
    assert "- ddtree B=4: " in table
    assert data["skipped"] == [] and data["pending"] == []
    assert "synthetic acceptance" in data["title"] and data["standin"] is False
    rows = {(r["mode"], r["concurrency"]): r for r in data["results"]}
    chain, tree = "dflash chain k=15", "ddtree B=16"
    dynamic = "ddtree B=16 dynamic <=24 tokens/step"
    assert list(rows) == [("no speculation", 1), ("no speculation", 2), (chain, 1), (chain, 2),
                          (tree, 1), (tree, 2), (dynamic, 2)]
    for (mode, conc), r in rows.items():
        assert "synthetic acceptance" in r["label"] and "stand-in" not in r["label"]
        assert f"| {r['label']} | {conc} | {r['tokens_per_s']:.1f} |" in table
        assert r["tokens_per_s"] > 0 and r["engine_steps"] > 0 and r["startup_s"] > 0
        assert r["speedup_vs_none"] == pytest.approx(
            r["tokens_per_s"] / rows[("no speculation", conc)]["tokens_per_s"])
        assert r["speedup_vs_chain"] == pytest.approx(
            r["tokens_per_s"] / rows[(chain, conc)]["tokens_per_s"])
        if mode == "no speculation":
            assert r["acceptance_length"] == 1.0 and r["requested_acceptance"] is None
        else:
            assert r["requested_acceptance"] == (6.9 if mode == chain else 5.5)
            assert abs(r["acceptance_length"] - r["requested_acceptance"]) \
                <= ACCEPTANCE_TOLERANCE, (mode, conc, r["acceptance_length"])
            # Fewer verify steps than tokens: drafts were accepted.
            assert r["verify_steps_per_request"] < 64 / 3
    assert data["startup_s"].keys() == {m for m, _ in rows}
    assert (tmp_path / "full" / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A budget of 0 s: the first mode runs (the baseline), every later one is named skipped;
    # with the compiled-op stand-in (when its module is there) every row says so.
    standin = importlib.util.find_spec("gpu_machine.standin_ops") is not None
    data, table = bench(tmp_path / "tiny-budget", tmp_path / "models", "--concurrency", "1",
                        "--output-len", "8", "--time-budget-s", "0", "--tree", "16:5.5",
                        "--dynamic", "16:24",
                        env={"VLLM_DDTREE_STANDIN_OPS": "1"} if standin else None)
    assert [r["mode"] for r in data["results"]] == ["no speculation"]
    assert [s["mode"] for s in data["skipped"]] == [chain, tree, dynamic]
    assert all(s["reason"].startswith("time budget") for s in data["skipped"])
    for s in data["skipped"]:
        assert f"- {s['mode']}: time budget" in table
    assert data["standin"] is standin
    if standin:
        assert "compiled-op stand-in" in data["title"]
        assert all("compiled-op stand-in" in r["label"] for r in data["results"])


@pytest.mark.slow
def test_bench_gpu_throughput_on_a_hybrid_target(tmp_path: Path) -> None:
    """--shape tiny-hybrid (gpu_check.sh's hybrid step): make_tiny_models' Qwen3-Next and its
    drafter, the chain and trees at synthetic acceptance, every mode measured."""
    data, _ = bench(tmp_path / "hybrid", tmp_path / "models", "--concurrency", "1",
                    "--output-len", "32", "--chain-acceptance", "4", "--tree", "8:4.0",
                    "16:4.5", "--dynamic", shape="tiny-hybrid")
    assert data["failed"] == [] and data["skipped"] == []
    rows = {r["mode"]: r for r in data["results"]}
    assert list(rows) == ["no speculation", "dflash chain k=7", "ddtree B=8", "ddtree B=16"]
    config = json.loads((tmp_path / "models" / "target" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    for mode, want in (("dflash chain k=7", 4.0), ("ddtree B=8", 4.0), ("ddtree B=16", 4.5)):
        assert abs(rows[mode]["acceptance_length"] - want) <= ACCEPTANCE_TOLERANCE, rows[mode]


def test_time_budget_estimate_and_skip() -> None:
    from bench_gpu_throughput import estimate_s, skip_reason

    assert estimate_s([1, 8], []) is None
    assert skip_reason(None, elapsed_s=1e9, budget_s=0) is None  # the first mode always runs
    done = [{"startup_s": 40.0, "teardown_s": 2.0, "run_s": {1: 5.0, 8: 6.0, 32: 9.0}},
            {"startup_s": 50.0, "teardown_s": 1.0, "run_s": {1: 4.0}}]
    # The longest start-up + teardown, then per concurrency the longest run seen there.
    assert estimate_s([1, 8, 32], done) == pytest.approx(51 + 5 + 6 + 9)
    assert estimate_s([32], done) == pytest.approx(51 + 9)
    assert estimate_s([64], done) == pytest.approx(51 + 9)  # unseen: the longest anywhere
    assert skip_reason(60.0, elapsed_s=300, budget_s=360) is None
    reason = skip_reason(61.0, elapsed_s=300, budget_s=360)
    assert reason is not None and reason.startswith("time budget: needs about 61 s, 60 s")


def test_modes_order_and_settings() -> None:
    from bench_gpu_throughput import engine_kwargs, modes

    plan = modes("D", 15, 6.9, [(128, 9.19), (64, 7.16)], [(64, 512)], 32)
    assert [m.name for m in plan] == [
        "no speculation", "dflash chain k=15", "ddtree B=128", "ddtree B=64",
        "ddtree B=64 dynamic <=512 tokens/step"]
    chain, dynamic = plan[1], plan[4]
    assert chain.spec == {"method": "dflash", "model": "D", "num_speculative_tokens": 15,
                          "rejection_sample_method": "synthetic",
                          "synthetic_acceptance_length": 6.9}
    assert plan[2].spec["tree_budget"] == 128 and plan[2].requested_acceptance == 9.19
    assert dynamic.concurrencies == [32] and dynamic.requested_acceptance == 7.16
    assert dynamic.spec["num_speculative_tokens_per_batch_size"][-1][1:] == (32, 15)
    assert all(m.spec["rejection_sample_method"] == "synthetic" for m in plan[1:])

    merged = engine_kwargs({"compilation_config": {"custom_ops": ["none"]}, "seed": 0},
                           {"compilation_config": {"mode": 0}, "seed": 1})
    assert merged == {"compilation_config": {"custom_ops": ["none"], "mode": 0}, "seed": 1}
