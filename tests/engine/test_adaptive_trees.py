"""Adaptive trees (enable_adaptive_verification; vllm_ddtree/spec_decode/adaptive/) in V2's
engine on CPU with the trained tiny pair: every step verifies a prefix of each request's
tree, sized across requests by the measured costs and the calibrated acceptance, or
nothing, with the drafter paused and probing; through every change of size, pause and
resume, greedy output is the target's own, token for token, with paths accepted deep and
off the spine; sampling keeps the target's distribution.

The costs a test needs are set on the engine (``use_costs``): measured ones would make
this CPU choose whatever it finds fastest, which may be no tree at all."""

from __future__ import annotations

import pytest
from engine_runs import REPO, preempt_and_abort, preemption_prompts, tree_stats

PAIR = REPO / "models" / "tiny-pair"
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,",
           "for i in range(10):", "The capital of France is", "while True:", "# sort a list"]


def adaptive_spec(drafter: str = "drafter", cap: int = 64, **fields: object) -> dict:
    return {"method": "ddtree", "model": str(PAIR / drafter), "tree_budget": cap,
            "enable_adaptive_verification": True, **fields}


def costs(per_token_ms: float, draft_ms: float):
    from engine_helpers import fixed_step_costs

    return fixed_step_costs(per_token_ms, draft_ms)


def sizing_of(llm: object):
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    return runner.adaptive_verification


def use_costs(llm: object, step_costs: object) -> object:
    """The engine's sizing reads ``step_costs``, not measured ones, from now on."""
    from engine_helpers import use_step_costs

    return use_step_costs(llm.llm_engine.engine_core.engine_core.model_executor
                          .driver_worker.worker.model_runner, step_costs)


def target_alone(prompts: list[str], max_tokens: int = 40) -> dict[str, list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {o.prompt: list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, params, use_tqdm=False)}


def adaptive_engine(spec: dict, max_num_seqs: int) -> object:
    from vllm import LLM

    return LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
               dtype="float32", max_num_seqs=max_num_seqs, disable_log_stats=False,
               speculative_config=spec)


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    return target_alone(PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize(("drafter", "max_num_seqs"), [
    ("drafter", 1), ("drafter", 8), ("jetspec-drafter", 8)])
def test_sized_trees_are_lossless_deep_and_off_the_spine(alone: dict, drafter: str,
                                                         max_num_seqs: int) -> None:
    """A verify token costs 0.2% of a step: trees are cut to what pays, request by request,
    and their sizes vary with the drafter's confidence."""
    from vllm import SamplingParams

    llm = adaptive_engine(adaptive_spec(drafter), max_num_seqs)
    sizing = use_costs(llm, costs(per_token_ms=0.01, draft_ms=0.05))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == alone
    stats, chosen = tree_stats(llm), sizing.stats()
    assert stats["longest_accepted"] >= 3, stats
    assert chosen["paths_off_the_greedy_chain"] > 0, chosen
    assert 0 < chosen["min_nodes"] < chosen["max_nodes"] < 64 * max_num_seqs, chosen
    assert chosen["realized"] > 0


@pytest.mark.slow
def test_a_paused_drafter_resumes_with_its_context_right(alone: dict) -> None:
    """Drafting pays, then costs 100 ms a step (the drafter pauses, and a probe would cost
    about 20 paused steps: none comes while it does), then pays again (the next look at
    the curves, at most a back-off later, probes and drafting resumes): output stays the
    target's, and after the pause trees are accepted as deep as before it (DFlash's
    context was stored through the pause)."""
    from engine_helpers import pause_and_resume
    from vllm import SamplingParams

    llm = adaptive_engine(adaptive_spec(), 8)
    paying = costs(per_token_ms=0.01, draft_ms=0.05)
    sizing = use_costs(llm, paying)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    done, before, paused = pause_and_resume(llm, sizing, PROMPTS, params, 8, 24, paying,
                                            costs(per_token_ms=0.01, draft_ms=100.0))
    after = sizing.stats()
    assert done == {p: t[:60] for p, t in target_alone(PROMPTS, 60).items()}
    assert paused["paused_steps"] >= 10 and paused["probes"] == before["probes"], paused
    # While paused, a step verifies drafts only after a probe (and the first, which
    # decided to pause).
    assert paused["steps"] - before["steps"] <= 1
    assert after["probes"] > paused["probes"], after
    resumed = after["steps"] - paused["steps"]
    accepted = after["realized"] - paused["realized"]
    assert resumed > 0 and accepted / resumed >= 0.8 * before["realized"] / before["steps"]


@pytest.mark.slow
def test_chunked_prefill_preemption_and_aborts_stay_lossless() -> None:
    """The preempt-and-abort scenario (engine_runs.preempt_and_abort) with adaptive trees
    whose sizes vary step by step."""
    prompts = preemption_prompts(12)
    llm, sizing = preempt_and_abort(
        str(PAIR / "target"), adaptive_spec(cap=12), prompts, later=4,
        started=lambda llm: use_costs(llm, costs(per_token_ms=0.01, draft_ms=0.05)))
    chosen = sizing.stats()
    assert chosen["realized"] > 0 and chosen["min_nodes"] < chosen["max_nodes"], chosen


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution() -> None:
    """Temperature 1, trees sized adaptively: the 2nd and 3rd generated tokens are
    distributed as without speculation (chi-square p > 0.001, fixed seeds)."""
    from engine_helpers import chi_square_p_value
    from engine_runs import generate
    from vllm import SamplingParams

    n = 600
    prompts, seeds = ["def main():"] * n, [1000 + i for i in range(n)]
    plain = generate(str(PAIR / "target"), prompts=prompts, max_tokens=3, max_num_seqs=64,
                     temperature=1.0, seeds=seeds)["tokens"]
    from vllm import LLM

    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=64, speculative_config=adaptive_spec(cap=16))
    sizing = use_costs(llm, costs(per_token_ms=0.001, draft_ms=0.05))
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s)
              for s in seeds]
    run = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                use_tqdm=False)]
    chosen = sizing.stats()
    assert chosen["realized"] > 0 and chosen["paths_off_the_greedy_chain"] > 0, chosen
    for position in (1, 2):
        p = chi_square_p_value([t[position] for t in plain], [t[position] for t in run])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"


@pytest.mark.slow
def test_measured_costs_are_profiled_then_kept_current() -> None:
    """Without set costs: the first verify step profiles the step (1, 2, 4, ... tokens,
    drafting and paused), served steps update the curves, and the choice is logged."""
    from vllm import SamplingParams

    llm = adaptive_engine(adaptive_spec(cap=16), 4)
    llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=24,
                                             ignore_eos=True), use_tqdm=False)
    measured = sizing_of(llm).stats()["costs"]
    sizes = [n for n, _ in measured["verify_ms_by_tokens"]]
    assert {1, 2, 4} <= set(sizes) and all(ms > 0 for _, ms in measured["verify_ms_by_tokens"])
    assert measured["draft_ms_by_requests"] and measured["paused_draft_ms_by_requests"]
    # Only served steps measure the rest of a step's period (drafting, or paused where
    # drafting lost: a probe may then come only after this short run).
    assert any(ms is not None for ms in measured["rest_ms"].values()), measured


@pytest.mark.slow
def test_processed_and_structured_requests_are_cut_losslessly() -> None:
    """Requests that draft chains (penalties, bad words: vLLM's processing) batched with
    structured ones (a regex, a JSON schema: trees, masked along them) and plain, min_tokens
    and allowed_token_ids ones: chains and trees are cut to prefixes, and output equals the
    target alone's with the same parameters."""
    import re

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    regex = r"[a-z]+( [a-z]+)*"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8),
             dict(bad_words=[" the", " a"]), dict(min_tokens=8),
             dict(allowed_token_ids=list(range(0, 1024, 3))),
             dict(structured_outputs=StructuredOutputsParams(regex=regex)),
             dict(structured_outputs=StructuredOutputsParams(json=schema)), {}]
    params = [SamplingParams(temperature=0.0, max_tokens=32, **kw) for kw in extra]
    alone = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
                dtype="float32", max_num_seqs=8).generate(PROMPTS, params, use_tqdm=False)
    llm = adaptive_engine(adaptive_spec(), 8)
    sizing = use_costs(llm, costs(per_token_ms=0.01, draft_ms=0.05))
    cut = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in cut] == [
        list(o.outputs[0].token_ids) for o in alone]
    assert re.fullmatch(regex, cut[5].outputs[0].text), cut[5].outputs[0].text
    chosen = sizing.stats()
    assert chosen["realized"] > 0 and chosen["min_nodes"] < chosen["max_nodes"], chosen


@pytest.mark.slow
def test_a_paused_drafter_drafts_as_one_that_never_paused(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """While paused, the drafter stores each committed token's context itself (from the
    runner's slot mappings, DFlash's input preparation skipped): after the pause it drafts,
    at every position, what a drafter that never paused drafts there (its greedy chain per
    depth; float32, one request), so the context it stored is DFlash's own."""
    import gc

    from vllm import SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    drafted: dict[int, tuple] = {}
    generate_draft = DDTreeSpeculator._generate_draft

    def recording(self, num_reqs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        generate_draft(self, num_reqs, *args, **kwargs)
        if num_reqs == 1:  # the root's position: the first sample's, less one
            drafted[int(self.sample_pos[0]) - 1] = tuple(self._greedy.tolist())

    def greedy_of(self, hidden_states):  # noqa: ANN001, ANN202
        logits = self.model.compute_logits(hidden_states)
        self._greedy = logits.argmax(dim=-1)
        return logits

    monkeypatch.setattr(DDTreeSpeculator, "_generate_draft", recording)
    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", greedy_of)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = []
    for pause in (False, True):
        drafted.clear()
        cleanup_dist_env_and_memory()  # the engine before, in this process
        llm = adaptive_engine(adaptive_spec(cap=16), 1)
        sizing = use_costs(llm, costs(per_token_ms=0.01, draft_ms=0.05))
        engine = llm.llm_engine
        engine.add_request("r", PROMPTS[0], params)
        for step in range(200):
            if not engine.has_unfinished_requests():
                break
            if pause and step in (4, 20):  # paused in between, then drafting again
                sizing.timer.costs = costs(per_token_ms=0.01,
                                           draft_ms=100.0 if step == 4 else 0.05)
            engine.step()
        runs.append(dict(drafted))
        if pause:
            assert sizing.stats()["paused_steps"] >= 8
        del llm, engine, sizing  # shut down before the next engine starts in this process
        gc.collect()
    never, paused = runs
    resumed = [p for p in paused if p in never and p > min(never) + 20]
    assert len(resumed) >= 5, (sorted(never), sorted(paused))
    same = sum(never[p] == paused[p] for p in resumed)
    assert same >= 0.9 * len(resumed), [(p, never[p], paused[p]) for p in resumed]
