"""A verify step's node sampling and logprobs in chunks of rows
(vllm_ddtree/spec_decode/node_sampling.py): every chunking gives the tokens and logprobs
of one chunk (V2's sampler given all rows at once, as the verifier did before), with seeded
and unseeded sampling, greedy rows, top-k / top-p, penalties and bad words on a request
verified as a chain (which read its earlier rows), and logprobs; start-up's memory profile
runs the largest verify step's sampling through the same path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vllm.v1.worker.cpu.shm  # noqa: F401  (as the CPU worker: UVA buffers in plain memory)

from vllm_ddtree.spec_decode import node_sampling

VOCAB, DEPTH = 256, 3
A, B = 17, 42  # tokens no request's history holds (theirs are >= 100)
# Rows a request (budget 8: 9; the last one shorter, as near max_model_len).
ROWS = [9, 9, 9, 9, 9, 4]


def _params() -> list:
    from vllm.sampling_params import SamplingParams

    return [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=7, logprobs=3),
            SamplingParams(temperature=0.0, logprob_token_ids=[1, 5, 9]),
            SamplingParams(temperature=1.0, seed=11),
            # Verified as a chain: its processing counts its earlier rows' drafts.
            SamplingParams(temperature=0.8, seed=3, presence_penalty=1.5,
                           frequency_penalty=0.5, repetition_penalty=1.3,
                           _bad_words_token_ids=[[4], [6, 8]], logprobs=2),
            SamplingParams(temperature=0.7, top_k=5),  # unseeded
            SamplingParams(temperature=0.6, top_p=0.8, seed=5, min_p=0.05)]


def make_sampler():
    """V2's Sampler on CPU with the stand-in's kernels (as the engine's worker has them),
    its requests added in slots out of batch order; their tokens all >= 100."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    from cpu_standin import kernels

    kernels.install()
    dev = torch.device("cpu")
    states = RequestState(8, 256, 512, 8, VOCAB, dev)
    sampler = Sampler(VllmConfig(), 8, VOCAB, dev, states)
    gen = torch.Generator().manual_seed(0)
    for i, params in enumerate(_params()):
        tokens = torch.randint(100, VOCAB, (30,), generator=gen).tolist()
        states.add_request(f"r{i}", 20, tokens, 30, 100)
        sampler.add_request(states.req_id_to_index[f"r{i}"], params)
    states.apply_staged_writes()
    sampler.apply_staged_writes()
    sampler.slots = [states.req_id_to_index[f"r{i}"] for i in range(len(ROWS))]
    return sampler


@pytest.fixture(scope="module")
def sampler():
    return make_sampler()


def _batch(sampler) -> dict:
    """A verify step's per-row inputs: request 3 (rows 27-35) a chain (history: its earlier
    rows up to the depth), the others trees (no history). The chain's first draft (row 28)
    is token A, which its rows 28-30 favour (30) over B (27), unless penalized."""
    gen = torch.Generator().manual_seed(1)
    cu = np.concatenate([[0], np.cumsum(ROWS)]).astype(np.int32)
    L = int(cu[-1])
    req = np.repeat(np.arange(len(ROWS)), ROWS)
    local = torch.from_numpy(np.arange(L) - cu[req]).int()
    chain = torch.from_numpy(req == 3)
    slots = np.array(sampler.slots, dtype=np.int32)
    logits = torch.randn(L, VOCAB, generator=gen) * 3
    input_ids = torch.randint(0, VOCAB, (L,), generator=gen).int()
    input_ids[28] = A
    logits[28:31, A], logits[28:31, B] = 30.0, 27.0
    return dict(
        logits=logits,
        expanded_idx_mapping=torch.from_numpy(slots[req]).int(),
        idx_mapping=torch.from_numpy(slots).int(), idx_mapping_np=slots, cu_num_logits_np=cu,
        pos=torch.from_numpy(40 + local.numpy()).long(),
        input_ids=input_ids,
        local_pos=torch.where(chain & (local <= DEPTH), local, 0).int(),
        seq_lens_np=np.full(len(ROWS), 50, dtype=np.int32))


@pytest.mark.parametrize("head", [1, DEPTH + 1])
@pytest.mark.parametrize("chunk_rows", [1, 2, 5, 8, 13])
def test_chunk_bounds_cover_the_rows_and_keep_heads_whole(chunk_rows: int, head: int) -> None:
    cu = np.concatenate([[0], np.cumsum(ROWS + [1, 20])])
    bounds = node_sampling.chunk_bounds(cu, chunk_rows, head)
    assert bounds[0][0] == 0 and bounds[-1][1] == cu[-1]
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(0 < e - s <= max(chunk_rows, head) for s, e in bounds)
    for start, end in zip(cu[:-1], cu[1:]):  # no chunk starts inside a request's head
        assert not any(start < s < min(end, start + head) for s, _ in bounds)


@pytest.mark.parametrize("chunk_rows", [1, 2, 3, 7, 10, 23])
def test_chunked_sampling_draws_the_tokens_of_one_chunk(sampler, chunk_rows: int) -> None:
    batch = _batch(sampler)
    L = batch["logits"].shape[0]
    whole = node_sampling.sample_nodes(sampler, **batch, head=DEPTH + 1, chunk_rows=L)
    # One chunk is V2's sampler on all rows at once.
    plain = sampler.sample(*(batch[k] for k in (
        "logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos",
        "input_ids", "local_pos", "seq_lens_np")))[0]
    assert torch.equal(whole, plain)
    chunked = node_sampling.sample_nodes(sampler, **batch, head=DEPTH + 1,
                                         chunk_rows=chunk_rows)
    # Unseeded request 4 draws from a seed vLLM drew at add_request: fixed here too.
    assert torch.equal(chunked, whole)
    # The draws are not all the argmax; the chain's penalties read its earlier rows: with
    # them its rows after the first draft penalize A, without them they draw A.
    assert not torch.equal(whole, batch["logits"].argmax(dim=1))
    no_history = node_sampling.sample_nodes(sampler, **(batch | dict(
        local_pos=torch.zeros_like(batch["local_pos"]))), head=1, chunk_rows=L)
    assert whole[29:31].tolist() == [B, B] and no_history[29:31].tolist() == [A, A]


@pytest.mark.parametrize("chunk_rows", [1, 4, 11, 100])
def test_chunked_logprobs_are_those_of_one_gather(sampler, chunk_rows: int) -> None:
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    batch = _batch(sampler)
    logits, L = batch["logits"], batch["logits"].shape[0]
    gen = torch.Generator().manual_seed(2)
    order = torch.randint(0, L, (L,), generator=gen)  # emitted rows: any rows, repeated
    tokens = torch.randint(0, VOCAB, (L,), generator=gen)
    num_logprobs, max_ids = sampler.get_logprobs_dims(batch["idx_mapping_np"])
    assert (num_logprobs, max_ids) == (3, 3)
    cu = batch["cu_num_logits_np"].tolist()
    for logits_mode in (False, True):
        want = compute_topk_scores(
            logits[order], num_logprobs, tokens, cu,
            logprob_token_ids_state=sampler.logprob_token_ids_state,
            expanded_idx_mapping=batch["expanded_idx_mapping"], max_per_req_token_ids=max_ids,
            logits_mode=logits_mode)
        got = node_sampling.topk_scores(logits, order, tokens, num_logprobs, cu,
                                        batch["expanded_idx_mapping"], sampler, max_ids,
                                        logits_mode=logits_mode, chunk_rows=chunk_rows)
        assert got.cu_num_generated_tokens == want.cu_num_generated_tokens == cu
        for name in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_rows_a_chunk_follow_the_vocabulary() -> None:
    assert node_sampling.rows_a_chunk(151_936) == (1 << 24) // 151_936 == 110
    assert node_sampling.rows_a_chunk(1 << 30) == 1


def test_the_profile_samples_the_largest_verify_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_verify_step (start-up's memory profile; model_state.py's dummy_sampler_run):
    the logits of ``rows`` rows through the node sampling and the logprobs, chunk by chunk,
    with every processing stage on; the dummy slots left as fresh after."""
    from types import SimpleNamespace

    sampler = make_sampler()  # its slots are reset here
    calls: dict[str, list] = {"sample": [], "logits": [], "scores": []}
    sample, scores = node_sampling.sample_nodes, node_sampling.topk_scores

    def spy_sample(sampler, logits, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["sample"].append(logits.shape)
        return sample(sampler, logits, *args, **kwargs)

    def spy_scores(logits, rows, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["scores"].append(rows.shape[0])
        return scores(logits, rows, *args, **kwargs)

    def compute_logits(hidden):  # noqa: ANN001, ANN202
        calls["logits"].append(hidden.shape[0])
        return hidden @ torch.randn(hidden.shape[1], VOCAB)

    monkeypatch.setattr(node_sampling, "sample_nodes", spy_sample)
    monkeypatch.setattr(node_sampling, "topk_scores", spy_scores)
    monkeypatch.setattr(node_sampling, "CHUNK_ELEMENTS", 4 * VOCAB)  # 4 rows a chunk
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=60,
                                                              max_num_seqs=8))
    rows = node_sampling.max_verify_rows(config, budget=8)
    assert rows == 60  # the step's tokens; at budget 4, 8 requests of 5 rows
    assert node_sampling.max_verify_rows(config, budget=4) == 40
    slots = np.arange(7)
    node_sampling.profile_verify_step(sampler, SimpleNamespace(compute_logits=compute_logits),
                                      torch.randn(3, 16), rows, budget=8, head=DEPTH + 1,
                                      processing=True)
    assert calls == {"sample": [(rows, VOCAB)], "logits": [rows], "scores": [rows]}
    # Reset: greedy, no processing, no logprobs, no penalties (the slots' earlier requests
    # are gone too: the profile runs before any request).
    assert not sampler.needs_logits_processing[slots].any()
    assert (sampler.sampling_states.temperature.np[slots] == 0).all()
    assert (sampler.sampling_states.num_logprobs[slots] == -1).all()
    assert not sampler.penalties_state.use_penalty[slots].any()


@pytest.mark.slow
def test_start_up_profile_covers_the_largest_verify_step(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """V2's start-up memory profile (the runner's profile_run, which the CPU worker skips
    for an eager engine with a set KV cache size: called here) samples, through the
    ModelState's dummy_sampler_run, the logits rows of the engine's largest verify step,
    4 requests of budget + 1 rows; the steps of 4 requests then sample no more. Steps
    sampled in chunks of 5 rows give the tokens and logprobs of one chunk (seeded, greedy,
    penalties on a chain, top-k / top-p, logprobs)."""
    from engine_runs import REPO
    from vllm import LLM, SamplingParams

    pair = REPO / "models" / "tiny-pair"
    llm = LLM(model=str(pair / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=4, max_num_batched_tokens=256,
              speculative_config={"method": "ddtree", "model": str(pair / "drafter"),
                                  "tree_budget": 16})
    rows: list[int] = []
    sample = node_sampling.sample_nodes

    def spy(sampler, logits, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        rows.append(logits.shape[0])
        return sample(sampler, logits, *args, **kwargs)

    monkeypatch.setattr(node_sampling, "sample_nodes", spy)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    runner.profile_run()
    assert rows == [4 * 17]

    prompts = ["def f(x):", "import os", "The quick", "x = ["]
    params = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=1, max_tokens=12,
                             ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, seed=2, presence_penalty=1.5, max_tokens=12,
                             ignore_eos=True, logprobs=1),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]

    def run() -> list:
        rows.clear()
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(len(o.token_ids) == 12 for o in outputs)
        assert max(rows) == 4 * 17, rows
        return [(list(o.token_ids), [{t: (lp.logprob, lp.rank) for t, lp in step.items()}
                                     for step in o.logprobs or []]) for o in outputs]

    vocab = runner.vocab_size
    assert node_sampling.rows_a_chunk(vocab) >= 4 * 17  # one chunk a step
    whole = run()
    monkeypatch.setattr(node_sampling, "CHUNK_ELEMENTS", 5 * vocab)
    assert run() == whole
