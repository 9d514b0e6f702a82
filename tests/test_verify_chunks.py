"""A verify step's memory is bounded by its chunk of node rows, not by its rows, with the
same results: node choices and logprobs computed in several chunks equal those of one
chunk (greedy, seeded, with every logits processor), unseeded draws stay independent per
node; in the engine, chunked verification gives the same tokens and logprobs, and the
verify output is depth + 1 wide, not budget + 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree import ops, sampling

REPO = Path(__file__).resolve().parent.parent
ONE_CHUNK = 10**9


@settings(max_examples=300, deadline=None)
@given(num_sampled=st.lists(st.integers(1, 40), min_size=1, max_size=12),
       seeded=st.sets(st.integers(0, 11)), size=st.integers(1, 50))
def test_chunks_cover_the_rows_and_never_split_a_seeded_request_with_others(
        num_sampled, seeded, size) -> None:
    starts = [0]
    for n in num_sampled:
        starts.append(starts[-1] + n)
    seeded = {r for r in seeded if r < len(num_sampled)}
    ranges = sampling.chunk_ranges(starts, seeded, size)
    assert [s for s, _ in ranges] == [0] + [e for _, e in ranges[:-1]]
    assert ranges[-1][1] == starts[-1] and all(0 < e - s <= size for s, e in ranges)
    for r in seeded:
        a, b = starts[r], starts[r + 1]
        for s, e in ranges:  # apart, the request inside the chunk, or the chunk inside it
            assert e <= a or b <= s or (s <= a and b <= e) or (a <= s and e <= b)


NUM_SAMPLED = [1, 9, 17, 5, 33, 2, 20, 12]  # rows per request: a root and its nodes
VOCAB, DEPTH = 300, 4


def step(case: str, seed: int = 0) -> tuple:
    """A synthetic step: logits, each row's request, depth and path, and sampling metadata
    (fresh generators each call: a rerun draws the same numbers)."""
    R, T = len(NUM_SAMPLED), sum(NUM_SAMPLED)
    gen = torch.Generator().manual_seed(seed)
    request = torch.repeat_interleave(torch.arange(R), torch.tensor(NUM_SAMPLED))
    logits = torch.randn(T, VOCAB, generator=gen) * 3
    depth = torch.randint(0, DEPTH + 1, (T,), generator=gen)
    path = torch.randint(-1, VOCAB, (T, DEPTH), generator=gen)
    greedy = case == "greedy"

    def per_request(value, dtype=torch.float32):
        return torch.full((R,), value, dtype=dtype)

    temperature = per_request(0.0) if greedy else torch.tensor(
        [0.0, 0.6, 1.0, 0.6, 0.8, 0.0, 0.6, 1.3])
    penalties = case == "processors"
    allowed = None
    if penalties:
        allowed = torch.zeros(R, VOCAB, dtype=torch.bool)
        allowed[3, ::2] = True  # request 3 may not use even tokens
    sm = SimpleNamespace(
        all_greedy=greedy, temperature=temperature, top_k=per_request(20, torch.int64),
        top_p=per_request(0.95),
        generators={r: torch.Generator().manual_seed(10 + r) for r in (1, 2, 4, 6)},
        no_penalties=not penalties, allowed_token_ids_mask=allowed,
        bad_words_token_ids={2: [[5, 6], [7]], 4: [[1, 2, 3]]} if penalties else {},
        output_token_ids=[torch.randint(0, VOCAB, (30,), generator=gen).tolist()
                          for _ in range(R)],
        prompt_token_ids=torch.randint(0, VOCAB, (R, 50), generator=gen),
        presence_penalties=per_request(0.5), frequency_penalties=per_request(0.3),
        repetition_penalties=per_request(1.2))
    min_tokens = None
    if penalties:
        min_tokens = sampling.MinTokens([(1, [3, 4]), (4, [9])], torch.tensor(
            [0, 3, 0, 0, 2, 0, 0, 0]))
    return logits, request, depth, path, sm, min_tokens


def choices(case: str, chunk_rows: int, monkeypatch) -> tuple[torch.Tensor, list]:
    """The step's node choices in chunks of ``chunk_rows``, and the draws from seeded
    generators: (seed, numbers drawn) per call, in order. On CPU a generator split over
    two calls yields the same numbers as one call; CUDA's Philox does not (the counter
    layout follows each call's size), so the draws themselves must be those of one chunk."""
    monkeypatch.setattr(sampling, "CHUNK_ROWS", chunk_rows)
    draws, exponential = [], torch.Tensor.exponential_

    def recorded(self, *args, generator=None, **kwargs):
        if generator is not None:
            draws.append((generator.initial_seed(), self.numel()))
        return exponential(self, *args, generator=generator, **kwargs)

    monkeypatch.setattr(torch.Tensor, "exponential_", recorded)
    logits, request, depth, path, sm, min_tokens = step(case)
    got = sampling.node_targets(logits, request, NUM_SAMPLED, lambda: depth, lambda: path,
                                sm, min_tokens)
    monkeypatch.setattr(torch.Tensor, "exponential_", exponential)
    return got, draws


@pytest.mark.parametrize("case", ["greedy", "sampled", "processors"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 64])
def test_chunks_choose_what_one_chunk_chooses(case, chunk_rows, monkeypatch) -> None:
    """Greedy and seeded rows (requests 1, 2, 4, 6: their rows span chunks) equal one
    chunk's, with allowed_token_ids, bad_words, min_tokens and penalties too, next to
    unseeded sampled rows (requests 3 and 7), which take other independent draws; each
    seeded generator draws what it draws in one chunk."""
    want, want_draws = choices(case, ONE_CHUNK, monkeypatch)
    got, draws = choices(case, chunk_rows, monkeypatch)
    # Each seeded request's generator: one call for all its rows, as in one chunk.
    assert draws == want_draws == ([] if case == "greedy" else [
        (10 + r, NUM_SAMPLED[r] * VOCAB) for r in (1, 2, 4, 6)])
    request = step(case)[1]
    reproducible = torch.isin(request, torch.tensor([0, 1, 2, 4, 5, 6]))
    if case == "greedy":
        reproducible[:] = True
    assert torch.equal(got[reproducible], want[reproducible])
    # The processing applies in every chunk: the argmax of processed logits.
    if case == "processors":
        logits, request, depth, path, sm, min_tokens = step(case)
        rules = sampling._Processing.make(logits, lambda: depth, lambda: path,
                                          len(NUM_SAMPLED), sm, min_tokens)
        processed = sampling.process_node_logits(logits, request, slice(None), rules, sm)
        greedy_rows = sm.temperature[request] == 0
        assert torch.equal(got[greedy_rows], processed.argmax(dim=-1)[greedy_rows])
        assert bool((got[request == 3] % 2 == 1).all())  # allowed_token_ids, unseeded too


def test_unseeded_draws_are_independent_per_node_across_chunks(monkeypatch) -> None:
    """One unseeded request, every row with the same logits, chunks of 16 rows: the
    choices follow the distribution (chi-square), and rows at the same offset of
    consecutive chunks agree only as often as independent draws do (sum of p^2), not
    always, as a noise drawn once and reused per chunk would make them."""
    monkeypatch.setattr(sampling, "CHUNK_ROWS", 16)
    torch.manual_seed(0)
    rows, probs = 4096, torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().expand(rows, -1).contiguous()
    sm = SimpleNamespace(all_greedy=False, temperature=torch.ones(1), top_k=None, top_p=None,
                         generators={}, no_penalties=True, allowed_token_ids_mask=None,
                         bad_words_token_ids={})
    got = sampling.node_targets(logits, torch.zeros(rows, dtype=torch.int64), [rows],
                                lambda: None, lambda: None, sm, None)
    counts = torch.bincount(got, minlength=len(probs)).double()
    expected = probs.double() * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # 5 degrees of freedom: p = 0.001
    agree = float((got[:-16] == got[16:]).double().mean())
    assert abs(agree - float((probs ** 2).sum())) < 0.04, agree


@pytest.mark.parametrize("chunk_rows", [1, 7, 50])
def test_chunked_logprobs_equal_one_chunk(chunk_rows, monkeypatch) -> None:
    """The emitted tokens' logprobs (rows R x (depth + 1)) in several chunks equal one
    chunk's, and are the raw log-softmax at the node that chose each token."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree.runner import DDTreeState

    logits = step("sampled")[0]
    first_row = torch.tensor([0, *NUM_SAMPLED[:-1]]).cumsum(0)
    gen = torch.Generator().manual_seed(1)
    reach = torch.arange(1, DEPTH + 1)
    accepted = torch.where(reach < torch.tensor(NUM_SAMPLED)[:, None], reach, -1).int()
    accepted[::2, 2:] = -1  # shorter paths: padding rows under -1 tokens
    tokens = torch.randint(0, VOCAB, (len(NUM_SAMPLED), DEPTH + 1), generator=gen)
    verdict = ops.Verdict(accepted, (accepted > 0).sum(1).int(), tokens)
    state = SimpleNamespace(runner=SimpleNamespace(sampler=Sampler("raw_logprobs")))
    results = []
    for size in (ONE_CHUNK, chunk_rows):
        monkeypatch.setattr(sampling, "CHUNK_ROWS", size)
        results.append(DDTreeState._logprobs(state, logits, first_row, verdict, 3))
    fields = ("logprob_token_ids", "logprobs", "selected_token_ranks")
    for name in fields:
        assert torch.equal(getattr(results[1], name), getattr(results[0], name)), name
    ids, logprobs = results[0][:2]
    assert ids.shape == (len(NUM_SAMPLED) * (DEPTH + 1), 4)
    row = first_row[1] + 2  # request 1's third token was chosen at its accepted node 2
    want = torch.log_softmax(logits[row], dim=-1)[tokens[1, 2]]
    assert float(logprobs[1 * (DEPTH + 1) + 2, 0]) == pytest.approx(float(want), abs=1e-6)


@pytest.mark.slow
def test_verify_memory_is_bounded_by_the_chunk() -> None:
    """Peak extra resident memory of the node sampling path and the logprobs of a step of
    8,190 rows (Qwen3's sampling defaults, penalties on; scripts/verify_memory.py in a
    subprocess, reading Linux's VmHWM) is below 14 [CHUNK_ROWS, V] float32 buffers: the
    CPU path peaks in vLLM's penalties (a float32 copy, two int64 bin counts, the torch
    repetition penalty's four float32 temporaries and masks: about 10.5) whatever the
    rows. In one chunk, as before, 1,024 rows alone took over twice the bound. An 8,192
    vocabulary keeps the test short (memory is linear in it: 11.6 buffers here, 10.8 at
    151,936); glibc's mmap threshold is lowered so that freed blocks leave."""
    import os

    vocab = 8192
    code = (f"import json, verify_memory as m; print(json.dumps([m.measure(8190, {vocab}, "
            f"penalties=True), m.measure(1024, {vocab}, penalties=True, chunk_rows=1024)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "scripts", check=True,
                         capture_output=True, text=True,
                         env=os.environ | {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}).stdout
    chunked, one_chunk = json.loads(out.splitlines()[-1])
    bound = 14 * sampling.CHUNK_ROWS * vocab * 4
    assert chunked["chunk_rows"] == sampling.CHUNK_ROWS
    assert chunked["peak_extra_bytes"] < bound, chunked
    assert one_chunk["peak_extra_bytes"] > 2 * bound, one_chunk


@pytest.mark.slow
def test_chunked_verify_in_the_engine_gives_the_same_tokens_and_logprobs(
        tiny_models: Path, monkeypatch) -> None:
    """Greedy, seeded sampled (temperature 0.8, top-k 20, top-p 0.95) and penalised
    requests with logprobs, trees accepted deep (the oracle drafter): verifying 5 node
    rows at a time gives exactly the tokens and logprobs of the default chunk (one
    chunk per step here), and greedy output is the target's own."""
    from test_ddtree_engine import ddtree_state, oracle_for_target
    from vllm import LLM, SamplingParams

    prompts = [f"def f{i}(x):\n    return x + {i}" for i in range(8)]
    target = oracle_for_target(tiny_models, monkeypatch, seed=12, prompts=prompts)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, top_p=0.95, seed=7),
             dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
             dict(temperature=0.8, top_k=20, top_p=0.95, seed=9, frequency_penalty=0.4)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2, **kinds[i % 4])
              for i in range(len(prompts))]

    def run(chunk_rows: int) -> tuple[list, list]:
        monkeypatch.setattr(sampling, "CHUNK_ROWS", chunk_rows)
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                  seed=0, dtype="float32", max_num_seqs=8,
                  speculative_config={"method": "ddtree", "tree_budget": 16,
                                      "model": str(tiny_models / "drafter")})
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert ddtree_state(llm).stats()["longest_accepted"] >= 3
        del llm
        return ([list(o.outputs[0].token_ids) for o in outputs],
                [[{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                  for d in o.outputs[0].logprobs] for o in outputs])

    tokens, logprobs = run(sampling.CHUNK_ROWS)
    assert (tokens, logprobs) == run(5)
    for i in range(0, len(prompts), 4):  # greedy: the target's own
        assert tokens[i] == list(target[prompts[i]].token_ids[:20])


@pytest.mark.slow
def test_verify_output_is_depth_plus_one_wide(tiny_models: Path, monkeypatch) -> None:
    """Budget 64, drafter depth 7: the sampled tokens vLLM copies and parses are 8 columns
    per request (not 65), the logprobs 8 rows per request; output and logprobs are still
    the target's own, with trees accepted deep (the oracle drafter)."""
    from test_ddtree_engine import ddtree_state, generate, oracle_for_target

    from vllm_ddtree.runner import DDTreeState

    prompts = [f"The {w} of the list is" for w in ("name", "size", "end", "start")]
    target = oracle_for_target(tiny_models, monkeypatch, seed=13, prompts=prompts,
                               logprobs=2)
    shapes, verify = [], DDTreeState.verify

    def record(self, *args, **kwargs):
        out = verify(self, *args, **kwargs)
        shapes.append((tuple(out.sampled_token_ids.shape),
                       tuple(out.logprobs_tensors.logprobs.shape)))
        return out

    monkeypatch.setattr(DDTreeState, "verify", record)
    outputs, llm = generate(tiny_models, {"method": "ddtree", "tree_budget": 64,
                                          "model": str(tiny_models / "drafter")},
                            prompts=prompts, logprobs=2)
    state = ddtree_state(llm)
    assert (state.budget, state.depth) == (64, 7)
    assert shapes and all(tokens[1] == 8 and lps[0] == tokens[0] * 8
                          for tokens, lps in shapes), shapes
    assert state.stats()["longest_accepted"] >= 3
    for o in outputs:
        want, got = target[o.prompt], o.outputs[0]
        assert list(got.token_ids) == list(want.token_ids[:len(got.token_ids)])
        for token, w, g in zip(got.token_ids, want.logprobs, got.logprobs):
            assert abs(g[token].logprob - w[token].logprob) < 1e-4
