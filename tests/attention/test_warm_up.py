"""No Triton kernel of ours compiles once the engine serves: the warm-up forward (the first
tree step's, V2's start-up warm-up step, under TreeBatch.set_warm_up: tested in
tests/engine/test_ddtree_limits.py) launches every configuration a real step can launch.
Launches are compared by the key Triton's CUDA JIT compiles them under (jit_keys.py, beside
this file), worked out on CPU: the tree kernel and its merge on Triton's interpreter, with
split counts chosen as on a GPU of 8 multiprocessors (off CUDA nothing is split)."""

from __future__ import annotations

import jit_keys
import pytest
import torch

HEADS, KV_HEADS, HEAD_SIZE, PAGE, BUDGET = 8, 2, 64, 16, 15


@pytest.fixture
def gpu_split_counts(monkeypatch) -> None:
    """auto_splits as on a GPU of 8 multiprocessors: 1, 2 and 4 splits within small
    batches."""
    from vllm_ddtree.attention import triton_tree_attention as tta

    auto = tta.auto_splits
    monkeypatch.setattr(tta, "_multiprocessors", lambda device: 8)
    monkeypatch.setattr(tta, "auto_splits",
                        lambda programs, device: auto(programs, torch.device("cuda")))


def record_launches(monkeypatch, execute: bool = True) -> list:
    from vllm_ddtree import ranked_topk
    from vllm_ddtree.attention import triton_tree_attention as tta

    return jit_keys.record_launches(monkeypatch, {
        "attention": tta._tree_attention_kernel, "merge": tta._merge_splits,
        "top-k": ranked_topk._partial_topk_kernel, "ranking": ranked_topk._ranked_topk_kernel},
        execute)


def split_counts(launches: list, windowed: bool | None = None) -> set[int]:
    return {jit_keys.constexpr(key, "NUM_SPLITS") for name, key in launches
            if name == "attention" and windowed in (None, jit_keys.constexpr(key, "HAS_WINDOW"))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window, with_sinks", [(None, False), (None, True), (6, True)])
@pytest.mark.usefixtures("gpu_split_counts")
def test_warm_up_forward_launches_exactly_what_steps_launch(monkeypatch, dtype, window,
                                                            with_sinks) -> None:
    # The backend's forward over every batch shape up to 160 tokens in 8 requests (tree
    # buffers as the runner installs them, padded queries as vLLM pads batches) launches
    # exactly the configurations that one forward of one token launches under
    # TreeBatch.set_warm_up((160, 8)): each split count auto_splits picks (1, 2 and 4; none with a
    # window) with its merge, and no other key (a batch size changes no other argument's
    # specialization). The kernels are not run.
    from vllm_ddtree.attention import backend, tree_batch

    max_tokens, max_reqs = 160, 8
    launches = record_launches(monkeypatch, execute=False)
    sinks = torch.linspace(-2.0, 3.0, HEADS) if with_sinks else None
    impl = backend.TreeAttentionImpl(HEADS, HEAD_SIZE, 0.125, KV_HEADS, None, window, "auto",
                                     sinks=sinks)
    kv_cache = torch.zeros(8, KV_HEADS, PAGE, 2 * HEAD_SIZE, dtype=dtype)
    trees = tree_batch.TreeBatch(max_reqs, BUDGET, "cpu")
    block_table = torch.zeros(max_reqs, 16, dtype=torch.int32)
    seq_lens = torch.zeros(max_reqs, dtype=torch.int32)
    query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32)

    def step(num_tokens: int, num_reqs: int) -> None:
        query = torch.empty(num_tokens + 3, HEADS, HEAD_SIZE, dtype=dtype)
        metadata = backend.TreeAttentionMetadata(
            num_actual_tokens=num_tokens, query_start_loc=query_start_loc[:num_reqs + 1],
            seq_lens=seq_lens[:num_reqs], block_table=block_table[:num_reqs],
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            tree_index=trees.tree_index[:num_reqs], ancestor_mask=trees.ancestor_mask,
            depths=trees.depths, warm_up=trees.warm_up)
        impl.forward(None, query, None, None, kv_cache, metadata, torch.empty_like(query))

    trees.set_warm_up((max_tokens, max_reqs))
    step(1, 1)
    trees.set_warm_up(None)
    start_up = set(launches)
    launches.clear()
    for num_reqs in range(1, max_reqs + 1):
        for num_tokens in range(num_reqs, max_tokens + 1):
            step(num_tokens, num_reqs)
    assert set(launches) == start_up
    assert split_counts(launches) == ({1} if window else {1, 2, 4})
    assert any(name == "merge" for name, _ in launches) == (window is None)


def test_top_k_compiles_once_for_every_batch(monkeypatch) -> None:
    """On a GPU of 132 multiprocessors a row of Qwen3's vocabulary is split over 32 down to
    1 programs as the batch grows (15 rows a request): the top-k kernels' launches share one
    key, so warm-up's one tree (one request) compiles what every batch launches."""
    from vllm_ddtree import ranked_topk as rk

    monkeypatch.setattr(rk, "_multiprocessors", lambda device: 132)
    auto = rk.auto_splits
    monkeypatch.setattr(rk, "auto_splits",
                        lambda rows, vocab, device: auto(rows, vocab, torch.device("cuda")))
    launches = record_launches(monkeypatch, execute=False)
    logits = torch.empty(64 * 15, 151936, dtype=torch.bfloat16)
    splits = set()
    for reqs in (1, 2, 3, 5, 8, 16, 33, 64):
        splits.add(rk.auto_splits(reqs * 15, 151936, logits.device))
        rk.ranked_topk(logits[:reqs * 15], 256)
    assert splits >= {1, 2, 17}
    assert len({key for name, key in launches if name == "top-k"}) == 1
    assert len({key for name, key in launches if name == "ranking"}) == 1


def test_split_choices_span_the_engine_bounds(monkeypatch) -> None:
    # 64 x 64 tiles (bf16) and 4 query heads per KV head: 16 tokens a query tile, 2 KV
    # heads. On 8 multiprocessors (4 programs each) up to 8 tiles get 2 or more splits, 2
    # and 3 tiles 4 splits; a step has 2 tiles at least (1 token, 1 request). A window is
    # never split, nor is anything off CUDA.
    from vllm_ddtree.attention import triton_tree_attention as tta

    monkeypatch.setattr(tta, "_multiprocessors", lambda device: 8)
    cuda = torch.device("cuda")
    assert tta.split_choices(torch.bfloat16, 8, 2, False, 8192, 256, cuda) == [1, 2, 4]
    assert tta.split_choices(torch.bfloat16, 8, 2, False, 112, 1, cuda) == [2, 4]  # 8 tiles
    assert tta.split_choices(torch.bfloat16, 8, 2, False, 128, 1, cuda) == [1, 2, 4]
    assert tta.split_choices(torch.bfloat16, 8, 2, False, 32, 1, cuda) == [4]  # 2..3 tiles
    assert tta.split_choices(torch.bfloat16, 8, 2, True, 8192, 256, cuda) == [1]
    assert tta.split_choices(torch.bfloat16, 8, 2, False, 8192, 256,
                             torch.device("cpu")) == [1]
