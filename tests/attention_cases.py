"""Random batches for the tree-attention tests: paged KV caches, block tables, and requests
that carry a tree (chain, star, deep, bushy), a prefill chunk, or a single decode token;
and the dense reference every implementation is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_ddtree.tree import mask_words

SHAPES = ("chain", "star", "deep", "bushy")


def tree_parents(shape: str, num_nodes: int, gen: torch.Generator) -> list[int]:
    """Parents of nodes 0..num_nodes-1 (node 0 is the root, parent -1); parents precede."""
    parents = [-1]
    for i in range(1, num_nodes):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        elif shape == "deep":  # three long branches from the root
            parents.append(i - 3 if i > 3 else 0)
        else:
            parents.append(int(torch.randint(0, i, (), generator=gen)))
    return parents


def ancestor_bits(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, mask_words(n), dtype=torch.int64)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j // 32] |= 1 << (j % 32)
            j = parents[j]
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def node_depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [blocks, page, Hkv, D]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    tree_index: torch.Tensor  # int32 [R]
    ancestor_mask: torch.Tensor  # int32 [num_trees, N, W]
    depths: torch.Tensor  # int32 [num_trees, N]
    parents: list  # per request: parents list (tree) or None
    scale: float


def make_batch(seed: int, kinds: list[str], num_nodes: int, context_lens: list[int],
               heads: int, kv_heads: int, head_size: int, page: int,
               dtype: torch.dtype) -> Batch:
    """kinds: per request one of SHAPES (a tree of num_nodes), "prefill" or "decode"."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, parents, trees = [], [], []
    for kind in kinds:
        if kind in SHAPES:
            p = tree_parents(kind, num_nodes, gen)
            parents.append(p)
            trees.append(ancestor_bits(p))
            q_lens.append(num_nodes)
        else:
            parents.append(None)
            q_lens.append(1 if kind == "decode" else int(torch.randint(2, 40, (), generator=gen)))
    seq_lens = [c + q for c, q in zip(context_lens, q_lens)]
    max_blocks = max(-(-s // page) for s in seq_lens)
    num_blocks = sum(-(-s // page) for s in seq_lens) + 4
    perm = torch.randperm(num_blocks, generator=gen)  # scattered physical blocks
    block_table = torch.zeros(len(kinds), max_blocks, dtype=torch.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // page)
        block_table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n
    cache_shape = (num_blocks, page, kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype)
    tree_index, t = [], 0
    for p in parents:
        tree_index.append(t if p is not None else -1)
        t += p is not None
    ancestor_mask = (torch.stack(trees) if trees
                     else torch.zeros(0, num_nodes, mask_words(num_nodes), dtype=torch.int32))
    depths = torch.tensor([node_depths(p) for p in parents if p is not None],
                          dtype=torch.int32).view(-1, num_nodes)
    return Batch(query, key_cache, value_cache, block_table,
                 torch.tensor(seq_lens, dtype=torch.int32),
                 torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
                 torch.tensor(tree_index, dtype=torch.int32), ancestor_mask, depths, parents,
                 head_size ** -0.5)


def dense_reference(b: Batch, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Gather each request's keys and values, build its mask from the parents lists, and
    take a float64 softmax: slow and obviously right. With a sliding window, a query at
    position p sees keys at positions p - sliding_window + 1 .. p (a node's position is the
    context length plus its depth); with sinks, head h's softmax sums exp(sinks[h]) too."""
    out = torch.empty(b.query.shape, dtype=torch.float64)
    page = b.key_cache.shape[1]
    group = b.query.shape[1] // b.key_cache.shape[2]
    for r, parents in enumerate(b.parents):
        start, end = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1])
        q_len, seq_len = end - start, int(b.seq_lens[r])
        ctx = seq_len - q_len
        slots = [int(b.block_table[r, j // page]) * page + j % page for j in range(seq_len)]
        k = b.key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = b.value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        allowed = torch.zeros(q_len, seq_len, dtype=torch.bool)
        allowed[:, :ctx] = True
        depth = node_depths(parents) if parents is not None else list(range(q_len))
        position = list(range(ctx)) + [ctx + d for d in depth]
        for i in range(q_len):
            if parents is None:
                allowed[i, ctx:ctx + i + 1] = True
            else:
                j = i
                while j >= 0:
                    allowed[i, ctx + j] = True
                    j = parents[j]
            if sliding_window is not None:
                for key in range(seq_len):
                    if position[ctx + i] - position[key] >= sliding_window:
                        allowed[i, key] = False
        q = b.query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * b.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more logit per head, with no value
            sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def require_cpu_attn_isa(isa: str, dtype: torch.dtype) -> None:
    """Skips unless the CPU library vLLM loaded here has CPU_ATTN kernels for ``isa``: vLLM
    loads ``_C`` (with amx) only on a CPU with AVX512-BF16, else ``_C_AVX512`` or
    ``_C_AVX2``, built without amx. Packing one token runs no tile instruction."""
    from vllm import _cpu_ops as ops

    kv = torch.zeros(1, 1, 64, 64, dtype=dtype)
    try:
        ops.cpu_attn_reshape_and_cache(kv[0, 0, :1].unsqueeze(1), kv[0, 0, :1].unsqueeze(1),
                                       *kv.chunk(2, dim=2), torch.zeros(1, dtype=torch.long),
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    except RuntimeError as e:
        if "Unsupported CPU attention configuration" not in str(e):
            raise
        library = "_C" if torch.cpu._is_avx512_bf16_supported() else (
            "_C_AVX512" if torch.cpu._is_avx512_supported() else "_C_AVX2")
        pytest.skip(f"vLLM's CPU library on this machine ({library}) has no {isa} attention "
                    f"kernels for {dtype}: amx is built into _C only, which vLLM loads where "
                    "the CPU has AVX512-BF16")
