"""PyTorch versions of V2's input-preparation kernels (``vllm/v1/worker/gpu/input_batch.py``,
``block_table.py``, ``buffer_utils.py``) and the hybrid models' state kernels."""

from __future__ import annotations

import torch

from vllm_ddtree.cpu_standin.kernels import torch_kernel

INPUT_BATCH = "vllm.v1.worker.gpu.input_batch"


def _query_lens(query_start_loc: torch.Tensor, num_reqs: int) -> torch.Tensor:
    return (query_start_loc[1:num_reqs + 1] - query_start_loc[:num_reqs]).long()


@torch_kernel(f"{INPUT_BATCH}._prepare_pos_seq_lens_kernel")
def prepare_pos_seq_lens(grid, pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
                         num_computed_tokens_ptr, max_num_reqs, BLOCK_SIZE=None) -> None:
    # The grid's last program pads seq_lens past the batch with 0 (full CUDA graphs).
    num_reqs = grid[0] - 1
    computed = num_computed_tokens_ptr[idx_mapping_ptr[:num_reqs].long()].long()
    query_lens = _query_lens(query_start_loc_ptr, num_reqs)
    seq_lens_ptr[:num_reqs] = (computed + query_lens).to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    total = int(query_lens.sum())
    if total:
        starts = query_start_loc_ptr[:num_reqs].long()
        req = torch.repeat_interleave(torch.arange(num_reqs), query_lens, output_size=total)
        offset = torch.arange(total) - (starts - starts[0])[req] if num_reqs else None
        tokens = starts[0] + torch.arange(total)
        pos_ptr[tokens] = (computed[req] + offset).to(pos_ptr.dtype)
