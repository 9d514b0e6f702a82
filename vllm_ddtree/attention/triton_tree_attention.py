"""Tree attention over vLLM's paged KV cache, as one Triton kernel launch for the batch.

Per request ``r`` of the batch, with ``q_len`` query tokens and ``ctx = seq_lens[r] - q_len``
committed tokens before them, query token ``i`` sees key ``j`` when ``j < ctx`` (the
committed context), and among the new keys (``n = j - ctx``):

- a request without a tree (``tree_index[r] < 0``: prefill chunks, plain decodes): ``n <= i``
  (causal);
- a tree request: bit ``n`` of ``ancestor_mask[tree_index[r], i]`` (the node itself and its
  ancestors, the root included).

Ancestors precede their descendants, so a tree query never needs a key past its own index:
the causal key range bounds both cases. Shapes only decide the grid: no host sync, so a
launch can be captured in a CUDA graph when its inputs live in persistent buffers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows (query token, query head) per program
TILE_N = 32  # keys per loop step, across page boundaries (vLLM's Triton prefill tile)
# Triton's CPU interpreter computes bf16/fp16 tl.dot wrongly (seen with Triton 3.9): there the
# operands go to fp32 first. On a GPU the dots run in the cache's dtype.
_UPCAST_DOTS = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tree_attention_kernel(
    Q, K, V, Out, block_table, seq_lens, query_start_loc, tree_index, ancestor_mask,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_bt, stride_mt, stride_mn,
    scale, num_reqs, head_size,
    QUERIES_PER_KV: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
):
    # A program takes BLOCK_Q query tokens of one request and the QUERIES_PER_KV query heads
    # that share one KV head: BLOCK_M rows (query token, head), each key tile read once.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
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
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
        kv_end = ctx + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
        mask_rows = ancestor_mask + tl.maximum(tree, 0) * stride_mt + offs_m * stride_mn
        for tile_start in range(0, kv_end, TILE_N):
            offs_n = tile_start + tl.arange(0, TILE_N)
            n_ok = offs_n < kv_end
            # A tile may span pages. Offsets in int64: a large cache has over 2**31 elements.
            block = tl.load(block_table + r * stride_bt + offs_n // PAGE, mask=n_ok,
                            other=0).to(tl.int64)
            slot = (offs_n % PAGE)[:, None]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + block[:, None] * stride_kb + slot * stride_kn + kv_head * stride_kh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + block[:, None] * stride_vb + slot * stride_vn + kv_head * stride_vh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST_DOTS:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                q = q.to(tl.float32)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            new = offs_n - ctx  # index among this step's tokens (negative: context)
            in_new = (new >= 0)[None, :] & row_ok[:, None] & n_ok[None, :]
            causal = new[None, :] <= offs_m[:, None]
            is_tree = (tl.zeros([BLOCK_M, TILE_N], tl.int32) + tree) >= 0
            word = tl.load(mask_rows[:, None] + (tl.maximum(new, 0) // 32)[None, :],
                           mask=in_new & is_tree, other=0)
            in_tree = ((word >> (tl.maximum(new, 0) % 32)[None, :]) & 1) != 0
            allowed = (new < 0)[None, :] | tl.where(is_tree, in_tree, causal)
            allowed = allowed & n_ok[None, :]
            # Padding rows see everything (their output is never stored): no NaN from -inf.
            allowed = allowed | ~row_ok[:, None]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


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
    block_m: int = BLOCK_M,
    tile_n: int = TILE_N,
) -> torch.Tensor:
    """Causal attention for plain requests and tree attention for tree requests, one launch.
    Tile sizes (powers of 2, at least 16): block_m rows of (query token, query head) sharing
    a KV head (at least that many heads), tile_n keys per step."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs = query_start_loc.shape[0] - 1
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"tree_attention: argument 'query' has {num_heads} heads, not a "
                         f"multiple of the cache's {num_kv_heads} KV heads")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("tree_attention: head_size must be the innermost, contiguous dim")
    if ancestor_mask.numel() == 0:  # keep a valid pointer for the kernel
        ancestor_mask = ancestor_mask.new_zeros(1, 1, 1)
    queries_per_kv = num_heads // num_kv_heads
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    grid = (triton.cdiv(num_tokens, block_q) + num_reqs, num_kv_heads)
    _tree_attention_kernel[grid](
        query, key_cache, value_cache, out, block_table, seq_lens, query_start_loc,
        tree_index, ancestor_mask,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), ancestor_mask.stride(0), ancestor_mask.stride(1),
        scale, num_reqs, head_size,
        QUERIES_PER_KV=queries_per_kv, HEAD=triton.next_power_of_2(head_size),
        BLOCK_M=block_m, BLOCK_Q=block_q, PAGE=page, TILE_N=tile_n, UPCAST_DOTS=_UPCAST_DOTS,
    )
    return out
