"""Method "ddtree" inside vLLM on a GPU, with the tiny pair and CUDA graphs on (torch.compile
and graph capture, as vLLM runs by default): greedy output is the target alone's, token for
token, in FULL and PIECEWISE graph modes; verify steps replay captured graphs; the target
attends through TREE_ATTN's Triton implementation; trees are accepted deep and off the
greedy chain (the oracle drafter of tests/test_ddtree_engine.py). And a bfloat16 run.

Engine start-ups (torch.compile, graph capture) dominate the time: one engine per graph mode
and dtype, and the eager targets alone that the oracle reads from."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bench_gpu_throughput import engine_kwargs
from test_ddtree_engine import PROMPTS as PROMPTS_ALL
from test_ddtree_engine import ddtree_state, oracle_draft_logits

PROMPTS = PROMPTS_ALL[:4]
MAX_TOKENS = 24
MAX_NUM_SEQS = 4
BUDGET = 16
STEP = BUDGET + 1  # tokens per request in a verify step: the root and the tree's nodes


def make_llm(pair: Path, dtype: str, spec: dict | None = None, **settings):
    from vllm import LLM

    # With vLLM's compiled ops replaced by their pure-PyTorch stand-in (the lent machine,
    # where the wheel's ops fail), every engine needs the settings that keep vLLM off them.
    standin = {}
    if os.environ.get("VLLM_DDTREE_STANDIN_OPS") == "1":
        from gpu_machine.standin_ops import standin_engine_kwargs

        standin = standin_engine_kwargs()
    # Engines follow one another in this process: each takes a small share of the GPU and a
    # fixed KV cache (a share of an H200 would be about a million blocks to set up).
    return LLM(**engine_kwargs(dict(
        model=str(pair / "target"), dtype=dtype, seed=0, max_model_len=512,
        max_num_seqs=MAX_NUM_SEQS, disable_log_stats=False, gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=1 << 30, speculative_config=spec), settings, standin))


def greedy(llm, max_tokens: int = MAX_TOKENS, prompts: list[str] | None = None) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts or PROMPTS, params, use_tqdm=False)


def target_alone(pair: Path, dtype: str) -> tuple[dict[str, list], dict[tuple, str]]:
    """The target alone, greedy, eager (what ddtree must reproduce; its graphs are not under
    test), 16 tokens past MAX_TOKENS for the oracle's look-ahead; and the prompts' ids."""
    llm = make_llm(pair, dtype, enforce_eager=True)
    outputs = greedy(llm, MAX_TOKENS + 16)
    del llm
    gc.collect()
    return ({o.prompt: list(o.outputs[0].token_ids) for o in outputs},
            {tuple(o.prompt_token_ids): o.prompt for o in outputs})


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32_dots():
    """vLLM's Triton attention (the float32 target alone's backend: FlashAttention has no
    float32) leaves tl.dot at Triton's default, TF32 on Hopper, while the tree kernel
    computes float32 dots in IEEE: both in IEEE, so that the two sides differ only by
    summation order. Set before any kernel compiles (Triton keys its cache on it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_F32_DEFAULT", "ieee")
        yield


@pytest.fixture(scope="module")
def float32_target(tiny_models: Path, ieee_fp32_dots):
    return target_alone(tiny_models, "float32")


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner


def record_dispatches(llm, monkeypatch) -> list:
    """Per step after start-up: (num_tokens, uniform decode, graph mode run), as vLLM's
    cudagraph metrics (observability_config.cudagraph_metrics) record it: the mode is the
    dispatcher's answer. Verify steps are the uniform ones."""
    dispatcher, dispatched = runner_of(llm).cudagraph_dispatcher, []
    dispatch = dispatcher.dispatch

    def record(num_tokens, *args, **kwargs):
        runtime_mode, batch = dispatch(num_tokens, *args, **kwargs)
        uniform = kwargs.get("uniform_decode", args[0] if args else False)
        dispatched.append((num_tokens, uniform, runtime_mode))
        return runtime_mode, batch

    monkeypatch.setattr(dispatcher, "dispatch", record)
    return dispatched


# Triton kernels that a ddtree engine compiles at start-up (vllm_ddtree/warmup.py): none
# may compile while it serves.
STARTUP_KERNELS = {"_tree_attention_kernel", "_merge_splits", "_partial_topk_kernel",
                   "_ranked_topk_kernel", "copy_and_expand_dflash_inputs_kernel"}


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The names of the Triton kernels compiled within (Triton's post-compile hook, which
    vLLM's JIT monitor uses too)."""
    from triton import knobs

    names, previous = [], knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        names.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def install_oracle(target, monkeypatch, seed: int) -> None:
    from vllm_ddtree.runner import DDTreeProposer

    tokens, prompt_ids = target
    monkeypatch.setattr(DDTreeProposer, "draft_logits",
                        oracle_draft_logits(tokens, prompt_ids, seed=seed))


def run_ddtree(pair: Path, target, monkeypatch, dtype: str, mode: str, seed: int, **settings):
    """ddtree under cudagraph_mode ``mode`` with the oracle drafter reading ``target``; the
    outputs, the engine and its dispatches after start-up."""
    install_oracle(target, monkeypatch, seed)
    spec = {"method": "ddtree", "model": str(pair / "drafter"), "tree_budget": BUDGET}
    llm = make_llm(pair, dtype, spec, **engine_kwargs(
        {"compilation_config": {"cudagraph_mode": mode}}, settings))
    dispatched = record_dispatches(llm, monkeypatch)
    with triton_compiles() as compiled:
        outputs = greedy(llm)
    assert not STARTUP_KERNELS & set(compiled), compiled
    return outputs, llm, dispatched


def check_graphs(llm, mode: str, dispatched: list) -> None:
    """vLLM kept graphs on, captured the verify step's sizes, and replayed them."""
    from vllm.config.compilation import CUDAGraphMode

    runner = ddtree_state(llm).runner
    cc = runner.compilation_config
    assert runner.uniform_decode_query_len == STEP
    # TREE_ATTN's builder captures uniform batches only (AttentionCGSupport.UNIFORM_BATCH):
    # vLLM turns FULL into FULL_AND_PIECEWISE (its default on a GPU), full graphs for the
    # verify steps (uniform: STEP tokens per request) and piecewise ones for mixed batches.
    # In PIECEWISE, attention runs eagerly between captured pieces.
    resolved = {"FULL": CUDAGraphMode.FULL_AND_PIECEWISE, "PIECEWISE": CUDAGraphMode.PIECEWISE}
    assert cc.cudagraph_mode == resolved[mode]
    assert runner.cudagraph_dispatcher.cudagraph_mode == resolved[mode]
    # vLLM's default sizes hold the verify step of 1, 2 and MAX_NUM_SEQS requests (its
    # uniform decode sizes); with full decode graphs it rounds every size to a multiple of
    # STEP (adjust_cudagraph_sizes_for_spec_decode).
    sizes = cc.cudagraph_capture_sizes
    assert {STEP, 2 * STEP, MAX_NUM_SEQS * STEP} <= set(sizes), sizes
    if mode == "FULL":
        assert all(s % STEP == 0 for s in sizes), sizes
    verify = [(n, run) for n, uniform, run in dispatched if uniform]
    assert MAX_NUM_SEQS * STEP in {n for n, _ in verify}, dispatched  # all 4 at once
    want = CUDAGraphMode.FULL if mode == "FULL" else CUDAGraphMode.PIECEWISE
    assert {run for _, run in verify} == {want}, verify


def check_tree_attention(llm) -> None:
    """The target's every attention layer is TREE_ATTN's CUDA (Triton) implementation; the
    drafter's are not (it attends without trees)."""
    from vllm_ddtree.attention.backend import TreeAttentionImpl

    runner = ddtree_state(llm).runner
    target = [type(m.impl) for m in runner.model.modules() if hasattr(m, "impl")]
    layers = runner.model_config.hf_config.num_hidden_layers
    assert target == [TreeAttentionImpl] * layers, target
    drafter = [type(m.impl) for m in runner.drafter.model.modules() if hasattr(m, "impl")]
    assert drafter and TreeAttentionImpl not in drafter, drafter


def acceptance(llm) -> tuple[dict[str, int], float]:
    """The tree counters and vLLM's mean acceptance length (1 + accepted per draft)."""
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts, accepted = (metrics[f"vllm:spec_decode_num_{k}"] for k in ("drafts",
                                                                      "accepted_tokens"))
    return ddtree_state(llm).stats(), 1 + accepted / drafts


# Lossless in float32: a verify step runs its tokens through the target as one batch of
# up to 68 rows (tree attention), the target alone one token per request per step; GEMMs
# and attention of other shapes sum in other orders. In float32 that moves logits by about
# 1e-6, far inside the tiny model's greedy margins; in bfloat16 by about 1e-2, enough to
# flip a near tie now and then, which is rounding, not a loss. So token equality is checked
# in float32 (as the CPU suite does) and the bfloat16 run checks everything else.
@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_lossless_with_cuda_graphs(tiny_models: Path, float32_target, monkeypatch,
                                   mode) -> None:
    outputs, llm, dispatched = run_ddtree(tiny_models, float32_target, monkeypatch,
                                          "float32", mode, seed=11)
    tokens, _ = float32_target
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: t[:MAX_TOKENS] for p, t in tokens.items()}
    check_graphs(llm, mode, dispatched)
    check_tree_attention(llm)
    stats, mean_length = acceptance(llm)
    # With the spine, nodes 1..depth are the drafter's greedy chain: a path off that line
    # was accepted off the chain.
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    assert mean_length > 2, (mean_length, stats)


BF16_PROMPTS = PROMPTS_ALL[:8]


@pytest.fixture(scope="module")
def bfloat16_target_on_tree_attn(tiny_models: Path) -> dict[int, tuple]:
    """The bfloat16 target alone, with vLLM's default CUDA graphs and on TREE_ATTN (without
    trees it attends causally), so that both sides use the same attention kernel and
    differ only by batch shapes; greedy at concurrency 1 and 8 (the oracle's look-ahead
    included), and its graph replays."""
    llm = make_llm(tiny_models, "bfloat16", max_num_seqs=8, attention_backend="TREE_ATTN")
    dispatched = []
    with pytest.MonkeyPatch.context() as mp:
        dispatched = record_dispatches(llm, mp)
        out = {}
        for conc in (1, 8):
            outputs = greedy(llm, MAX_TOKENS + 16, BF16_PROMPTS[:conc])
            out[conc] = ({o.prompt: list(o.outputs[0].token_ids) for o in outputs},
                         {tuple(o.prompt_token_ids): o.prompt for o in outputs})
    from vllm.config.compilation import CUDAGraphMode

    decode = [run for n, uniform, run in dispatched if uniform]
    assert decode and set(decode) == {CUDAGraphMode.FULL}, dispatched
    del llm
    gc.collect()
    return out


@pytest.mark.parametrize("budget", [16, 64])
def test_bfloat16_default_graphs_lossless_on_the_gpu_path(
        tiny_models: Path, bfloat16_target_on_tree_attn, monkeypatch, budget) -> None:
    """What a GPU serves: bfloat16, vLLM's default CUDA-graph mode, the Triton TREE_ATTN
    and the CUDA tree ops; greedy output equals the target alone on the same kernel, at
    concurrency 1 and 8, with verify steps replaying full graphs, trees accepted deep and
    off the greedy chain."""
    from vllm.config.compilation import CUDAGraphMode

    import vllm_ddtree.ops  # noqa: F401  (the tree ops, built with CUDA by gpu_check.sh)

    spec = {"method": "ddtree", "model": str(tiny_models / "drafter"), "tree_budget": budget}
    llm = make_llm(tiny_models, "bfloat16", spec, max_num_seqs=8)
    assert llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    assert torch.ops.vllm_ddtree.build_tree.default.has_kernel_for_dispatch_key("CUDA")
    dispatched = record_dispatches(llm, monkeypatch)
    with triton_compiles() as compiled:
        for conc in (1, 8):
            target = bfloat16_target_on_tree_attn[conc]
            install_oracle(target, monkeypatch, seed=11 + conc)
            outputs = greedy(llm, MAX_TOKENS, BF16_PROMPTS[:conc])
            assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
                p: t[:MAX_TOKENS] for p, t in target[0].items()}, conc
    # Start-up built a tree from the drafter's bfloat16 logits; the oracle's are float32,
    # which only the top-k's pass over the logits reads.
    assert not (STARTUP_KERNELS - {"_partial_topk_kernel"}) & set(compiled), compiled
    check_tree_attention(llm)
    verify = [(n, run) for n, uniform, run in dispatched if uniform]
    assert {n for n, _ in verify} >= {budget + 1, 8 * (budget + 1)}, verify
    assert {run for _, run in verify} == {CUDAGraphMode.FULL}, verify
    stats, mean_length = acceptance(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    assert mean_length > 2, (mean_length, stats)
