"""The compiled Triton tree-attention kernel on the GPU (bf16 dots on tensor cores, no
interpreter) against the dense reference: the CPU suite's cases, tile sizes, a cache of over
2**31 elements, and replays of one captured CUDA graph on new trees and contexts."""

from __future__ import annotations

import pytest
import torch
from attention_cases import dense_reference, make_batch
from test_tree_attention import CASES, TOLERANCE

from vllm_ddtree.attention.triton_tree_attention import tree_attention


def run_on_gpu(batch, **kwargs) -> torch.Tensor:
    """The kernel on the batch's tensors moved to the GPU; its output back on the CPU."""
    cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in batch.__dict__.items()}
    out = torch.full_like(cuda["query"], float("nan"))
    tree_attention(cuda["query"], cuda["key_cache"], cuda["value_cache"], out,
                   cuda["block_table"], cuda["seq_lens"], cuda["query_start_loc"],
                   cuda["tree_index"], cuda["ancestor_mask"], batch.scale,
                   depths=cuda["depths"], **kwargs)
    return out.cpu()


@pytest.mark.parametrize("dtype, head_size, heads, page", [
    (torch.float32, 64, (4, 4), 16), (torch.bfloat16, 128, (8, 2), 32),
    (torch.bfloat16, 64, (32, 8), 16), (torch.float16, 128, (8, 1), 16)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_on_gpu_matches_dense_reference(dtype, head_size, heads, page, case) -> None:
    kinds, num_nodes, contexts = CASES[case]
    batch = make_batch(case, kinds, num_nodes, contexts, heads[0], heads[1], head_size, page,
                       dtype)
    err = (run_on_gpu(batch).double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE.get(dtype, 3e-2), err


@pytest.mark.parametrize("window, splits", [(1, 1), (5, 1), (128, 1), (5, 4), (40, 8)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_window_and_sinks_on_gpu_match_dense_reference(window, splits, case) -> None:
    # gpt-oss's layers: bf16, 64-dim heads, 8 query heads per KV head, sinks, a window.
    kinds, num_nodes, contexts = CASES[case]
    batch = make_batch(case, kinds, num_nodes, [c + 150 for c in contexts], 16, 2, 64, 16,
                       torch.bfloat16)
    sinks = torch.linspace(-2.0, 3.0, 16, dtype=torch.bfloat16)
    out = run_on_gpu(batch, sliding_window=window, sinks=sinks.cuda(), num_splits=splits)
    err = (out.double() - dense_reference(batch, window, sinks)).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], err


@pytest.mark.parametrize("block_m, tile_n, splits, warps", [
    (16, 16, 1, 4), (32, 64, 1, 4), (64, 64, 1, 4), (16, 32, 4, 4), (32, 32, 8, 4),
    (16, 32, 1, 8), (32, 32, 1, 8)])
def test_kernel_tile_sizes_and_splits_on_gpu(block_m, tile_n, splits, warps) -> None:
    batch = make_batch(5, ["decode", "star", "prefill", "deep", "bushy"], 40, [1, 16, 0, 95, 64],
                       32, 8, 128, 16, torch.bfloat16)
    out = run_on_gpu(batch, block_m=block_m, tile_n=tile_n, num_splits=splits,
                     num_warps=warps)
    err = (out.double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], err


def test_kernel_on_a_cache_of_over_2_31_elements() -> None:
    # 2 x 4.3 GB of cache: block offsets past 2**31 elements must not wrap around.
    batch = make_batch(0, ["bushy", "decode"], 9, [20, 5], 2, 1, 64, 16, torch.bfloat16)
    skip = 2**31 // batch.key_cache[0].numel() + 7
    caches = []
    for small in (batch.key_cache, batch.value_cache):
        big = torch.empty(skip + small.shape[0], *small.shape[1:], dtype=small.dtype,
                          device="cuda")
        big[skip:] = small.cuda()
        caches.append(big)
    out = torch.full_like(batch.query.cuda(), float("nan"))
    tree_attention(batch.query.cuda(), *caches, out, (batch.block_table + skip).cuda(),
                   batch.seq_lens.cuda(), batch.query_start_loc.cuda(),
                   batch.tree_index.cuda(), batch.ancestor_mask.cuda(), batch.scale)
    err = (out.cpu().double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], err


def replay_batches(batches, device: str, capture: bool, splits: int = 1) -> list[float]:
    """Persistent buffers sized for every batch (same tokens and requests, any contexts);
    the kernel captured once on the first batch (capture=True) then replayed on each batch
    copied into the buffers. Returns each batch's max abs error against the reference."""
    blocks = max(b.key_cache.shape[0] for b in batches)
    cols = max(b.block_table.shape[1] for b in batches)
    key_cache = torch.zeros(blocks, *batches[0].key_cache.shape[1:],
                            dtype=batches[0].key_cache.dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.zeros(len(batches[0].seq_lens), cols, dtype=torch.int32, device=device)
    rest = {name: torch.zeros_like(getattr(batches[0], name), device=device)
            for name in ("query", "seq_lens", "query_start_loc", "tree_index", "ancestor_mask")}
    out = torch.empty_like(rest["query"])

    def load(batch) -> None:
        key_cache[:batch.key_cache.shape[0]].copy_(batch.key_cache)
        value_cache[:batch.value_cache.shape[0]].copy_(batch.value_cache)
        block_table.zero_()
        block_table[:, :batch.block_table.shape[1]].copy_(batch.block_table)
        for name, buf in rest.items():
            buf.copy_(getattr(batch, name))

    def call() -> None:
        tree_attention(rest["query"], key_cache, value_cache, out, block_table,
                       rest["seq_lens"], rest["query_start_loc"], rest["tree_index"],
                       rest["ancestor_mask"], batches[0].scale, num_splits=splits)

    load(batches[0])
    call()  # compiles the kernel outside the graph
    if capture:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    errors = []
    for batch in batches:
        load(batch)
        out.fill_(float("nan"))
        if capture:
            graph.replay()
            torch.cuda.synchronize()
        else:
            call()
        errors.append((out.cpu().double() - dense_reference(batch)).abs().max().item())
    return errors


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_replays_in_a_cuda_graph_with_new_trees_and_contexts(splits) -> None:
    # What a captured uniform verify step needs: one graph, new trees, contexts and block
    # tables each step, read from the same buffers, no host sync inside.
    batches = [make_batch(seed, kinds, 17, contexts, 32, 8, 128, 16, torch.bfloat16)
               for seed, kinds, contexts in [
                   (1, ["bushy", "star", "deep"], [40, 3, 70]),
                   (2, ["chain", "bushy", "star"], [90, 33, 0]),
                   (3, ["deep", "deep", "bushy"], [5, 128, 17])]]
    errors = replay_batches(batches, "cuda", capture=True, splits=splits)
    assert max(errors) <= TOLERANCE[torch.bfloat16], errors
