"""V2's input-preparation kernels: PyTorch (vllm_ddtree.cpu_standin.kernels.inputs)
against the Triton kernels in Triton's interpreter, on random and edge inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import run_both
from vllm.v1.worker.gpu import input_batch

from vllm_ddtree.cpu_standin.kernels.inputs import INPUT_BATCH


def batch(gen: torch.Generator, num_reqs: int, max_reqs: int, max_query: int):
    """idx_mapping into max_reqs request states, query_start_loc, num_computed_tokens."""
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    query_lens = torch.randint(0, max_query + 1, (num_reqs,), generator=gen)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    computed = torch.randint(0, 1000, (max_reqs,), generator=gen, dtype=torch.int32)
    return idx_mapping, query_start_loc, computed


@pytest.mark.parametrize("num_reqs,max_query", [(0, 4), (1, 1), (5, 9), (16, 40), (3, 1100)])
def test_prepare_pos_seq_lens(num_reqs: int, max_query: int) -> None:
    gen = torch.Generator().manual_seed(num_reqs)
    max_reqs = 16
    idx_mapping, query_start_loc, computed = batch(gen, num_reqs, max_reqs, max_query)
    total = int(query_start_loc[-1])
    pos = torch.full((total + 8,), -1, dtype=torch.int64)
    seq_lens = torch.full((max_reqs,), -1, dtype=torch.int32)
    run_both(f"{INPUT_BATCH}._prepare_pos_seq_lens_kernel", input_batch.prepare_pos_seq_lens,
             idx_mapping, query_start_loc, computed, pos, seq_lens)
