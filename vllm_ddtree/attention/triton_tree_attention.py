"""Tree attention over vLLM's paged KV cache, as one Triton kernel launch for the batch (and
a second that merges the partial results when each request's keys are split).

Per request ``r`` of the batch, with ``q_len`` query tokens and ``ctx = seq_lens[r] - q_len``
committed tokens before them, query token ``i`` sees key ``j`` when ``j < ctx`` (the
committed context), and among the new keys (``n = j - ctx``):

- a request without a tree (``tree_index[r] < 0``: prefill chunks, plain decodes): ``n <= i``
  (causal);
- a tree request: bit ``n`` of ``ancestor_mask[tree_index[r], i]`` (the node itself and its
  ancestors, the root included).

Ancestors precede their descendants, so a tree query never needs a key past its own index:
the causal key range bounds both cases. Positions are ``ctx`` plus the node's depth (tree
requests) or index (others). With a sliding window ``W``, a key is also hidden from a query
more than ``W - 1`` positions ahead of it (vLLM's window: ``W`` positions, the query's own
included), and key tiles wholly before every query's window are skipped. With attention
sinks, each query head's sink logit joins the softmax's sum (it adds no value).

Shapes only decide the grid: no host sync, so a launch can be captured in a CUDA graph when
its inputs live in persistent buffers.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Tile sizes of the default launch: on an H200 (Qwen3-8B's heads, bf16) 64 x 64 was the
# fastest or near it of the swept tiles once the context loop lost its mask work, up to 3.7x
# faster than 16 x 32 (scripts/bench_tree_attention.py, docs/benchmarks.md).
BLOCK_M = 64  # rows (query token, query head) per program
TILE_N = 64  # keys per loop step, across page boundaries
# Smaller tiles where 64 x 64 does not pay: with a sliding window a query reads few keys
# (on gpt-oss's windowed layers 16 x 32, unsplit, was as fast or faster than 64 x 64 with
# auto splits at every measured size); in fp32 (IEEE dots on the FMA units) 64 x 64 spills
# 3-10 KiB of stack per thread (scripts/check_triton_compile.py; not timed on a GPU).
SMALL_BLOCK_M, SMALL_TILE_N = 16, 32
NUM_WARPS = 4  # Triton's default; 8 was slower at every swept size
# Key splits chosen when the caller names none (never with a window): enough programs for
# about this many per multiprocessor (few requests over long contexts otherwise leave most
# of the GPU idle).
PROGRAMS_PER_SM = 4
MAX_AUTO_SPLITS = 4  # the most measured with 64 x 64 tiles
# Configurations (block_m, tile_n, num_splits, num_warps) that scripts/bench_tree_attention.py
# times beside the default, and scripts/check_triton_compile.py compiles.
SWEPT_CONFIGS = [(16, 32, 1, 4), (16, 64, 1, 4), (32, 32, 1, 4), (32, 64, 1, 4),
                 (64, 32, 1, 4), (64, 64, 1, 4), (64, 64, 1, 8), (128, 64, 1, 8),
                 (64, 64, 2, 4), (64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 2, 8)]
# Triton's CPU interpreter computes bf16/fp16 tl.dot wrongly (seen with Triton 3.9): there the
# operands go to fp32 first. On a GPU the dots run in the cache's dtype.
_UPCAST_DOTS = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, allowed, qk_scale,
                         MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile into the running max, sum and output of each row, in base 2 (the scale
    carries log2(e)). Unmasked tiles (every row sees every key) skip the -inf guards."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * qk_scale
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:  # a row may see no key of a split's range yet: keep exp2() off -inf - -inf
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    alpha = tl.exp2(m_i - m_new_safe)
    p = tl.exp2(s - m_new_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                        input_precision=DOT_PRECISION).to(tl.float32)
    return m_new, l_i, acc


# num_reqs changes from step to step: specializing it (== 1, multiple of 16) would compile
# new variants in the middle of serving.
@triton.jit(do_not_specialize=["num_reqs"])
def _tree_attention_kernel(
    Q, K, V, Out, Part, PartLse, block_table, seq_lens, query_start_loc, tree_index,
    ancestor_mask, depths, sinks, stride_qt, stride_qh, stride_ot, stride_oh, stride_ps, stride_ls,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_bt, stride_mt, stride_mn, stride_dt,
    scale, window, num_reqs, num_heads, head_size,
    QUERIES_PER_KV: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST_DOTS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # A program takes BLOCK_Q query tokens of one request and the QUERIES_PER_KV query heads
    # that share one KV head: BLOCK_M rows (query token, head), each key tile read once.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # with NUM_SPLITS > 1, this program's share of the keys
    # Request of this program: the last r with qsl[r] // BLOCK_Q + r <= pid (each request's
    # query tiles start at its own tile boundary).
    lo, hi = 0, num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid - 1
    r = lo
    q_start = tl.load(query_start_loc + r)
    q_len = tl.load(query_start_loc + r + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + r)
    if tile * BLOCK_Q < q_len:
        LOG2E: tl.constexpr = 1.4426950408889634
        qk_scale = scale * LOG2E  # scores in base 2: exp2 below
        ctx = tl.load(seq_lens + r) - q_len
        tree = tl.load(tree_index + r)
        rows = tl.arange(0, BLOCK_M)
        offs_m = tile * BLOCK_Q + rows // QUERIES_PER_KV  # query token of each row
        head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        offs_d = tl.arange(0, HEAD)
        row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (offs_m < q_len)
        d_ok = offs_d < head_size
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOTS:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink is a logit every row starts from (in one split only)
            first = (tl.zeros([BLOCK_M], tl.int32) + split) == 0
            m_i = tl.where(first, tl.load(sinks + head).to(tl.float32) * LOG2E, m_i)
            l_i = tl.where(first, 1.0, l_i)
        acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
        kv_end = ctx + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
        mask_rows = ancestor_mask + tl.maximum(tree, 0) * stride_mt + offs_m * stride_mn
        # int64: with the head-major cache layout a head's offset alone may pass 2**31.
        head_k = kv_head.to(tl.int64) * stride_kh
        head_v = kv_head.to(tl.int64) * stride_vh
        kv_begin = 0
        if HAS_WINDOW:
            # Query offsets from ctx: a tree node's depth, else its index. The lowest one
            # bounds the keys any row can see (a tree's root is at depth 0).
            depth_row = depths + tl.maximum(tree, 0) * stride_dt
            tree_rows = (tl.zeros([BLOCK_M], tl.int32) + tree) >= 0
            q_off = tl.where(tree_rows, tl.load(depth_row + offs_m, mask=row_ok & tree_rows,
                                                other=0), offs_m)
            lowest = ctx + tile * BLOCK_Q * (tree < 0).to(tl.int32)
            kv_begin = tl.maximum(lowest - window + 1, 0)
        if NUM_SPLITS > 1:
            per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, TILE_N), NUM_SPLITS) * TILE_N
            kv_begin = kv_begin + split * per_split
            kv_end = tl.minimum(kv_end, kv_begin + per_split)
        # Two loops: tiles wholly inside the committed context, which every row sees (but
        # for a window), with no mask work; then the rest, the new keys' masks applied.
        # Their loads are written out in each: folded into one jit helper, the measured
        # 64 x 64 launch compiled to 1448 B of spills per thread on sm_90 instead of 1016.
        ctx_end = kv_begin + tl.maximum(tl.minimum(ctx, kv_end) - kv_begin, 0) // TILE_N * TILE_N
        d_only = d_ok[None, :] & (tl.zeros([TILE_N], tl.int32) == 0)[:, None]
        for tile_start in range(kv_begin, ctx_end, TILE_N):
            offs_n = tile_start + tl.arange(0, TILE_N)
            # A tile may span pages. Offsets in int64: a large cache has over 2**31 elements.
            block = tl.load(block_table + r * stride_bt + offs_n // PAGE).to(tl.int64)
            slot = (offs_n % PAGE)[:, None]
            k = tl.load(K + block[:, None] * stride_kb + slot * stride_kn + head_k
                        + offs_d[None, :], mask=d_only, other=0.0)
            v = tl.load(V + block[:, None] * stride_vb + slot * stride_vn + head_v
                        + offs_d[None, :], mask=d_only, other=0.0)
            if UPCAST_DOTS:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if HAS_WINDOW:  # context keys sit at their index (negative offsets from ctx)
                seen = (q_off[:, None] - (offs_n - ctx)[None, :]) < window
                m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, seen, qk_scale,
                                                     True, DOT_PRECISION)
            else:
                m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, None, qk_scale,
                                                     False, DOT_PRECISION)
        for tile_start in range(ctx_end, kv_end, TILE_N):
            offs_n = tile_start + tl.arange(0, TILE_N)
            n_ok = offs_n < kv_end
            block = tl.load(block_table + r * stride_bt + offs_n // PAGE, mask=n_ok,
                            other=0).to(tl.int64)
            slot = (offs_n % PAGE)[:, None]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + block[:, None] * stride_kb + slot * stride_kn + head_k
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + block[:, None] * stride_vb + slot * stride_vn + head_v
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST_DOTS:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            new = offs_n - ctx  # index among this step's tokens (negative: context)
            in_new = (new >= 0)[None, :] & row_ok[:, None] & n_ok[None, :]
            causal = new[None, :] <= offs_m[:, None]
            is_tree = (tl.zeros([BLOCK_M, TILE_N], tl.int32) + tree) >= 0
            word = tl.load(mask_rows[:, None] + (tl.maximum(new, 0) // 32)[None, :],
                           mask=in_new & is_tree, other=0)
            in_tree = ((word >> (tl.maximum(new, 0) % 32)[None, :]) & 1) != 0
            allowed = (new < 0)[None, :] | tl.where(is_tree, in_tree, causal)
            allowed = allowed & n_ok[None, :]
            if HAS_WINDOW:  # key offsets from ctx: negative in the context
                tree_key = (new >= 0) & ((tl.zeros([TILE_N], tl.int32) + tree) >= 0)
                k_off = tl.where(tree_key, tl.load(depth_row + tl.maximum(new, 0),
                                                   mask=tree_key & n_ok, other=0), new)
                allowed = allowed & ((q_off[:, None] - k_off[None, :]) < window)
            # Padding rows see everything (their output is never stored): no NaN from -inf.
            allowed = allowed | ~row_ok[:, None]
            m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, allowed, qk_scale,
                                                 True, DOT_PRECISION)
        store_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :], out.to(Out.dtype.element_ty), mask=store_mask)
        else:  # this split's normalized output and (natural) log-sum-exp, for _merge_splits
            seen = l_i > 0
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E,
                           float("-inf"))
            row = (q_start + offs_m).to(tl.int64) * num_heads + head
            tl.store(Part + split * stride_ps + row[:, None] * HEAD + offs_d[None, :], out,
                     mask=store_mask)
            tl.store(PartLse + split * stride_ls + row, lse, mask=row_ok)


@triton.jit
def _merge_splits(Part, PartLse, Out, stride_ps, stride_ls, stride_ot, stride_oh, num_heads,
                  head_size, HEAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # One (token, head) row: the splits' outputs weighted by their share of the softmax sum.
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD)
    d_ok = offs_d < head_size
    lse = tl.load(PartLse + splits * stride_ls + row)
    weight = tl.exp(lse - tl.max(lse, axis=0))
    part = tl.load(Part + splits[:, None] * stride_ps + row * HEAD + offs_d[None, :],
                   mask=d_ok[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(Out + (row // num_heads) * stride_ot + (row % num_heads) * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=d_ok)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_launch(dtype: torch.dtype, windowed: bool) -> tuple[int, int, int | None]:
    """(block_m, tile_n, num_splits) of a launch that names none; num_splits None: from
    the grid's size (auto_splits)."""
    if windowed:
        return SMALL_BLOCK_M, SMALL_TILE_N, 1
    if dtype == torch.float32:
        return SMALL_BLOCK_M, SMALL_TILE_N, None
    return BLOCK_M, TILE_N, None


def auto_splits(programs: int, device: torch.device) -> int:
    """Key splits for a launch of ``programs`` programs (query tiles x KV heads): the
    largest power of 2, at most MAX_AUTO_SPLITS, that keeps programs x splits within
    PROGRAMS_PER_SM per multiprocessor; 1 off CUDA. Shapes only: no host sync, and a
    captured graph's launch stays valid."""
    if device.type != "cuda":
        return 1
    want = PROGRAMS_PER_SM * _multiprocessors(device) // max(programs, 1)
    splits = 1
    while splits * 2 <= min(want, MAX_AUTO_SPLITS):
        splits *= 2
    return splits


def _rows_per_program(block_m: int, queries_per_kv: int) -> tuple[int, int]:
    """(block_m, block_q): block_m widened to hold a KV head's query heads, and the query
    tokens that many rows take."""
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    return block_m, block_m // queries_per_kv


def _query_tiles(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """A launch's programs per KV head: each request's query tiles start at a tile
    boundary, so each request may add one partial tile."""
    return triton.cdiv(num_tokens, block_q) + num_reqs


def split_choices(dtype: torch.dtype, num_heads: int, num_kv_heads: int, windowed: bool,
                  max_tokens: int, max_reqs: int, device: torch.device) -> list[int]:
    """Every num_splits a launch that names none (the backend's) can pick for a layer of
    this shape, over batches of 1..max_tokens tokens in 1..max_reqs requests: the split
    variants (each a kernel of its own) that a warm-up compiles."""
    block_m, _, splits = default_launch(dtype, windowed)
    if splits is not None:
        return [splits]
    _, block_q = _rows_per_program(block_m, num_heads // num_kv_heads)
    # A step holds a token at least: 2 query tiles, and every count up to the most (more
    # tokens or more requests add one at a time).
    most = _query_tiles(max_tokens, min(max_tokens, max_reqs), block_q)
    return sorted({auto_splits(tiles * num_kv_heads, device) for tiles in range(2, most + 1)})


def tree_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], any strides
    value_cache: torch.Tensor,  # same shape as key_cache
    out: torch.Tensor,  # [num_tokens, num_heads, head_size]
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_reqs]: context + this step's tokens
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    tree_index: torch.Tensor,  # int32 [num_reqs]: row of ancestor_mask, -1 without a tree
    ancestor_mask: torch.Tensor,  # int32 [num_trees, num_nodes, words] (vllm_ddtree/tree.py)
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: one logit per query head
    depths: torch.Tensor | None = None,  # int32 [num_trees, num_nodes]: with a window
    block_m: int | None = None,
    tile_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Causal attention for plain requests and tree attention for tree requests, one launch.
    Tile sizes (powers of 2, at least 16): block_m rows of (query token, query head)
    sharing a KV head (at least that many heads), tile_n keys per step. num_splits > 1 (a
    power of 2) splits each request's keys across that many programs, whose partial results
    a second launch merges: more parallelism when few requests face long contexts. None:
    default_launch's. num_warps: the main kernel's warps per program. sliding_window:
    vLLM's window of a layer (positions a query sees, its own included; None: all); it
    needs the trees' ``depths``."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs = query_start_loc.shape[0] - 1
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"tree_attention: argument 'query' has {num_heads} heads, not a "
                         f"multiple of the cache's {num_kv_heads} KV heads")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("tree_attention: head_size must be the innermost, contiguous dim")
    default_m, default_n, default_splits = default_launch(query.dtype,
                                                          sliding_window is not None)
    block_m = default_m if block_m is None else block_m
    tile_n = default_n if tile_n is None else tile_n
    for name, tile in (("block_m", block_m), ("tile_n", tile_n)):
        if tile < 16 or tile & (tile - 1):  # tl.dot needs 16 (the interpreter does not)
            raise ValueError(f"tree_attention: argument '{name}' must be a power of 2 of at "
                             f"least 16, got {tile}")
    queries_per_kv = num_heads // num_kv_heads
    block_m, block_q = _rows_per_program(block_m, queries_per_kv)
    programs = _query_tiles(num_tokens, num_reqs, block_q) * num_kv_heads
    if num_splits is None:
        num_splits = default_splits or auto_splits(programs, query.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"tree_attention: argument 'num_splits' must be a power of 2, got "
                         f"{num_splits}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"tree_attention: argument 'sliding_window' must be at least 1 or "
                         f"None, got {sliding_window}")
    if sliding_window is not None and depths is None and ancestor_mask.shape[0]:
        raise ValueError("tree_attention: argument 'depths' is needed with a sliding window")
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"tree_attention: argument 'sinks' must have shape ({num_heads},), "
                         f"got {tuple(sinks.shape)}")
    if ancestor_mask.numel() == 0:  # keep a valid pointer for the kernel
        ancestor_mask = ancestor_mask.new_zeros(1, 1, 1)
    if depths is None or depths.numel() == 0:
        depths = ancestor_mask.new_zeros(1, 1)
    head = triton.next_power_of_2(head_size)
    if num_splits > 1:
        # Rows padded to a multiple of 16: the partial results' strides are kernel
        # arguments, which Triton specializes on divisibility by 16; unpadded, a batch
        # size of another residue would compile another variant mid-serving.
        rows = max(triton.cdiv(num_tokens * num_heads, 16), 1) * 16
        part = query.new_empty(num_splits, rows, head, dtype=torch.float32)
        part_lse = query.new_empty(num_splits, rows, dtype=torch.float32)
    else:  # unused
        part = part_lse = query.new_empty(1, 1, dtype=torch.float32)
    grid = (programs // num_kv_heads, num_kv_heads, num_splits)
    _tree_attention_kernel[grid](
        query, key_cache, value_cache, out, part, part_lse, block_table, seq_lens,
        query_start_loc, tree_index, ancestor_mask, depths,
        sinks if sinks is not None else query,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        part.stride(0), part_lse.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), ancestor_mask.stride(0), ancestor_mask.stride(1),
        depths.stride(0), scale, sliding_window or 0, num_reqs, num_heads, head_size,
        QUERIES_PER_KV=queries_per_kv, HEAD=head, BLOCK_M=block_m, BLOCK_Q=block_q,
        PAGE=page, TILE_N=tile_n, NUM_SPLITS=num_splits, UPCAST_DOTS=_UPCAST_DOTS,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        # float32 dots in float32 (a GPU's default, TF32, keeps 10 mantissa bits); 16-bit
        # inputs are unaffected.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    if num_splits > 1 and num_tokens > 0:
        _merge_splits[(num_tokens * num_heads,)](
            part, part_lse, out, part.stride(0), part_lse.stride(0), out.stride(0),
            out.stride(1), num_heads, head_size, HEAD=head, NUM_SPLITS=num_splits)
    return out
