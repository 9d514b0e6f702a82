"""Method "ddtree" on hybrid targets (Gated DeltaNet + full attention) inside vLLM 0.34
(Model Runner V2) on a GPU: vLLM's CUDA GDN path hands each verify step's tree rows to
vllm_ddtree's Triton tree kernels (patch 0008), the accepted path is committed with them,
and greedy output is the target alone's, token for token, with trees accepted deep and off
the chain (the oracle drafter of tests/engine_helpers.py). On CUDA a hybrid target runs
without CUDA graphs (verify_vllm_config sets cudagraph_mode NONE: the GDN tree path reads
the step's trees on the host), torch.compile on. The tiny hand-built Qwen3-Next and the same
model as a Qwen3.5 (M-RoPE), bf16 (tests/tools/test_tiny_hybrid.py measures their margins)."""

from __future__ import annotations

import gc

import make_tiny_models
import pytest
from engine_helpers import language_model_only, oracle_tree_logits
from test_engine_cuda import greedy, make_llm, runner_of, tokens_of

# tests/engine/test_ddtree_hybrid.py's prompts.
PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(8)]
MAX_TOKENS = 20


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_lossless_on_the_gpu(tmp_path_factory: pytest.TempPathFactory, monkeypatch,
                                    arch: str) -> None:
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    pair = tmp_path_factory.mktemp(arch)
    make_tiny_models.make_hybrid(pair, seed=0, arch=arch)
    settings = dict(enable_prefix_caching=False, **language_model_only(pair))
    # The target alone, eager, 16 tokens past MAX_TOKENS for the oracle's look-ahead; its
    # continuations by the prompts' token ids (as the engine tokenized them).
    llm = make_llm(pair, "bfloat16", enforce_eager=True, **settings)
    outputs = greedy(llm, MAX_TOKENS + 16, PROMPTS)
    baseline = tokens_of(outputs)
    truth = {tuple(o.prompt_token_ids): t for o, t in zip(outputs, baseline)}
    del llm, outputs
    gc.collect()

    # The drafter runs eagerly here (no graphs), so the oracle's host reads are allowed.
    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", oracle_tree_logits(truth, 16))
    spec = {"method": "ddtree", "model": str(pair / "drafter"),
            "speculator_options": {"tree_budget": 16}}
    llm = make_llm(pair, "bfloat16", spec, **settings)
    runner = runner_of(llm)
    # No CUDA graphs on a hybrid target, for the target nor for DFlash's drafter.
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert runner.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert runner.cudagraph_manager.cudagraph_mode == CUDAGraphMode.NONE
    assert not runner.cudagraph_manager.graphs
    drafter_graphs = runner.speculator.query_cudagraph_manager
    assert drafter_graphs.cudagraph_mode == CUDAGraphMode.NONE and not drafter_graphs.graphs

    got = tokens_of(greedy(llm, MAX_TOKENS, PROMPTS))
    assert got == [t[:MAX_TOKENS] for t in baseline]
    verifier = runner.speculator.verifier
    gdn = verifier.gdn
    # The GDN layers verified trees and committed the accepted paths' state.
    assert gdn is not None and gdn.commits > 0 and gdn.stash == [], gdn
    stats = verifier.stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
