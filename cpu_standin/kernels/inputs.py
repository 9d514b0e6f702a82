"""PyTorch versions of V2's input-preparation kernels (``vllm/v1/worker/gpu/input_batch.py``,
``block_table.py``, ``buffer_utils.py``, ``mm/rope.py``) and the hybrid models' state
kernels (``vllm/v1/worker/utils.py``, ``model_states/mamba_hybrid.py``).

They read and write through :func:`_ptr` views, so offsets the kernels compute from
explicit strides (or past a tensor's own shape, as ``last_sampled_tokens`` of shape
``[max_num_reqs, 1]`` is read) land where the kernel's would. Kernels given tables of raw
addresses (block tables per KV cache group, KV cache segments) get the tensors back from
their callers' frames (:func:`_pointees`); where none is found they hand the launch back
to Triton, which follows raw addresses itself.
"""

from __future__ import annotations

import itertools
import sys
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from cpu_standin.kernels import FALLBACK, pointer, ranges, torch_kernel

INPUT_BATCH = "vllm.v1.worker.gpu.input_batch"
BLOCK_TABLE = "vllm.v1.worker.gpu.block_table"
BUFFER_UTILS = "vllm.v1.worker.gpu.buffer_utils"
ROPE = "vllm.v1.worker.gpu.mm.rope"
WORKER_UTILS = "vllm.v1.worker.utils"
MAMBA_HYBRID = "vllm.v1.worker.gpu.model_states.mamba_hybrid"


# ----------------------------------------------------------------------------- helpers


def _query_lens(query_start_loc: torch.Tensor, num_reqs: int) -> torch.Tensor:
    return (query_start_loc[1:num_reqs + 1] - query_start_loc[:num_reqs]).long()


def _tdiv(a: torch.Tensor, b: Any) -> torch.Tensor:
    # Integer division as in Triton (and C): rounded toward zero (remainders: torch.fmod).
    return torch.div(a, b, rounding_mode="trunc")


# Address -> a live tensor (weakly held) whose storage holds that address.
_HOLDERS: dict[int, weakref.ref[torch.Tensor]] = {}
# Frames of these modules stand between a kernel and its launch site.
_SKIPPED_MODULES = (__name__.rsplit(".", 1)[0], "vllm.triton_utils.dispatcher", "functools")
_CALLER_FRAMES = 4  # the launch site and its callers, where the tensors are looked for
_SEARCH_DEPTH = 3  # attribute/element hops from a frame's locals (self.block_tables[i].gpu)
_MAX_ITEMS = 4096  # elements looked at in one container


def _holds(t: torch.Tensor, addr: int) -> bool:
    storage = t.untyped_storage()
    return storage.data_ptr() <= addr < storage.data_ptr() + storage.nbytes()


def _children(value: Any) -> list[Any]:
    """What ``value`` holds: a container's items, an object's attributes."""
    if isinstance(value, (list, tuple, set, frozenset)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (types.ModuleType, type, types.FunctionType, types.MethodType,
                            torch.nn.Module, str, bytes, int, float)) or value is None:
        return []  # (a model's parameters never hold a pointer table's targets)
    else:
        try:
            items = vars(value)
        except Exception:  # noqa: BLE001  (no __dict__, or a proxy's __getattr__ failing)
            return []
        if not isinstance(items, dict):  # a proxy synthesising __dict__
            return []
        items = items.values()
    try:
        return list(itertools.islice(items, _MAX_ITEMS))
    except RuntimeError:  # changed by another thread meanwhile
        return []


def _search_callers(addrs: set[int], device: torch.device) -> dict[int, torch.Tensor]:
    """Live tensors holding ``addrs``, found among the locals of the launch site and its
    callers and what those reach in a few hops (the vLLM object that built the pointer
    table holds the tensors: ``BlockTables.block_tables``, the model runner's
    ``kv_caches``)."""
    found: dict[int, torch.Tensor] = {}
    frames = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < _CALLER_FRAMES:
        if not frame.f_globals.get("__name__", "").startswith(_SKIPPED_MODULES):
            frames.append(frame)
        frame = frame.f_back
    for frame in frames:
        level = list(frame.f_locals.values())
        seen: set[int] = set()  # (per frame: what one left unexpanded, another may need)
        for depth in range(_SEARCH_DEPTH + 1):
            following = []
            for value in level:
                if id(value) in seen:
                    continue
                seen.add(id(value))
                if isinstance(value, torch.Tensor):
                    if value.device != device or value.is_meta:
                        continue
                    storage = value.untyped_storage()
                    low = storage.data_ptr()
                    high = low + storage.nbytes()
                    for addr in addrs - found.keys():
                        if low <= addr < high:
                            found[addr] = value
                    if len(found) == len(addrs):
                        return found
                elif depth < _SEARCH_DEPTH:
                    following.extend(_children(value))
            level = following
    return found


def _pointees(addrs: Sequence[int], device: torch.device
              ) -> list[tuple[torch.UntypedStorage, int]] | None:
    """(storage, byte offset in it) of every address of a pointer table, or None where one
    is held by no tensor the launch site can reach."""
    holders: list[torch.Tensor | None] = []
    for addr in addrs:
        ref = _HOLDERS.get(addr)
        held = ref() if ref is not None else None
        holders.append(held if held is not None and _holds(held, addr) else None)
    missing = {addr for addr, held in zip(addrs, holders) if held is None}
    if missing:
        found = _search_callers(missing, device)
        if len(found) < len(missing):
            return None
        if len(_HOLDERS) > 4096:
            _HOLDERS.clear()
        for addr, held in found.items():
            _HOLDERS[addr] = weakref.ref(held)
        holders = [held if held is not None else found[addr]
                   for addr, held in zip(addrs, holders)]
    result = []
    for addr, held in zip(addrs, holders):
        storage = held.untyped_storage()
        result.append((storage, addr - storage.data_ptr()))
    return result


def _view(storage: torch.UntypedStorage, offset: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor | None:
    """A pointer (as ``_ptr``) of ``dtype`` at byte ``offset`` of ``storage``."""
    size = torch.empty(0, dtype=dtype).element_size()
    if offset % size:
        return None
    n = (storage.nbytes() - offset) // size
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset // size, (n,),
                                                           (1,))


def _int32_pointers(ptrs: torch.Tensor, count: int) -> list[torch.Tensor] | None:
    """The first ``count`` entries of a pointer table (``uint64`` addresses the kernel
    reads as ``int32`` pointers), as int32 pointer views; None where not found."""
    pointees = _pointees([int(a) for a in ptrs[:count].tolist()], ptrs.device)
    if pointees is None:
        return None
    views = [_view(storage, offset, torch.int32, ptrs.device) for storage, offset in pointees]
    return None if any(v is None for v in views) else views


# ----------------------------------------------------------------------- input_batch.py


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


@torch_kernel(f"{INPUT_BATCH}._prepare_prefill_inputs_kernel")
def prepare_prefill_inputs(grid, input_ids_ptr, next_prefill_tokens_ptr,
                           next_prefill_tokens_stride, num_lookahead, idx_mapping_ptr,
                           query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride,
                           prefill_lens_ptr, num_computed_tokens_ptr, BLOCK_SIZE=None,
                           LOOKAHEAD_BLOCK=None) -> None:
    num_reqs = grid[0]
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    prefill_len = pointer(prefill_lens_ptr)[req].long()
    computed = pointer(num_computed_tokens_ptr)[req].long()
    # Only requests still in their prefill: the others' inputs come from sampling.
    rows = (computed < prefill_len).nonzero().squeeze(1)
    if not rows.numel():
        return
    req, prefill_len, computed = req[rows], prefill_len[rows], computed[rows]
    query_start_loc = pointer(query_start_loc_ptr)
    starts = query_start_loc[rows].long()
    query_lens = query_start_loc[rows + 1].long() - starts
    all_token_ids = pointer(all_token_ids_ptr)
    row_start = req * all_token_ids_stride
    k, j, total = ranges(query_lens.clamp(min=0))
    if total:
        input_ids = pointer(input_ids_ptr)
        tokens = all_token_ids[row_start[k] + computed[k] + j]
        input_ids[starts[k] + j] = tokens.to(input_ids.dtype)
    if num_lookahead > 0:
        # The next num_lookahead prompt tokens after this chunk, 0 past the prompt.
        lookahead = torch.arange(num_lookahead)
        pos = (computed + query_lens)[:, None] + lookahead
        valid = pos < prefill_len[:, None]
        src = torch.where(valid, row_start[:, None] + pos, 0)
        tokens = torch.where(valid, all_token_ids[src], 0)
        out = pointer(next_prefill_tokens_ptr)
        out[lookahead * next_prefill_tokens_stride + req[:, None]] = tokens.to(out.dtype)


@torch_kernel(f"{INPUT_BATCH}._combine_sampled_and_draft_tokens_kernel")
def combine_sampled_and_draft_tokens(grid, input_ids_ptr, idx_mapping_ptr,
                                     last_sampled_tokens_ptr, query_start_loc_ptr,
                                     seq_lens_ptr, prefill_len_ptr, draft_tokens_ptr,
                                     draft_tokens_stride, cu_num_logits_ptr,
                                     logits_indices_ptr, BLOCK_SIZE,
                                     NUM_NEW_SAMPLED_TOKENS=1) -> None:
    num_reqs = grid[0]
    if not num_reqs:
        return
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    cu_num_logits = pointer(cu_num_logits_ptr)[:num_reqs + 1].long()
    logits_offset = cu_num_logits[:-1]
    num_logits = cu_num_logits[1:] - logits_offset
    query_end = pointer(query_start_loc_ptr)[1:num_reqs + 1].long()
    logits_start = query_end - num_logits

    # The last num_logits tokens of each query are sampled from (at most BLOCK_SIZE).
    k, j, total = ranges(num_logits.clamp(0, BLOCK_SIZE))
    if total:
        logits_indices = pointer(logits_indices_ptr)
        logits_indices[logits_offset[k] + j] = (logits_start[k] + j).to(logits_indices.dtype)

    seq_lens = pointer(seq_lens_ptr)[:num_reqs].long()
    prefill_len = pointer(prefill_len_ptr)[req].long()
    # Requests whose sequence stays inside the prompt (chunked prefill) keep their inputs.
    decoding = seq_lens > prefill_len
    input_ids = pointer(input_ids_ptr)
    if NUM_NEW_SAMPLED_TOKENS > 0:
        # The last sampled token goes first unless that slot still holds a prompt token.
        rows = (decoding & (seq_lens - num_logits >= prefill_len)).nonzero().squeeze(1)
        if rows.numel():
            last = pointer(last_sampled_tokens_ptr)[req[rows]]
            input_ids[logits_start[rows]] = last.to(input_ids.dtype)
    num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
    k, j, total = ranges(torch.where(decoding, num_draft.clamp(0, BLOCK_SIZE), 0))
    if total:
        drafts = pointer(draft_tokens_ptr)[req[k] * draft_tokens_stride + j]
        input_ids[query_end[k] - num_draft[k] + j] = drafts.to(input_ids.dtype)


@torch_kernel(f"{INPUT_BATCH}._get_num_sampled_and_rejected_kernel")
def get_num_sampled_and_rejected(grid, num_sampled_ptr, num_rejected_ptr, seq_lens_ptr,
                                 cu_num_logits_ptr, idx_mapping_ptr, prefill_len_ptr) -> None:
    num_reqs = grid[0]
    if not num_reqs:
        return
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    # Chunked prefills sample nothing and reject nothing.
    chunked = pointer(seq_lens_ptr)[:num_reqs] < pointer(prefill_len_ptr)[req]
    num_sampled = pointer(num_sampled_ptr)[:num_reqs]
    cu_num_logits = pointer(cu_num_logits_ptr)[:num_reqs + 1]
    num_logits = cu_num_logits[1:] - cu_num_logits[:-1]
    num_rejected = pointer(num_rejected_ptr)
    num_rejected[:num_reqs] = (num_logits - num_sampled).masked_fill(chunked, 0).to(
        num_rejected.dtype)
    num_sampled.masked_fill_(chunked, 0)


@torch_kernel(f"{INPUT_BATCH}._post_update_kernel")
def post_update(grid, idx_mapping_ptr, num_computed_tokens_ptr, last_sampled_tokens_ptr,
                output_bin_counts_ptr, output_bin_counts_stride, sampled_tokens_ptr,
                sampled_tokens_stride, num_sampled_ptr, num_rejected_ptr,
                query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride, total_len_ptr,
                draft_tokens_ptr, draft_tokens_out_ptr, num_draft_tokens) -> None:
    num_reqs = grid[0]
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    # Rows with a negative request index are skipped (filtered under pipeline parallelism).
    rows = (req >= 0).nonzero().squeeze(1)
    if not rows.numel():
        return
    req = req[rows]

    if draft_tokens_ptr is not None and num_draft_tokens > 0:
        j = torch.arange(num_draft_tokens)
        drafts = pointer(draft_tokens_ptr)[rows[:, None] * num_draft_tokens + j]
        out = pointer(draft_tokens_out_ptr)
        out[req[:, None] * num_draft_tokens + j] = drafts.to(out.dtype)

    total_len = pointer(total_len_ptr)
    old_len = total_len[req].long()
    num_sampled = pointer(num_sampled_ptr)[rows].long()
    sampled = pointer(sampled_tokens_ptr)
    row_start = rows * sampled_tokens_stride
    has = (num_sampled > 0).nonzero().squeeze(1)
    if has.numel():
        last_sampled = pointer(last_sampled_tokens_ptr)
        last = sampled[row_start[has] + num_sampled[has] - 1]
        last_sampled[req[has]] = last.to(last_sampled.dtype)
        total_len[req[has]] = (old_len[has] + num_sampled[has]).to(total_len.dtype)
        # Every sampled token is appended to the request's token ids (and counted).
        k, i, total = ranges(num_sampled.clamp(min=0))
        tokens = sampled[row_start[k] + i]
        all_token_ids = pointer(all_token_ids_ptr)
        all_token_ids[req[k] * all_token_ids_stride + old_len[k] + i] = tokens.to(
            all_token_ids.dtype)
        if output_bin_counts_ptr is not None:
            counts = pointer(output_bin_counts_ptr)
            index = req[k] * output_bin_counts_stride + tokens.long()
            counts.index_put_((index,), torch.ones((), dtype=counts.dtype), accumulate=True)

    if query_start_loc_ptr is None:
        query_lens = torch.zeros_like(rows)
    else:
        query_start_loc = pointer(query_start_loc_ptr)
        query_lens = query_start_loc[rows + 1].long() - query_start_loc[rows].long()
    delta = query_lens - pointer(num_rejected_ptr)[rows].long()
    num_computed = pointer(num_computed_tokens_ptr)
    num_computed.index_add_(0, req, delta.to(num_computed.dtype))


@torch_kernel(f"{INPUT_BATCH}._post_update_num_computed_tokens_kernel")
def post_update_num_computed_tokens(grid, idx_mapping_ptr, num_computed_tokens_ptr,
                                    query_start_loc_ptr) -> None:
    num_reqs = grid[0]
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    if not num_reqs:
        return
    if bool((req < 0).any()):
        return FALLBACK  # the kernel has no guard: it writes before the tensor
    num_computed = pointer(num_computed_tokens_ptr)
    query_lens = _query_lens(pointer(query_start_loc_ptr), num_reqs)
    num_computed.index_add_(0, req, query_lens.to(num_computed.dtype))


@torch_kernel(f"{INPUT_BATCH}._expand_idx_mapping_kernel")
def expand_idx_mapping(grid, idx_mapping_ptr, expanded_idx_mapping_ptr,
                       expanded_local_pos_ptr, cu_num_logits_ptr, BLOCK_SIZE) -> None:
    num_reqs = grid[0]
    if not num_reqs:
        return
    cu_num_logits = pointer(cu_num_logits_ptr)[:num_reqs + 1].long()
    starts = cu_num_logits[:-1]
    k, j, total = ranges((cu_num_logits[1:] - starts).clamp(0, BLOCK_SIZE))
    if total:
        expanded = pointer(expanded_idx_mapping_ptr)
        local_pos = pointer(expanded_local_pos_ptr)
        expanded[starts[k] + j] = pointer(idx_mapping_ptr)[k].to(expanded.dtype)
        local_pos[starts[k] + j] = j.to(local_pos.dtype)


# ----------------------------------------------------------------------- block_table.py


@torch_kernel(f"{BLOCK_TABLE}._gather_block_tables_kernel")
def gather_block_tables(grid, batch_idx_to_req_idx, src_block_table_ptrs,
                        dst_block_table_ptrs, block_table_strides, num_blocks_ptr,
                        num_blocks_stride, num_reqs, num_computed_tokens_ptr,
                        sliding_window_reach_ptr, block_sizes_ptr, MASK_SLIDING_WINDOW,
                        BLOCK_SIZE=None):
    num_groups, num_rows = grid
    if not num_groups or not num_rows:
        return None
    srcs = _int32_pointers(src_block_table_ptrs, num_groups)
    dsts = _int32_pointers(dst_block_table_ptrs, num_groups)
    if srcs is None or dsts is None:
        return FALLBACK
    strides = block_table_strides[:num_groups].tolist()
    num_gathered = min(num_reqs, num_rows)
    req = pointer(batch_idx_to_req_idx)[:num_gathered].long()
    num_blocks_all = pointer(num_blocks_ptr)
    if MASK_SLIDING_WINDOW:
        first_pos = pointer(num_computed_tokens_ptr)[req].long()
        reach = pointer(sliding_window_reach_ptr)[:num_groups].tolist()
        block_sizes = pointer(block_sizes_ptr)[:num_groups].tolist()
    for g in range(num_groups):
        stride = strides[g]
        dst = dsts[g][:num_rows * stride].view(num_rows, stride)
        # Rows past the batch are zeroed (CUDA-graph padding, rows of a larger batch).
        dst[num_reqs:] = 0
        if not num_gathered:
            continue
        num_blocks = num_blocks_all[g * num_blocks_stride + req].long()
        width = int(num_blocks.max())
        if width <= 0:
            continue
        cols = torch.arange(width)
        blocks = srcs[g][req[:, None] * stride + cols]
        if MASK_SLIDING_WINDOW and reach[g] > 0:
            # Blocks wholly below every query's window read as the null block.
            num_null = (first_pos - reach[g]).clamp(min=0) // block_sizes[g]
            blocks = blocks.masked_fill(cols < num_null[:, None], 0)
        rows = dst[:num_gathered, :width]
        rows.copy_(torch.where(cols < num_blocks[:, None], blocks, rows))
    return None


@torch_kernel(f"{BLOCK_TABLE}._compute_slot_mappings_kernel")
def compute_slot_mappings(grid, max_num_tokens, idx_mapping, query_start_loc, pos,
                          block_table_ptrs, block_table_strides, block_sizes,
                          slot_mapping_enabled, dcp_sharded, slot_mappings_ptr,
                          slot_mappings_stride, cp_rank, CP_SIZE, CP_INTERLEAVE, PAD_ID,
                          TRITON_BLOCK_SIZE=None):
    num_groups, num_programs = grid
    num_reqs = num_programs - 1
    if not num_groups or num_reqs < 0:
        return None
    query_start_loc = pointer(query_start_loc)[:num_reqs + 1].long()
    num_tokens = int(query_start_loc[-1])
    k, j, total = ranges(query_start_loc[1:] - query_start_loc[:-1])
    tables = None
    if total:
        tables = _int32_pointers(block_table_ptrs, num_groups)
        if tables is None:
            return FALLBACK
        tokens = query_start_loc[k] + j
        req = pointer(idx_mapping)[k].long()
        # idx_mapping -1: a dummy (padding) request without blocks, PAD for its tokens.
        real = req >= 0
        positions = pointer(pos)[tokens]
    strides = block_table_strides[:num_groups].tolist()
    sizes = block_sizes[:num_groups].tolist()
    enabled = slot_mapping_enabled[:num_groups].tolist()
    sharded = dcp_sharded[:num_groups].tolist()
    slot_mappings = pointer(slot_mappings_ptr)
    for g in range(num_groups):
        base = g * slot_mappings_stride
        # Past the batch's tokens: PAD (CUDA graphs; stale slots of earlier chunks).
        if num_tokens < max_num_tokens:
            slot_mappings[base + num_tokens:base + max_num_tokens] = PAD_ID
        if not total:
            continue
        block_size = sizes[g]
        local, is_local = positions, None
        if CP_SIZE != 1 and sharded[g]:
            # Context parallelism: this rank holds every CP_INTERLEAVE tokens out of
            # CP_SIZE * CP_INTERLEAVE of a virtual block CP_SIZE blocks long.
            virtual_size = block_size * CP_SIZE
            virtual_offset = torch.fmod(positions, virtual_size)
            is_local = torch.fmod(_tdiv(virtual_offset, CP_INTERLEAVE), CP_SIZE) == cp_rank
            local = (_tdiv(positions, virtual_size) * block_size
                     + _tdiv(virtual_offset, CP_INTERLEAVE * CP_SIZE) * CP_INTERLEAVE
                     + torch.fmod(virtual_offset, CP_INTERLEAVE))
        if not enabled[g]:
            slot_mappings[base + tokens] = PAD_ID
            continue
        load = real if is_local is None else real & is_local
        index = torch.where(load, req * strides[g] + _tdiv(local, block_size), 0)
        block_numbers = torch.where(load, tables[g][index], 0)
        # block number * block size in int32, as the kernel computes it.
        slots = block_numbers * block_size + torch.fmod(local, block_size)
        slot_mappings[base + tokens] = torch.where(load, slots, PAD_ID).to(
            slot_mappings.dtype)
    return None


# ---------------------------------------------------------------------- buffer_utils.py


@torch_kernel(f"{BUFFER_UTILS}._apply_write_kernel")
def apply_write(grid, output_ptr, output_stride, write_indices_ptr, write_starts_ptr,
                write_contents_ptr, write_cu_lens_ptr, write_group_ids_ptr, BLOCK_SIZE,
                MULTI_GROUP):
    num_writes, num_chunks = grid
    if not num_writes or not num_chunks:
        return None
    cu_lens = pointer(write_cu_lens_ptr)[:num_writes].long()
    cu_starts = torch.cat([cu_lens.new_zeros(1), cu_lens[:-1]])
    # Write p copies contents[cu_starts[p]:cu_lens[p]] to row indices[p] from starts[p].
    k, j, total = ranges((cu_lens - cu_starts).clamp(0, num_chunks * BLOCK_SIZE))
    if not total:
        return None
    rows = pointer(write_indices_ptr)[:num_writes].long()
    starts = pointer(write_starts_ptr)[:num_writes].long()
    contents = pointer(write_contents_ptr)[cu_starts[k] + j]
    if not MULTI_GROUP:
        out = pointer(output_ptr)
        out[rows[k] * output_stride + starts[k] + j] = contents.to(out.dtype)
        return None
    # One output tensor (KV cache group's block table, int32) per group id.
    group = pointer(write_group_ids_ptr)[:num_writes].long()
    num_groups = int(group.max()) + 1
    outs = _int32_pointers(output_ptr, num_groups)
    if outs is None:
        return FALLBACK
    strides = pointer(output_stride)[:num_groups].tolist()
    group = group[k]
    for g in group.unique().tolist():
        sel = (group == g).nonzero().squeeze(1)
        kk = k[sel]
        outs[g][rows[kk] * strides[g] + starts[kk] + j[sel]] = contents[sel].to(torch.int32)
    return None


# ---------------------------------------------------------------------------- mm/rope.py


@torch_kernel(f"{ROPE}._prepare_rope_positions_kernel")
def prepare_rope_positions(grid, positions_ptr, positions_stride, prefill_positions_ptr,
                           prefill_positions_stride0, prefill_positions_stride1,
                           prefill_delta_ptr, idx_mapping_ptr, query_start_loc_ptr,
                           prefill_lens_ptr, num_computed_tokens_ptr, BLOCK_SIZE,
                           NUM_DIMS) -> None:
    num_reqs = grid[0]
    if not num_reqs:
        return
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    computed = pointer(num_computed_tokens_ptr)[req].long()
    prefill = computed < pointer(prefill_lens_ptr)[req].long()
    delta = pointer(prefill_delta_ptr)[req].long()
    query_start_loc = pointer(query_start_loc_ptr)
    starts = query_start_loc[:num_reqs].long()
    k, j, total = ranges((query_start_loc[1:num_reqs + 1].long() - starts).clamp(min=0))
    if not total:
        return
    orig = computed[k] + j
    dims = torch.arange(NUM_DIMS)[:, None]
    # Prefill tokens take the model's precomputed M-RoPE positions; decode tokens all
    # dimensions' position + the request's delta.
    staged = torch.where(prefill[k], req[k] * prefill_positions_stride0 + orig, 0)
    staged = pointer(prefill_positions_ptr)[staged + dims * prefill_positions_stride1]
    values = torch.where(prefill[k], staged.long(), (orig + delta[k]).expand(NUM_DIMS, -1))
    positions = pointer(positions_ptr)
    positions[dims * positions_stride + starts[k] + j] = values.to(positions.dtype)


# ------------------------------------------------------------- hybrid models' state


@torch_kernel(f"{WORKER_UTILS}._zero_kv_blocks_kernel")
def zero_kv_blocks(grid, seg_addrs_ptr, seg_block_strides_ptr, seg_page_sizes_ptr,
                   block_ids_ptr, BLOCK_SIZE):
    num_blocks, num_segs, num_chunks = grid
    if not num_blocks or not num_segs or not num_chunks:
        return None
    pointees = _pointees([int(a) for a in seg_addrs_ptr[:num_segs].tolist()],
                         seg_addrs_ptr.device)
    if pointees is None:
        return FALLBACK
    block_strides = seg_block_strides_ptr[:num_segs].tolist()
    page_sizes = seg_page_sizes_ptr[:num_segs].tolist()
    block_ids = pointer(block_ids_ptr)[:num_blocks].long()
    # Segments of one storage and page size are zeroed together: the rows of an int32
    # view over the storage starting at every element are the pages to zero.
    starts: dict[tuple[int, int], list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for (storage, offset), stride, page in zip(pointees, block_strides, page_sizes):
        page = min(page, num_chunks * BLOCK_SIZE)
        if page <= 0:
            continue
        if offset % 4 or offset // 4 + page > storage.nbytes() // 4:
            return FALLBACK  # (misaligned, or a page past its storage: Triton's to handle)
        storages[storage.data_ptr()] = storage
        starts.setdefault((storage.data_ptr(), page), []).append(
            offset // 4 + block_ids * stride)
    for (key, page), rows in starts.items():
        flat = _view(storages[key], 0, torch.int32, seg_addrs_ptr.device)
        pages = flat.as_strided((flat.numel() - page + 1, page), (1, 1))
        pages.index_fill_(0, torch.cat(rows), 0)
    return None


@torch_kernel(f"{MAMBA_HYBRID}._scatter_num_accepted_kernel")
def scatter_num_accepted(grid, idx_mapping_ptr, num_sampled_ptr, num_accepted_ptr) -> None:
    num_reqs = grid[0]
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    rows = (req >= 0).nonzero().squeeze(1)  # -1: a filtered row, skipped
    if rows.numel():
        out = pointer(num_accepted_ptr)
        out[req[rows]] = pointer(num_sampled_ptr)[rows].clamp(min=1).to(out.dtype)


@torch_kernel(f"{MAMBA_HYBRID}._fill_num_accepted_kernel")
def fill_num_accepted(grid, idx_mapping_ptr, num_accepted_ptr, num_sampled) -> None:
    num_reqs = grid[0]
    req = pointer(idx_mapping_ptr)[:num_reqs].long()
    rows = (req >= 0).nonzero().squeeze(1)
    if rows.numel():
        pointer(num_accepted_ptr)[req[rows]] = num_sampled
