"""ddtree under tensor parallelism on this CPU machine: with the target and the drafter
sharded over two ranks (the tiny pair's heads divide by 2), greedy output equals the target
alone, so every rank built, verified and compacted the same trees; and when sampling, both
ranks take the same verdict (accepted path, emitted tokens) at every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams

models, tp, method, temperature = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
spec = None if method == "none" else {"method": "ddtree", "tree_budget": 8,
                                      "model": os.path.join(models, "drafter")}
llm = LLM(model=os.path.join(models, "target"), enforce_eager=True, max_model_len=256,
          seed=0, dtype="float32", tensor_parallel_size=tp, speculative_config=spec)


def record_verdicts(worker):
    # Each rank logs what its own verify step decided (a test-only wrapper).
    state = getattr(worker, "worker", worker).model_runner.drafter.ddtree_state
    state.log, inner = [], state.verify

    def verify(*args, **kwargs):
        out = inner(*args, **kwargs)
        v = state.last_verdict
        state.log.append([v.accepted.tolist(), v.num_accepted.tolist(),
                          out.sampled_token_ids.tolist()])
        return out

    state.verify = verify


if spec:
    llm.collective_rpc(record_verdicts)
params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True)
outputs = llm.generate([f"def f{i}(x):" for i in range(8)], params, use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
if spec:
    logs = llm.collective_rpc(
        lambda w: getattr(w, "worker", w).model_runner.drafter.ddtree_state.log)
    print("VERDICTS " + json.dumps(logs))
"""


def run(tiny_models: Path, tp: int, method: str, temperature: float = 0.0) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # TP workers are processes
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends the test's functions
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (upstream-facts §6)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_models), str(tp), method,
                             str(temperature)],
                            env=env, capture_output=True, text=True, timeout=600)
    found = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in result.stdout.splitlines() if line.startswith(("TOKENS ", "VERDICTS "))}
    assert result.returncode == 0 and "TOKENS" in found, \
        result.stdout[-2000:] + result.stderr[-4000:]
    return found


@pytest.mark.slow
def test_tensor_parallel_2_is_lossless(tiny_models: Path) -> None:
    assert run(tiny_models, 2, "ddtree")["TOKENS"] == run(tiny_models, 1, "none")["TOKENS"]


@pytest.mark.slow
def test_tensor_parallel_2_ranks_agree_when_sampling(tiny_models: Path) -> None:
    found = run(tiny_models, 2, "ddtree", temperature=1.0)
    rank0, rank1 = found["VERDICTS"]
    assert len(rank0) > 0 and rank0 == rank1
