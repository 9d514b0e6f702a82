"""Method "ddtree" on hybrid targets (Gated DeltaNet + full attention) inside vLLM on a GPU:
vLLM's CUDA GDN path hands each verify step's tree rows to vllm_ddtree's Triton tree kernels
(patch 0015), the accepted path is committed with them, and greedy output is the target
alone's, token for token, with trees accepted deep and off the chain (the oracle drafter),
under the PIECEWISE CUDA graphs ddtree selects for hybrids (torch.compile on). The tiny
hand-built Qwen3-Next and the same model as a Qwen3.5 (M-RoPE), bf16 (tests/test_tiny_hybrid.py
measures their margins)."""

from __future__ import annotations

import gc

import make_tiny_models
import pytest
from test_ddtree_engine import ddtree_state, oracle_draft_logits
from test_ddtree_hybrid import PROMPTS, language_model_only
from test_engine_cuda import greedy, make_llm

MAX_TOKENS = 20


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_lossless_on_the_gpu(tmp_path_factory: pytest.TempPathFactory, monkeypatch,
                                    arch: str) -> None:
    from vllm.config import CUDAGraphMode

    from vllm_ddtree.runner import DDTreeProposer

    pair = tmp_path_factory.mktemp(arch)
    make_tiny_models.make_hybrid(pair, seed=0, arch=arch)
    settings = dict(enable_prefix_caching=False, **language_model_only(pair))
    llm = make_llm(pair, "bfloat16", enforce_eager=True, **settings)
    outputs = greedy(llm, MAX_TOKENS + 16, PROMPTS[:8])
    baseline = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    prompt_ids = {tuple(o.prompt_token_ids): o.prompt for o in outputs}
    del llm
    gc.collect()

    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(baseline, prompt_ids, seed=16))
    spec = {"method": "ddtree", "model": str(pair / "drafter"), "tree_budget": 16}
    llm = make_llm(pair, "bfloat16", spec, **settings)
    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    assert mode == CUDAGraphMode.PIECEWISE, mode
    got = {o.prompt: list(o.outputs[0].token_ids)
           for o in greedy(llm, MAX_TOKENS, PROMPTS[:8])}
    assert got == {p: t[:MAX_TOKENS] for p, t in baseline.items()}
    state = ddtree_state(llm)
    assert state._gdn and state._gdn.commits > 0  # the GDN layers verified trees
    assert state.stats()["longest_accepted"] >= 3, state.stats()
    del llm
    gc.collect()

