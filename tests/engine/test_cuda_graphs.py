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

    def build(config, backend):
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
            decode_query_lens=config.get_decode_cudagraph_query_lens(query_len))

    return build


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

    ran: list[tuple[object, CUDAGraphMode]] = []

    def create_forward_fn(desc, warmup: bool):
        def forward(mode: CUDAGraphMode) -> None:
            if RecordedGraph.capturing is not None:
                RecordedGraph.capturing.body = lambda: ran.append((desc, "replay"))
            ran.append((desc, mode))
        return forward

    manager.capture(create_forward_fn)
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
