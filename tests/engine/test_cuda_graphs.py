"""Verify steps under Model Runner V2's CUDA graph manager, run on CPU as on a Hopper GPU.

vLLM's own code decides which graphs a ddtree engine captures and which one each step
replays: the sizing (`_set_cudagraph_sizes`, with patch 0002's decode request counts), the
mode resolution against TREE_ATTN's graph support, and `CudaGraphManager`'s capture loop
and dispatch (`v1/worker/gpu/cudagraph_utils.py`), the objects the runner builds. The CPU
has no CUDA graphs, so torch's capture is replaced by a recorder: what runs inside a capture
is what a replay runs again. Everything else is vLLM's code on ddtree's config."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
from test_series_hooks import PAIR, engine_config


class RecordedGraph:
    """torch.cuda.CUDAGraph's stand-in: the forward run inside its capture is its body."""

    capturing: RecordedGraph | None = None

    def __init__(self) -> None:
        self.body = None

    def replay(self) -> None:
        self.body()


@contextmanager
def recording(graph: RecordedGraph, pool=None, stream=None):
    RecordedGraph.capturing = graph
    try:
        yield
    finally:
        RecordedGraph.capturing = None


@pytest.fixture
def graph_manager(monkeypatch):
    """Builds vLLM's CudaGraphManager for a config the way the runner does (its mode
    resolved against the target's attention backend, its decode query lengths from the
    config), with single-rank stand-ins for the process groups and the recorder for torch's
    capture."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import cudagraph_utils

    monkeypatch.setattr(cudagraph_utils, "get_pp_group",
                        lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True))
    monkeypatch.setattr(cudagraph_utils, "graph_capture",
                        lambda device, stream: nullcontext(SimpleNamespace(stream=None)))
    monkeypatch.setattr(cudagraph_utils, "capture_pool", lambda pool, config: nullcontext())
    monkeypatch.setattr(cudagraph_utils, "current_stream", lambda: None)
    monkeypatch.setattr(cudagraph_utils, "is_global_first_rank", lambda: False)
    monkeypatch.setattr(current_platform, "get_global_graph_pool", lambda: object(),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", recording)

    def build(config, backend, varlen_decode: bool = False):
        from vllm.config import CUDAGraphMode

        cc = config.compilation_config
        cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM's default on a GPU
        cc.cudagraph_capture_sizes = cc.max_cudagraph_capture_size = None  # CPU's emptied
        config._set_cudagraph_sizes()
        query_len = config.uniform_decode_query_len
        mode = cc.resolve_cudagraph_mode_and_sizes(
            backend._cudagraph_support, "TREE_ATTN", query_len,
            max_num_reqs=config.scheduler_config.max_num_seqs)
        return cudagraph_utils.CudaGraphManager(
            config, torch.device("cpu"), mode,
            decode_query_lens=config.get_decode_cudagraph_query_lens(query_len),
            varlen_decode=varlen_decode)

    return build


def capture(manager) -> list:  # noqa: ANN001
    """Captures every graph of ``manager``; the list it returns records each forward run
    from now on, (descriptor, mode), and each replay, (descriptor, "replay")."""
    ran: list = []

    def create_forward_fn(desc, warmup: bool):  # noqa: ANN001, ANN202
        def forward(mode) -> None:  # noqa: ANN001
            if RecordedGraph.capturing is not None:
                RecordedGraph.capturing.body = lambda: ran.append((desc, "replay"))
            ran.append((desc, mode))
        return forward

    manager.capture(create_forward_fn)
    return ran


@pytest.mark.parametrize(("budget", "most"), [(16, 32), (64, 32), (256, 31), (1024, 7)])
def test_verify_steps_replay_full_graphs_for_1_to_32_requests(graph_manager, budget: int,
                                                              most: int) -> None:
    """Every verify batch of 1..32 requests (each request's tree_budget + 1 tokens) is
    dispatched, as the runner dispatches it, to a FULL graph of exactly its requests, whose
    replay runs what was captured for that shape, as far as vLLM's token cap for decode
    graphs allows (``most`` requests: 31 at budget 256, 7 at 1024, within 8192 tokens); one
    request more and a batch with a prefill chunk in it get no FULL graph (the first
    replays piecewise or runs eagerly)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

    from vllm_ddtree.attention.backend import TreeAttentionMetadataBuilder

    spec = {"method": "ddtree", "model": str(PAIR / "drafter"), "tree_budget": budget}
    config = engine_config(spec, max_num_batched_tokens=8192)
    manager = graph_manager(config, TreeAttentionMetadataBuilder)
    step = budget + 1

    ran = capture(manager)
    captured_full = {d.num_reqs for d in manager.graphs if d.cg_mode == CUDAGraphMode.FULL
                     and d.uniform_token_count == step}
    assert captured_full == set(range(1, most + 1)), sorted(captured_full)

    def dispatch(num_reqs: int, num_tokens: int, uniform: int | None):
        desc, _ = dispatch_cg_and_sync_dp(manager, num_reqs, num_tokens, uniform, 1, 0,
                                          max_query_len=step if uniform else num_tokens,
                                          uniform_decode=uniform == step)
        return desc

    for n in range(1, most + 1):
        desc = dispatch(n, n * step, step)
        assert (desc.cg_mode, desc.num_reqs, desc.num_tokens) == (
            CUDAGraphMode.FULL, n, n * step), (n, desc)
        ran.clear()
        manager.run_fullgraph(desc)
        assert ran == [(desc, "replay")]

    assert dispatch(most + 1, (most + 1) * step, step).cg_mode != CUDAGraphMode.FULL
    mixed = dispatch(3, 2 * step + 100, None)
    assert mixed.cg_mode != CUDAGraphMode.FULL and mixed.num_tokens >= 2 * step + 100


@pytest.mark.parametrize("budget", [16, 64])
def test_adaptive_verify_steps_replay_varlen_full_graphs(graph_manager, monkeypatch,
                                                        budget: int) -> None:
    """Adaptive trees verify a prefix of each request's tree: the runner's manager is
    vLLM's varlen one (patch 0013's seat), and with TREE_ATTN's declared bound every decode
    batch of 1..tree_budget + 1 tokens a request, in any mix, replays a FULL graph. The
    start-up check passes for TREE_ATTN's groups and refuses, naming both settings, a
    backend whose FULL graphs take uniform batches only."""
    import numpy as np
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

    from vllm_ddtree.attention.backend import TreeAttentionMetadataBuilder
    from vllm_ddtree.spec_decode.adaptive.sizing import use_varlen_graphs

    spec = {"method": "ddtree", "model": str(PAIR / "drafter"), "tree_budget": budget,
            "enable_adaptive_verification": True}
    config = engine_config(spec, max_num_batched_tokens=8192)
    step = budget + 1
    assert TreeAttentionMetadataBuilder.get_varlen_cudagraph_max_query_len(config, None) \
        == step

    def runner_with(builder) -> SimpleNamespace:  # noqa: ANN001
        group = SimpleNamespace(layer_names=["target.attn"], kv_cache_spec=None,
                                get_metadata_builder=lambda i: builder, backend=builder)
        kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            layer_names=["target.attn", "draft.attn"])])
        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
        return SimpleNamespace(compilation_config=config.compilation_config,
                               kv_cache_config=kv, attn_groups=[[group]],
                               vllm_config=config, decode_query_len=step, model=None)

    class UniformOnly(TreeAttentionMetadataBuilder):
        _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

        @classmethod
        def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec):  # noqa
            return None

    with pytest.raises(ValueError, match=r"enable_adaptive_verification.*UniformOnly.*"
                                         r"compilation_config\.cudagraph_mode"):
        use_varlen_graphs(runner_with(UniformOnly), {"draft.attn"})
    runner = runner_with(TreeAttentionMetadataBuilder)
    # Without piecewise capture (no compiled submodule), vLLM's resolution for its own
    # adaptive verification: FULL decode graphs only.
    monkeypatch.setattr(model_runner, "has_compiled_submodule", lambda model: False)
    use_varlen_graphs(runner, {"draft.attn"})
    assert runner.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY

    manager = graph_manager(config, TreeAttentionMetadataBuilder, varlen_decode=True)
    ran = capture(manager)
    rng = np.random.default_rng(0)
    for num_reqs in (1, 2, 5, 8, 16):
        lengths = rng.integers(1, step + 1, size=num_reqs)
        lengths[0] = step  # the scheduler's width: the longest query it scheduled
        num_tokens = int(lengths.sum())
        if num_tokens > 8192:
            continue
        uniform = step if (lengths == step).all() else None
        desc, _ = dispatch_cg_and_sync_dp(manager, num_reqs, num_tokens, uniform, 1, 0,
                                          max_query_len=step,
                                          uniform_decode=uniform == step)
        assert desc.cg_mode == CUDAGraphMode.FULL and desc.num_tokens >= num_tokens, (
            num_reqs, lengths, desc)
        assert desc.max_query_len is None or desc.max_query_len >= step
        ran.clear()
        manager.run_fullgraph(desc)
        assert ran == [(desc, "replay")]
