"""Method "ddtree" with tensor parallelism 2 on two GPUs (scripts/gpu_check.sh runs it where
the machine has two), vLLM 0.34's Model Runner V2, CUDA graphs on (vLLM's default): with the
trained tiny pair's target and drafter sharded over two ranks (worker processes, which load
the plugin by entry point), greedy output equals the target alone's under the same
parallelism, so every rank built, verified and compacted the same trees; and greedy or
sampling, both ranks take the same verdict (accepted path, emitted tokens) at every verify
step. The GPU counterpart of tests/engine/test_ddtree.py's
test_tensor_parallel_2_is_lossless_and_the_ranks_agree, whose folder runs only in the CPU
stand-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PAIR = REPO / "models" / "tiny-pair"

SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams

pair, method = sys.argv[1], sys.argv[2]
spec = None if method == "none" else {"method": "ddtree", "model": pair + "/drafter",
                                      "speculator_options": {"tree_budget": 16}}
standin = {}
if os.environ.get("VLLM_DDTREE_STANDIN_OPS") == "1":
    from gpu_machine.standin_ops import standin_engine_kwargs

    standin = standin_engine_kwargs()
llm = LLM(model=pair + "/target", max_model_len=256, seed=0, dtype="float32",
          tensor_parallel_size=2, max_num_seqs=8, gpu_memory_utilization=0.2,
          kv_cache_memory_bytes=1 << 30, disable_log_stats=False, speculative_config=spec,
          **standin)


def record_verdicts(worker):
    # Each rank logs what its own verify steps decided (a test-only wrapper of the
    # verifier, which V2's runner calls as its rejection sampler).
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    if hasattr(TreeVerifier, "verdict_log"):
        TreeVerifier.verdict_log.clear()
        return
    call, log = TreeVerifier.__call__, []

    def recorded(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        v = self._path.verdict  # the walk just made
        log.append([v.accepted.tolist(), v.num_accepted.tolist(), v.output_tokens.tolist()])
        return out

    TreeVerifier.__call__ = recorded
    TreeVerifier.verdict_log = log


def verdict_log(worker):
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    return list(TreeVerifier.verdict_log)


prompts = [f"def f{i}(x):" for i in range(8)]
result = {}
for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
    if spec:
        llm.collective_rpc(record_verdicts)
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=7)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if spec:
        result[name]["verdicts"] = llm.collective_rpc(verdict_log)
    if method == "none":
        break
metrics = {m.name: m for m in llm.get_metrics()}
accepted = metrics.get("vllm:spec_decode_num_accepted_tokens")
result["accepted"] = accepted.value if accepted else 0
print("RESULT " + json.dumps(result), flush=True)
"""


def run(method: str) -> dict:
    env = {**os.environ, "TRITON_F32_DEFAULT": "ieee",  # as test_engine_cuda.py's runs
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc sends the functions
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # TP workers are processes
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(PAIR), method], env=env,
                          cwd=REPO, text=True, capture_output=True, timeout=540)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(autouse=True)
def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism 2 needs two GPUs")


def test_tensor_parallel_2_is_lossless_and_ranks_agree() -> None:
    plain, trees = run("none"), run("ddtree")
    assert trees["greedy"]["tokens"] == plain["greedy"]["tokens"]
    assert trees["accepted"] > 0, trees["accepted"]
    for name in ("greedy", "sampled"):
        rank0, rank1 = trees[name]["verdicts"]
        assert len(rank0) > 0 and rank0 == rank1, name
