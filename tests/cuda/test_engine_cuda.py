"""Method "ddtree" inside vLLM 0.34 (Model Runner V2) on a GPU, with the trained tiny pair
(models/tiny-pair, whose drafter the target often agrees with) and CUDA graphs on
(torch.compile and graph capture, as vLLM runs by default): greedy output is the target
alone's, token for token, in FULL_AND_PIECEWISE (the default) and PIECEWISE graph modes;
verify steps (tree_budget + 1 tokens a request) replay the target's captured FULL decode
graphs, keyed by request count, up to 32 requests (patch 0002); the drafter's steps, tree
build included, replay DFlash's captured FULL graph, with no drafting in Python while
serving; the target attends through TREE_ATTN's Triton implementation; trees are accepted
deep and off the drafter's greedy chain. And bfloat16 runs at budgets 16 and 64.

The oracle drafter of tests/engine_helpers.py (``oracle_tree_logits``) reads request state on
the host, which a captured graph can neither do nor replay: it serves the hybrid targets'
test (test_engine_hybrid_cuda.py), which runs without graphs, and the trained drafter drafts
here.

Engine start-ups (torch.compile, graph capture) dominate the time: one engine per graph mode
and budget, and the targets alone that the outputs are compared with."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_gpu_throughput import engine_kwargs

REPO = Path(__file__).resolve().parents[2]
PAIR = REPO / "models" / "tiny-pair"
# tests/engine/test_ddtree.py's prompts (trees accepted 3+ deep and off the spine there), and
# two more for a verify step of 8 requests.
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,",
           "for i in range(10):", "The capital of France is", "def main():",
           "import numpy as np\n"]
MAX_TOKENS = 40
MAX_NUM_SEQS = 8
BUDGET = 16


def tree_spec(pair: Path, budget: int) -> dict:
    return {"method": "ddtree", "model": str(pair / "drafter"),
            "speculator_options": {"tree_budget": budget}}


def make_llm(pair: Path, dtype: str, spec: dict | None = None, **settings):
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # An engine started earlier in this process may have left a parallel state without the
    # expert-parallel group a mixture-of-experts target (Qwen3-Next) needs.
    cleanup_dist_env_and_memory()
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


def greedy(llm, max_tokens: int = MAX_TOKENS, prompts: list[str] | None = None,
           logprobs: int | None = None) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    return llm.generate(prompts or PROMPTS, params, use_tqdm=False)


def tokens_of(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def runner_of(llm):
    """The engine's V2 GPUModelRunner (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0,
    tests/conftest.py)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner


class GraphRecord:
    """What a V2 CudaGraphManager (vllm/v1/worker/gpu/cudagraph_utils.py) does from now on:
    every ``dispatch`` (num_reqs, num_tokens, the uniform token count asked for, and the
    BatchExecutionDescriptor it chose: its cg_mode is what runs) and every FULL graph
    ``run_fullgraph`` replayed. The runner and DFlash's speculator reach their managers
    through these two methods only (model_runner.py execute_model, dp_utils.py
    dispatch_cg_and_sync_dp, dflash/speculator.py propose)."""

    def __init__(self, manager: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dispatched: list[tuple[int, int, int | None, Any]] = []
        self.replayed: list[Any] = []
        dispatch, run_fullgraph = manager.dispatch, manager.run_fullgraph

        def record_dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
            desc = dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
            self.dispatched.append((num_reqs, num_tokens, uniform_token_count, desc))
            return desc

        def record_replay(desc):
            self.replayed.append(desc)
            return run_fullgraph(desc)

        monkeypatch.setattr(manager, "dispatch", record_dispatch)
        monkeypatch.setattr(manager, "run_fullgraph", record_replay)

    def uniform(self, query_len: int) -> list[tuple[int, Any]]:
        """(num_reqs, descriptor) of the dispatches of uniform batches of ``query_len``."""
        return [(n, desc) for n, _, q, desc in self.dispatched if q == query_len]


class Recorded:
    """An engine's graph records after start-up: the target's (verify steps among them),
    the drafter's, and the drafter's forwards run in Python (not replayed)."""

    def __init__(self, llm, monkeypatch: pytest.MonkeyPatch) -> None:
        runner = runner_of(llm)
        speculator = runner.speculator
        self.target = GraphRecord(runner.cudagraph_manager, monkeypatch)
        self.drafter = GraphRecord(speculator.query_cudagraph_manager, monkeypatch)
        self.eager_drafts: list[int] = []
        generate_draft = speculator._generate_draft

        def counted(num_reqs, *args, **kwargs):
            self.eager_drafts.append(num_reqs)
            return generate_draft(num_reqs, *args, **kwargs)

        monkeypatch.setattr(speculator, "_generate_draft", counted)


def check_verify_graphs(llm, mode: str, record: GraphRecord, budget: int,
                        concurrency: set[int]) -> None:
    """vLLM kept graphs on in ``mode``; with FULL decode graphs it captured one per request
    count up to 32 at query length budget + 1 (patch 0002's sizes),
    and every verify step dispatched to one and replayed it; in PIECEWISE, verify steps ran
    the token-keyed piecewise graphs. Verify steps of every count in ``concurrency`` ran."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.spec_decode.config import DECODE_GRAPH_REQUESTS

    runner = runner_of(llm)
    step, cc, manager = budget + 1, runner.compilation_config, runner.cudagraph_manager
    want = CUDAGraphMode[mode]
    assert runner.decode_query_len == step
    assert cc.cudagraph_mode == want and manager.cudagraph_mode == want, \
        (cc.cudagraph_mode, manager.cudagraph_mode)
    verify = record.uniform(step)
    assert concurrency <= {n for n, _ in verify}, record.dispatched
    if want == CUDAGraphMode.FULL_AND_PIECEWISE:
        sizes = list(range(1, min(DECODE_GRAPH_REQUESTS, MAX_NUM_SEQS) + 1))
        assert cc.decode_cudagraph_capture_request_sizes == sizes, \
            cc.decode_cudagraph_capture_request_sizes
        captured = {d.num_reqs for d in manager.graphs if d.uniform_token_count == step}
        assert captured == set(sizes), (captured, sizes)
        assert all(d.cg_mode == CUDAGraphMode.FULL and d.uniform_token_count == step
                   and d.num_reqs >= n for n, d in verify), verify
        full = [d for *_, d in record.dispatched if d.cg_mode == CUDAGraphMode.FULL]
        assert record.replayed == full, (record.replayed, full)
    else:
        assert not manager.graphs, manager.graphs
        assert all(d.cg_mode == CUDAGraphMode.PIECEWISE for _, d in verify), verify
        assert record.replayed == []


def check_drafter_graphs(llm, mode: str, recorded: Recorded) -> None:
    """With FULL decode graphs DFlash captures its drafting forward (the tree build inside
    it: DDTreeSpeculator._generate_draft) at depth + 1 queries a request, and every draft
    step replays it: no draft runs in Python. DFlash has no piecewise graphs: in PIECEWISE
    it drafts eagerly."""
    from vllm.config.compilation import CUDAGraphMode

    speculator = runner_of(llm).speculator
    manager, record = speculator.query_cudagraph_manager, recorded.drafter
    q = speculator.num_query_per_req
    assert q == speculator.depth + 1
    assert record.dispatched, "no draft step"
    assert all(uniform == q for _, _, uniform, _ in record.dispatched), record.dispatched
    if mode == "FULL_AND_PIECEWISE":
        assert manager.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY, manager.cudagraph_mode
        assert manager.graphs and all(d.uniform_token_count == q for d in manager.graphs)
        descs = [d for *_, d in record.dispatched]
        assert all(d.cg_mode == CUDAGraphMode.FULL for d in descs), descs
        assert record.replayed == descs
        assert recorded.eager_drafts == [], recorded.eager_drafts
    else:
        assert manager.cudagraph_mode == CUDAGraphMode.NONE, manager.cudagraph_mode
        assert all(d.cg_mode == CUDAGraphMode.NONE for *_, d in record.dispatched)
        assert len(recorded.eager_drafts) == len(record.dispatched)


def check_tree_attention(llm) -> None:
    """The target's every attention layer is TREE_ATTN's CUDA (Triton) implementation; the
    drafter's are not (it attends without trees)."""
    from vllm_ddtree.attention.backend import TreeAttentionImpl

    runner = runner_of(llm)
    target = [type(m.impl) for m in runner.model.modules() if hasattr(m, "impl")]
    layers = runner.model_config.hf_config.num_hidden_layers
    assert target == [TreeAttentionImpl] * layers, target
    drafter = [type(m.impl) for m in runner.speculator.model.modules() if hasattr(m, "impl")]
    assert drafter and TreeAttentionImpl not in drafter, drafter


def check_acceptance(llm) -> None:
    """Trees accepted 3+ deep and through nodes off the spine (the drafter's greedy chain:
    a path off the node-index == depth line), and vLLM's mean acceptance length
    (1 + accepted per draft) above 2."""
    stats = runner_of(llm).speculator.verifier.stats()
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts, accepted = (metrics[f"vllm:spec_decode_num_{k}"] for k in ("drafts",
                                                                      "accepted_tokens"))
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    assert 1 + accepted / drafts > 2, (accepted, drafts, stats)


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
def float32_target(ieee_fp32_dots) -> list[list[int]]:
    """The target alone, greedy, eager (what ddtree must reproduce; its graphs are not
    under test)."""
    llm = make_llm(PAIR, "float32", enforce_eager=True)
    tokens = tokens_of(greedy(llm))
    del llm
    gc.collect()
    return tokens


# Lossless in float32: a verify step runs its tokens through the target as one batch of
# up to 8 * 17 rows (tree attention), the target alone one token per request per step;
# GEMMs and attention of other shapes sum in other orders. In float32 that moves logits by
# about 1e-6, far inside the tiny model's greedy margins; in bfloat16 by about 1e-2, enough
# to flip a near tie now and then, which is rounding, not a loss. So exact token equality
# is checked in float32 and the bfloat16 runs allow a first divergence at a near tie only.
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE"])
def test_lossless_with_cuda_graphs(float32_target, monkeypatch, mode: str) -> None:
    llm = make_llm(PAIR, "float32", tree_spec(PAIR, BUDGET),
                   compilation_config={"cudagraph_mode": mode})
    recorded = Recorded(llm, monkeypatch)
    assert tokens_of(greedy(llm)) == float32_target
    check_verify_graphs(llm, mode, recorded.target, BUDGET, {len(PROMPTS)})
    check_drafter_graphs(llm, mode, recorded)
    check_tree_attention(llm)
    check_acceptance(llm)


# A first divergence from the target alone is allowed where the target alone's top two
# choices are within this many nats (bfloat16 rounding), in at most a quarter of the prompts.
NEAR_TIE = 0.15


def assert_lossless_up_to_near_ties(got: list[list[int]], alone: list) -> None:
    diverged = []
    for i, (tokens, out) in enumerate(zip(got, alone)):
        want = list(out.outputs[0].token_ids)[:len(tokens)]
        if tokens == want:
            continue
        at = next(j for j, (a, b) in enumerate(zip(tokens, want)) if a != b)
        top = sorted((lp.logprob for lp in out.outputs[0].logprobs[at].values()),
                     reverse=True)
        margin = top[0] - top[1] if len(top) > 1 else float("inf")
        assert margin < NEAR_TIE, (f"prompt {i} diverges at token {at} where the target "
                                   f"alone's margin is {margin:.3f}", tokens, want)
        diverged.append(i)
    assert len(diverged) <= len(got) // 4, diverged


@pytest.fixture(scope="module")
def bfloat16_target_on_tree_attn() -> dict[int, list]:
    """The bfloat16 target alone, with vLLM's default CUDA graphs and on TREE_ATTN (without
    trees it attends causally), so that both sides use the same attention kernel and
    differ only by batch shapes; greedy at concurrency 1 and 8, with the top-2 logprobs
    (assert_lossless_up_to_near_ties reads them). Its decode steps replayed FULL graphs."""
    from vllm.config.compilation import CUDAGraphMode

    llm = make_llm(PAIR, "bfloat16", attention_backend="TREE_ATTN")
    with pytest.MonkeyPatch.context() as mp:
        record = GraphRecord(runner_of(llm).cudagraph_manager, mp)
        out = {conc: greedy(llm, prompts=PROMPTS[:conc], logprobs=2) for conc in (1, 8)}
    decode = [d.cg_mode for _, d in record.uniform(1)]
    assert decode and set(decode) == {CUDAGraphMode.FULL}, record.dispatched
    del llm, record
    gc.collect()
    return out


@pytest.mark.parametrize("budget", [16, 64])
def test_bfloat16_default_graphs_lossless_on_the_gpu_path(
        bfloat16_target_on_tree_attn, monkeypatch, budget: int) -> None:
    """What a GPU serves: bfloat16, vLLM's default CUDA-graph mode, the Triton TREE_ATTN
    and the CUDA tree ops; greedy output equals the target alone on the same kernel (up to
    bfloat16 near ties), at concurrency 1 and 8, with verify steps replaying FULL graphs
    (at budget 64, 8 requests are 520 tokens: a graph only patch 0002's 32-request default
    captures; vLLM's own stops at 512 // 65 = 7 requests), drafts replaying DFlash's graph,
    trees accepted deep and off the greedy chain."""
    import vllm_ddtree.ops  # noqa: F401  (the tree ops, built with CUDA by gpu_check.sh)

    llm = make_llm(PAIR, "bfloat16", tree_spec(PAIR, budget))
    assert llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    assert torch.ops.vllm_ddtree.build_tree.default.has_kernel_for_dispatch_key("CUDA")
    recorded = Recorded(llm, monkeypatch)
    for conc in (1, 8):
        got = tokens_of(greedy(llm, prompts=PROMPTS[:conc]))
        assert_lossless_up_to_near_ties(got, bfloat16_target_on_tree_attn[conc])
    check_verify_graphs(llm, "FULL_AND_PIECEWISE", recorded.target, budget, {1, 8})
    check_drafter_graphs(llm, "FULL_AND_PIECEWISE", recorded)
    check_tree_attention(llm)
    check_acceptance(llm)


def test_adaptive_trees_replay_varlen_full_graphs(float32_target, monkeypatch) -> None:
    """Adaptive trees (set costs: sizes vary by request and step) with vLLM's default
    graphs: greedy output is the target alone's, and verify steps whose requests verify
    prefixes of different lengths replay FULL graphs (vLLM's varlen decode graphs, which
    TREE_ATTN declares it replays)."""
    from engine_helpers import fixed_step_costs, use_step_costs
    from vllm.config.compilation import CUDAGraphMode

    spec = tree_spec(PAIR, BUDGET) | {"enable_adaptive_verification": True}
    llm = make_llm(PAIR, "float32", spec)
    runner = runner_of(llm)
    assert runner.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    sizing = use_step_costs(runner, fixed_step_costs(per_token_ms=0.01, draft_ms=0.05))
    record = GraphRecord(runner.cudagraph_manager, monkeypatch)
    assert tokens_of(greedy(llm)) == float32_target
    chosen = sizing.stats()
    assert 0 < chosen["min_nodes"] < chosen["max_nodes"], chosen
    varlen = [d for d in record.replayed
              if d.uniform_token_count is None and d.max_query_len == BUDGET + 1]
    assert varlen, record.dispatched
    assert runner.speculator.verifier.stats()["longest_accepted"] >= 3
    assert chosen["paths_off_the_greedy_chain"] > 0, chosen
