"""The compiled Triton tree-attention kernel on the GPU (bf16 dots on tensor cores, no
interpreter) against the dense reference, on the CPU suite's cases."""

from __future__ import annotations

import pytest
import torch
from attention_cases import dense_reference, make_batch
from test_tree_attention import CASES, TOLERANCE

from vllm_ddtree.attention.triton_tree_attention import tree_attention


@pytest.mark.parametrize("dtype, head_size, heads, page", [
    (torch.float32, 64, (4, 4), 16), (torch.bfloat16, 128, (8, 2), 32),
    (torch.bfloat16, 64, (32, 8), 16), (torch.float16, 128, (8, 1), 16)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_on_gpu_matches_dense_reference(dtype, head_size, heads, page, case) -> None:
    kinds, num_nodes, contexts = CASES[case]
    batch = make_batch(case, kinds, num_nodes, contexts, heads[0], heads[1], head_size, page,
                       dtype)
    cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in batch.__dict__.items()}
    out = torch.full_like(cuda["query"], float("nan"))
    tree_attention(cuda["query"], cuda["key_cache"], cuda["value_cache"], out,
                   cuda["block_table"], cuda["seq_lens"], cuda["query_start_loc"],
                   cuda["tree_index"], cuda["ancestor_mask"], batch.scale)
    err = (out.cpu().double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE.get(dtype, 3e-2), err


@pytest.mark.parametrize("block_m, tile_n", [(16, 16), (32, 64), (64, 64)])
def test_kernel_tile_sizes_on_gpu(block_m, tile_n) -> None:
    batch = make_batch(5, ["decode", "star", "prefill", "deep", "bushy"], 40, [1, 16, 0, 95, 64],
                       32, 8, 128, 16, torch.bfloat16)
    cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in batch.__dict__.items()}
    out = torch.full_like(cuda["query"], float("nan"))
    tree_attention(cuda["query"], cuda["key_cache"], cuda["value_cache"], out,
                   cuda["block_table"], cuda["seq_lens"], cuda["query_start_loc"],
                   cuda["tree_index"], cuda["ancestor_mask"], batch.scale,
                   block_m=block_m, tile_n=tile_n)
    err = (out.cpu().double() - dense_reference(batch)).abs().max().item()
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
