"""PyTorch versions of DFlash's drafter-input kernel (``spec_decode/dflash/speculator.py``)
and of the rejection sampler's kernels (``spec_decode/rejection_sampler.py``,
``spec_decode/rejection_sampler_utils.py``).

Covered: greedy and sampled requests (mixed in a batch), one-hot drafts or the drafter's
logits (probabilistic drafting) in the statistics and acceptance kernels, synthetic
acceptance, fp32 or fp64 Gumbel noise, skipped masked vocabulary blocks. Handed back to
Triton: block verification, FlyDecoding windows, watermarking, and resampling from the
residual of the drafter's distribution (the Triton kernel calls libdevice's log1p there,
which Triton's interpreter does not run either).

Floating-point reductions run in NumPy as Triton's interpreter runs them (``np.sum`` over
the same padded blocks, ``np.exp``/``np.log``, NaN-ignoring ``nanmax``/``nanargmax``), so
statistics, accepted drafts and resampled tokens agree with the interpreted kernels bit
for bit; the random numbers come from :mod:`.rng`. Entries the kernels leave unwritten
(statistics of bonus rows, steps past a rejection, greedy rows' resampling) stay unwritten.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from cpu_standin.kernels import FALLBACK, pointer, rng, torch_kernel

DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
UTILS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers
#
# The small index arithmetic runs in NumPy on the tensors' memory: a NumPy operation on a
# few dozen elements costs a fraction of a PyTorch one, and these kernels are dozens of
# them.


def _a(t: torch.Tensor) -> np.ndarray:
    """:func:`_flat` as a NumPy array (the same memory)."""
    if t.dim() == 1 and t.is_contiguous() and (
            (t.storage_offset() + t.numel()) * t.element_size()
            == t.untyped_storage().nbytes()):
        return t.numpy()  # (already to the end of its storage: a third of the time)
    return pointer(t).numpy()


def _rows(t: torch.Tensor, num_rows: int, stride: int, width: int) -> np.ndarray:
    """The [num_rows, width] matrix a kernel addresses as ``t + row * stride + col``, as
    a NumPy array on ``t``'s memory."""
    return t.as_strided((num_rows, width), (int(stride), 1)).numpy()


def _ranges(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of ``lens[i]`` (>= 0) elements each, flattened: the row and the index
    within it of every element."""
    row = np.repeat(np.arange(lens.size), lens)
    first = np.cumsum(lens) - lens
    return row, np.arange(row.size) - first[row]


def _tdiv(a: np.ndarray, b: Any) -> np.ndarray:
    # Integer division as in Triton (and C): rounded toward zero.
    q = np.floor_divide(a, b)
    return q + ((q < 0) & (q * b != a))


def _firsts(keys: np.ndarray) -> np.ndarray:
    """Of sorted ``keys``, where each run of equal keys starts."""
    if not keys.size:
        return keys
    starts = np.empty(keys.size, dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    return np.flatnonzero(starts)


def _frows(t: torch.Tensor, num_rows: int, stride: int, width: int) -> np.ndarray:
    """:func:`_rows` of a float matrix as float32 (its memory where already float32)."""
    view = t.as_strided((num_rows, width), (int(stride), 1))
    return (view if view.dtype == torch.float32 else view.float()).numpy()


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _blocks(x: np.ndarray, width: int, num_blocks: int, block_size: int
            ) -> list[tuple[int, np.ndarray]]:
    """The rows of ``x`` ([rows, >= width]) cut in blocks of ``block_size`` columns as the
    kernels load them, the columns from ``width`` on -inf: (first block, [rows, blocks,
    block_size]) parts, whole blocks as a view, a partial last block padded in a copy."""
    whole = min(width // block_size, num_blocks)
    parts = []
    if whole:
        parts.append((0, x[:, :whole * block_size].reshape(x.shape[0], whole, block_size)))
    if whole < num_blocks:
        pad = np.full((x.shape[0], num_blocks - whole, block_size), _NEG_INF, dtype=x.dtype)
        tail = x[:, whole * block_size:width]
        pad.reshape(x.shape[0], -1)[:, :tail.shape[1]] = tail
        parts.append((whole, pad))
    return parts


def _nan_fix(blocks: np.ndarray, values: np.ndarray, idx: np.ndarray | None) -> None:
    """Recomputes in place the blocks whose max NumPy took as NaN as the interpreter's
    ``nanmax``/``nanargmax`` do (NaNs ignored)."""
    nan = np.isnan(values)
    if nan.any():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (all-NaN blocks)
            values[nan] = np.nanmax(blocks[nan], axis=-1)
            if idx is not None:
                fixed = blocks[nan]
                fixed[np.isnan(fixed)] = _NEG_INF
                idx[nan] = fixed.argmax(axis=-1)


def _block_argmax(x: np.ndarray, width: int, num_blocks: int, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``tl.max(block, return_indices=True)`` of every block of every row: the maximum
    and the token id reaching it first."""
    values = np.empty((x.shape[0], num_blocks), dtype=x.dtype)
    tokens = np.empty((x.shape[0], num_blocks), dtype=np.int64)
    for first, blocks in _blocks(x, width, num_blocks, block_size):
        idx = blocks.argmax(axis=-1)
        vals = np.take_along_axis(blocks, idx[..., None], axis=-1)[..., 0]
        _nan_fix(blocks, vals, idx)
        values[:, first:first + blocks.shape[1]] = vals
        tokens[:, first:first + blocks.shape[1]] = (
            idx + (first + np.arange(blocks.shape[1]))[None] * block_size)
    return values, tokens


@np.errstate(invalid="ignore", over="ignore")
def _block_max_sumexp(x: np.ndarray, width: int, num_blocks: int, block_size: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``_compute_max_and_sumexp`` of every block of every row (float32)."""
    maxes = np.empty((x.shape[0], num_blocks), dtype=np.float32)
    sums = np.empty((x.shape[0], num_blocks), dtype=np.float32)
    for first, blocks in _blocks(x, width, num_blocks, block_size):
        m = blocks.max(axis=-1)
        _nan_fix(blocks, m, None)
        e = np.subtract(blocks, m[..., None])
        np.exp(e, out=e)
        # Summed over the whole padded block: np.sum's pairwise order is the interpreter's.
        s = e.sum(axis=-1)
        maxes[:, first:first + blocks.shape[1]] = m
        sums[:, first:first + blocks.shape[1]] = np.where(m > _NEG_INF, s, np.float32(0.0))
    return maxes, sums


def _subset(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows ``rows`` of ``x`` and where they are in what is returned: all of ``x``
    (a view) when they are most of it, else a copy of just them."""
    if 2 * rows.size >= x.shape[0]:
        return x, rows
    return x[rows], np.arange(rows.size)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def _global_logsumexp(local_max: np.ndarray, local_sumexp: np.ndarray, padded: int
                      ) -> np.ndarray:
    """``_compute_global_logsumexp`` of [rows, blocks] statistics: over ``padded``
    blocks, the missing ones -inf and 0 (they change np.sum's order at 8 blocks and up)."""
    rows, blocks = local_max.shape
    maxes = np.full((rows, padded), _NEG_INF, dtype=np.float32)
    sums = np.zeros((rows, padded), dtype=np.float32)
    maxes[:, :blocks], sums[:, :blocks] = local_max, local_sumexp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (all-NaN rows)
        gmax = np.nanmax(maxes, axis=-1)
    return gmax + np.log(np.sum(sums * np.exp(maxes - gmax[:, None]), axis=-1))


def _draft_rows(req_state: np.ndarray, row_mapping: torch.Tensor | None) -> np.ndarray:
    """``tl.maximum(draft_logits_row(req_state), 0)``: a request's row of the drafter's
    logits cache (its state index, or its entry of the row mapping)."""
    if row_mapping is None:
        row = req_state
    else:
        row = np.where(req_state >= 0, _a(row_mapping)[np.maximum(req_state, 0)], -1)
    return np.maximum(row.astype(np.int64), 0)


def _cp_local_slot(pos: np.ndarray, block_id: np.ndarray, block_size: int, cp_rank: int,
                   cp_size: int, cp_interleave: int, pad_id: int) -> np.ndarray:
    """cp_utils.cp_local_slot: a position's KV slot on this context-parallel rank."""
    offset = np.fmod(pos, block_size * cp_size)
    if cp_size == 1:
        return block_id * block_size + offset
    is_local = np.fmod(_tdiv(offset, cp_interleave), cp_size) == cp_rank
    local = (_tdiv(offset, cp_interleave * cp_size) * cp_interleave
             + np.fmod(offset, cp_interleave))
    return np.where(is_local, block_id * block_size + local, pad_id)


# ------------------------------------------------------------- dflash/speculator.py


@torch_kernel(f"{DFLASH}._prepare_dflash_inputs_kernel")
def prepare_dflash_inputs(grid, out_input_ids_ptr, out_query_positions_ptr,
                          out_is_padding_ptr, out_query_start_loc_ptr, out_seq_lens_ptr,
                          out_query_slot_mapping_ptr, out_context_positions_ptr,
                          out_context_slot_mapping_ptr, out_sample_indices_ptr,
                          out_sample_pos_ptr, out_sample_idx_mapping_ptr,
                          out_temperature_ptr, out_seeds_ptr, target_positions_ptr,
                          target_query_start_loc_ptr, idx_mapping_ptr, last_sampled_ptr,
                          next_prefill_tokens_ptr, num_sampled_ptr, num_rejected_ptr,
                          temperature_ptr, seeds_ptr, block_table_ptr, block_table_stride,
                          parallel_drafting_token_id, block_size, num_query_per_req,
                          num_speculative_steps, max_num_reqs, max_num_tokens, max_model_len,
                          cp_rank, num_reqs, SAMPLE_FROM_ANCHOR, PAD_SLOT_ID, CP_SIZE,
                          CP_INTERLEAVE, BLOCK_SIZE, NUM_PAD_PROGRAMS) -> Any:
    num_programs, num_blocks = grid
    num_reqs, nq, steps = int(num_reqs), int(num_query_per_req), int(num_speculative_steps)
    num_pad = max(num_programs - max(num_reqs, 0), 0)
    if num_pad not in (0, NUM_PAD_PROGRAMS):
        return FALLBACK  # (padding programs covering part of the buffers only)
    if not num_blocks:
        return None
    span = num_blocks * BLOCK_SIZE  # the tokens of a request the grid covers
    R = max(min(num_reqs, num_programs), 0)  # noqa: N806
    block_table = _a(block_table_ptr)
    virtual_block = block_size * CP_SIZE

    def slots(pos: np.ndarray, req: np.ndarray, covered: np.ndarray | None) -> np.ndarray:
        # The KV slot of ``pos``; PAD where not covered or in the null block 0.
        block_num = np.minimum(_tdiv(pos, virtual_block), block_table_stride - 1)
        index = req * block_table_stride + block_num
        if covered is None:
            block_id = block_table[index].astype(np.int64)
        else:
            block_id = np.where(covered, block_table[np.where(covered, index, 0)], 0).astype(
                np.int64)
        local = _cp_local_slot(pos, block_id, block_size, cp_rank, CP_SIZE, CP_INTERLEAVE,
                               PAD_SLOT_ID)
        resident = block_id != 0 if covered is None else covered & (block_id != 0)
        return np.where(resident, local, PAD_SLOT_ID)

    if R:
        positions = _a(target_positions_ptr)
        query_start_loc = _a(target_query_start_loc_ptr)[:R + 1].astype(np.int64)
        ctx_start = query_start_loc[:-1]
        num_ctx = query_start_loc[1:] - ctx_start
        num_valid = num_ctx - _a(num_rejected_ptr)[:R]
        req_state = _a(idx_mapping_ptr)[:R].astype(np.int64)
        bonus = np.where(_a(num_sampled_ptr)[:R] > 0, _a(last_sampled_ptr)[req_state],
                         _a(next_prefill_tokens_ptr)[req_state]).astype(np.int32)
        last_valid_pos = positions[ctx_start + num_valid - 1].astype(np.int64)

        # Context rows: the accepted ones keep their positions and slots; the rejected
        # suffix gets position 0 and PAD (written all the same, for graph replays).
        k, j = _ranges(np.clip(num_ctx, 0, span))
        if k.size:
            valid = j < num_valid[k]
            dst = ctx_start[k] + j
            pos = np.where(valid, positions[np.where(valid, dst, 0)], 0).astype(np.int64)
            _a(out_context_positions_ptr)[dst] = pos
            _a(out_context_slot_mapping_ptr)[dst] = slots(pos, k, valid)

        # Query rows: the bonus token then the mask tokens, right after the accepted ones.
        j = num_valid[:, None] + np.arange(nq)
        rows, qs = np.nonzero((j >= 0) & (j < span))
        if rows.size:
            query_pos = last_valid_pos[rows] + 1 + qs
            query_idx = rows * nq + qs
            _a(out_input_ids_ptr)[query_idx] = np.where(qs == 0, bonus[rows],
                                                        int(parallel_drafting_token_id))
            _a(out_is_padding_ptr)[query_idx] = False
            _a(out_query_positions_ptr)[query_idx] = np.minimum(query_pos, max_model_len - 1)
            _a(out_query_slot_mapping_ptr)[query_idx] = slots(query_pos, rows, None)
            # DFlash samples at the mask tokens, each at its own position; DSpark at
            # every query token, for the next position.
            first = 0 if SAMPLE_FROM_ANCHOR else 1
            sample = qs >= first
            sample_idx = rows[sample] * steps + qs[sample] - first
            _a(out_sample_indices_ptr)[sample_idx] = query_idx[sample]
            _a(out_sample_pos_ptr)[sample_idx] = query_pos[sample] + (1 - first)
            _a(out_sample_idx_mapping_ptr)[sample_idx] = req_state[rows[sample]]

        # Per request (the first block's program).
        _a(out_query_start_loc_ptr)[:R] = np.arange(R) * nq
        _a(out_seq_lens_ptr)[:R] = np.minimum(last_valid_pos + 1 + nq, max_model_len)
        _a(out_temperature_ptr)[req_state] = _a(temperature_ptr)[req_state]
        _a(out_seeds_ptr)[req_state] = _a(seeds_ptr)[req_state]

    if num_pad:
        # Past the batch, for CUDA graphs of more requests: empty queries, no sampling
        # (-1 request), padding tokens without KV slots.
        _a(out_query_start_loc_ptr)[num_reqs:max_num_reqs + 1] = num_reqs * nq
        _a(out_seq_lens_ptr)[num_reqs:max_num_reqs] = 0
        pad = slice(num_reqs * steps, max_num_reqs * steps)
        _a(out_sample_indices_ptr)[pad] = 0
        _a(out_sample_pos_ptr)[pad] = 0
        _a(out_sample_idx_mapping_ptr)[pad] = -1
        pad = slice(num_reqs * nq, max_num_tokens)
        _a(out_input_ids_ptr)[pad] = 0
        _a(out_query_positions_ptr)[pad] = 0
        _a(out_is_padding_ptr)[pad] = True
        _a(out_query_slot_mapping_ptr)[pad] = PAD_SLOT_ID
    return None


# ---------------------------------------------------------------- rejection_sampler.py


@torch_kernel(f"{SAMPLER}._gather_draft_sampled_kernel")
def gather_draft_sampled(grid, draft_sampled_ptr, pos_ptr, input_ids_ptr, positions_ptr,
                         logits_indices_ptr, expanded_idx_mapping_ptr,
                         expanded_local_pos_ptr, prefill_len_ptr, num_logits,
                         BLOCK_SIZE) -> None:
    n = min(int(num_logits), grid[0] * BLOCK_SIZE)
    if n <= 0:
        return
    token = _a(logits_indices_ptr)[:n]
    pos = _a(positions_ptr)[token]
    local_pos = _a(expanded_local_pos_ptr)[:n].astype(np.int64)
    prefill_len = _a(prefill_len_ptr)[_a(expanded_idx_mapping_ptr)[:n]]
    # Draft slots of a step that starts inside the prefill hold no real draft.
    placeholder = (local_pos > 0) & (pos - local_pos < prefill_len)
    _a(draft_sampled_ptr)[:n] = np.where(placeholder, -1, _a(input_ids_ptr)[token])
    _a(pos_ptr)[:n] = pos


# ---------------------------------------------------------- rejection_sampler_utils.py


@torch_kernel(f"{UTILS}._compute_local_logits_stats_kernel")
def compute_local_logits_stats(grid, target_local_argmax_ptr, target_local_argmax_stride,
                               target_local_max_ptr, target_local_max_stride,
                               target_local_sumexp_ptr, target_local_sumexp_stride,
                               draft_local_max_ptr, draft_local_max_stride,
                               draft_local_sumexp_ptr, draft_local_sumexp_stride,
                               target_logits_ptr, target_logits_stride, draft_logits_ptr,
                               draft_logits_stride_0, draft_logits_stride_1,
                               draft_logits_row_mapping_ptr, expanded_idx_mapping_ptr,
                               expanded_local_pos_ptr, temp_ptr, vocab_size, num_logits,
                               BLOCK_SIZE, HAS_DRAFT_LOGITS) -> None:
    n, num_blocks = grid
    width = min(int(vocab_size), num_blocks * BLOCK_SIZE)
    if not n or not num_blocks or width <= 0:
        return
    # Bonus rows (the next row starts a request, or none follows) need no statistics.
    local_pos = _a(expanded_local_pos_ptr)
    following = min(max(int(num_logits) - 1, 0), n)
    next_pos = np.zeros(n, dtype=np.int64)
    next_pos[:following] = local_pos[1:following + 1]
    rows = np.flatnonzero(next_pos)
    if not rows.size:
        return
    req_state = _a(expanded_idx_mapping_ptr)[rows].astype(np.int64)
    temp = _f32(_a(temp_ptr)[req_state])
    greedy = temp == 0.0
    logits = _frows(target_logits_ptr, n, target_logits_stride, width)

    g = rows[greedy]
    if g.size:  # greedy: the block's max and argmax
        x, at = _subset(logits, g)
        values, tokens = _block_argmax(x, width, num_blocks, BLOCK_SIZE)
        _rows(target_local_argmax_ptr, n, target_local_argmax_stride, num_blocks)[g] = (
            tokens[at])
        _rows(target_local_max_ptr, n, target_local_max_stride, num_blocks)[g] = values[at]

    sampled = ~greedy
    s = rows[sampled]
    if not s.size:
        return
    x, at = _subset(logits, s)
    maxes, sums = _block_max_sumexp(x, width, num_blocks, BLOCK_SIZE)
    _rows(target_local_max_ptr, n, target_local_max_stride, num_blocks)[s] = maxes[at]
    _rows(target_local_sumexp_ptr, n, target_local_sumexp_stride, num_blocks)[s] = sums[at]
    if HAS_DRAFT_LOGITS:
        # The drafter's logits of the step, cached before temperature: divided here.
        row = _draft_rows(req_state[sampled], draft_logits_row_mapping_ptr)
        start = row * draft_logits_stride_0 + local_pos[s] * draft_logits_stride_1
        draft = _f32(_a(draft_logits_ptr)[start[:, None] + np.arange(width)])
        draft = draft / temp[sampled][:, None]
        maxes, sums = _block_max_sumexp(draft, width, num_blocks, BLOCK_SIZE)
        _rows(draft_local_max_ptr, n, draft_local_max_stride, num_blocks)[s] = maxes
        _rows(draft_local_sumexp_ptr, n, draft_local_sumexp_stride, num_blocks)[s] = sums


@torch_kernel(f"{UTILS}._rejection_kernel")
def rejection(grid, sampled_ptr, sampled_stride, rejected_steps_ptr,
              target_rejected_logsumexp_ptr, draft_rejected_logsumexp_ptr, target_logits_ptr,
              target_logits_stride, target_local_argmax_ptr, target_local_argmax_stride,
              target_local_max_ptr, target_local_max_stride, target_local_sumexp_ptr,
              target_local_sumexp_stride, draft_sampled_ptr, draft_logits_ptr,
              draft_logits_stride_0, draft_logits_stride_1, draft_logits_row_mapping_ptr,
              draft_local_max_ptr, draft_local_max_stride, draft_local_sumexp_ptr,
              draft_local_sumexp_stride, cu_num_logits_ptr, idx_mapping_ptr, temp_ptr,
              seed_ptr, pos_ptr, synthetic_conditional_rates_ptr, cumulative_log_p_ptr,
              local_residual_mass_ptr, local_residual_mass_stride, fly_entropy_ptr,
              fly_entropy_threshold, vocab_num_blocks, PADDED_VOCAB_NUM_BLOCKS,
              HAS_DRAFT_LOGITS, SYNTHETIC_MODE, USE_BLOCK_VERIFICATION,
              FLY_WINDOW_SIZE) -> Any:
    if USE_BLOCK_VERIFICATION or FLY_WINDOW_SIZE:
        return FALLBACK
    R = grid[0]  # noqa: N806
    if not R:
        return None
    req_state = _a(idx_mapping_ptr)[:R].astype(np.int64)
    cu = _a(cu_num_logits_ptr)[:R + 1].astype(np.int64)
    start = cu[:-1]
    num_drafts = np.maximum(cu[1:] - start - 1, 0)
    greedy = _f32(_a(temp_ptr)[req_state]) == 0.0
    nb, padded = int(vocab_num_blocks), int(PADDED_VOCAB_NUM_BLOCKS)

    # Every (request, step) pair, decided at once; a request's verification stops at
    # its first pair not accepted (or, sampling, at a -1 placeholder).
    k, i = _ranges(num_drafts)
    n = k.size
    logit = start[k] + i
    num_rows = int(logit.max()) + 1 if n else 0
    raw = _a(draft_sampled_ptr)[logit + 1].astype(np.int64)
    valid = raw >= 0
    draft = np.maximum(raw, 0)
    pair_greedy = greedy[k]
    ok = np.zeros(n, dtype=bool)
    argmax = np.zeros(n, dtype=np.int64)
    lse = np.zeros(n, dtype=np.float32)  # each pair's target and draft logsumexp
    draft_lse = np.zeros(n, dtype=np.float32)

    g = np.flatnonzero(pair_greedy)
    if g.size:  # the target's argmax (local maxima NaN-free, first block wins)
        local_max = _rows(target_local_max_ptr, num_rows, target_local_max_stride,
                          nb)[logit[g]]
        local_max[np.isnan(local_max)] = _NEG_INF
        block = local_max.argmax(axis=1)
        argmax[g] = _rows(target_local_argmax_ptr, num_rows, target_local_argmax_stride,
                          nb)[logit[g], block]
        ok[g] = argmax[g] == draft[g]

    s = np.flatnonzero(~pair_greedy)
    rand = np.arange(n) if SYNTHETIC_MODE else s
    u = None
    if rand.size:
        u = rng.tl_rand32(_a(seed_ptr)[req_state[k[rand]]], _a(pos_ptr)[logit[rand]],
                          includes_zero=False).numpy()
    if s.size:
        ls = logit[s]
        lse[s] = _global_logsumexp(
            _f32(_rows(target_local_max_ptr, num_rows, target_local_max_stride, nb)[ls]),
            _f32(_rows(target_local_sumexp_ptr, num_rows, target_local_sumexp_stride,
                       nb)[ls]), padded)
        target_logit = _f32(_a(target_logits_ptr)[ls * target_logits_stride + draft[s]])
        with np.errstate(invalid="ignore", divide="ignore"):
            target_logprob = np.where(valid[s], target_logit, np.float32(_NEG_INF)) - lse[s]
            bound = np.log(u[s] if SYNTHETIC_MODE else u)
        if HAS_DRAFT_LOGITS:
            draft_lse[s] = _global_logsumexp(
                _f32(_rows(draft_local_max_ptr, num_rows, draft_local_max_stride, nb)[ls]),
                _f32(_rows(draft_local_sumexp_ptr, num_rows, draft_local_sumexp_stride,
                           nb)[ls]), padded)
            row = _draft_rows(req_state[k[s]], draft_logits_row_mapping_ptr)
            d = _f32(_a(draft_logits_ptr)[row * draft_logits_stride_0
                                          + i[s] * draft_logits_stride_1 + draft[s]])
            d = np.where(valid[s], d, np.float32(_NEG_INF))
            with np.errstate(invalid="ignore"):
                bound = bound + (d / _f32(_a(temp_ptr)[req_state[k[s]]]) - draft_lse[s])
        ok[s] = target_logprob > bound
    if SYNTHETIC_MODE and u is not None:
        ok = u < _f32(_a(synthetic_conditional_rates_ptr)[i])
    ok &= valid

    # The first pair not accepted: its step is the accepted length.
    accepted = num_drafts.copy()
    failed = np.flatnonzero(~ok)
    first = failed[_firsts(k[failed])]
    accepted[k[first]] = i[first]
    stop = accepted[k]
    # Greedy requests store the target's argmax at the rejected step; sampled ones store
    # the draft there (if not a placeholder), resampled later.
    written = (i < stop) | ((i == stop) & (pair_greedy | valid))
    value = np.where(pair_greedy & (i == stop), argmax, draft)
    _a(sampled_ptr)[k[written] * sampled_stride + i[written]] = value[written]
    _a(rejected_steps_ptr)[:R] = accepted

    # Sampled requests report the logsumexps of their last verified step (0 if none).
    verified = np.flatnonzero(written & ~pair_greedy)
    # (each request's last: the first of its run in reverse)
    last = verified[verified.size - 1 - _firsts(k[verified][::-1])]
    for out, values in ((target_rejected_logsumexp_ptr, lse),
                        (draft_rejected_logsumexp_ptr, draft_lse)):
        reported = np.zeros(R, dtype=np.float32)
        reported[k[last]] = values[last]
        _a(out)[:R] = reported
    return None


@torch_kernel(f"{UTILS}._resample_kernel")
def resample(grid, resampled_local_argmax_ptr, resampled_local_argmax_stride,
             resampled_local_max_ptr, resampled_local_max_stride, target_logits_ptr,
             target_logits_stride, target_rejected_logsumexp_ptr, draft_logits_ptr,
             draft_logits_stride_0, draft_logits_stride_1, draft_logits_row_mapping_ptr,
             draft_rejected_logsumexp_ptr, rejected_step_ptr, cu_num_logits_ptr,
             expanded_idx_mapping_ptr, draft_sampled_ptr, temp_ptr, seed_ptr, pos_ptr,
             cumulative_log_p_ptr, contexts_ptr, contexts_stride, watermarking_ptr,
             watermarking_skip_mask_ptr, watermark_key_0, watermark_key_1, vocab_size,
             BLOCK_SIZE, HAS_DRAFT_LOGITS, USE_FP64, USE_BLOCK_VERIFICATION, CONTEXT_WIDTH,
             WATERMARK, DEDUPLICATE_CONTEXTS, SKIP_MASKED_BLOCKS) -> Any:
    if WATERMARK or USE_BLOCK_VERIFICATION:
        return FALLBACK
    R, num_blocks = grid  # noqa: N806
    width = min(int(vocab_size), num_blocks * BLOCK_SIZE)
    if not R or not num_blocks:
        return None
    cu = _a(cu_num_logits_ptr)[:R + 1].astype(np.int64)
    token = cu[:-1] + _a(rejected_step_ptr)[:R]
    is_bonus = token == cu[1:] - 1
    req_state = _a(expanded_idx_mapping_ptr)[token].astype(np.int64)
    temp = _f32(_a(temp_ptr)[req_state])
    # Greedy requests rejected a draft: their target argmax is already in place.
    rows = np.flatnonzero((temp != 0.0) | is_bonus)
    if not rows.size:
        return None
    token, is_bonus, req_state = token[rows], is_bonus[rows], req_state[rows]
    rejected = np.where(is_bonus, 0, _a(draft_sampled_ptr)[np.where(is_bonus, 0, token + 1)])
    residual = ~is_bonus & (rejected >= 0)  # a real draft was rejected
    if HAS_DRAFT_LOGITS and residual[temp[rows] != 0.0].any():
        # Triton's residual max(p - q, 0) uses libdevice's log1p (not in the interpreter).
        return FALLBACK

    target = _frows(target_logits_ptr, int(token.max()) + 1, target_logits_stride,
                    width)[token]
    x = np.full((rows.size, num_blocks * BLOCK_SIZE), _NEG_INF, dtype=np.float32)
    x[:, :width] = target
    # One-hot draft: the residual is the target without the rejected token.
    r = np.flatnonzero(residual)
    x[r, rejected[r]] = _NEG_INF
    if USE_FP64:
        x = x.astype(np.float64)
    # Gumbel-max over the (already tempered) residual logits, as gumbel_block_argmax.
    valid_req = req_state >= 0
    safe = np.maximum(req_state, 0)
    noisy = np.flatnonzero(valid_req & (_f32(_a(temp_ptr)[safe]) != 0.0))
    if noisy.size:
        seed = np.where(valid_req, _a(seed_ptr)[safe], 0)[noisy].astype(np.int64)
        noise = rng.gumbel_noise(seed[:, None], _a(pos_ptr)[token[noisy]][:, None],
                                 torch.arange(width, dtype=torch.int32), use_fp64=USE_FP64)
        x[noisy, :width] += noise.numpy()
    values, tokens = _block_argmax(x, num_blocks * BLOCK_SIZE, num_blocks, BLOCK_SIZE)
    if SKIP_MASKED_BLOCKS:
        # Blocks without a surviving target token report their first token and -inf.
        target_max, _ = _block_argmax(target, width, num_blocks, BLOCK_SIZE)
        masked = target_max == _NEG_INF
        values[masked] = _NEG_INF
        tokens[masked] = np.nonzero(masked)[1] * BLOCK_SIZE
    _rows(resampled_local_argmax_ptr, R, resampled_local_argmax_stride, num_blocks)[rows] = (
        tokens)
    _rows(resampled_local_max_ptr, R, resampled_local_max_stride, num_blocks)[rows] = values
    return None


@torch_kernel(f"{UTILS}._insert_resampled_kernel")
def insert_resampled(grid, sampled_ptr, sampled_stride, num_sampled_ptr,
                     resampled_local_argmax_ptr, resampled_local_argmax_stride,
                     resampled_local_max_ptr, resampled_local_max_stride,
                     resample_num_blocks, cu_num_logits_ptr, expanded_idx_mapping_ptr,
                     temp_ptr, PADDED_RESAMPLE_NUM_BLOCKS=None) -> None:
    R = grid[0]  # noqa: N806
    if not R:
        return
    num_sampled = _a(num_sampled_ptr)[:R]
    count = num_sampled.astype(np.int64)
    cu = _a(cu_num_logits_ptr)[:R + 1].astype(np.int64)
    token = cu[:-1] + count
    is_bonus = token == cu[1:] - 1
    temp = _f32(_a(temp_ptr)[_a(expanded_idx_mapping_ptr)[token]])
    num_sampled += 1
    rows = np.flatnonzero((temp != 0.0) | is_bonus)
    nb = int(resample_num_blocks)
    if not rows.size or nb <= 0:
        return
    # The block with the largest (NaN-free) maximum; the first one on ties.
    local_max = _rows(resampled_local_max_ptr, R, resampled_local_max_stride, nb)[rows]
    local_max[np.isnan(local_max)] = _NEG_INF
    block = local_max.argmax(axis=1)
    _a(sampled_ptr)[rows * sampled_stride + count[rows]] = _rows(
        resampled_local_argmax_ptr, R, resampled_local_argmax_stride, nb)[rows, block]
