"""V2's input-preparation kernels: PyTorch (cpu_standin.kernels.inputs)
against the Triton kernels in Triton's interpreter, on random and edge inputs.

Objects holding pointer tables (BlockTables, KVBlockZeroer) are built inside the call from
the (deep-copied) tensors, so that each run's tables point at its own copies."""

from __future__ import annotations

import array
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import vllm.v1.worker.cpu.shm  # noqa: F401  (as the CPU worker: UVA buffers in plain memory)
from kernel_harness import run_both
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker import utils as worker_utils
from vllm.v1.worker.gpu import block_table, input_batch
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor
from vllm.v1.worker.gpu.mm.rope import RopeState
from vllm.v1.worker.gpu.model_states import mamba_hybrid

from cpu_standin.kernels.inputs import (
    BLOCK_TABLE,
    BUFFER_UTILS,
    INPUT_BATCH,
    MAMBA_HYBRID,
    ROPE,
    WORKER_UTILS,
)

CPU = torch.device("cpu")


def batch(gen: torch.Generator, num_reqs: int, max_reqs: int, max_query: int):
    """idx_mapping into max_reqs request states, query_start_loc, num_computed_tokens."""
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    query_lens = torch.randint(0, max_query + 1, (num_reqs,), generator=gen)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    computed = torch.randint(0, 1000, (max_reqs,), generator=gen, dtype=torch.int32)
    return idx_mapping, query_start_loc, computed


def cumsum0(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    out[1:] = lens.cumsum(0)
    return out


def rand(gen: torch.Generator, low: int, high: int, *shape: int,
         dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


# ----------------------------------------------------------------------- input_batch.py


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


@pytest.mark.parametrize("num_reqs,max_len,num_lookahead",
                         [(0, 16, 1), (1, 8, 1), (6, 40, 3), (8, 24, 2), (2, 1100, 4)])
def test_prepare_prefill_inputs(num_reqs: int, max_len: int, num_lookahead: int) -> None:
    gen = torch.Generator().manual_seed(100 + num_reqs)
    max_reqs = 8
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    prefill_len = rand(gen, 1, max_len + 1, max_reqs)
    prefill_len[0] = max_len  # a prompt filling the model's length
    computed = (torch.rand(max_reqs, generator=gen) * prefill_len).to(torch.int32)
    # Some requests are decoding (all of the prompt computed), one starts at 0.
    computed[1] = 0
    decoding = torch.rand(max_reqs, generator=gen) < 0.3
    computed[decoding] = prefill_len[decoding] + rand(gen, 0, 3, int(decoding.sum()))
    query_lens = torch.zeros(num_reqs, dtype=torch.int32)
    for i, r in enumerate(idx_mapping.tolist()):
        remaining = int(prefill_len[r] - computed[r])
        # Prefill chunks, whole (reaching the prompt's end: no lookahead) or partial.
        query_lens[i] = (rand(gen, 1, 4, 1) if remaining <= 0
                         else rand(gen, 1, remaining + 1, 1) if i % 2 else remaining)
    query_start_loc = cumsum0(query_lens)
    all_token_ids = rand(gen, 0, 50000, max_reqs, max_len + 4)
    input_ids = torch.full((int(query_start_loc[-1]) + 4,), -1, dtype=torch.int32)
    next_prefill_tokens = torch.full((num_lookahead, max_reqs), -3, dtype=torch.int32)
    run_both(f"{INPUT_BATCH}._prepare_prefill_inputs_kernel",
             input_batch.prepare_prefill_inputs, input_ids, next_prefill_tokens, idx_mapping,
             query_start_loc, all_token_ids, prefill_len, computed)


@pytest.mark.parametrize("num_reqs,num_spec,num_new", [
    (0, 1, 1), (1, 0, 1), (6, 3, 1), (8, 4, 0), (5, 7, 1), (3, 2, 0)])
def test_combine_sampled_and_draft_tokens(num_reqs: int, num_spec: int, num_new: int) -> None:
    gen = torch.Generator().manual_seed(200 + num_reqs * 10 + num_spec)
    max_reqs = 8
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    num_draft = rand(gen, 0, num_spec + 1, num_reqs)
    if num_reqs:
        num_draft[0] = num_spec  # the most drafts: a full block
    num_logits = num_draft + num_new
    query_lens = num_logits + torch.where(torch.rand(num_reqs, generator=gen) < 0.3,
                                          rand(gen, 1, 6, num_reqs), 0)
    query_start_loc = cumsum0(query_lens)
    cu_num_logits = cumsum0(num_logits)
    prefill_len = rand(gen, 1, 30, max_reqs)
    prefill = prefill_len[idx_mapping.long()]
    # Chunked prefill (seq_len <= prefill_len), a prompt's tail among the logits, decode.
    kind = rand(gen, 0, 3, num_reqs)
    seq_lens = torch.where(kind == 0, prefill - rand(gen, 0, 3, num_reqs),
                           torch.where(kind == 1, prefill + (num_logits - 1).clamp(min=0),
                                       prefill + num_logits + rand(gen, 0, 9, num_reqs)))
    seq_lens = seq_lens.to(torch.int32)
    last_sampled = rand(gen, 0, 50000, max_reqs, 1, dtype=torch.int64)
    draft_tokens = rand(gen, 0, 50000, max_reqs, num_spec, dtype=torch.int64)
    input_ids = rand(gen, -9, 0, int(query_start_loc[-1]) + 3)
    run_both(f"{INPUT_BATCH}._combine_sampled_and_draft_tokens_kernel",
             input_batch.combine_sampled_and_draft_tokens, input_ids, idx_mapping,
             last_sampled, query_start_loc, seq_lens, prefill_len, draft_tokens,
             cu_num_logits, int(cu_num_logits[-1]), num_new)


@pytest.mark.parametrize("num_reqs", [0, 1, 7])
def test_get_num_sampled_and_rejected(num_reqs: int) -> None:
    gen = torch.Generator().manual_seed(300 + num_reqs)
    max_reqs = 8
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    num_logits = rand(gen, 1, 5, num_reqs)
    num_sampled = (torch.rand(num_reqs, generator=gen) * num_logits).to(torch.int32) + 1
    prefill_len = rand(gen, 5, 20, max_reqs)
    seq_lens = (prefill_len[idx_mapping.long()] + rand(gen, -2, 3, num_reqs)).to(torch.int32)
    run_both(f"{INPUT_BATCH}._get_num_sampled_and_rejected_kernel",
             input_batch.get_num_sampled_and_rejected, num_sampled, seq_lens,
             cumsum0(num_logits), idx_mapping, prefill_len)


@pytest.mark.parametrize("num_reqs,num_spec,counts,drafts,query", [
    (0, 0, True, False, True), (1, 0, False, False, False), (6, 3, True, True, True),
    (8, 2, False, True, False), (5, 4, True, False, True)])
def test_post_update(num_reqs: int, num_spec: int, counts: bool, drafts: bool,
                     query: bool) -> None:
    gen = torch.Generator().manual_seed(400 + num_reqs)
    max_reqs, max_len, vocab = 8, 40, 7  # a small vocabulary: repeated tokens
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    if num_reqs > 2:
        idx_mapping[1] = -1  # a filtered row
    sampled = rand(gen, 0, vocab, num_reqs, num_spec + 1, dtype=torch.int64)
    num_sampled = rand(gen, 0, num_spec + 2, num_reqs)
    num_rejected = num_spec + 1 - num_sampled
    num_rejected[num_sampled == 0] = 0
    query_start_loc = cumsum0(rand(gen, 1, num_spec + 3, num_reqs)) if query else None
    total_len = rand(gen, 0, max_len - num_spec - 2, max_reqs)
    run_both(f"{INPUT_BATCH}._post_update_kernel", input_batch.post_update,
             idx_mapping, rand(gen, 0, 100, max_reqs),
             rand(gen, 0, vocab, max_reqs, 1, dtype=torch.int64),
             rand(gen, 0, 3, max_reqs, vocab) if counts else None, sampled, num_sampled,
             num_rejected, query_start_loc, rand(gen, -5, 0, max_reqs, max_len), total_len,
             rand(gen, 0, 50, num_reqs, num_spec, dtype=torch.int64) if drafts else None,
             rand(gen, -5, 0, max_reqs, num_spec, dtype=torch.int64) if drafts else None)


@pytest.mark.parametrize("num_reqs", [0, 1, 6])
def test_post_update_num_computed_tokens(num_reqs: int) -> None:
    gen = torch.Generator().manual_seed(500 + num_reqs)
    idx_mapping, query_start_loc, computed = batch(gen, num_reqs, 8, 20)
    run_both(f"{INPUT_BATCH}._post_update_num_computed_tokens_kernel",
             input_batch.post_update_num_computed_tokens, idx_mapping, computed,
             query_start_loc)


@pytest.mark.parametrize("num_reqs,max_expand", [(0, 1), (1, 1), (6, 4), (4, 9)])
def test_expand_idx_mapping(num_reqs: int, max_expand: int) -> None:
    gen = torch.Generator().manual_seed(600 + num_reqs)
    idx_mapping = torch.randperm(8, generator=gen)[:num_reqs].to(torch.int32)
    counts = rand(gen, 1, max_expand + 1, num_reqs)
    if num_reqs:
        counts[-1] = max_expand
    cu_num_logits = cumsum0(counts)
    run_both(f"{INPUT_BATCH}._expand_idx_mapping_kernel", input_batch.expand_idx_mapping,
             idx_mapping, int(cu_num_logits[-1]), cu_num_logits, max_expand)


# ----------------------------------------------------------------------- block_table.py


def block_tables(tables, inputs, num_blocks, block_sizes, reach=None, cp=(1, 0, 1),
                 enabled=None, sharded=None) -> BlockTables:
    """A BlockTables on the given tensors (its pointer tables point at them)."""
    cp_size, cp_rank, cp_interleave = cp
    bt = BlockTables(block_sizes, tables[0].shape[0], 64, [t.shape[1] for t in tables], CPU,
                     cp_size=cp_size, cp_rank=cp_rank, cp_interleave=cp_interleave,
                     slot_mapping_enabled=enabled, dcp_sharded=sharded,
                     sliding_window_reach=reach)
    for staged, table in zip(bt.block_tables, tables):
        staged.gpu = table
    bt.input_block_tables = list(inputs)
    bt.num_blocks.gpu = num_blocks
    bt.num_blocks.np[:] = num_blocks.numpy()
    bt.init_block_table_layout_tensors()
    return bt


def gather(tables, inputs, num_blocks, block_sizes, reach, idx_mapping, num_reqs_padded,
           num_dirty, num_computed, out):
    bt = block_tables(tables, inputs, num_blocks, block_sizes, reach)
    bt._num_dirty_rows = num_dirty
    out_ptrs = bt._make_ptr_tensor(out) if out is not None else None
    return bt.gather_block_tables(idx_mapping, num_reqs_padded, out, out_ptrs, num_computed)


@pytest.mark.parametrize("num_reqs,padded,dirty,groups,window,out", [
    (0, 0, 3, 1, False, False), (1, 1, 0, 1, False, False), (5, 6, 8, 2, False, False),
    (6, 6, 2, 2, True, False), (4, 5, 0, 2, True, True), (3, 3, 0, 1, False, True)])
def test_gather_block_tables(num_reqs: int, padded: int, dirty: int, groups: int,
                             window: bool, out: bool) -> None:
    gen = torch.Generator().manual_seed(700 + num_reqs * 3 + groups)
    max_reqs = 8
    block_sizes, widths = [4, 16][:groups], [12, 3][:groups]
    tables = [rand(gen, 1, 1000, max_reqs, w) for w in widths]
    inputs = [rand(gen, -9, 0, max_reqs, w) for w in widths]
    num_blocks = torch.stack([rand(gen, 0, w + 1, max_reqs) for w in widths])
    num_blocks[:, 0] = torch.tensor(widths)  # a full row (the model's length)
    num_blocks[:, 1] = 0
    reach = [10, 0][:groups] if window else None
    computed = rand(gen, 0, 60, max_reqs) if window else None
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    outs = tuple(rand(gen, -9, 0, max_reqs, w) for w in widths) if out else None
    run_both(f"{BLOCK_TABLE}._gather_block_tables_kernel", gather, tables, inputs,
             num_blocks, block_sizes, reach, idx_mapping, padded, dirty, computed, outs)


def gather_hidden(hidden, num_blocks, idx_mapping) -> None:
    """A launch whose block tables (``hidden``: [src, dst] nested deeper than the PyTorch
    version looks) no local or attribute near the launch site holds."""
    def ptrs(i: int) -> torch.Tensor:
        return torch.tensor([hidden[0][0][0][0][0][i].data_ptr()], dtype=torch.uint64)

    stride = hidden[0][0][0][0][0][0].stride(0)
    num_reqs = idx_mapping.shape[0]
    zero = torch.zeros(1, dtype=torch.int32)
    block_table._gather_block_tables_kernel[(1, num_reqs + 2)](
        idx_mapping, ptrs(0), ptrs(1), torch.tensor([stride]), num_blocks,
        num_blocks.stride(0), num_reqs, zero, zero, zero, MASK_SLIDING_WINDOW=False,
        BLOCK_SIZE=1024)


def test_gather_block_tables_unreachable() -> None:
    # Without the tensors, the PyTorch version hands the launch back to Triton.
    gen = torch.Generator().manual_seed(750)
    hidden = [[[[[[rand(gen, 1, 100, 6, 5), rand(gen, -9, 0, 6, 5)]]]]]]
    run_both(f"{BLOCK_TABLE}._gather_block_tables_kernel", gather_hidden, hidden,
             rand(gen, 0, 6, 1, 6), torch.tensor([3, 0, 5], dtype=torch.int32),
             fallback=True)


def slot_mappings(tables, num_blocks, block_sizes, cp, enabled, sharded, idx_mapping,
                  query_start_loc, positions, num_tokens_padded, out):
    bt = block_tables(tables, [torch.zeros_like(t) for t in tables], num_blocks,
                      block_sizes, cp=cp, enabled=enabled, sharded=sharded)
    # Twice: the second launch finds the block tables it resolved in the first (cached).
    bt.compute_slot_mappings(idx_mapping, query_start_loc, positions, num_tokens_padded, out)
    return bt.compute_slot_mappings(idx_mapping, query_start_loc, positions,
                                    num_tokens_padded, out)


@pytest.mark.parametrize("num_reqs,max_len,cp,enabled,sharded", [
    (0, 32, (1, 0, 1), [True, True], None),
    (1, 32, (1, 0, 1), [True], None),
    (5, 48, (1, 0, 1), [True, False], None),
    (4, 40, (2, 1, 1), [True, True], [True, False]),
    (4, 40, (4, 2, 2), [True, False], [True, True]),
    (2, 1100, (1, 0, 1), [True, True], None),
])
def test_compute_slot_mappings(num_reqs: int, max_len: int, cp: tuple[int, int, int],
                               enabled: list[bool], sharded: list[bool] | None) -> None:
    gen = torch.Generator().manual_seed(800 + num_reqs + max_len)
    max_reqs, groups = 8, len(enabled)
    block_sizes = [4, 16][:groups]
    tables = [rand(gen, 0, 5000, max_reqs, -(-max_len // bs)) for bs in block_sizes]
    num_blocks = torch.zeros(groups, max_reqs, dtype=torch.int32)
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    if num_reqs > 2:
        idx_mapping[2] = -1  # a dummy request without blocks
    query_lens = rand(gen, 0, min(max_len, 12) + 1, num_reqs)
    computed = (torch.rand(num_reqs, generator=gen) * (max_len - query_lens)).to(torch.int32)
    if num_reqs:
        query_lens[0] = min(max_len, 1100)  # ends in the table's last block
        computed[0] = max_len - query_lens[0]
    query_start_loc = cumsum0(query_lens)
    positions = torch.cat([torch.arange(c, c + n) for c, n in
                           zip(computed.tolist(), query_lens.tolist())] + [torch.zeros(5)])
    positions = positions.to(torch.int64)
    num_tokens = int(query_start_loc[-1])
    out = torch.full((groups, num_tokens + 20), 12345, dtype=torch.int64)
    run_both(f"{BLOCK_TABLE}._compute_slot_mappings_kernel", slot_mappings, tables,
             num_blocks, block_sizes, cp, enabled, sharded, idx_mapping, query_start_loc,
             positions, num_tokens + 3, out)


# ---------------------------------------------------------------------- buffer_utils.py


def staged_write(target: torch.Tensor, writes: list) -> None:
    staged = StagedWriteTensor(tuple(target.shape), target.dtype, CPU)
    staged.gpu = target
    for index, start, values in writes:
        if start is None:
            staged.stage_write_elem(index, values)
        else:
            staged.stage_write(index, start, values)
    staged.apply_write()


@pytest.mark.parametrize("dtype,shape", [(torch.int32, (6, 2200)), (torch.int64, (4, 30)),
                                         (torch.float32, (5, 9)), (torch.int32, (10,))])
def test_apply_write(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(900 + shape[0])
    target = torch.randn(shape, generator=gen).mul(100).to(dtype)
    if len(shape) == 1:
        writes = [(3, None, 17), (0, None, -4), (9, None, 5)]
    else:
        width = shape[1]
        writes = [(1, 0, list(range(width))),  # a whole row (several blocks when long)
                  (3, 2, np.arange(width - 2, dtype=np.float64) * 3),
                  (0, width - 1, array.array("i", [77])),
                  (2, 1, [5, 6, 7]),
                  (4, 0, [])]  # nothing staged
        if shape[0] > 5:
            writes.append((5, width - 1100, list(range(1100))))
    run_both(f"{BUFFER_UTILS}._apply_write_kernel", staged_write, target, writes)


def append_block_ids(tables, num_blocks, appends) -> torch.Tensor:
    bt = block_tables(tables, [torch.zeros_like(t) for t in tables], num_blocks,
                      [16] * len(tables))
    for req_index, new_block_ids, overwrite in appends:
        bt.append_block_ids(req_index, new_block_ids, overwrite)
    bt.apply_staged_writes()
    return bt.num_blocks.gpu.clone()


@pytest.mark.parametrize("groups", [1, 3])
def test_apply_write_block_tables(groups: int) -> None:
    gen = torch.Generator().manual_seed(950 + groups)
    max_reqs, widths = 6, [20, 5, 12][:groups]
    tables = [rand(gen, -9, 0, max_reqs, w) for w in widths]
    num_blocks = torch.stack([rand(gen, 0, 3, max_reqs) for _ in widths])
    appends = [
        (0, tuple(list(range(1, w - 2)) for w in widths), False),
        (2, tuple([] if g == 1 else [100 + g] for g in range(groups)), False),
        (4, tuple(list(range(w)) for w in widths), True),  # a whole row
        (5, tuple([] for _ in widths), False),
    ]
    run_both(f"{BUFFER_UTILS}._apply_write_kernel", append_block_ids, tables, num_blocks,
             appends)


# ------------------------------------------------------------------------- mm/rope.py


def rope_positions(positions, prefill_positions, prefill_delta, idx_mapping, query_start_loc,
                   prefill_lens, num_computed, num_dims, max_model_len) -> None:
    state = RopeState(num_dims, prefill_lens.shape[0], positions.shape[1] - 1, max_model_len,
                      CPU)
    state.positions = positions
    state.prefill_positions.gpu = prefill_positions
    state.prefill_delta.gpu = prefill_delta
    state.prepare_positions(idx_mapping, query_start_loc, prefill_lens, num_computed)


@pytest.mark.parametrize("num_reqs,max_len", [(0, 8), (1, 8), (6, 30), (2, 1100)])
def test_prepare_rope_positions(num_reqs: int, max_len: int) -> None:
    gen = torch.Generator().manual_seed(1000 + num_reqs)
    max_reqs, num_dims = 8, 3
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    prefill_len = rand(gen, 1, max_len + 1, max_reqs)
    computed = (torch.rand(max_reqs, generator=gen) * (prefill_len + 4)).to(torch.int32)
    computed[0], prefill_len[0] = 0, max_len  # a whole prompt of the model's length
    remaining = (max_len - computed[idx_mapping.long()]).clamp(min=1)
    query_lens = (torch.rand(num_reqs, generator=gen) * remaining).to(torch.int32) + 1
    query_lens = torch.minimum(query_lens, remaining)
    query_start_loc = cumsum0(query_lens)
    num_tokens = int(query_start_loc[-1])
    run_both(f"{ROPE}._prepare_rope_positions_kernel", rope_positions,
             torch.full((num_dims, num_tokens + 6), -1, dtype=torch.int64),
             rand(gen, 0, 5000, max_reqs * num_dims, max_len),
             rand(gen, -50, 50, max_reqs), idx_mapping, query_start_loc, prefill_len,
             computed, num_dims, max_len)


# --------------------------------------------------------------- hybrid models' state


@dataclass
class Group:
    kv_cache_spec: FullAttentionSpec
    layer_names: list[str]
    kv_cache_group_id: int
    kernel_block_stride: int = 0


def zero_blocks(kv_caches: list[torch.Tensor], groups: list[Group], kernel_block_sizes,
                num_blocks: int, block_ids: list[int]) -> None:
    context = {name: SimpleNamespace(kv_cache=kv)
               for name, kv in zip([n for g in groups for n in g.layer_names], kv_caches)}
    zeroer = worker_utils.KVBlockZeroer(CPU, groups, kernel_block_sizes, context, num_blocks)
    zeroer.zero_block_ids(block_ids)


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first", "kernel_blocks", "two_groups"])
def test_zero_kv_blocks(layout: str) -> None:
    gen = torch.Generator().manual_seed(1100)
    num_blocks, block_size, heads, head_size = 5, 4, 2, 8
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=torch.float16)
    kernel_block_sizes = [block_size, block_size]
    shape = (num_blocks, 2, block_size, heads, head_size)
    numel = int(np.prod(shape))
    # Layers are views of one raw buffer, as the model runner allocates them.
    raw = torch.randn(3 * numel + 64, generator=gen).to(torch.float16)
    layers = [raw[i * numel:(i + 1) * numel] for i in range(3)]
    if layout == "blocks_first":
        kv_caches = [x.view(shape) for x in layers]
    elif layout == "kv_first":  # K and V outside the block dimension: two segments a layer
        kv_caches = [x.view(2, num_blocks, block_size, heads, head_size).transpose(0, 1)
                     for x in layers]
    elif layout == "kernel_blocks":  # blocks split in two kernel blocks
        kernel_block_sizes = [block_size // 2]
        kv_caches = [x.view(2 * num_blocks, 2, block_size // 2, heads, head_size)
                     for x in layers]
    else:  # a second group with pages over 1024 int32 elements (several chunks)
        big = (num_blocks, 2, block_size, heads, 160)
        kv_caches = [layers[0].view(shape),
                     torch.randn(int(np.prod(big)), generator=gen).to(torch.float16).view(big)]
    names = [f"layer.{i}" for i in range(len(kv_caches))]
    groups = [Group(spec, names, 0)]
    if layout == "two_groups":
        big_spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                     head_size=160, dtype=torch.float16)
        groups = [Group(spec, names[:1], 0), Group(big_spec, names[1:], 1)]
    for block_ids in ([0], [num_blocks - 1, 2, 2]):
        run_both(f"{WORKER_UTILS}._zero_kv_blocks_kernel", zero_blocks, kv_caches, groups,
                 kernel_block_sizes, num_blocks, block_ids)


def scatter_num_accepted(idx_mapping, num_sampled, num_accepted) -> None:
    mamba_hybrid._scatter_num_accepted_kernel[(idx_mapping.shape[0],)](
        idx_mapping, num_sampled, num_accepted)


def fill_num_accepted(idx_mapping, num_accepted, num_sampled: int) -> None:
    mamba_hybrid._fill_num_accepted_kernel[(idx_mapping.shape[0],)](
        idx_mapping, num_accepted, num_sampled)


@pytest.mark.parametrize("num_reqs", [0, 1, 6])
def test_num_accepted(num_reqs: int) -> None:
    gen = torch.Generator().manual_seed(1200 + num_reqs)
    idx_mapping = torch.randperm(8, generator=gen)[:num_reqs].to(torch.int32)
    if num_reqs > 2:
        idx_mapping[1] = -1  # a filtered row
    num_sampled = rand(gen, 0, 4, num_reqs)  # 0 counts as 1 accepted
    num_accepted = rand(gen, -9, 0, 8)
    run_both(f"{MAMBA_HYBRID}._scatter_num_accepted_kernel", scatter_num_accepted,
             idx_mapping, num_sampled, num_accepted)
    run_both(f"{MAMBA_HYBRID}._fill_num_accepted_kernel", fill_num_accepted, idx_mapping,
             num_accepted, 3)
