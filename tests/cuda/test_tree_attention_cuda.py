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
