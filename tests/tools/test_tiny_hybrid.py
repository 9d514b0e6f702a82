"""The tiny hybrid target (scripts/make_tiny_models.py --hybrid): a Qwen3-Next with Gated
DeltaNet and full-attention layers, and in vLLM (CPU, bf16) greedy choices whose margins are
far above bf16 noise, so exactness tests on it fail only for logical reasons."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import make_tiny_models
import pytest
import torch
from safetensors import safe_open

GDN_WEIGHTS = ["A_log", "dt_bias", "conv1d.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
               "norm.weight", "out_proj.weight"]


def test_target_is_a_qwen3_next_hybrid_and_the_drafter_fits_it(tiny_hybrid: Path) -> None:
    target = json.loads((tiny_hybrid / "target/config.json").read_text())
    drafter = json.loads((tiny_hybrid / "drafter/config.json").read_text())
    assert target["architectures"] == ["Qwen3NextForCausalLM"]
    assert target["model_type"] == "qwen3_next" and target["torch_dtype"] == "bfloat16"
    types = target["layer_types"]
    assert len(types) == target["num_hidden_layers"]
    assert "full_attention" in types and types.count("linear_attention") >= 2
    assert target["num_experts"] > 0 and target["linear_key_head_dim"] == 128
    with safe_open(tiny_hybrid / "target/model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(n).dtype for n in names}
    for n, kind in enumerate(types):
        p = f"model.layers.{n}"
        if kind == "linear_attention":
            assert {f"{p}.linear_attn.{w}" for w in GDN_WEIGHTS} <= names
        else:
            assert {f"{p}.self_attn.q_proj.weight", f"{p}.self_attn.k_norm.weight"} <= names
        assert {f"{p}.mlp.experts.0.down_proj.weight", f"{p}.mlp.shared_expert_gate.weight",
                f"{p}.mlp.gate.weight"} <= names
    assert dtypes == {torch.bfloat16}
    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["vocab_size"] == target["vocab_size"]
    assert all(0 <= i < len(types) for i in drafter["dflash_config"]["target_layer_ids"])


def test_same_seed_same_bytes(tiny_hybrid: Path, tmp_path: Path) -> None:
    make_tiny_models.make_hybrid(tmp_path, seed=0)
    for name in ("target/model.safetensors", "target/config.json", "drafter/model.safetensors"):
        assert (tmp_path / name).read_bytes() == (tiny_hybrid / name).read_bytes()


@pytest.mark.slow
def test_greedy_is_the_same_batched_and_alone_with_large_margins(tiny_hybrid: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    gen = torch.Generator().manual_seed(1)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(
        4, 1000, (int(torch.randint(8, 41, (1,), generator=gen)),), generator=gen).tolist())
        for _ in range(8)]
    cleanup_dist_env_and_memory()  # Qwen3-Next's experts need their own parallel group
    llm = LLM(model=str(tiny_hybrid / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="bfloat16", max_num_seqs=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    batched = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]

    gaps = [top[0] - top[1] for o in batched + alone for step in o.outputs[0].logprobs
            for top in [sorted((lp.logprob for lp in step.values()), reverse=True)]]
    assert len(gaps) == 2 * 8 * 32 and min(gaps) > 0.1
    # The next token is not a function of the current one alone: context (GDN) counts.
    follow = defaultdict(set)
    for p, o in zip(prompts, batched):
        seq = [*p["prompt_token_ids"], *o.outputs[0].token_ids]
        for a, b in zip(seq[len(p["prompt_token_ids"]) - 1:], seq[len(p["prompt_token_ids"]):]):
            follow[a].add(b)
    assert max(len(v) for v in follow.values()) >= 2


@pytest.mark.slow
def test_qwen3_5_target_is_the_same_function(tiny_hybrid: Path, tiny_qwen3_5: Path,
                                             tiny_qwen3_5_text: Path) -> None:
    """The tiny Qwen3.5 (Qwen3_5ForConditionalGeneration: split GDN projections, a dense
    MLP, M-RoPE) is the Qwen3-Next rewritten: in vLLM both continue token prompts the same,
    greedy, so what differs between them is Qwen3.5's own code (its M-RoPE positions among
    it), and so does the text-only checkpoint, which vLLM runs with 1-D RoPE. Their tokenizer
    differs (transformers' Qwen3.5 class splits digits): token prompts."""
    from engine_helpers import language_model_only
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    config = json.loads((tiny_qwen3_5 / "target/config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["rope_parameters"]["mrope_section"]
    with safe_open(tiny_qwen3_5 / "target/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert not any("visual" in n or "experts" in n for n in names)
    gen = torch.Generator().manual_seed(2)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(
        4, 1000, (int(torch.randint(8, 41, (1,), generator=gen)),), generator=gen).tolist())
        for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = {}
    for pair in (tiny_hybrid, tiny_qwen3_5, tiny_qwen3_5_text):
        cleanup_dist_env_and_memory()
        llm = LLM(model=str(pair / "target"), enforce_eager=True, max_model_len=512, seed=0,
                  dtype="bfloat16", max_num_seqs=8, enable_prefix_caching=False,
                  **language_model_only(pair))
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
            .model_runner
        assert (runner.model_state.rope_state is not None) == (pair == tiny_qwen3_5)  # M-RoPE
        outputs[pair] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)]
        del llm
    assert outputs[tiny_hybrid] == outputs[tiny_qwen3_5] == outputs[tiny_qwen3_5_text]
