"""Tree attention on the CPU: per tree request, gather its keys and values from the paged
cache and run PyTorch's SDPA with an explicit mask (committed context, then ancestors).

Same arguments and meaning as ``triton_tree_attention.tree_attention``; it reads the batch
layout on the host, which is fine on the CPU and is why the GPU path is the Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def unpack_mask(words: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool [rows, num_keys] from int32 bit words [rows, W] (bit j of word j // 32)."""
    bit = torch.arange(num_keys, device=words.device)
    return ((words[:, bit // 32] >> (bit % 32)) & 1).bool()


def tree_attention_sdpa(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_index: torch.Tensor,
    ancestor_mask: torch.Tensor,
    scale: float,
    requests: list[int] | None = None,
    read_blocks: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Writes ``out`` rows of ``requests`` (default: all); plain requests run causal.

    ``read_blocks(block_ids)`` returns those blocks' keys and values as
    ``[n, block_size, kv_heads, head_size]``, for caches whose blocks are packed (CPU_ATTN's
    keys are); by default they are read from ``key_cache`` and ``value_cache`` as they are.
    """
    if read_blocks is None:
        def read_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return key_cache[blocks], value_cache[blocks]

    page = key_cache.shape[1]
    qsl, lens, trees = query_start_loc.tolist(), seq_lens.tolist(), tree_index.tolist()
    for r in range(len(lens)) if requests is None else requests:
        start, end, seq_len = qsl[r], qsl[r + 1], lens[r]
        q_len = end - start
        ctx = seq_len - q_len
        blocks = block_table[r, : -(-seq_len // page)].long()
        k_blocks, v_blocks = read_blocks(blocks)
        k = k_blocks.flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]
        v = v_blocks.flatten(0, 1)[:seq_len]
        allowed = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
        if trees[r] >= 0:
            allowed[:, ctx:] = unpack_mask(ancestor_mask[trees[r], :q_len], q_len)
        else:
            allowed[:, ctx:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=allowed, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out
