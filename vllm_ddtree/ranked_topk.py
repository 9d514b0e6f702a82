"""The drafter's top-k, ranked, on CUDA (tree.topk_ranked): float32 log-probs and ids in
the tree build's rank order, from one read of the logits.

Before, torch.topk read the logits, a log-sum-exp kernel read them again, and sorts ranked
the top-k. Here two launches do it all:

1. ``_partial_topk_kernel``, a program per (row, split), passes once over its split of the
   vocabulary. It keeps the running max and sum of exp per lane (the log-sum-exp's parts)
   and the split's best tokens as int64 keys (logit, then id, in sortable bits) in a
   scratch buffer: a tile's keys above the k-th best so far are appended, and when the
   next tile might not fit, a bitonic top-k keeps the best ``K_BLOCK``. After the first
   tiles few keys pass, so a split sorts a few times (best when large logits come early).
2. ``_ranked_topk_kernel``, a program per row, joins the splits: their parts give the
   log-sum-exp, their best keys the row's top k (appended and kept the same way), and one
   sort of (log-prob, id) keys the rank order.

At small batches a row is spread over several splits to fill the GPU (``auto_splits``,
from shapes only: no host sync, and a captured graph stays valid). Among tokens tied at
the k-th logit the lowest ids make the cut.

Memory beside the outputs: a scratch of 16 KiB per (row, split) at k <= 512 (32 KiB up to
1024), so 64 MiB for 256 requests of depth 16 at budget 256, where the logits are 1.2 GB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The largest k: its keys are kept and sorted in blocks of up to this many (and tree.py's
# builder takes no larger budget). Its own constant, so that it needs nothing of tree.py,
# which calls it.
MAX_K = 1024
BLOCK = 1024  # vocabulary entries per loop step (fewer for a vocabulary under 1024)
MAX_SPLITS = 32  # programs a row is split over at most
PROGRAMS_PER_SM = 2  # auto_splits fills the GPU to this many programs per multiprocessor
PAD = tl.constexpr(-(2**63))  # below every key: an empty slot


@triton.jit
def _sortable(bits):
    """float32 bits (as int32) → an int32 in the floats' order; its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key(value, ids):
    """(float32 value, int64 id) → an int64 key: descending keys are values descending,
    equal values by id ascending. -0.0 is 0.0, as torch's topk and sort take it."""
    value = tl.where(value == 0.0, 0.0, value)
    high = _sortable(value.to(tl.int32, bitcast=True)).to(tl.int64)
    return (high << 32) | (0xFFFFFFFF - ids)


@triton.jit
def _key_value(key):
    return _sortable((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key):
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _keep_best(S, n, k, K_BLOCK: tl.constexpr, SCRATCH: tl.constexpr):
    """Keep the best ``K_BLOCK`` of the scratch's first ``n`` keys in front, sorted (empty
    slots PAD), and return the k-th best key, the threshold a key must pass to be kept."""
    tl.debug_barrier()  # the program's appends are visible
    offs = tl.arange(0, SCRATCH)
    # A bitonic top-k: sorts runs of K_BLOCK, then halves the keys by pairwise maxima.
    keys = tl.topk(tl.load(S + offs, mask=offs < n, other=PAD), K_BLOCK)
    tl.debug_barrier()  # every thread has loaded before any stores
    best = tl.arange(0, K_BLOCK)
    tl.store(S + best, keys)
    return tl.max(tl.where(best == k - 1, keys, PAD), axis=0)


@triton.jit
def _append_best(S, n, threshold, keys, k, TILE: tl.constexpr, K_BLOCK: tl.constexpr,
                 SCRATCH: tl.constexpr):
    """Append the ``TILE`` keys above ``threshold`` to the scratch's ``n``, sorting first
    if they might not fit. Returns the new (n, threshold)."""
    if n + TILE > SCRATCH:
        threshold = _keep_best(S, n, k, K_BLOCK, SCRATCH)
        n = tl.full((), K_BLOCK, tl.int32)
    passed = (keys > threshold).to(tl.int32)
    tl.store(S + n + tl.cumsum(passed, axis=0) - passed, keys, mask=passed > 0)
    return n + tl.sum(passed, axis=0), threshold


@triton.jit(do_not_specialize=["span"])
def _partial_topk_kernel(X, Scratch, PartMax, PartSum, vocab, stride_row, span, k,
                         BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, SCRATCH: tl.constexpr):
    row = tl.program_id(0)
    part = row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    x_row = X + row.to(tl.int64) * stride_row
    S = Scratch + part * SCRATCH
    begin = tl.program_id(1) * span
    end = tl.minimum(begin + span, vocab)
    # Per lane: the running max and the sum of exp(x - max), rescaled when the max grows.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    n = tl.full((), 0, tl.int32)  # keys in the scratch
    threshold = tl.full((), PAD, tl.int64)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < end
        x = tl.load(x_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        s = s * tl.exp(m - base) + tl.exp(x - base)
        m = m_new
        keys = tl.where(valid, _key(x, offs.to(tl.int64)), PAD)
        n, threshold = _append_best(S, n, threshold, keys, k, BLOCK, K_BLOCK, SCRATCH)
    _keep_best(S, n, k, K_BLOCK, SCRATCH)
    top = tl.max(m, axis=0)
    base = tl.where(top == float("-inf"), 0.0, top)
    tl.store(PartMax + part, top)
    tl.store(PartSum + part, tl.sum(s * tl.exp(m - base), axis=0))


@triton.jit(do_not_specialize=["splits"])
def _ranked_topk_kernel(Scratch, PartMax, PartSum, OutLogprobs, OutIds, splits, k,
                        K_BLOCK: tl.constexpr, SCRATCH: tl.constexpr,
                        MAX_SPLITS: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, MAX_SPLITS)
    at = row.to(tl.int64) * splits + parts
    part_max = tl.load(PartMax + at, mask=parts < splits, other=float("-inf"))
    part_sum = tl.load(PartSum + at, mask=parts < splits, other=0.0)
    top = tl.max(part_max, axis=0)
    base = tl.where(top == float("-inf"), 0.0, top)
    lse = base + tl.log(tl.sum(part_sum * tl.exp(part_max - base), axis=0))

    # The row's top k: the first split's best keys, then the others' appended to them.
    S = Scratch + row.to(tl.int64) * splits * SCRATCH
    offs = tl.arange(0, K_BLOCK)
    n = tl.full((), K_BLOCK, tl.int32)
    threshold = tl.load(S + k - 1)
    for split in range(1, splits):
        keys = tl.load(S + split * SCRATCH + offs)
        n, threshold = _append_best(S, n, threshold, keys, k, K_BLOCK, K_BLOCK, SCRATCH)
    if n > K_BLOCK:
        _keep_best(S, n, k, K_BLOCK, SCRATCH)
    tl.debug_barrier()

    best = tl.load(S + offs)
    ids = _key_id(best)
    logprobs = _key_value(best) - lse
    keys = tl.sort(tl.where(offs < k, _key(logprobs, ids), PAD), descending=True)
    out = row.to(tl.int64) * k + offs
    tl.store(OutLogprobs + out, _key_value(keys), mask=offs < k)
    tl.store(OutIds + out, _key_id(keys), mask=offs < k)


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Splits per row: enough programs for PROGRAMS_PER_SM per multiprocessor, at most
    MAX_SPLITS and one block of the vocabulary each; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    want = PROGRAMS_PER_SM * _multiprocessors(device) // max(rows, 1)
    return max(1, min(want, MAX_SPLITS, triton.cdiv(vocab, BLOCK)))


def ranked_topk(logits: torch.Tensor, k: int,
                splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [..., V] (any float dtype, last dim contiguous) → the top ``k`` (at most
    V and MAX_K) as (float32 log-probs, int64 ids) [..., k], log-prob descending and equal
    log-probs by id. ``splits``: programs per row (default auto_splits)."""
    if logits.stride(-1) != 1:
        raise ValueError("ranked_topk: argument 'logits' must be contiguous in its last dim")
    vocab = logits.shape[-1]
    if not 0 <= k <= min(vocab, MAX_K):
        raise ValueError(f"ranked_topk: argument 'k' must be in [0, min(vocab, {MAX_K})],"
                         f" got {k} for vocab {vocab}")
    rows = logits.reshape(-1, vocab)
    out_logprobs = torch.empty(*logits.shape[:-1], k, dtype=torch.float32, device=logits.device)
    out_ids = torch.empty(out_logprobs.shape, dtype=torch.int64, device=logits.device)
    if rows.shape[0] == 0 or k == 0:
        return out_logprobs, out_ids
    if splits is None:
        splits = auto_splits(rows.shape[0], vocab, logits.device)
    block = min(BLOCK, triton.next_power_of_2(vocab))  # a model's vocabulary fixes it
    span = triton.cdiv(triton.cdiv(vocab, min(splits, MAX_SPLITS)), block) * block
    splits = triton.cdiv(vocab, span)  # none empty
    k_block = max(2, triton.next_power_of_2(k))  # Triton 3.6's tl.topk takes no k of 1
    scratch_size = triton.next_power_of_2(2 * k_block + block)  # the best, a tile, room
    scratch = torch.empty(rows.shape[0], splits, scratch_size, dtype=torch.int64,
                          device=logits.device)
    part_max = torch.empty(rows.shape[0], splits, device=logits.device)
    part_sum = torch.empty_like(part_max)  # its own, 16-byte aligned: one compiled key
    _partial_topk_kernel[(rows.shape[0], splits)](
        rows, scratch, part_max, part_sum, vocab, rows.stride(0), span, k, BLOCK=block,
        K_BLOCK=k_block, SCRATCH=scratch_size, num_warps=8)
    _ranked_topk_kernel[(rows.shape[0],)](
        scratch, part_max, part_sum, out_logprobs, out_ids, splits, k, K_BLOCK=k_block,
        SCRATCH=scratch_size, MAX_SPLITS=MAX_SPLITS, num_warps=8)
    return out_logprobs, out_ids
