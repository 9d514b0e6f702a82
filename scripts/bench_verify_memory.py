#!/usr/bin/env python3
"""Peak memory of a verify step, per node row: ddtree against vLLM's DFlash chain, in one run.

Each run starts vLLM's engine in a fresh process (in-process engine core, CPU platform
unless a GPU is there), then generates for ``--requests`` requests at once, sampled with
Qwen3's defaults (temperature 0.6, top-p 0.95, top-k 20; seeded) and a presence penalty, and
reports the process's peak resident memory during generation over its resident memory with
the engine started (Linux ``VmHWM``, reset through /proc/self/clear_refs just before the
requests are added). The target is a tiny random Qwen3 with Qwen3's vocabulary of 151,936
tokens (scripts/make_tiny_models.py, made into ``--models`` if missing), so the verify step's
[rows, vocab] tensors dominate. Rows a verify step: requests x (budget + 1) for ddtree
(requests with penalties draft the greedy chain but are still scheduled budget + 1 rows),
requests x (K + 1) for the chain (K: the drafter's block size - 1).

Runs alternate between the methods, ``--repeats`` times each; the medians are printed as a
table (peak extra MB, MB per node row) and, with ``--json``, written out.

    .venv/bin/python scripts/bench_verify_memory.py                 # 12 requests, budget 64
    .venv/bin/python scripts/bench_verify_memory.py --logprobs 5    # and logprobs

On CPU, torch frees large blocks back to the system (glibc maps them), so resident memory
follows what torch holds; on a GPU the numbers are host memory, not the GPU's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151_936
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,",
           "for i in range(10):", "The capital of France is", "while True:", "# TODO:",
           "Once upon a time", "SELECT * FROM", "async def main():", "return {"]


def _status(field: str) -> int:
    """A /proc/self/status field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def ensure_models(out: Path) -> Path:
    """The tiny random pair with Qwen3's vocabulary (2 layers, hidden 64), made if missing."""
    if not (out / "drafter" / "config.json").exists():
        sys.path.insert(0, str(REPO / "scripts"))
        import make_tiny_models

        make_tiny_models.make(out, seed=0, vocab_size=QWEN3_VOCAB, layers=2, hidden_size=64)
    return out


def spec_of(method: str, models: Path, budget: int) -> dict:
    if method == "ddtree":
        return {"method": "ddtree", "model": str(models / "drafter"), "tree_budget": budget}
    # The chain DFlash drafts: one block (the anchor, then block_size - 1 mask tokens).
    block = json.loads((models / "drafter" / "config.json").read_text())["block_size"]
    return {"method": "dflash", "model": str(models / "drafter"),
            "num_speculative_tokens": block - 1}


def measure(method: str, models: str, budget: int, requests: int, max_tokens: int,
            presence_penalty: float, logprobs: int | None,
            chunk_elements: int | None = None) -> dict:
    """One run in this process: the engine started, then the requests generated."""
    from vllm import LLM, SamplingParams

    from vllm_ddtree.spec_decode import node_sampling

    if chunk_elements is not None:  # read at every step (the engine runs in this process)
        node_sampling.CHUNK_ELEMENTS = chunk_elements
    spec = spec_of(method, Path(models), budget)
    llm = LLM(model=str(Path(models) / "target"), enforce_eager=True, max_model_len=512,
              seed=0, dtype="float32", max_num_seqs=requests,
              max_num_batched_tokens=max(2048, requests * (budget + 1)),
              disable_log_stats=False, speculative_config=spec)
    k = llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
    params = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=i, max_tokens=max_tokens,
                             ignore_eos=True, presence_penalty=presence_penalty,
                             logprobs=logprobs) for i in range(requests)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before, start = _status("VmRSS:"), time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    peak = _status("VmHWM:") - before
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    rows = requests * (k + 1)
    return {"method": method, "rows_a_step": rows, "peak_extra_mb": peak / 2**20,
            "mb_per_row": peak / 2**20 / rows, "engine_rss_mb": before / 2**20,
            "verify_steps": int(drafts.value) if drafts is not None else None,
            "seconds": round(time.time() - start, 1)}


def run_child(settings: dict) -> dict:
    """``measure(**settings)`` in a fresh process (a fresh VmHWM, a fresh engine)."""
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(settings)], env=env,
                          text=True, capture_output=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{settings['method']} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, list[dict]]) -> str:
    # The tiny pair's weights are random (memory does not depend on them): said on each row.
    lines = ["| method | models | rows a step | peak extra MB (median) | MB per node row "
             "| runs (MB) |", "| --- | --- | --- | --- | --- | --- |"]
    for method, runs in results.items():
        peak = statistics.median(r["peak_extra_mb"] for r in runs)
        rows = runs[0]["rows_a_step"]
        each = ", ".join(f"{r['peak_extra_mb']:.0f}" for r in runs)
        lines.append(f"| {method} | tiny, random weights | {rows} | {peak:.0f} "
                     f"| {peak / rows:.2f} | {each} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--models", type=Path, default=Path("/tmp/ddtree-qwen3-vocab"),
                    help="the tiny pair with Qwen3's vocabulary (made here if missing)")
    ap.add_argument("--methods", nargs="+", default=["ddtree", "dflash"],
                    choices=["ddtree", "dflash"])
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--presence-penalty", type=float, default=1.5)
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--chunk-elements", type=int, default=None,
                    help="ddtree's node_sampling.CHUNK_ELEMENTS (logits elements a chunk "
                    "of rows; 10**12: all rows in one chunk, as before the chunking)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write every run here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = measure(**json.loads(args.child))
        print(json.dumps(result), flush=True)
        return
    models = ensure_models(args.models)
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for _ in range(args.repeats):
        for method in args.methods:  # alternated: the same machine state for both
            run = run_child(dict(method=method, models=str(models), budget=args.budget,
                                 requests=args.requests, max_tokens=args.max_tokens,
                                 presence_penalty=args.presence_penalty,
                                 logprobs=args.logprobs,
                                 chunk_elements=args.chunk_elements))
            print(json.dumps(run), flush=True)
            results[method].append(run)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
