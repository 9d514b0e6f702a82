"""Method "ddtree" on hybrid targets (Gated DeltaNet + full attention) inside vLLM 0.34
(Model Runner V2) on a GPU: vLLM's CUDA GDN path hands each verify step's tree rows to
vllm_ddtree's Triton tree kernels (patch 0008), the accepted path is committed with them,
and greedy output is the target alone's, token for token, with trees accepted deep and off
the chain (the oracle drafter of tests/engine_helpers.py), with vLLM's defaults: prefix
caching on (align mode) and CUDA graphs on, the target's verify steps replaying FULL decode
graphs (the GDN tree path is graph-safe: gdn_verify.py). The oracle reads request state on
the host, which a captured graph cannot: the drafter's graph dispatch is turned to eager
here (its graphs are tests/cuda/test_engine_cuda.py's). The tiny hand-built Qwen3-Next and
the same model as a Qwen3.5 (M-RoPE), bf16 (tests/tools/test_tiny_hybrid.py measures their
margins)."""

from __future__ import annotations

import dataclasses
import gc

import make_tiny_models
import pytest
from engine_helpers import language_model_only, oracle_tree_logits
from test_engine_cuda import GraphRecord, greedy, make_llm, runner_of, tokens_of

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
    settings = language_model_only(pair)
    # The target alone, eager, 16 tokens past MAX_TOKENS for the oracle's look-ahead; its
    # continuations by the prompts' token ids (as the engine tokenized them).
    llm = make_llm(pair, "bfloat16", enforce_eager=True, enable_prefix_caching=False,
                   **settings)
    outputs = greedy(llm, MAX_TOKENS + 16, PROMPTS)
    baseline = tokens_of(outputs)
    truth = {tuple(o.prompt_token_ids): t for o, t in zip(outputs, baseline)}
    del llm, outputs
    gc.collect()

    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", oracle_tree_logits(truth, 16))
    spec = {"method": "ddtree", "model": str(pair / "drafter"),
            "speculator_options": {"tree_budget": 16}}
    llm = make_llm(pair, "bfloat16", spec, **settings)
    runner = runner_of(llm)
    config = llm.llm_engine.vllm_config
    assert config.cache_config.mamba_cache_mode == "align"  # prefix caching: vLLM's default
    assert runner.cudagraph_manager.cudagraph_mode.has_full_cudagraphs()
    drafter = runner.speculator.query_cudagraph_manager
    dispatch = drafter.dispatch

    def eager(*args, **kwargs):  # the oracle's host reads cannot run in a graph
        return dataclasses.replace(dispatch(*args, **kwargs), cg_mode=CUDAGraphMode.NONE)

    monkeypatch.setattr(drafter, "dispatch", eager)
    record = GraphRecord(runner.cudagraph_manager, monkeypatch)

    got = tokens_of(greedy(llm, MAX_TOKENS, PROMPTS))
    assert got == [t[:MAX_TOKENS] for t in baseline]
    verify_steps = [d for _, d in record.uniform(17)]  # tree_budget + 1 tokens a request
    assert verify_steps and all(d.cg_mode == CUDAGraphMode.FULL for d in verify_steps)
    assert record.replayed, "no verify step replayed a FULL graph"
    verifier = runner.speculator.verifier
    gdn = verifier.gdn
    # The GDN layers verified trees (inside the replayed graphs) and committed the paths.
    assert gdn is not None and gdn.commits > 0 and len(gdn.stash) == 3, gdn
    stats = verifier.stats()
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
