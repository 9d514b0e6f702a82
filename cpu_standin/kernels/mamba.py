"""PyTorch versions of the hybrid models' prefix-caching kernels (``vllm/v1/worker/
mamba_utils.py``, Mamba cache mode "align", vLLM's default with prefix caching): the
per-step advance of each request's running state column (preprocess), and the copies of
the conv and temporal (SSM) states between block-table columns before the forward pass
(pre-copy) and after acceptance (postprocess).

The two copy kernels are given raw addresses: the state tensors' base addresses and the
per-group block tables' (``int64`` tables). On CPU these are this process's own addresses,
so the versions here follow the kernels on them: they read the int32 block ids at
``table + 4 * (row * stride + column)``, compute every copy's source, destination and size
as the kernel does, and copy the bytes (``ctypes.memmove``; strided views over the raw
memory for the per-row conv layout, CONV_STATE_DIM_FIRST). A launch is planned entirely
before anything is written (so that FALLBACK stays possible), then carried out in the
interpreter's program order (batch row, then state), so that copies which meet (one
request's destination another's source) land as they would there.

Handed back to Triton: a grid with fewer temporal tiles than TEMPORAL_TILES (partial
copies), a negative token bias on a same-block conv shift, copies whose source and
destination overlap other than as the kernel's same-block left shift, conv rows that
overlap one another, a postprocess whose output count shares memory with its input, and a
block-table group index outside the table of tables.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from cpu_standin.kernels import FALLBACK, pointer, torch_kernel

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"

_U64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- helpers


def _tdiv(a: int, b: int) -> int:
    """Integer division as in Triton (and C): rounded toward zero."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    g = tuple(grid) + (1,) * (3 - len(grid))
    return g[0], g[1], g[2]


def _read_i32(addr: int) -> int:
    return ctypes.c_int32.from_address(addr & _U64).value


def _raw(addr: int, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` bytes of this process's memory at ``addr``, as a uint8 tensor."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr & _U64),
                            dtype=torch.uint8)


def _overlap(a: int, b: int, n: int) -> bool:
    """Whether [a, a + n) and [b, b + n) overlap (and are not the same range)."""
    return a != b and abs(a - b) < n


@dataclass
class _Copy:
    """``nbytes`` bytes from ``src`` to ``dst`` (a memmove)."""

    dst: int
    src: int
    nbytes: int


@dataclass
class _RowCopy:
    """``nbytes`` bytes of each of ``rows`` rows ``row_stride`` bytes apart, ``src`` to
    ``dst`` (a memmove per row; the rows do not overlap one another)."""

    dst: int
    src: int
    rows: int
    row_stride: int
    nbytes: int


@dataclass
class _States:
    """The flattened (layer, state) metadata of a copy launch, as Python ints."""

    base: list[int]
    block_stride: list[int]
    elem_size: list[int]
    inner_size: list[int]
    conv_width: list[int]
    group: list[int]
    dim_rows: list[int]
    row_stride: list[int]
    tables: list[int]  # each group's block table base address
    table_stride: int  # int32 entries between two rows of a block table

    def block_id(self, state: int, row: int, col: int) -> int | None:
        group = self.group[state]
        if not 0 <= group < len(self.tables):
            return None
        return _read_i32(self.tables[group] + 4 * (row * self.table_stride + col))


def _states(num_states: int, block_table_ptrs: torch.Tensor, block_table_stride_req: int,
            base_addrs: torch.Tensor, block_strides: torch.Tensor, elem_sizes: torch.Tensor,
            inner_sizes: torch.Tensor, conv_widths: torch.Tensor, group_indices: torch.Tensor,
            dim_row_count: torch.Tensor, dim_row_stride: torch.Tensor) -> _States:
    def first(t: torch.Tensor) -> list[int]:
        return [int(v) for v in pointer(t)[:num_states].tolist()]

    return _States(first(base_addrs), first(block_strides), first(elem_sizes),
                   first(inner_sizes), first(conv_widths), first(group_indices),
                   first(dim_row_count), first(dim_row_stride),
                   [int(v) for v in pointer(block_table_ptrs).tolist()],
                   int(block_table_stride_req))


def _plan_copy(st: _States, state: int, row: int, src_col: int, dst_col: int, bias: int,
               dim_first: bool) -> list[_Copy | _RowCopy] | None:
    """The copies of ``_copy_mamba_state_block`` for one (request, state): the block-table
    row ``row``'s column ``src_col`` to ``dst_col``, ``bias`` accepted tokens on. None where
    the PyTorch version does not follow the kernel (FALLBACK)."""
    base, stride = st.base[state], st.block_stride[state]
    elem, width = st.elem_size[state], st.conv_width[state]
    dst_block = st.block_id(state, row, dst_col)
    if dst_block is None:
        return None
    dst = base + dst_block * stride
    if width <= 0:
        # Temporal state: the whole block of the accepted column, src_col + bias.
        src_block = st.block_id(state, row, src_col + bias)
        if src_block is None:
            return None
        src, size = base + src_block * stride, st.inner_size[state] * elem
        if size <= 0 or src == dst:
            return []
        return None if _overlap(src, dst, size) else [_Copy(dst, src, size)]

    # Conv state: the window shifted left by bias tokens, src[bias:] -> dst[:width - bias].
    src_block = st.block_id(state, row, src_col)
    if src_block is None:
        return None
    src = base + src_block * stride
    num_tokens = width - bias
    if num_tokens <= 0:
        return []
    same_block = src_block == dst_block
    if same_block and bias < 0:
        return None  # (a right shift, copied low to high by the kernel)
    if dim_first:
        # Per dim row (state_len the slide axis), an element per token.
        rows, row_stride = st.dim_rows[state], st.row_stride[state]
        if rows <= 0:
            return []
        if rows == 1:
            row_stride = 0
        elif row_stride < (max(width, num_tokens) - min(bias, 0)) * elem:
            return None  # (rows overlapping one another)
        nbytes = num_tokens * elem
        src += bias * elem
        if same_block:
            return [] if bias == 0 else [_RowCopy(dst, src, rows, row_stride, nbytes)]
        span = (rows - 1) * row_stride + nbytes
        if _overlap(src, dst, span):
            return None
        return [_RowCopy(dst, src, rows, row_stride, nbytes)]
    # (num_blocks, state_len, dim): one contiguous range. A same-block shift is copied a
    # token at a time from low to high, which for a left shift is what memmove does.
    token = st.inner_size[state] * elem
    src, size = src + bias * token, num_tokens * token
    if size <= 0 or src == dst:
        return []
    if not same_block and _overlap(src, dst, size):
        return None
    return [_Copy(dst, src, size)]


def _run(copies: list[_Copy | _RowCopy]) -> None:
    for copy in copies:
        if isinstance(copy, _Copy):
            ctypes.memmove(copy.dst & _U64, copy.src & _U64, copy.nbytes)
            continue
        span = (copy.rows - 1) * copy.row_stride + copy.nbytes
        shape, strides = (copy.rows, copy.nbytes), (copy.row_stride, 1)
        src = _raw(copy.src, span).as_strided(shape, strides)
        dst = _raw(copy.dst, span).as_strided(shape, strides)
        # (a same-block shift overlaps its source: read it whole first, as memmove)
        dst.copy_(src.clone() if abs(copy.dst - copy.src) < span else src)


def _batch_rows(grid_rows: int, num_reqs: int, idx_mapping: torch.Tensor | None,
                has_idx_mapping: bool) -> list[tuple[int, int]]:
    """(batch row, request state slot) of every program row that goes on: below
    ``num_reqs``, and not a negative (filtered) idx_mapping row."""
    num_rows = max(min(grid_rows, num_reqs), 0)
    if not has_idx_mapping:
        return [(b, b) for b in range(num_rows)]
    if not num_rows:
        return []
    reqs = pointer(idx_mapping)[:num_rows].tolist()
    return [(b, int(r)) for b, r in enumerate(reqs) if r >= 0]


def _values(t: torch.Tensor, reqs: list[int]) -> list[int]:
    return [int(v) for v in pointer(t)[torch.tensor(reqs, dtype=torch.long)].tolist()]


# --------------------------------------------------------------------------- preprocess


@torch_kernel(f"{MAMBA_UTILS}.preprocess_mamba_align_fused_kernel")
def preprocess_mamba_align_fused(grid: tuple[int, ...], idx_mapping_ptr: torch.Tensor | None,
                                 state_idx_ptr: torch.Tensor,
                                 num_computed_tokens_ptr: torch.Tensor,
                                 query_start_loc_ptr: torch.Tensor,
                                 num_accepted_tokens_ptr: torch.Tensor,
                                 src_col_ptr: torch.Tensor, src_off_ptr: torch.Tensor,
                                 num_reqs: int, BLOCK_SIZE: int, MAMBA_BLOCK_SIZE: int,
                                 HAS_IDX_MAPPING: bool = True) -> None:
    """Each batch row's request: the pre-copy source column (its running column) and token
    bias (accepted - 1, at least 0); its running column advanced to the block holding its
    last computed token; its accepted count reset to 1 where that column changed."""
    num_rows = min(num_reqs, grid[0] * BLOCK_SIZE)
    state_idx, accepted = pointer(state_idx_ptr), pointer(num_accepted_tokens_ptr)
    query_start_loc = pointer(query_start_loc_ptr)
    for start in range(0, max(num_rows, 0), BLOCK_SIZE):  # one program at a time
        batch = torch.arange(start, min(start + BLOCK_SIZE, num_rows))
        if HAS_IDX_MAPPING:
            req = pointer(idx_mapping_ptr)[batch].long()
            keep = (req >= 0).nonzero().squeeze(1)
            batch, req = batch[keep], req[keep]
        else:
            req = batch
        if not req.numel():
            continue
        old = state_idx[req].long()
        src_off = (accepted[req].long() - 1).clamp(min=0)
        src_col, src_offs = pointer(src_col_ptr), pointer(src_off_ptr)
        src_col[req] = old.to(src_col.dtype)
        src_offs[req] = src_off.to(src_offs.dtype)
        computed_after = (pointer(num_computed_tokens_ptr)[req].long()
                          + query_start_loc[batch + 1].long() - query_start_loc[batch].long())
        # (computed_after >= 0: floor and truncated division agree)
        numerator = computed_after + MAMBA_BLOCK_SIZE - 1
        new = torch.div(numerator, MAMBA_BLOCK_SIZE, rounding_mode="trunc") - 1
        state_idx[req] = new.to(state_idx.dtype)
        reset = req[(old >= 0) & (old != new)]
        if reset.numel():
            accepted[reset] = 1


# ----------------------------------------------------------------------------- copies


@torch_kernel(f"{MAMBA_UTILS}.precopy_mamba_align_fused_kernel")
def precopy_mamba_align_fused(grid: tuple[int, ...], mamba_state_idx_ptr: torch.Tensor,
                              src_col_ptr: torch.Tensor, token_bias_ptr: torch.Tensor,
                              block_table_ptrs_ptr: torch.Tensor, block_table_stride_req: int,
                              state_base_addrs_ptr: torch.Tensor,
                              state_block_strides_ptr: torch.Tensor,
                              state_elem_sizes_ptr: torch.Tensor,
                              state_inner_sizes_ptr: torch.Tensor,
                              state_conv_widths_ptr: torch.Tensor,
                              state_group_indices_ptr: torch.Tensor,
                              state_dim_row_count_ptr: torch.Tensor,
                              state_dim_row_stride_ptr: torch.Tensor,
                              idx_mapping_ptr: torch.Tensor | None, num_reqs: int,
                              COPY_BLOCK_SIZE: int, CONV_STATE_DIM_FIRST: bool,
                              HAS_IDX_MAPPING: bool = True,
                              ZERO_TEMPORAL_TOKEN_BIAS: bool = False,
                              TEMPORAL_TILES: int = 1) -> Any:
    """Each request whose running column moved (source column >= 0 and not the new one):
    every state copied from the old column to the new, conv windows shifted by the token
    bias, temporal states taken from column ``src_col + token_bias`` (bias 0 for them
    under ZERO_TEMPORAL_TOKEN_BIAS)."""
    grid_rows, num_states, num_tiles = _grid3(grid)
    rows = _batch_rows(grid_rows, num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING)
    if not rows or num_states <= 0 or num_tiles <= 0:
        return None
    if TEMPORAL_TILES < 1 or num_tiles < TEMPORAL_TILES:
        return FALLBACK
    reqs = [r for _, r in rows]
    src_cols = _values(src_col_ptr, reqs)
    dst_cols = _values(mamba_state_idx_ptr, reqs)
    moving = [i for i, (s, d) in enumerate(zip(src_cols, dst_cols)) if s >= 0 and s != d]
    if not moving:
        return None
    biases = _values(token_bias_ptr, [reqs[i] for i in moving])
    st = _states(num_states, block_table_ptrs_ptr, block_table_stride_req,
                 state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
                 state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                 state_dim_row_count_ptr, state_dim_row_stride_ptr)
    copies: list[_Copy | _RowCopy] = []
    for i, bias in zip(moving, biases):
        for state in range(num_states):
            state_bias = bias
            if ZERO_TEMPORAL_TOKEN_BIAS and st.conv_width[state] <= 0:
                state_bias = 0
            planned = _plan_copy(st, state, reqs[i], src_cols[i], dst_cols[i], state_bias,
                                 CONV_STATE_DIM_FIRST)
            if planned is None:
                return FALLBACK
            copies += planned
    _run(copies)
    return None


@torch_kernel(f"{MAMBA_UTILS}.postprocess_mamba_fused_kernel")
def postprocess_mamba_fused(grid: tuple[int, ...], num_accepted_tokens_ptr: torch.Tensor,
                            mamba_state_idx_ptr: torch.Tensor,
                            num_scheduled_tokens_ptr: torch.Tensor | None,
                            num_computed_tokens_ptr: torch.Tensor,
                            num_draft_tokens_ptr: torch.Tensor | None,
                            block_table_ptrs_ptr: torch.Tensor, block_table_stride_req: int,
                            state_base_addrs_ptr: torch.Tensor,
                            state_block_strides_ptr: torch.Tensor,
                            state_elem_sizes_ptr: torch.Tensor,
                            state_inner_sizes_ptr: torch.Tensor,
                            state_conv_widths_ptr: torch.Tensor,
                            state_group_indices_ptr: torch.Tensor,
                            state_dim_row_count_ptr: torch.Tensor,
                            state_dim_row_stride_ptr: torch.Tensor,
                            num_accepted_tokens_out_ptr: torch.Tensor,
                            idx_mapping_ptr: torch.Tensor | None, num_reqs: int,
                            block_size: int, COPY_BLOCK_SIZE: int, CONV_STATE_DIM_FIRST: bool,
                            HAS_IDX_MAPPING: bool = False,
                            PRECOMPUTED_NEW_COMPUTED: bool = False,
                            SKIP_TEMPORAL_STATE_COPY: bool = False,
                            TEMPORAL_TILES: int = 1) -> Any:
    """Each request whose accepted tokens carried it past a block boundary: its running
    state (column ``mamba_state_idx``) saved in the last block it filled, at the boundary
    (``mamba_state_copy_boundary``): conv windows shifted, temporal states taken from the
    accepted token's column. Where that block is the running one, its accepted count
    (``num_accepted_tokens_out``) becomes 1."""
    grid_rows, num_states, num_tiles = _grid3(grid)
    rows = _batch_rows(grid_rows, num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING)
    if not rows or num_states <= 0 or num_tiles <= 0:
        return None
    if TEMPORAL_TILES < 1 or num_tiles < TEMPORAL_TILES:
        return FALLBACK
    if (num_accepted_tokens_out_ptr.untyped_storage().data_ptr()
            == num_accepted_tokens_ptr.untyped_storage().data_ptr()):
        return FALLBACK  # (later programs would read the count earlier ones reset)
    reqs = [r for _, r in rows]
    accepted = _values(num_accepted_tokens_ptr, reqs)
    src_cols = _values(mamba_state_idx_ptr, reqs)
    computed = _values(num_computed_tokens_ptr, reqs)
    if not PRECOMPUTED_NEW_COMPUTED:
        scheduled = _values(num_scheduled_tokens_ptr, reqs)
        drafts = _values(num_draft_tokens_ptr, reqs)
    st: _States | None = None
    resets: list[int] = []
    copies: list[_Copy | _RowCopy] = []
    for i, req in enumerate(reqs):
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[i]
            running = new_computed - accepted[i] + 1
        else:
            running = computed[i] + scheduled[i] - drafts[i]
            new_computed = running + accepted[i] - 1
        # mamba_state_copy_boundary: the last block boundary reached, if the running
        # state is at or before it.
        aligned = _tdiv(new_computed, block_size) * block_size
        if aligned < running:
            continue
        bias, dst_col = aligned - running, _tdiv(aligned, block_size) - 1
        if src_cols[i] == dst_col:
            resets.append(req)
            if bias == 0:
                continue
        if st is None:
            st = _states(num_states, block_table_ptrs_ptr, block_table_stride_req,
                         state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr,
                         state_inner_sizes_ptr, state_conv_widths_ptr,
                         state_group_indices_ptr, state_dim_row_count_ptr,
                         state_dim_row_stride_ptr)
        for state in range(num_states):
            if SKIP_TEMPORAL_STATE_COPY and st.conv_width[state] == 0:
                continue
            planned = _plan_copy(st, state, req, src_cols[i], dst_col, bias,
                                 CONV_STATE_DIM_FIRST)
            if planned is None:
                return FALLBACK
            copies += planned
    if resets:
        out = pointer(num_accepted_tokens_out_ptr)
        out[torch.tensor(resets, dtype=torch.long)] = 1
    _run(copies)
    return None
