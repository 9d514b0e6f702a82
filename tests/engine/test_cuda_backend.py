"""TREE_ATTN's CUDA backend inside V2's engine, on CPU tensors: vLLM's Triton KV layout, the
backend's metadata builder on the runner's real batches, the Triton tree kernel on the
interpreter (for gpt-oss with sinks, and a window in every other layer), and the CUDA tree
ops (csrc/cuda/tree_ops.cu: build, verify, compaction in that layout) on the CPU emulator,
with trees accepted deep and off the chain: lossless. What a GPU runs, bar the device,
graph capture and vLLM's cache-write kernel."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from engine_helpers import oracle_tree_logits, other_target_pair
from engine_runs import tree_stats

pytestmark = pytest.mark.slow
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,"]
TREE_OPS = ("build_tree", "verify_tree", "compact_tree")
# What the kernel reads of the step's metadata: the same buffers at every step, or a
# captured graph would replay stale data (block tables: one per KV-cache group).
METADATA_ARGS = ("block_table", "seq_lens", "query_start_loc", "tree_index", "ancestor_mask",
                 "depths")


@pytest.fixture
def cuda_ops_on_the_emulator(monkeypatch: pytest.MonkeyPatch, emulated_cuda_ops
                             ) -> dict[str, int]:
    """For one test, torch.ops.vllm_ddtree.* run the CUDA ops' source on tests/cuda_emulator;
    the calls are counted per op, and "deepest_move" is the deepest path position whose
    node compaction had to move."""
    import vllm_ddtree.ops  # noqa: F401  (registers the ops replaced here)

    calls = dict.fromkeys((*TREE_OPS, "deepest_move"), 0)

    def counted(name: str):  # noqa: ANN202
        def op(*args):  # noqa: ANN002, ANN202
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


def generate(pair: Path, spec: dict | None, max_tokens: int):  # noqa: ANN201
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # gpt-oss's experts need their own parallel group
    llm = LLM(model=str(pair / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=4, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=1)
    return {o.prompt: o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)}, llm


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_cuda_backend_in_the_engine_on_the_interpreter(tiny_models: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       family: str, cuda_tree_attn_on_cpu,
                                                       cuda_ops_on_the_emulator,
                                                       emulated_cuda_ops) -> None:
    from vllm_ddtree.attention import backend
    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    pair = tiny_models if family == "qwen3" else other_target_pair(tiny_models, tmp_path,
                                                                   family)
    # 24 tokens for Qwen3: enough later steps to read what deep moves wrote. The random
    # gpt-oss barely reads its KV (its sinks take most of the attention): longer runs buy
    # little there.
    max_tokens = 24 if family == "qwen3" else 12
    alone, llm = generate(pair, None, max_tokens + 16)  # the oracle looks 16 tokens ahead
    encode = llm.get_tokenizer().encode
    truth = {tuple(encode(p)): list(o.token_ids) for p, o in alone.items()}
    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", oracle_tree_logits(truth, 11))
    launches: dict[str, list[torch.Tensor]] = {}
    kernel = backend.tree_attention

    def tree_attention(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        bound = inspect.signature(kernel).bind(*args, **kwargs).arguments
        for name in METADATA_ARGS:
            launches.setdefault(name, []).append(bound[name])  # kept alive: no reuse
        return kernel(*args, **kwargs)

    monkeypatch.setattr(backend, "tree_attention", tree_attention)
    outputs, llm = generate(pair, {"method": "ddtree", "tree_budget": 16,
                                   "model": str(pair / "drafter")}, max_tokens)
    for prompt, out in outputs.items():
        want = alone[prompt]
        assert list(out.token_ids) == list(want.token_ids[:max_tokens]), prompt
        # Each token's logprob too (float32): a KV entry the compaction left wrong shifts
        # the later logprobs of its request even where it flips no greedy token.
        for j, (token, w, g) in enumerate(zip(want.token_ids, want.logprobs, out.logprobs)):
            assert abs(g[token].logprob - w[token].logprob) < 1e-4, (prompt, j)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    impls = [m.impl for m in runner.model.modules()
             if isinstance(getattr(m, "impl", None), backend.TreeAttentionImpl)]
    assert len(impls) == 4
    if family == "gpt-oss":
        assert sorted(i.sliding_window[0] for i in impls) == [-1, -1, 3, 3]
        assert all(i.sinks is not None for i in impls)
    assert any((t >= 0).any() for t in launches["tree_index"])  # launches with trees
    addresses = {name: {t.data_ptr() for t in tensors} for name, tensors in launches.items()}
    tables = {t.data_ptr() for t in runner.block_tables.input_block_tables}
    assert addresses.pop("block_table") <= tables  # each group's persistent table
    assert {name: len(a) for name, a in addresses.items()} == dict.fromkeys(
        METADATA_ARGS[1:], 1), addresses
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    calls = cuda_ops_on_the_emulator
    assert all(calls[name] > 0 for name in TREE_OPS), calls
    assert calls["deepest_move"] >= (5 if family == "qwen3" else 3), calls
    parallel, serial = emulated_cuda_ops.take_build_counts()
    assert parallel > 0 and serial == 0, (parallel, serial)  # every tree built in parallel


def test_jetspec_head_on_the_cuda_backend_never_sees_the_targets_trees(
        monkeypatch: pytest.MonkeyPatch, cuda_tree_attn_on_cpu,
        cuda_ops_on_the_emulator) -> None:
    """A causal JetSpec head attends through TREE_ATTN's CUDA backend too (its layers'
    builders are the drafter's own). Without the spine a tree's nodes are not causal, so a
    drafter handed the target's trees would attend through the last verify step's masks:
    every attention call of the drafter's layers must be told no tree, and the output stays
    the target's (greedy, logprobs) with the trained head's trees accepted off the spine."""
    from vllm_ddtree.attention import backend

    pair = Path(__file__).resolve().parents[2] / "models" / "tiny-pair"
    alone, _ = generate(pair, None, 24)
    forward = backend.TreeAttentionImpl.forward
    calls: list[tuple[str, bool]] = []  # per call: the layer, whether a request had a tree

    def recorded(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None:
            calls.append((layer.layer_name, bool((attn_metadata.tree_index >= 0).any())))
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, *args,
                       **kwargs)

    monkeypatch.setattr(backend.TreeAttentionImpl, "forward", recorded)
    spec = {"method": "jetspec", "model": str(pair / "jetspec-drafter"), "tree_budget": 16,
            "tree_spine": False}
    outputs, llm = generate(pair, spec, 24)
    for prompt, out in outputs.items():
        want = alone[prompt]
        assert list(out.token_ids) == list(want.token_ids), prompt
        for j, (token, w, g) in enumerate(zip(want.token_ids, want.logprobs, out.logprobs)):
            assert abs(g[token].logprob - w[token].logprob) < 1e-4, (prompt, j)
    speculator = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner.speculator
    assert speculator.spine is False and speculator.widths == (7,)
    drafter = [tree for name, tree in calls if name in speculator.draft_attn_layer_names]
    assert drafter and not any(drafter), f"{sum(drafter)} of {len(drafter)} calls with trees"
    assert any(tree for name, tree in calls if name not in speculator.draft_attn_layer_names)
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 2 and stats["paths_off_the_index_line"] > 0, stats
