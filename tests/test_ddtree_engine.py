"""Method "ddtree" end to end on CPU with the tiny pair: greedy output is the target's own,
token for token, across budgets, spine on/off and concurrency; and with a drafter that
often guesses right, deep and off-chain acceptance happens and output stays lossless."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import (
    _bool_index,
    chi_square_p_value,
    imperfect_logits,
    other_target_pair,
    random_lora,
    windowed_pair,
)

PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(16)] + [
    f"The {w} of the {v} is" for w in ("name", "size", "end", "start", "type", "value",
                                        "first", "last") for v in ("list", "file")]
MAX_TOKENS = 20


def generate(tiny_models: Path, spec: dict | None, max_num_seqs: int = 8,
             max_tokens: int = MAX_TOKENS, prompts: list[str] = PROMPTS,
             logprobs: int | None = None):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
              seed=0, dtype="float32", max_num_seqs=max_num_seqs, disable_log_stats=False,
              speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, llm


@pytest.fixture(params=["sync", "async"])
def scheduling(request, monkeypatch) -> str:
    """Both scheduling modes. vLLM's CPU platform turns async scheduling off ("not required
    on CPU"), but on a GPU it is on by default, for ddtree too (which runs as method dflash,
    which vLLM schedules asynchronously): turn it back on to run that path here."""
    if request.param == "async":
        from vllm.platforms.cpu import CpuPlatform

        original = CpuPlatform.check_and_update_config.__func__

        def keep_async(cls, vllm_config) -> None:
            original(cls, vllm_config)
            vllm_config.scheduler_config.async_scheduling = True

        monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))
    return request.param


def assert_scheduling(llm, scheduling: str) -> None:
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == (
        scheduling == "async")


def ddtree_state(llm):
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    return runner.drafter.ddtree_state


def attention_impls(llm, cls: type) -> list:
    """The target's attention implementations of class ``cls``."""
    return [m.impl for m in ddtree_state(llm).runner.model.modules()
            if isinstance(getattr(m, "impl", None), cls)]


_TARGET_ALONE: dict = {}


def target_alone(key: tuple, run):
    """What ``run()`` (the target alone, no speculation) returns for ``key``, run once per
    test process: tests compare speculation against it in both scheduling modes and in
    several tree configurations, and the target alone's output depends on neither."""
    if key not in _TARGET_ALONE:
        _TARGET_ALONE[key] = run()
    return _TARGET_ALONE[key]


@pytest.fixture(scope="module")
def prompt_ids(tiny_models: Path) -> dict[tuple, str]:
    """PROMPTS by their token ids, as the engine tokenizes them (the oracle drafter's key)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    return {tuple(tokenizer.encode(p)): p for p in PROMPTS}


@pytest.fixture(scope="module")
def baseline(tiny_models: Path) -> dict[str, list]:
    """The target alone (and vLLM's dflash chain), greedy: what ddtree must reproduce."""
    outputs, _ = generate(tiny_models, None, max_tokens=MAX_TOKENS + 16)
    plain = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    assert len(plain) == len(PROMPTS)
    return plain


@pytest.mark.slow
def test_dflash_chain_matches_the_target(tiny_models: Path, baseline) -> None:
    outputs, _ = generate(tiny_models, {"method": "dflash", "model": str(tiny_models / "drafter"),
                                        "num_speculative_tokens": 7})
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: t[:MAX_TOKENS] for p, t in baseline.items()}


SMOKE = (16, True, 8)  # the fast tier's engine test (scripts/test.sh -m "not slow")


@pytest.mark.parametrize("budget, spine, max_num_seqs", [
    pytest.param(*case, marks=() if case == SMOKE else pytest.mark.slow)
    for case in itertools.product([1, 4, 16, 64], [True, False], [1, 8])])
def test_greedy_is_lossless(tiny_models: Path, baseline, budget, spine, max_num_seqs) -> None:
    spec = {"method": "ddtree", "model": str(tiny_models / "drafter"), "tree_budget": budget,
            "tree_spine": spine}
    outputs, llm = generate(tiny_models, spec, max_num_seqs=max_num_seqs)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    assert got == {p: t[:MAX_TOKENS] for p, t in baseline.items()}
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    # Every draft is a tree node: the scheduler counts tree_budget per verify step.
    assert metrics["vllm:spec_decode_num_draft_tokens"] == (
        budget * metrics["vllm:spec_decode_num_drafts"])


def verify_steps(monkeypatch) -> list[list[tuple[int, bool, bool]]]:
    """Records every verify step the runner prepares: per request, its number of drafts,
    whether it has a stored tree, and whether it is verified as a tree (not a chain)."""
    from vllm_ddtree.runner import DDTreeState

    steps, prepare_step = [], DDTreeState.prepare_step

    def record(self, spec_decode_metadata, num_tokens):
        prepare_step(self, spec_decode_metadata, num_tokens)
        if spec_decode_metadata is not None:
            drafts = spec_decode_metadata.num_draft_tokens
            as_tree = self._row_info.np[len(drafts):2 * len(drafts)] >= 0
            steps.append([(n, rid in self.proposed_rows, bool(tree)) for rid, n, tree in zip(
                self.runner.input_batch.req_ids, drafts, as_tree)])

    monkeypatch.setattr(DDTreeState, "prepare_step", record)
    return steps


def oracle_draft_logits(baseline: dict[str, list], prompt_ids: dict[tuple, str], seed: int):
    """A drafter that knows the target's greedy continuation and shows it imperfectly: per
    depth the true token is ranked first (55%), second or third (30%), or missing (15%).
    The logits are made on the host and returned on the drafter's device (a GPU's too)."""
    produced: dict[str, int] = {}  # per request, tokens emitted so far (async scheduling)

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        state, depth = self.ddtree_state, self.depth
        batch = state.runner.input_batch
        rows = hidden_states.shape[0] // depth
        vocab = self.model.compute_logits(hidden_states[:1]).shape[-1]
        logits = torch.zeros(rows, depth, vocab)
        for r in range(rows):
            history = list(batch.token_ids_cpu[r, :batch.num_tokens_no_spec[r]])
            verdict = state.last_verdict
            if verdict is not None:
                emitted = verdict.output_tokens[r, :int(verdict.num_accepted[r]) + 1].tolist()
            else:
                emitted = [int(self._roots[r])]
            ids = next(i for i in prompt_ids if tuple(history[:len(i)]) == i)
            prompt, done = prompt_ids[ids], len(history) + len(emitted) - len(ids)
            if state.runner.use_async_scheduling:
                # The host's history lags and holds placeholders: count what each step
                # emitted instead; the sequence is then the prompt and the target's own
                # continuation (output is lossless: the tests check it).
                rid = batch.req_ids[r]
                done = produced[rid] = produced.get(rid, len(history) - len(ids)) + len(
                    emitted)
            seq = [*ids, *baseline[prompt][:done]]
            rng = np.random.default_rng([seed, len(seq), *seq[-3:]])
            logits[r] = imperfect_logits(baseline[prompt][done:done + depth], depth, vocab,
                                         rng)
        return logits.flatten(0, 1).to(hidden_states.device)

    return draft_logits


def oracle_for_target(pair: Path, monkeypatch, seed: int, prompts: list[str] = PROMPTS,
                      max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> dict:
    """The target of ``pair`` alone, greedy (16 tokens past ``max_tokens``, for the oracle's
    look-ahead), and the oracle drafter installed on its outputs, which are returned (each
    prompt's vLLM CompletionOutput, with ``logprobs`` if asked)."""
    from vllm_ddtree.runner import DDTreeProposer

    outputs, llm = generate(pair, None, max_tokens=max_tokens + 16, prompts=prompts,
                            logprobs=logprobs)
    target = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    prompt_ids = {tuple(llm.get_tokenizer().encode(p)): p for p in prompts}
    del llm
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(target, prompt_ids, seed=seed))
    return {o.prompt: o.outputs[0] for o in outputs}


@pytest.mark.slow
@pytest.mark.parametrize("spine", [True, False])
def test_trees_accept_deep_and_off_chain_losslessly(tiny_models: Path, baseline, prompt_ids,
                                                    monkeypatch, spine, scheduling) -> None:
    from vllm_ddtree.runner import DDTreeProposer

    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=1))
    spec = {"method": "ddtree", "model": str(tiny_models / "drafter"), "tree_budget": 16,
            "tree_spine": spine}
    outputs, llm = generate(tiny_models, spec)
    assert_scheduling(llm, scheduling)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    assert got == {p: t[:MAX_TOKENS] for p, t in baseline.items()}
    stats = ddtree_state(llm).stats()
    # The target attends through TREE_ATTN's CPU backend, chosen by the ddtree config.
    from vllm_ddtree.attention.cpu_backend import TreeAttentionCPUImpl

    model = ddtree_state(llm).runner.model
    assert {type(m.impl) for m in model.modules() if hasattr(m, "impl")
            and "drafter" not in type(m.impl).__module__} >= {TreeAttentionCPUImpl}
    assert stats["longest_accepted"] >= 3, stats
    if spine:  # the spine is nodes 1..depth: an accepted node off that line is off-chain
        assert stats["paths_off_the_index_line"] > 0, stats
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts, accepted = (metrics[f"vllm:spec_decode_num_{k}"] for k in ("drafts",
                                                                      "accepted_tokens"))
    assert accepted / drafts > 1.0, (accepted, drafts)  # mean acceptance length > 2


@pytest.mark.slow
def test_the_largest_budget_is_lossless(tiny_models: Path, baseline, monkeypatch) -> None:
    """tree_budget 1024, the most (top-1024 per depth, 33 mask words per node): verify steps
    of 1,025 tokens per request, trees accepted deep and off the chain, lossless."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    prompts = PROMPTS[:6]
    prompt_ids = {tuple(tokenizer.encode(p)): p for p in prompts}
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=3))
    steps = verify_steps(monkeypatch)
    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=2048,
              # Each request takes 1,025 tokens and its drafter's 7 slots of the input
              # budget: 4 fit in 4,128 (with DFlash's accounting of 1,024 drafter slots
              # each, only 2 did).
              seed=0, dtype="float32", max_num_seqs=4, max_num_batched_tokens=4128,
              disable_log_stats=False,
              speculative_config={"method": "ddtree", "tree_budget": 1024,
                                  "model": str(tiny_models / "drafter")})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = {o.prompt: list(o.outputs[0].token_ids)
           for o in llm.generate(prompts, params, use_tqdm=False)}
    assert got == {p: baseline[p][:MAX_TOKENS] for p in prompts}
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:spec_decode_num_draft_tokens"] == (
        1024 * metrics["vllm:spec_decode_num_drafts"])  # whole trees, none cut short
    trees_per_step = [sum(n == 1024 for n, *_ in step) for step in steps]
    assert max(trees_per_step) == 4, trees_per_step


@pytest.mark.slow
def test_drafting_goes_on_beside_a_request_near_max_model_len(tiny_models: Path, monkeypatch,
                                                              scheduling) -> None:
    """One request ends one token short of max_model_len (160), a short one does not, at
    budget 64 and depth 7. vLLM reserves num_speculative_tokens + 1 past the batch's
    longest sequence before drafting, for ddtree tree_budget + 1 = 65: the long request is
    within that of its limit from its prefill on, so nothing would be drafted for either.
    ddtree reserves the drafter's block (depth + 1) past the accepted path: both draft until
    the long request is within 2 x (depth + 1) of its limit, the short one again once the
    long one is done, and the drafter's queries stay inside max_model_len. Output equals
    the target alone's."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.runner import DDTreeProposer, DDTreeState

    max_len, depth = 160, 7
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models / "target"))
    long = tokenizer.encode(" ".join(f"item{i}" for i in range(60)))[:125]
    prompts = [{"prompt_token_ids": long},
               {"prompt_token_ids": tokenizer.encode(PROMPTS[1])}]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (max_len - 1 - len(long), 80)]  # the short one outlives the long one

    def run(spec: dict | None):
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, seed=0,
                  max_model_len=max_len, dtype="float32", max_num_seqs=2,
                  speculative_config=spec)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)], llm

    steps, prepare_step, propose = [], DDTreeState.prepare_step, DDTreeProposer.propose
    positions, set_inputs = [], DDTreeProposer.set_inputs_first_pass

    def record_step(self, spec_decode_metadata, num_tokens):
        prepare_step(self, spec_decode_metadata, num_tokens)
        steps.append({"requests": self.runner.input_batch.num_reqs, "drafted": False})

    def record_draft(self, *args, **kwargs):
        steps[-1]["drafted"] = True
        return propose(self, *args, **kwargs)

    def record_positions(self, *args, **kwargs):
        out = set_inputs(self, *args, **kwargs)
        positions.append(int(self.positions[:out[0]].max()))
        return out

    monkeypatch.setattr(DDTreeState, "prepare_step", record_step)
    monkeypatch.setattr(DDTreeProposer, "propose", record_draft)
    monkeypatch.setattr(DDTreeProposer, "set_inputs_first_pass", record_positions)
    got, llm = run({"method": "ddtree", "tree_budget": 64,
                    "model": str(tiny_models / "drafter")})
    assert_scheduling(llm, scheduling)
    assert ddtree_state(llm).depth == depth
    # Steps with both requests: drafted, but for the long one's last 2 x (depth + 1)
    # tokens (its accepted path, unknown on the host before drafting, may be depth deep);
    # the short one drafts again once the long one is done.
    both = [step["drafted"] for step in steps if step["requests"] == 2]
    paused = both.index(False)
    assert both[paused:] == [False] * (len(both) - paused), steps
    assert len(both) - paused <= 2 * (depth + 1) < paused, steps
    last = max(i for i, step in enumerate(steps) if step["requests"] == 2)
    assert steps[last + 1]["requests"] == 1 and steps[-1]["drafted"], steps
    assert max(positions) < max_len
    assert got == target_alone((tiny_models, "near max_model_len"), lambda: run(None)[0])


@pytest.mark.slow
@pytest.mark.parametrize("busy", [12, 4, 0])
def test_dynamic_speculative_decoding_cuts_trees_losslessly(
        tiny_models: Path, baseline, prompt_ids, monkeypatch, scheduling, busy) -> None:
    """vLLM's num_speculative_tokens_per_batch_size picks the tree's size per batch size:
    16 nodes for up to 5 scheduled requests, ``busy`` (12 or 4 nodes, or no drafts) for 6-8.
    Trees accepted deep and off the chain (the oracle drafter); output equals the target
    alone's, and the metrics count the nodes verified."""
    from vllm_ddtree import ops
    from vllm_ddtree.runner import DDTreeProposer

    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=5))
    steps, asked, propose = verify_steps(monkeypatch), [], DDTreeProposer.propose

    def record(self, num_speculative_tokens, *args, **kwargs):
        asked.append(num_speculative_tokens)
        return propose(self, num_speculative_tokens, *args, **kwargs)

    monkeypatch.setattr(DDTreeProposer, "propose", record)
    builds, build = [], ops.build_tree_from_logits
    monkeypatch.setattr(ops, "build_tree_from_logits",
                        lambda *args: builds.append(args[2]) or build(*args))
    spec = {"method": "ddtree", "model": str(tiny_models / "drafter"), "tree_budget": 16,
            "num_speculative_tokens_per_batch_size": [(1, 5, 16), (6, 8, busy)]}
    # Requests of different lengths: the batch shrinks from 8 to 1 as they finish.
    from vllm import LLM, SamplingParams

    lengths = [MAX_TOKENS - (5 * i) % 13 for i in range(len(PROMPTS))]
    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
              seed=0, dtype="float32", max_num_seqs=8, disable_log_stats=False,
              speculative_config=spec)
    builds.clear()  # start-up's warm-up builds one tree (vllm_ddtree/warmup.py)
    outputs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m,
                                                    ignore_eos=True) for m in lengths],
                           use_tqdm=False)
    assert_scheduling(llm, scheduling)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    assert got == {p: baseline[p][:m] for p, m in zip(PROMPTS, lengths)}
    assert set(asked) == {busy, 16}, sorted(set(asked))
    # A tree is built where more than the spine (7 nodes) is asked; else the greedy chain.
    assert builds == [16] * sum(k > 7 for k in asked)
    sizes = [n for step in steps for n, _, _ in step if n > 0]
    assert set(sizes) == ({busy, 16} if busy else {16}), sorted(set(sizes))
    # The spine is the first 7 nodes: trees cut to 4 are verified as the drafter's chain.
    assert {(n, tree) for step in steps for n, _, tree in step if n > 0} == (
        {(16, True)} | ({(busy, busy > 7)} if busy else set()))
    assert ddtree_state(llm).stats()["longest_accepted"] >= 3
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts, nodes = (metrics[f"vllm:spec_decode_num_{k}"] for k in ("drafts", "draft_tokens"))
    if scheduling == "sync":  # async also verifies steps of requests already finished
        assert nodes == sum(sizes)
    big, rest = divmod(nodes - busy * drafts, 16 - busy)  # nodes = 16 big + busy (drafts - big)
    assert rest == 0 and 0 < big <= drafts and (big < drafts) == (busy > 0), (nodes, drafts)


@pytest.mark.slow
def test_logprobs_are_the_targets_own(tiny_models: Path, baseline, prompt_ids, monkeypatch,
                                      scheduling) -> None:
    """Greedy, half the requests asking logprobs=3 (a quarter also prompt_logprobs=2), with
    trees accepted deep and off the chain (the oracle drafter): every emitted token's
    logprob, rank and top-3 equal those of the target alone (float32, within 1e-4), each
    taken at the node that chose the token; prompt logprobs equal too."""
    from vllm import LLM, SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    def run(spec: dict | None) -> list:
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                  seed=0, dtype="float32", max_num_seqs=8, speculative_config=spec)
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 logprobs=3 if i % 2 == 0 else None,
                                 prompt_logprobs=2 if i % 4 == 0 else None)
                  for i in range(len(PROMPTS))]
        return llm.generate(PROMPTS, params, use_tqdm=False), llm

    plain = target_alone((tiny_models, "logprobs"), lambda: run(None)[0])
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=3))
    tree, llm = run({"method": "ddtree", "model": str(tiny_models / "drafter"),
                     "tree_budget": 16})
    assert_scheduling(llm, scheduling)
    assert ddtree_state(llm).stats()["longest_accepted"] >= 3
    for i, (want_request, got_request) in enumerate(zip(plain, tree)):
        if i % 4 == 0:  # prompt logprobs come from the prefill, untouched by trees
            for w, g in zip(want_request.prompt_logprobs[1:], got_request.prompt_logprobs[1:]):
                assert set(g) == set(w)
                assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in w)
        else:
            assert got_request.prompt_logprobs is None
        want, got = want_request.outputs[0], got_request.outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        if i % 2:
            assert got.logprobs is None
            continue
        assert len(got.logprobs) == len(want.logprobs) == MAX_TOKENS
        for token, w, g in zip(want.token_ids, want.logprobs, got.logprobs):
            assert set(g) == set(w) and token in g
            for t in w:
                assert g[t].rank == w[t].rank
                assert abs(g[t].logprob - w[t].logprob) < 1e-4, (i, t, g[t], w[t])


@pytest.mark.slow
def test_logits_processing_is_lossless_and_n_is_served(tiny_models: Path, baseline, prompt_ids,
                                                       monkeypatch, scheduling) -> None:
    """Repetition / presence / frequency penalties, allowed_token_ids, min_tokens (with a
    stop token the target would choose 4th; with nearly every token a stop token) and
    bad_words (two tokens the target would choose 4th and 5th), with trees accepted deep and
    off the chain (the oracle drafter, shown these continuations): output equals the target
    alone's with the same parameters. n=2 (sampled) gives two completions (vLLM fans n
    out)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "target")

    def params(i: int, prompt: str) -> SamplingParams:
        want = baseline[prompt]
        extra = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.4),
                 dict(allowed_token_ids=list(range(0, 1024, 3))),
                 dict(n=2, temperature=0.8, seed=i),
                 dict(min_tokens=12, stop_token_ids=[want[3]]),
                 dict(min_tokens=8, stop_token_ids=list(range(64, 1024))),
                 dict(bad_words=[tokenizer.decode(want[3:5])])][i % 7]
        return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                 "ignore_eos": True} | extra)

    def run(spec: dict | None):
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                  seed=0, dtype="float32", max_num_seqs=8, speculative_config=spec)
        outputs = llm.generate(PROMPTS, [params(i, p) for i, p in enumerate(PROMPTS)],
                               use_tqdm=False)
        return {o.prompt: [list(c.token_ids) for c in o.outputs] for o in outputs}, llm

    plain = target_alone((tiny_models, "logits processing"), lambda: run(None)[0])
    compared = [p for i, p in enumerate(PROMPTS) if i % 7 != 3]
    # The parameters change the continuations (the oracle shows the changed ones).
    assert sum(plain[p][0] != baseline[p][:MAX_TOKENS] for p in compared) > len(compared) // 2
    for p in PROMPTS[4::7]:  # the stop token, the target's 4th choice, waits for min_tokens
        assert baseline[p][3] not in plain[p][0][:12] and len(plain[p][0]) >= 12
    # Many stop tokens: output stops right at min_tokens, inside a tree (its depth counts).
    assert sum(len(plain[p][0]) == 9 for p in PROMPTS[5::7]) >= 3
    assert sum(plain[p][0][:5] != baseline[p][:5] for p in PROMPTS[6::7]) >= 2  # bad words
    monkeypatch.setattr(DDTreeProposer, "draft_logits", oracle_draft_logits(
        {p: t[0] for p, t in plain.items()}, prompt_ids, seed=4))
    tree, llm = run({"method": "ddtree", "model": str(tiny_models / "drafter"),
                     "tree_budget": 16})
    assert_scheduling(llm, scheduling)
    assert {p: tree[p] for p in compared} == {p: plain[p] for p in compared}
    for p in PROMPTS[3::7]:
        assert [len(t) for t in tree[p]] == [MAX_TOKENS, MAX_TOKENS]
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("spine", [False, True])
@pytest.mark.parametrize("mixed", [True, False])
def test_structured_output_is_lossless(tiny_models: Path, prompt_ids, monkeypatch, mixed,
                                       spine, scheduling) -> None:
    """Regex and JSON-schema requests, alone or batched with plain ones, the oracle drafter
    shown the constrained continuations, without the spine (nodes in index order are no
    chain: the greedy chain is written in) and with it (nodes 1..depth are that chain):
    output equals the target alone's and the regex is matched. vLLM builds grammar masks
    for drafts in node order, as a chain, so structured requests are verified as chains:
    alone, no accepted path leaves the node-index line."""
    import re

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.runner import DDTreeProposer

    regex = r"[a-z]+( [a-z]+)*"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def params(i: int) -> SamplingParams:
        constraint = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(json=schema),
                      StructuredOutputsParams(regex=regex), None if mixed else
                      StructuredOutputsParams(json=schema)][i % 4]
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                              structured_outputs=constraint)

    def run(spec: dict | None):
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                  seed=0, dtype="float32", max_num_seqs=8, speculative_config=spec)
        outputs = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))],
                               use_tqdm=False)
        return {o.prompt: o.outputs[0] for o in outputs}, llm

    plain = target_alone((tiny_models, "structured", mixed), lambda: run(None)[0])
    monkeypatch.setattr(DDTreeProposer, "draft_logits", oracle_draft_logits(
        {p: list(o.token_ids) for p, o in plain.items()}, prompt_ids, seed=5))
    tree, llm = run({"method": "ddtree", "model": str(tiny_models / "drafter"),
                     "tree_budget": 16, "tree_spine": spine})
    assert_scheduling(llm, scheduling)
    assert {p: list(o.token_ids) for p, o in tree.items()} == {
        p: list(o.token_ids) for p, o in plain.items()}
    for p in PROMPTS[0::2]:
        assert re.fullmatch(regex, tree[p].text), tree[p].text
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3, stats
    if not mixed:
        assert stats["paths_off_the_index_line"] == 0, stats


@pytest.mark.slow
def test_compiled_target_is_lossless(tiny_models: Path, baseline, prompt_ids,
                                     monkeypatch) -> None:
    """Without enforce_eager vLLM compiles the model with torch.compile, as it does by
    default on a GPU (the tests elsewhere run eager to save time): trees still accept deep
    and off the chain, and output is still the target's own."""
    from vllm import LLM, SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=7))
    llm = LLM(model=str(tiny_models / "target"), max_model_len=512, seed=0, dtype="float32",
              max_num_seqs=8, speculative_config={"method": "ddtree", "tree_budget": 16,
                                                  "model": str(tiny_models / "drafter")})
    assert llm.llm_engine.vllm_config.compilation_config.mode > 0  # compiled
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: t[:MAX_TOKENS] for p, t in baseline.items()}
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_sliding_window_target_is_lossless(tiny_models: Path, tmp_path: Path, monkeypatch,
                                           scheduling) -> None:
    """A target whose layers see 4 positions back: tree nodes lose context and upper
    ancestors to the window by position (siblings share one), exactly as the target alone
    does at that position. Trees accepted deep and off the chain (the oracle drafter),
    output equals the windowed target alone's, which differs from the full target's."""
    from vllm_ddtree.attention.cpu_backend import TreeAttentionCPUImpl

    pair = windowed_pair(tiny_models, tmp_path, window=4)
    windowed = oracle_for_target(pair, monkeypatch, seed=8)
    full, _ = generate(tiny_models, None, max_tokens=MAX_TOKENS)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in full} != {
        p: list(t.token_ids[:MAX_TOKENS]) for p, t in windowed.items()}  # the window matters
    outputs, llm = generate(pair, {"method": "ddtree", "model": str(pair / "drafter"),
                                   "tree_budget": 16})
    assert_scheduling(llm, scheduling)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: list(t.token_ids[:MAX_TOKENS]) for p, t in windowed.items()}
    impls = attention_impls(llm, TreeAttentionCPUImpl)
    assert impls and all(i.sliding_window == 4 for i in impls)
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 4 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt-oss"])
def test_other_target_families_are_lossless(tiny_models: Path, tmp_path: Path, monkeypatch,
                                            family) -> None:
    """Llama, and gpt-oss's attention: sinks in every layer, a window of 4 positions in
    every other one (two KV cache groups, one windowed). Trees accepted deep and off the
    chain (the oracle drafter), output equals the target alone's."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ddtree.attention.cpu_backend import TreeAttentionCPUImpl

    # In-process engines keep the first one's parallel groups; a mixture-of-experts model
    # needs its expert-parallel group, which a dense model's engine did not make.
    cleanup_dist_env_and_memory()
    pair = other_target_pair(tiny_models, tmp_path, family)
    target = oracle_for_target(pair, monkeypatch, seed=9)
    outputs, llm = generate(pair, {"method": "ddtree", "model": str(pair / "drafter"),
                                   "tree_budget": 16})
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: list(t.token_ids[:MAX_TOKENS]) for p, t in target.items()}
    impls = attention_impls(llm, TreeAttentionCPUImpl)
    assert len(impls) == 4
    if family == "gpt-oss":
        assert sorted(i.sliding_window for i in impls) == [-1, -1, 4, 4]
        assert all(i.sinks is not None for i in impls)
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 4 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_lora_requests_are_lossless(tiny_models: Path, baseline, tmp_path: Path,
                                    monkeypatch) -> None:
    """Half the requests with a LoRA adapter (the target's output changes), trees accepted
    deep and off the chain (the oracle drafter): output equals the target alone's with the
    same adapter. Needs patch 0008 (the drafter embeds past the target's LoRA wrapper)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_ddtree.runner import DDTreeProposer

    adapter = random_lora(tiny_models / "target", tmp_path / "lora")
    loras = [LoRARequest("random", 1, str(adapter)) if i % 2 == 0 else None
             for i in range(len(PROMPTS))]

    def run(spec: dict | None):
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                  seed=0, dtype="float32", max_num_seqs=8, speculative_config=spec,
                  enable_lora=True, max_lora_rank=8, max_loras=1)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False)
        return {o.prompt: list(o.outputs[0].token_ids) for o in outputs}, llm

    plain, llm = run(None)
    prompt_ids = {tuple(llm.get_tokenizer().encode(p)): p for p in PROMPTS}
    del llm
    assert all(plain[p] != baseline[p][:MAX_TOKENS] for p in PROMPTS[0::2])  # the adapter acts
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(plain, prompt_ids, seed=6))
    tree, llm = run({"method": "ddtree", "model": str(tiny_models / "drafter"),
                     "tree_budget": 16})
    assert tree == plain
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("budget", [8, 4])
def test_sampling_matches_the_target_distribution(tiny_models: Path, scheduling,
                                                  budget) -> None:
    """Temperature 1 (top-k 3 to keep the support small): the 2nd and 3rd generated tokens,
    the first ones speculation produces, are distributed as without speculation. Threshold:
    the test fails when the chi-square p-value is below 0.001 (fixed seeds: deterministic).
    Budget 8 verifies trees; budget 4, within the drafter's 7-deep spine, the greedy chain."""
    spec = {"method": "ddtree", "tree_budget": budget, "model": str(tiny_models / "drafter")}
    assert_same_distribution(*(
        sampled(tiny_models, s, 1.0, check=lambda llm: assert_scheduling(llm, scheduling))
        for s in (None, spec)))


def sampled(pair: Path, spec: dict | None, temperature: float, check=None, **engine
            ) -> list[list[int]]:
    """Three tokens (top-k 3) after "def main():" for each of 800 seeds, by a fresh engine
    (``check`` sees it first); the target alone's once per process."""
    if spec is None:
        return target_alone((pair, "sampled", temperature, *sorted(engine.items())),
                            lambda: _sample(pair, None, temperature, None, engine))
    return _sample(pair, spec, temperature, check, engine)


def _sample(pair: Path, spec: dict | None, temperature: float, check, engine: dict
            ) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    settings = dict(enforce_eager=True, max_model_len=128, seed=0, dtype="float32",
                    max_num_seqs=64, speculative_config=spec)
    llm = LLM(model=str(pair / "target"), **(settings | engine))
    if check:
        check(llm)
    params = [SamplingParams(temperature=temperature, top_k=3, max_tokens=3, seed=1000 + i)
              for i in range(800)]
    outputs = llm.generate(["def main():"] * 800, params, use_tqdm=False)
    del llm
    return [o.outputs[0].token_ids for o in outputs]


def assert_same_distribution(plain: list[list[int]], speculated: list[list[int]]) -> None:
    """The 2nd and 3rd tokens, the first ones speculation produces, are distributed alike:
    fails below a chi-square p-value of 0.001 (fixed seeds: deterministic)."""
    for position in (1, 2):
        assert len({t[position] for t in plain}) >= 2  # a distribution, not one token
        p = chi_square_p_value([t[position] for t in plain],
                               [t[position] for t in speculated])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"


@pytest.mark.slow
def test_batching_chunked_prefill_preemption_stay_lossless(tiny_models: Path,
                                                          monkeypatch, scheduling) -> None:
    """Requests of different lengths finishing at different steps, long prompts prefilled in
    chunks next to verify steps, prefix caching on, and preemption under a tiny KV cache:
    with trees being accepted (the oracle drafter), output stays the target's own."""
    from vllm import LLM, SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompts = [" ".join(words[(i + j) % 10] for j in range(5 + 15 * (i % 4))) + f" #{i}"
               for i in range(12)]
    prompts += [prompts[0] + " and more", prompts[1] + " again"]  # shared prefixes
    max_tokens = [8 + 5 * (i % 5) for i in range(len(prompts))]
    max_tokens[-1] = 256  # runs into max_model_len (256 below): its last trees are cut short
    settings = dict(enforce_eager=True, max_model_len=512, seed=0, dtype="float32",
                    block_size=32)

    def params(extra: int = 0) -> list:
        return [SamplingParams(temperature=0.0, max_tokens=m + extra, ignore_eos=True)
                for m in max_tokens]

    llm = LLM(model=str(tiny_models / "target"), **settings)
    outputs = llm.generate(prompts, params(16), use_tqdm=False)
    baseline = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    prompt_ids = {tuple(o.prompt_token_ids): o.prompt for o in outputs}
    del llm
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=2))
    steps, budget = verify_steps(monkeypatch), 12
    llm = LLM(model=str(tiny_models / "target"), **(settings | {"max_model_len": 256}),
              max_num_seqs=6,
              max_num_batched_tokens=64, num_gpu_blocks_override=10, disable_log_stats=False,
              speculative_config={"method": "ddtree", "tree_budget": budget,
                                  "model": str(tiny_models / "drafter")})
    assert_scheduling(llm, scheduling)
    outputs = llm.generate(prompts, params(), use_tqdm=False)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    room = {o.prompt: 256 - len(o.prompt_token_ids) for o in outputs}
    assert got == {p: baseline[p][:min(m, room[p])] for p, m in zip(prompts, max_tokens)}
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:num_preemptions"] > 0, "the KV cache was not small enough to preempt"
    # Trees whose nodes the scheduler cut (to stay within max_model_len).
    cut_short = [n for step in steps for n, stored, _ in step if stored and 0 < n < budget]
    assert cut_short, "no tree was cut short"
    assert ddtree_state(llm).stats()["longest_accepted"] >= 3


# Code that runs inside the decode step on a GPU; the CPU attention path is not among it.
DEVICE_STEP_FILES = ("runner.py", "sampling.py", "ops.py", "tree.py", "attention/backend.py",
                     "attention/tree_batch.py", "attention/triton_tree_attention.py",
                     "ranked_topk.py")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "cuda-on-interpreter"])
def test_the_step_never_waits_for_the_device(tiny_models: Path, monkeypatch, request,
                                             backend) -> None:
    # A host sync (.item(), .tolist(), .cpu(), a tensor's truth value, a boolean-mask index:
    # a data-dependent shape) inside the step stalls the GPU and breaks CUDA-graph capture.
    # Every such call made from the step's own files, greedy and sampled requests with
    # logprobs and every supported logits processor, is recorded: there must be none. With
    # TREE_ATTN's CUDA backend (its kernel on the interpreter) this covers the backend's
    # build(), forward() and KV compaction too. The other half of graph replay: the target
    # reads its positions, and the kernel its metadata, from the same buffers at every step.
    import inspect
    import sys

    from vllm import LLM, SamplingParams

    pkg = str(Path(__file__).resolve().parent.parent / "vllm_ddtree") + "/"
    calls = []

    def record(name: str, original, check=None):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            where = caller.co_filename.removeprefix(pkg)
            if where in DEVICE_STEP_FILES and (check is None or check(*args)):
                calls.append(f"{name} in {where}:{caller.co_name}")
            return original(self, *args, **kwargs)
        return wrapper

    if backend == "cuda-on-interpreter":
        request.getfixturevalue("cuda_tree_attn_on_cpu")
    spec = {"method": "ddtree", "model": str(tiny_models / "drafter"), "tree_budget": 16}
    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=8, speculative_config=spec)
    # The target must read its tree positions (context + depth) from the runner's own
    # buffer, which a captured graph replays: written there in place, never a fresh tensor.
    runner, seen = ddtree_state(llm).runner, {}
    model_forward = runner._model_forward

    def forward(*args, **kwargs):
        seen.setdefault("positions", []).append(kwargs["positions"])
        return model_forward(*args, **kwargs)
    monkeypatch.setattr(runner, "_model_forward", forward)
    if backend == "cuda-on-interpreter":
        from vllm_ddtree.attention import backend as cuda_backend
        assert len(attention_impls(llm, cuda_backend.TreeAttentionImpl)) > 0
        kernel = cuda_backend.tree_attention
        metadata_args = ("block_table", "seq_lens", "query_start_loc", "tree_index",
                         "ancestor_mask", "depths")

        def tree_attention(*args, **kwargs):
            bound = inspect.signature(kernel).bind(*args, **kwargs).arguments
            for name in metadata_args:
                seen.setdefault(name, []).append(bound[name])  # alive: no address reuse
            return kernel(*args, **kwargs)
        monkeypatch.setattr(cuda_backend, "tree_attention", tree_attention)
    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__",
                 "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, record(name, getattr(torch.Tensor, name)))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, record(f"boolean-mask {name}",
                                                       getattr(torch.Tensor, name),
                                                       lambda index, *_: _bool_index(index)))
    sampled = dict(temperature=0.8, seed=1, logprobs=2, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **kw) for kw in [
        dict(temperature=0.0), sampled, dict(temperature=0.0, min_tokens=6, stop_token_ids=[5]),
        dict(temperature=0.0, allowed_token_ids=list(range(0, 1024, 3))),
        dict(temperature=0.0, bad_words=["the"], prompt_logprobs=1)]]
    llm.generate(PROMPTS[:5], params, use_tqdm=False)
    assert calls == [], sorted(set(calls))
    # A fresh tensor per step would leave a replayed graph reading stale data.
    addresses = {name: {t.data_ptr() for t in tensors} for name, tensors in seen.items()}
    assert addresses.pop("positions") == {runner.positions.data_ptr()}
    if backend == "cuda-on-interpreter":
        assert {name: len(a) for name, a in addresses.items()} == dict.fromkeys(
            metadata_args, 1)
    ddtree_state(llm).stats()  # the metrics read-out syncs, outside the step: it is seen
    assert calls == ["tolist in runner.py:stats"]


@pytest.fixture
def cuda_tree_attn_on_cpu(monkeypatch):
    """For one test, TREE_ATTN on the CPU platform is the CUDA backend, its kernel on
    Triton's interpreter; vLLM's cache-write kernel (vLLM's CPU build has no Triton) is
    replaced by the same write in torch. vLLM caches backend choices per process: cleared
    before and after."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    import vllm_ddtree.attention

    def write_kv(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        slots = slot_mapping.long()
        written = slots >= 0
        block, offset = slots[written] // key_cache.shape[1], slots[written] % key_cache.shape[1]
        key_cache[block, offset] = key[:len(slots)][written]
        value_cache[block, offset] = value[:len(slots)][written]

    selector._cached_get_attn_backend.cache_clear()
    monkeypatch.setattr(vllm_ddtree.attention, "CPU_BACKEND_PATH",
                        "vllm_ddtree.attention.backend.TreeAttentionBackend")
    monkeypatch.setattr(TritonAttentionImpl, "do_kv_cache_update", write_kv)
    yield
    selector._cached_get_attn_backend.cache_clear()


TREE_OPS = ("build_tree", "verify_tree", "compact_tree")


@pytest.fixture
def cuda_ops_on_the_emulator(monkeypatch, emulated_cuda_ops) -> dict[str, int]:
    """For one test, torch.ops.vllm_ddtree.* on CPU tensors run the CUDA ops' source
    (csrc/cuda/tree_ops.cu) on tests/cuda_emulator; the calls are counted per op, and
    "deepest_move" is the deepest path position whose node compaction had to move."""
    import vllm_ddtree.ops  # noqa: F401  (registers the ops replaced here)

    calls = dict.fromkeys(TREE_OPS + ("deepest_move",), 0)

    def counted(name):
        def op(*args):
            calls[name] += 1
            if name == "compact_tree":
                accepted, num_accepted = args[4:6]
                position = torch.arange(1, accepted.shape[1] + 1)
                moved = (accepted > position) & (position <= num_accepted[:, None])
                if moved.any():
                    calls["deepest_move"] = max(calls["deepest_move"],
                                                int(position[moved.any(dim=0)].max()))
            return getattr(emulated_cuda_ops, name)(*args)
        return op

    for name in TREE_OPS:
        monkeypatch.setattr(torch.ops.vllm_ddtree, name, counted(name))
    emulated_cuda_ops.take_build_counts()  # (parallel, serial) builds from here on
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_cuda_backend_in_the_engine_on_the_interpreter(tiny_models: Path, tmp_path: Path,
                                                       monkeypatch, family, scheduling,
                                                       cuda_tree_attn_on_cpu,
                                                       cuda_ops_on_the_emulator,
                                                       emulated_cuda_ops) -> None:
    """TREE_ATTN's CUDA backend inside vLLM's engine, on CPU tensors: vLLM's Triton KV
    layout, the backend's metadata builder on the runner's real batches, the Triton tree
    kernel (for gpt-oss with sinks, and a window in every other layer), the CUDA tree ops
    (build, verify, compaction in that layout) on the CPU emulator, trees accepted deep and
    off the chain: lossless. What a GPU runs, bar the device and vLLM's cache-write
    kernel."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_ddtree.attention.backend import TreeAttentionImpl

    cleanup_dist_env_and_memory()  # gpt-oss's experts need their own parallel group
    pair = tiny_models if family == "qwen3" else other_target_pair(tiny_models, tmp_path,
                                                                   family)
    # 24 tokens for Qwen3: enough later steps to read what deep moves wrote (a compaction
    # planted to skip the path's 5th node passed at 12 tokens). The random gpt-oss barely
    # reads its KV (its sinks take most of the attention): a plant skipping the 3rd node
    # moved its logprobs by under 1e-5, one that never moves anything by 4e-4 (caught by
    # the logprobs, not by the tokens), so longer runs buy little there.
    prompts, max_tokens = PROMPTS[:4], 24 if family == "qwen3" else 12
    target = oracle_for_target(pair, monkeypatch, seed=11, prompts=prompts,
                               max_tokens=max_tokens, logprobs=1)
    outputs, llm = generate(pair, {"method": "ddtree", "tree_budget": 16,
                                   "model": str(pair / "drafter")},
                            max_num_seqs=4, max_tokens=max_tokens, prompts=prompts, logprobs=1)
    assert_scheduling(llm, scheduling)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: list(t.token_ids[:max_tokens]) for p, t in target.items()}
    # Each token's logprob too (float32, within 1e-4): a KV entry the compaction left wrong
    # shifts the later logprobs of its request even where it flips no greedy token.
    for o in outputs:
        want = target[o.prompt]
        for j, (token, w, g) in enumerate(zip(want.token_ids, want.logprobs,
                                              o.outputs[0].logprobs)):
            assert abs(g[token].logprob - w[token].logprob) < 1e-4, (o.prompt, j)
    impls = attention_impls(llm, TreeAttentionImpl)
    assert len(impls) == 4
    if family == "gpt-oss":
        assert sorted(i.sliding_window[0] for i in impls) == [-1, -1, 3, 3]
        assert all(i.sinks is not None for i in impls)
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    calls = cuda_ops_on_the_emulator
    assert all(calls[name] > 0 for name in TREE_OPS) and calls["deepest_move"] >= 5, calls
    parallel, serial = emulated_cuda_ops.take_build_counts()
    assert parallel > 0 and serial == 0, (parallel, serial)  # every tree built in parallel
