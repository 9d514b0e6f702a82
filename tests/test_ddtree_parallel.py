"""ddtree under tensor parallelism on this CPU machine: with the target and the drafter
sharded over two ranks (the tiny pair's heads divide by 2), greedy output equals the target
alone, so every rank built, verified and compacted the same trees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams

models, tp, method = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = None if method == "none" else {"method": "ddtree", "tree_budget": 8,
                                      "model": os.path.join(models, "drafter")}
llm = LLM(model=os.path.join(models, "target"), enforce_eager=True, max_model_len=256,
          seed=0, dtype="float32", tensor_parallel_size=tp, speculative_config=spec)
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
outputs = llm.generate([f"def f{i}(x):" for i in range(8)], params, use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


def run(tiny_models: Path, tp: int, method: str) -> list:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # TP workers are processes
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (upstream-facts §6)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_models), str(tp), method],
                            env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in result.stdout.splitlines() if x.startswith("TOKENS ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    import json

    return json.loads(lines[-1][len("TOKENS "):])


@pytest.mark.slow
def test_tensor_parallel_2_is_lossless(tiny_models: Path) -> None:
    assert run(tiny_models, 2, "ddtree") == run(tiny_models, 1, "none")
