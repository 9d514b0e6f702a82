"""One engine with the target and drafter sharded over two ranks (TP=2), in a fresh process,
over vLLM's multiprocessing executor (a worker process a rank) or its Ray executor (a local
Ray cluster of two CPUs, a Ray actor a rank): its greedy output, and with a tree method
each rank's tree counters and, at temperature 1, each rank's verdicts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine_runs import REPO

# "local": a cluster of this process's own, never one another test started.
RAY_INIT = "ray.init(address='local', num_cpus={cpus}, include_dashboard=False)"

ENGINE_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams

run = json.loads(sys.argv[1])
if run["executor"] == "ray":
    import ray

    """ + RAY_INIT.format(cpus=2) + """
llm = LLM(model=run["model"], enforce_eager=True, max_model_len=256, seed=0,
          tensor_parallel_size=2, distributed_executor_backend=run["executor"],
          speculative_config=run["spec"], **run["engine"])


def where(worker):
    # Where the rank runs: its Ray actor's name, or its worker process.
    if run["executor"] == "ray":
        return ray.get_runtime_context().get_actor_name()
    return os.getpid()


def verifier(worker):
    return getattr(worker, "worker", worker).model_runner.speculator.verifier


def install_oracle(worker, continuations):
    # The drafter of tests/engine_helpers.py that knows the target's continuations.
    from engine_helpers import oracle_tree_logits
    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    truth = {tuple(prompt): tokens for prompt, tokens in continuations}
    DDTreeSpeculator.draft_logits_at = oracle_tree_logits(truth, 16)


def record_verdicts(worker):
    # Each rank logs what its own verify steps decided (a test-only wrapper).
    tree_verifier = verifier(worker)
    tree_verifier.log, count = [], tree_verifier.counters.count

    def logged(verdict):
        tree_verifier.log.append([verdict.accepted.tolist(), verdict.num_accepted.tolist(),
                                  verdict.output_tokens.tolist()])
        count(verdict)

    tree_verifier.counters.count = logged


def fixed_costs(worker, per_token_ms, draft_ms):
    # Adaptive trees' step costs, the same on both ranks (engine_helpers.py).
    from engine_helpers import fixed_step_costs, use_step_costs

    use_step_costs(getattr(worker, "worker", worker).model_runner,
                   fixed_step_costs(per_token_ms, draft_ms))


prompts = run["prompts"]
if run.get("costs"):
    llm.collective_rpc(fixed_costs, args=tuple(run["costs"]))
if run.get("oracle"):
    encode = llm.get_tokenizer().encode
    llm.collective_rpc(install_oracle, args=(
        [[encode(p), tokens] for p, tokens in zip(prompts, run["oracle"])],))
greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=run["max_tokens"],
                                              ignore_eos=True), use_tqdm=False)
result = {"ranks": llm.collective_rpc(where), "driver": os.getpid(),
          "greedy": [list(o.outputs[0].token_ids) for o in greedy]}
if run["spec"] is not None:
    result["stats"] = llm.collective_rpc(lambda worker: verifier(worker).stats())
    result["gdn_commits"] = llm.collective_rpc(
        lambda worker: getattr(verifier(worker).gdn, "commits", 0))
if run.get("sample"):
    llm.collective_rpc(record_verdicts)
    params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    result["verdicts"] = llm.collective_rpc(lambda worker: verifier(worker).log)
print("RESULT " + json.dumps(result))
"""


def run_tp2(executor: str, model: Path, spec: dict | None, prompts: list[str],
            max_tokens: int, **run: object) -> dict:
    """``executor``: "mp" or "ray"; ``model``: a folder of target/ and drafter/.
    ``oracle``: the drafter knows each prompt's greedy continuation (these token lists);
    ``sample``: each rank's verdicts at temperature 1; ``costs``: adaptive trees' step
    costs, [ms a verify token, ms a draft] (engine_helpers.fixed_step_costs); ``engine``:
    the LLM's other settings (float32 unless given)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc sends functions
           "PYTHONPATH": str(REPO / "tests"),  # the ranks import engine_helpers
           "PYTHONFAULTHANDLER": "1"}  # a crash prints where it happened
    if executor == "ray":  # the engine in the script's process, a Ray driver
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:  # worker processes, bound to a core each
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    run = {"executor": executor, "model": str(model / "target"), "spec": spec,
           "prompts": prompts, "max_tokens": max_tokens, "engine": {"dtype": "float32"}} | run
    for attempt in range(2):
        done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, json.dumps(run)], env=env,
                              text=True, capture_output=True, timeout=600)
        # Known, not understood: a Ray driver on CPU has died by SIGSEGV (exit status -11)
        # in about one full suite run in two, after its workers loaded the models, its
        # stderr's last line a second "Started a local Ray instance"; alone or under an
        # artificial load it passes. Such a death (a signal, nothing asserted yet) is run
        # once more, and said on the test's output; any other failure fails at once.
        if done.returncode >= 0 or attempt:
            break
        print(f"run_tp2: the {executor} driver died by signal {-done.returncode}; once more. "
              f"Its stderr ended:\n{done.stderr[-3000:]}")
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"exit status {done.returncode}\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if executor == "ray":  # Ray kills its workers, which then never unlinked (patch 0011)
        assert not leftover_shared_memory(done.stderr + done.stdout)
    ranks = result["ranks"]
    if executor == "ray":  # each rank in a Ray actor of its own
        assert [re.sub(r"^vllm_Worker_.*_TP", "TP", name) for name in ranks] == \
            ["TP0", "TP1"], ranks
    else:  # each rank in a worker process of its own
        assert len(set(ranks)) == 2 and result["driver"] not in ranks, result
    return result


def leftover_shared_memory(log: str) -> list[str]:
    """The CPU all-reduce's shared-memory segments still in /dev/shm for the engines whose
    ranks logged their init ports in ``log`` (at least one must have)."""
    ports = set(re.findall(r"distributed_init_method=tcp://[^ ]+:(\d+)", log))
    assert ports, "no rank logged its distributed_init_method"
    return [str(p) for port in ports for p in Path("/dev/shm").glob(f"{port}-*cpushm*")]

