"""One generation run, in this process or (as a script) in a fresh one with other settings.

    python engine_runs.py '{"model": DIR, "spec": {...} | null, "dtype": "float32",
                            "prompts": [...], "max_tokens": 40}'

prints one JSON line: token ids per prompt, draft and accepted token counts, and the Triton
kernels that ran in the interpreter and the launches a PyTorch
kernel handed back to Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def generate(model: str, spec: dict | None = None, dtype: str = "float32",
             prompts: list[str] | None = None, max_tokens: int = 40, max_num_seqs: int = 8,
             temperature: float = 0.0, seeds: list[int] | None = None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # An engine started earlier in this process may have left a parallel state without the
    # expert-parallel group a mixture-of-experts target (gpt-oss) needs.
    cleanup_dist_env_and_memory()
    with triton_launches() as launches:
        llm = LLM(model=model, enforce_eager=True, max_model_len=512, seed=0, dtype=dtype,
                  max_num_seqs=max_num_seqs, disable_log_stats=False,
                  speculative_config=spec)
        prompts = prompts or ["def fibonacci(n):"]
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                 ignore_eos=True, seed=None if seeds is None else seeds[i])
                  for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}

    def count(name: str) -> int:
        return int(metrics[name].value) if name in metrics else 0

    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "drafts": count("vllm:spec_decode_num_drafts"),
            "draft_tokens": count("vllm:spec_decode_num_draft_tokens"),
            "accepted": count("vllm:spec_decode_num_accepted_tokens"),
            "trees": tree_stats(llm), **launches}


def preemption_prompts(count: int) -> list[str]:
    """Prompts of 5 to 50 words: some prefilled in chunks next to verify steps."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return [" ".join(words[(i + j) % 10] for j in range(5 + 15 * (i % 4))) + f" #{i}"
            for i in range(count)]


def alone_and_under_pressure(model: str, spec: dict, prompts: list, params: object
                             ) -> tuple[dict[str, list[int]], object]:
    """The target alone's outputs by prompt, and an engine of ``spec`` whose tiny KV cache
    (10 blocks of 32) and step (64 tokens) preempt requests and chunk prefills."""
    from vllm import LLM

    settings = dict(model=model, enforce_eager=True, max_model_len=256, seed=0,
                    dtype="float32", block_size=32)
    alone = {o.prompt: list(o.outputs[0].token_ids)
             for o in LLM(**settings).generate(prompts, params, use_tqdm=False)}
    return alone, LLM(**settings, max_num_seqs=6, max_num_batched_tokens=64,
                      num_gpu_blocks_override=10, disable_log_stats=False,
                      speculative_config=spec)


def run_with_aborts(llm: object, prompts: list, params: object, aborted: list[str],
                    at_step: int = 3) -> dict[str, tuple[str, list[int]]]:
    """Adds ``prompts`` as requests r0, r1, ... of ``llm``'s engine, aborts ``aborted``
    between steps ``at_step`` and ``at_step + 1``, and steps until all are done: the others'
    prompts and tokens, by request id."""
    engine, done = llm.llm_engine, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    for step in range(10_000):  # far more than any of these runs takes
        if not engine.has_unfinished_requests():
            return done
        if step == at_step:
            engine.abort_request(aborted)
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                done[out.request_id] = (out.prompt, list(out.outputs[0].token_ids))
    raise AssertionError("requests still unfinished after 10,000 engine steps")


def preempt_and_abort(model: str, spec: dict, prompts: list[str], later: int,
                      started: Callable[[object], object] = lambda llm: None
                      ) -> tuple[object, object]:
    """The preempt-and-abort scenario, greedy, 40 tokens a request: an engine of ``spec``
    under a tiny KV cache (alone_and_under_pressure: preemption, chunked prefills) runs all
    but the last ``later`` prompts as requests, r1, r4 and r6 aborted mid-stream
    (run_with_aborts), then the last ``later`` as one batch in the freed request slots.
    Asserts that every request not aborted gets the target alone's tokens and that the
    engine preempted. ``started`` is called with the engine before its first request; the
    engine and what ``started`` returned are returned."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone, llm = alone_and_under_pressure(model, spec, prompts, params)
    watched = started(llm)
    aborted, first = ["r1", "r4", "r6"], prompts[:-later]
    kept = run_with_aborts(llm, first, params, aborted)
    assert len(kept) == len(first) - len(aborted)
    assert all(tokens == alone[p] for p, tokens in kept.values())
    outputs = llm.generate(prompts[-later:], params, use_tqdm=False)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: alone[p] for p in prompts[-later:]}
    assert metrics_of(llm)["vllm:num_preemptions"] > 0, (
        "the KV cache was not small enough to preempt")
    return llm, watched


def metrics_of(llm: object) -> dict[str, float]:
    """An engine's counters and gauges, by name."""
    return {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}


def tree_stats(llm: object) -> dict[str, int] | None:
    """The tree verifier's counters (vllm_ddtree/spec_decode/verifier.py) of an engine run
    in this process, None without one."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return None
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    verifier = getattr(getattr(runner, "speculator", None), "verifier", None)
    return None if verifier is None else verifier.stats()


@contextmanager
def triton_launches() -> Iterator[dict[str, object]]:
    """Fills in, on exit, the Triton kernels launched in the interpreter (module.name,
    sorted) and the launches the stand-in's PyTorch kernels handed back to Triton; empty
    where Triton is not interpreted (TRITON_INTERPRET unset). The engine must run in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    found: dict[str, object] = {"interpreted": [], "fallbacks": 0}
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield found
        return
    from triton.runtime.interpreter import InterpretedFunction

    from cpu_standin import kernels

    names: set[str] = set()
    run, before = InterpretedFunction.run, sum(k.fallbacks for k in kernels.load().values())

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        names.add(f"{self.fn.__module__}.{self.fn.__name__}")
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield found
    finally:
        InterpretedFunction.run = run
        found["interpreted"] = sorted(names)
        found["fallbacks"] = sum(k.fallbacks for k in kernels.load().values()) - before


def run_in(python: Path, env: dict[str, str] | None = None, **run: object) -> dict:
    """``generate(**run)`` in a fresh process of ``python``'s environment."""
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        **(env or {})}
    done = subprocess.run([str(python), __file__, json.dumps(run)], env=env, text=True,
                          capture_output=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{python} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    result = generate(**json.loads(sys.argv[1]))
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
