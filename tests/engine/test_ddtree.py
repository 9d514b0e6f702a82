"""Methods ddtree and jetspec on vLLM 0.34's Model Runner V2 (vllm_ddtree/spec_decode/), end
to end in the CPU stand-in with the trained tiny pair (models/tiny-pair), whose drafter the
target often agrees with: greedy output is the target's own, token for token, with paths
accepted several nodes deep and off the spine (the drafter's greedy chain); sampling keeps
the target's distribution; logprobs are the target's; settings trees cannot honour are
refused at start-up naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_runs import REPO, generate, metrics_of, preempt_and_abort, preemption_prompts

PAIR = REPO / "models" / "tiny-pair"
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,",
           "for i in range(10):", "The capital of France is"]


def tree_spec(method: str = "ddtree", drafter: str = "drafter", **options: object) -> dict:
    return {"method": method, "model": str(PAIR / drafter), "speculator_options": options}


@pytest.fixture(scope="module")
def target_alone() -> dict:
    return generate(str(PAIR / "target"), prompts=PROMPTS, max_tokens=40)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "drafter", "budget", "max_num_seqs"), [
    ("ddtree", "drafter", 16, 8), ("ddtree", "drafter", 64, 2),
    ("jetspec", "jetspec-drafter", 64, 8), ("best_first", "jetspec-drafter", 64, 8)])
def test_greedy_is_lossless_with_deep_off_spine_paths(target_alone: dict, method: str,
                                                      drafter: str, budget: int,
                                                      max_num_seqs: int) -> None:
    # "best_first": the JetSpec head with DDTree's build (JetSpec's is its default).
    spec = (tree_spec("ddtree", drafter, tree_budget=budget, tree_build="best_first")
            if method == "best_first" else tree_spec(method, drafter, tree_budget=budget))
    run = generate(str(PAIR / "target"), spec=spec, prompts=PROMPTS, max_tokens=40,
                   max_num_seqs=max_num_seqs)
    assert run["tokens"] == target_alone["tokens"]
    trees = run["trees"]
    # Paths 3+ nodes deep, and paths through a node off the spine (a node whose index
    # exceeds its depth): verification walked the tree, not just the chain.
    assert trees["longest_accepted"] >= 3 and trees["paths_off_the_index_line"] > 0, trees
    assert run["draft_tokens"] == budget * run["drafts"], run
    assert run["accepted"] / run["drafts"] > 1.0, run  # mean acceptance length > 2
    assert (run["interpreted"], run["fallbacks"]) == ([], 0)


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution() -> None:
    """Temperature 1: the 2nd and 3rd generated tokens (the first drafted ones) are
    distributed as without speculation (chi-square p > 0.001, fixed seeds)."""
    from engine_helpers import chi_square_p_value

    n, model = 1500, str(PAIR / "target")
    common = dict(prompts=["def main():"] * n, max_tokens=3, max_num_seqs=64,
                  temperature=1.0, seeds=[1000 + i for i in range(n)])
    plain = generate(model, **common)["tokens"]
    run = generate(model, spec=tree_spec(tree_budget=16), **common)
    assert run["trees"]["verified_rows"] > 0 and all(len(t) == 3 for t in run["tokens"])
    assert run["trees"]["paths_off_the_index_line"] > 0, run["trees"]
    for position in (1, 2):
        p = chi_square_p_value([t[position] for t in plain],
                               [t[position] for t in run["tokens"]])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"


@pytest.mark.slow
def test_logprobs_are_the_targets_own() -> None:
    from vllm import LLM, SamplingParams

    def run(spec: dict | None) -> list:
        llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
                  dtype="float32", max_num_seqs=8, speculative_config=spec)
        # Top 3 for some requests, chosen token ids for the others.
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                 **(dict(logprobs=3) if i % 2 else
                                    dict(logprob_token_ids=[5, 17, 202])))
                  for i in range(len(PROMPTS))]
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    plain, trees = run(None), run(tree_spec(tree_budget=16))
    for a, b in zip(plain, trees):
        assert list(a.token_ids) == list(b.token_ids)
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            for token, lp in step_a.items():
                assert step_b[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
                assert step_b[token].rank == lp.rank


@pytest.mark.slow
def test_trace_replay_emits_the_trace_with_the_targets_logprobs(target_alone: dict) -> None:
    """--enable-trace-replay: a request's trace_decode_token_ids are emitted in place of the
    target's choices, each with the target's logprob, then the target's own tokens, as
    without speculation. The traces are the target's greedy continuations with two tokens
    changed: trees are accepted deep along them, and cut where they turn."""
    from engine_runs import tree_stats
    from vllm import LLM, SamplingParams

    traces = []
    for tokens in target_alone["tokens"]:
        trace = list(tokens[:30])
        for at in (9, 20):
            trace[at] = 5 if trace[at] != 5 else 6
        traces.append(trace)

    def run(spec: dict | None) -> tuple[list, object]:
        llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
                  dtype="float32", max_num_seqs=8, speculative_config=spec,
                  enable_trace_replay=True)
        params = [SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True, logprobs=0,
                                 trace_decode_token_ids=trace) for trace in traces]
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm

    (plain, _), (trees, llm) = run(None), run(tree_spec(tree_budget=16))
    for a, b, trace in zip(plain, trees, traces):
        assert list(b.token_ids[:30]) == trace
        assert list(a.token_ids) == list(b.token_ids)
        for token, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert step_b[token].logprob == pytest.approx(step_a[token].logprob, abs=1e-4)
    assert tree_stats(llm)["longest_accepted"] >= 3


@pytest.mark.parametrize(("spec", "named"), [
    (dict(tree_spec(tree_budget=0)), "tree_budget"),
    (dict(tree_spec(tree_budget=16, tree_size=3)), "speculator_options.tree_size"),
    (dict(tree_spec(tree_budget=16, adaptive="yes")), "speculator_options.adaptive"),
    (dict(tree_spec(tree_budget=16), rejection_sample_method="block"),
     "rejection_sample_method"),
    (dict(tree_spec(tree_budget=16), draft_sample_method="probabilistic"),
     "draft_sample_method"),
    (dict(tree_spec("jetspec", tree_build="best_first")), "tree_build"),
    (dict(tree_spec(tree_budget=16), num_speculative_tokens=9), "num_speculative_tokens"),
    (dict(tree_spec(tree_budget=16, tree_depth=5)), "speculator_options.tree_depth"),
    ({"method": "ddtree", "model": str(PAIR / "target")}, "model"),
])
def test_settings_trees_cannot_honour_are_refused_by_name(spec: dict, named: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(PAIR / "target"), max_model_len=512, speculative_config=spec)
    with pytest.raises(Exception, match=named.replace(".", r"\.")):
        args.create_engine_config()


@pytest.mark.parametrize(("fields", "other"), [
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.0},
     "rejection_sample_method"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, 16], [5, 256, 4]]},
     "num_speculative_tokens_per_batch_size"),
])
@pytest.mark.parametrize("method", ["ddtree", "jetspec"])
def test_settings_adaptive_trees_cannot_honour_are_refused_naming_both(
        method: str, fields: dict, other: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    spec = tree_spec(method, tree_budget=16) | {"enable_adaptive_verification": True}
    args = EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                      speculative_config=spec | fields)
    with pytest.raises(ValueError) as refused:
        args.create_engine_config()
    assert "enable_adaptive_verification" in str(refused.value)
    assert other in str(refused.value)
    # Each alone is set up.
    EngineArgs(model=str(PAIR / "target"), max_model_len=512,
               speculative_config=tree_spec(method, tree_budget=16) | fields
               ).create_engine_config()


@pytest.mark.parametrize(("engine", "named"), [
    (dict(logprobs_mode="processed_logprobs"), "logprobs_mode"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2),
     "decode_context_parallel_size"),
    (dict(enable_batch_sharded_sampling=True), "enable_batch_sharded_sampling"),
    (dict(logits_processors=["vllm.v1.sample.logits_processor.MinPLogitsProcessor"]),
     "logits_processors"),
])
def test_engine_settings_trees_cannot_honour_are_refused_by_name(engine: dict,
                                                                 named: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                      speculative_config=tree_spec(tree_budget=16), **engine)
    with pytest.raises(Exception, match=named):
        args.create_engine_config()


def test_the_resolved_options_are_in_the_config(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                        speculative_config=tree_spec(tree_budget=32)).create_engine_config()
    spec = config.speculative_config
    assert (spec.method, spec.custom_method, spec.num_speculative_tokens) == (
        "dflash", "ddtree", 32)
    assert spec.speculator_options == {"tree_budget": 32, "tree_depth": 7, "tree_spine": True,
                                       "tree_build": "best_first", "tree_width": None,
                                       "adaptive": False}
    # num_speculative_tokens is the depth, then tree_budget for vLLM; a re-validation of
    # the resolved config (vLLM re-runs it on copies) keeps both.
    config = EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                        speculative_config=tree_spec(tree_budget=32) | {
                            "num_speculative_tokens": 5}).create_engine_config()
    spec = config.speculative_config
    assert (spec.num_speculative_tokens, spec.speculator_options["tree_depth"]) == (32, 5)
    spec.__post_init__()
    assert (spec.num_speculative_tokens, spec.speculator_options["tree_depth"]) == (32, 5)
    # Adaptive trees: ddtree's own sizing, resolved into the options (vLLM's chain sizing,
    # and its backends' checks for it, stay off), kept on re-validation.
    config = EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                        speculative_config=tree_spec(tree_budget=32) | {
                            "enable_adaptive_verification": True}).create_engine_config()
    spec = config.speculative_config
    assert spec.speculator_options["adaptive"] and not spec.enable_adaptive_verification
    spec.__post_init__()
    assert spec.speculator_options["adaptive"]


def run_llm(spec: dict | None, params: list) -> tuple[list, dict | None]:
    from engine_runs import tree_stats
    from vllm import LLM

    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=8, speculative_config=spec)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0] for o in outputs], tree_stats(llm)


@pytest.mark.slow
def test_logits_processing_is_lossless() -> None:
    """Penalties and bad words (which vLLM applies counting the drafts before a row as
    history: such requests draft the greedy chain; as trees, the frequency-penalized
    request's output changes), allowed_token_ids and min_tokens with stop tokens the target
    would choose 4th to 6th (applied at tree nodes, min_tokens by the node's depth): output
    equals the target alone's with the same parameters, and the trees of the requests
    without penalties accept off the spine."""
    from vllm import SamplingParams

    plain = generate(str(PAIR / "target"), prompts=PROMPTS, max_tokens=40)["tokens"]
    extra = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.4),
             dict(frequency_penalty=1.0), dict(bad_words=[" the", " a"]),
             dict(min_tokens=8, stop_token_ids=plain[4][3:6]),
             dict(allowed_token_ids=list(range(0, 1024, 3)))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **extra[i])
              for i in range(len(PROMPTS))]
    alone, _ = run_llm(None, params)
    trees, stats = run_llm(tree_spec(tree_budget=16), params)
    assert [list(o.token_ids) for o in trees] == [list(o.token_ids) for o in alone]
    # The parameters change the output; the stop tokens wait for min_tokens.
    assert sum(list(o.token_ids) != t for o, t in zip(alone, plain)) >= 3
    assert not set(plain[4][3:6]) & set(alone[4].token_ids[:8])
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_structured_output_is_lossless() -> None:
    """Regex and JSON-schema requests batched with plain ones, verified as trees (the
    scheduler masks each node along its tree: grammar_tree.py; the oracle-drafted cases
    are tests/engine/test_structured_trees.py): output equals the target alone's and the
    regex is matched."""
    import re

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    regex = r"[a-z]+( [a-z]+)*"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constraints = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(json=schema),
                   None]
    params = [SamplingParams(temperature=0.0, max_tokens=24,
                             structured_outputs=constraints[i % 3])
              for i in range(len(PROMPTS))]
    alone, _ = run_llm(None, params)
    trees, stats = run_llm(tree_spec(tree_budget=16), params)
    assert [list(o.token_ids) for o in trees] == [list(o.token_ids) for o in alone]
    for o in trees[0::3]:
        assert re.fullmatch(regex, o.text), o.text
    assert stats["verified_rows"] > 0 and stats["longest_accepted"] >= 2, stats


@pytest.mark.slow
def test_synthetic_acceptance_gives_the_requested_per_depth_rates() -> None:
    """Benchmarking mode: per-depth rates [1, 1, 0.5] (and 0 below) at depth 7: every
    verify step accepts 2 or 3 drafts, a fair coin between them; the paths are drawn among
    the tree's nodes, off the spine too."""
    spec = tree_spec(tree_budget=16) | {"rejection_sample_method": "synthetic",
                                        "synthetic_acceptance_rates": [1, 1, 0.5, 0, 0, 0, 0]}
    run = generate(str(PAIR / "target"), spec=spec, prompts=PROMPTS, max_tokens=64)
    n, accepted = run["drafts"], run["accepted"]
    assert n >= 100 and run["trees"]["longest_accepted"] == 3, run
    assert run["trees"]["paths_off_the_index_line"] > 0, run["trees"]
    # accepted = 2n + Binomial(n, 0.5): within 4 standard deviations (0.5 sqrt(n)).
    assert abs(accepted - 2.5 * n) <= 4 * 0.5 * n ** 0.5, (accepted, n)


def test_synthetic_rates_are_per_depth_and_vllm_sees_them_padded() -> None:
    from vllm.engine.arg_utils import EngineArgs

    spec = tree_spec(tree_budget=16) | {"rejection_sample_method": "synthetic",
                                        "synthetic_acceptance_length": 2.5}
    config = EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                        speculative_config=spec).create_engine_config().speculative_config
    assert len(config.synthetic_acceptance_rates) == 16
    assert sum(config.synthetic_acceptance_rates) == pytest.approx(1.5)
    assert not any(config.synthetic_acceptance_rates[7:])
    bad = tree_spec(tree_budget=16) | {"rejection_sample_method": "synthetic",
                                       "synthetic_acceptance_rates": [0.5] * 9}
    with pytest.raises(Exception, match="synthetic_acceptance_rates.*tree_depth = 7"):
        EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                   speculative_config=bad).create_engine_config()


@pytest.mark.slow
def test_tensor_parallel_2_is_lossless_and_the_ranks_agree() -> None:
    """The target and the drafter sharded over two ranks (worker processes, which load the
    plugin by entry point; Ray actors: tests/engine/test_ray.py): greedy output is the
    target's own (the target alone over the same executor), with paths accepted 3+ nodes
    deep and off the spine on both ranks; at temperature 1 both ranks take the same verdict
    (accepted path, its length, the emitted tokens) at every verify step, so both compact
    the same KV entries, and some paths are accepted. Adaptive trees too: with the same
    costs and the same verdicts both ranks size every step alike (their whole adaptive
    stats equal)."""
    from tensor_parallel import run_tp2
    from test_adaptive_trees import adaptive_spec

    spec = tree_spec(tree_budget=16)
    alone = run_tp2("mp", PAIR, None, PROMPTS, 40)
    trees = run_tp2("mp", PAIR, spec, PROMPTS, 40, sample=True)
    sized = run_tp2("mp", PAIR, adaptive_spec(cap=16), PROMPTS, 40, sample=True,
                    costs=[0.01, 0.05])
    for run in (trees, sized):
        assert run["greedy"] == alone["greedy"]
        rank0, rank1 = run["stats"]
        assert rank0 == rank1 and rank0["longest_accepted"] >= 3, run["stats"]
        verdicts0, verdicts1 = run["verdicts"]
        assert len(verdicts0) > 3 and verdicts0 == verdicts1
    assert trees["stats"][0]["paths_off_the_index_line"] > 0, trees["stats"]
    assert any(n > 0 for _, accepted, _ in trees["verdicts"][0] for n in accepted)
    chosen = sized["stats"][0]["adaptive"]
    assert 0 < chosen["min_nodes"] < chosen["max_nodes"], chosen


# The port's code that runs inside the decode step (on a GPU: inside or between graphs).
STEP_FILES = ("spec_decode/speculator.py", "spec_decode/verifier.py",
              "spec_decode/rejection_sampler.py", "spec_decode/tree_store.py",
              "spec_decode/model_state.py", "spec_decode/accepted_path.py",
              "spec_decode/node_sampling.py", "synthetic.py", "ops.py", "tree.py",
              "attention/tree_batch.py")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "cuda-on-interpreter", "cpu-adaptive",
                                     "cpu-hybrid"])
def test_the_step_never_waits_for_the_device(monkeypatch: pytest.MonkeyPatch,
                                             request: pytest.FixtureRequest,
                                             backend: str) -> None:
    """A host sync (.item(), .tolist(), .cpu(), a tensor's truth value, a boolean-mask
    index: a data-dependent shape) inside the step stalls the GPU and breaks CUDA-graph
    capture. Every such call made from the port's step files, with greedy and sampled
    requests, logprobs, chains for penalties and bad words, min_tokens and
    allowed_token_ids, is recorded: there must be none (the CPU attention backend's own
    planning is host work by design, and not among them). With TREE_ATTN's CUDA backend
    (its kernel on the interpreter) the backend's build, forward and KV compaction too;
    with adaptive trees (fixed costs that size them step by step) the sizing's device work:
    the calibration's counts and the trees' scores (its host side reads host copies); on a
    hybrid target (the tiny Qwen3-Next, prefix caching on) the GDN tree path's forest, stash
    and commit (gdn_verify.py; its CPU kernels' planning is host work by design, its Triton
    kernels' capture is tests/recurrent/test_gdn_graph_replay.py's)."""
    import sys

    import torch
    from engine_helpers import _bool_index
    from vllm import LLM, SamplingParams

    pkg = str(REPO / "vllm_ddtree") + "/"
    calls: list[str] = []
    step_files = STEP_FILES
    if backend == "cuda-on-interpreter":
        request.getfixturevalue("cuda_tree_attn_on_cpu")
        step_files += ("attention/backend.py", "attention/triton_tree_attention.py")
    spec = tree_spec(tree_budget=16)
    if backend == "cpu-adaptive":
        step_files += tuple(f"spec_decode/adaptive/{f}.py"
                            for f in ("sizing", "calibration", "costs"))
        spec["enable_adaptive_verification"] = True

    def record(name: str, original, check=None):  # noqa: ANN001, ANN202
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            caller = sys._getframe(1).f_code
            where = caller.co_filename.removeprefix(pkg)
            if where in step_files and (check is None or check(*args)) and (
                    caller.co_name != "_host_seq_lens"):  # a host tensor by contract
                calls.append(f"{name} in {where}:{caller.co_name}")
            return original(self, *args, **kwargs)
        return wrapper

    pair, dtype = PAIR, "float32"
    if backend == "cpu-hybrid":
        pair, dtype = request.getfixturevalue("tiny_hybrid"), "bfloat16"
        spec["model"] = str(pair / "drafter")
        step_files += ("recurrent/gdn_verify.py",)
    llm = LLM(model=str(pair / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype=dtype, max_num_seqs=8, speculative_config=spec)
    if backend == "cpu-adaptive":
        from engine_helpers import fixed_step_costs, use_step_costs

        sizing = use_step_costs(llm.llm_engine.engine_core.engine_core.model_executor
                                .driver_worker.worker.model_runner,
                                fixed_step_costs(per_token_ms=0.01, draft_ms=0.05))
    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__",
                 "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, record(name, getattr(torch.Tensor, name)))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, record(
            f"boolean-mask {name}", getattr(torch.Tensor, name),
            lambda index, *_: _bool_index(index)))
    sampled = dict(temperature=0.8, seed=1, logprobs=2)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **kw) for kw in [
        dict(temperature=0.0, logprobs=1), sampled,
        dict(temperature=0.0, min_tokens=6, stop_token_ids=[5]),
        dict(temperature=0.0, allowed_token_ids=list(range(0, 1024, 3))),
        dict(temperature=0.0, presence_penalty=0.5, bad_words=["the"]),
        dict(temperature=0.0)]]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 6 for o in outputs)
    assert calls == [], sorted(set(calls))
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    if backend == "cuda-on-interpreter":
        from vllm_ddtree.attention.backend import TreeAttentionImpl

        assert any(isinstance(getattr(m, "impl", None), TreeAttentionImpl)
                   for m in runner.model.modules())
    verifier = runner.speculator.verifier
    assert verifier.stats()["verified_rows"] > 0  # the read-out syncs, outside the step
    if backend == "cpu-hybrid":
        assert verifier.gdn.commits > 0
    read_out = ["__int__ in spec_decode/verifier.py:stats"] * 2
    if backend == "cpu-adaptive":
        assert sizing.counters["min_nodes"] < sizing.counters["max_nodes"]
        read_out += ["__float__ in spec_decode/adaptive/sizing.py:stats"] * 2
    assert calls == read_out, calls


@pytest.mark.slow
def test_chunked_prefill_preemption_and_aborts_stay_lossless() -> None:
    """Requests of different lengths finishing at different steps, long prompts prefilled in
    chunks next to verify steps, prefix caching on, preemption under a tiny KV cache (a
    preempted request is re-added and prefilled again, then drafts anew), and requests
    aborted mid-stream; then a batch in the freed request slots."""
    prompts = preemption_prompts(12)
    prompts += [prompts[0] + " and more", prompts[1] + " again"]  # shared prefixes
    llm, _ = preempt_and_abort(str(PAIR / "target"), tree_spec(tree_budget=12), prompts,
                               later=4)
    assert metrics_of(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_async_scheduling_is_lossless(target_alone: dict,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU platform turns async scheduling off, but on a GPU it is on by default (the
    scheduler then schedules a step before the last one's tokens are on the host): turned
    back on, trees are still accepted deep and off the spine, and output is the target's."""
    from engine_runs import tree_stats
    from vllm import LLM, SamplingParams
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async(cls, vllm_config) -> None:  # noqa: ANN001
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))
    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=8, speculative_config=tree_spec(tree_budget=16))
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == target_alone["tokens"]
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("busy", [4, 0])
def test_dynamic_speculative_decoding_cuts_trees_losslessly(busy: int) -> None:
    """vLLM's num_speculative_tokens_per_batch_size picks the nodes verified per batch size:
    16 for up to 5 scheduled requests, ``busy`` (4, a prefix of the tree, or no drafts) for
    6-8. Requests of different lengths: the batch shrinks from 8 to 1 as they finish."""
    from vllm import SamplingParams

    prompts = PROMPTS + ["class Stack:", "while True:"]
    lengths = [40 - (5 * i) % 13 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    spec = tree_spec(tree_budget=16) | {
        "num_speculative_tokens_per_batch_size": [(1, 5, 16), (6, 8, busy)]}
    from engine_runs import tree_stats
    from vllm import LLM

    def run(spec: dict | None) -> tuple[list, object]:
        llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
                  dtype="float32", max_num_seqs=8, disable_log_stats=False,
                  speculative_config=spec)
        return [list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, params, use_tqdm=False)], llm

    alone, _ = run(None)
    trees, llm = run(spec)
    assert trees == alone
    assert tree_stats(llm)["longest_accepted"] >= 3
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts, nodes = (metrics[f"vllm:spec_decode_num_{k}"] for k in ("drafts", "draft_tokens"))
    big, rest = divmod(nodes - busy * drafts, 16 - busy)  # nodes = 16 big + busy (drafts - big)
    assert rest == 0 and 0 < big <= drafts and (big < drafts) == (busy > 0), (nodes, drafts)


def test_a_quantized_kv_cache_is_refused_at_start_up() -> None:
    from vllm import LLM

    with pytest.raises(Exception, match="cache_dtype"):
        LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512,
            dtype="bfloat16", kv_cache_dtype="fp8", speculative_config=tree_spec())
