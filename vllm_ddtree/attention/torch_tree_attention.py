"""Tree attention on the CPU: per tree request, gather its keys and values from the paged
cache and attend with an explicit mask (committed context, then ancestors).

Same arguments and meaning as ``triton_tree_attention.tree_attention``; it reads the batch
layout on the host, which is fine on the CPU and is why the GPU path is the Triton kernel.
The attention is written out (two batched matmuls and a softmax, in float32) rather than
calling SDPA: with a mask and grouped heads PyTorch's CPU SDPA takes its unfused math path,
which measured about twice as slow at verify-step shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def unpack_mask(words: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool [rows, num_keys] from int32 bit words [rows, W] (bit j of word j // 32)."""
    bit = torch.arange(num_keys, device=words.device)
    return ((words[:, bit // 32] >> (bit % 32)) & 1).bool()


def tree_bias(ancestor_rows: torch.Tensor | None, q_len: int) -> torch.Tensor:
    """Float32 [q_len, q_len] added to the scores of a request's own tokens: 0 where a token
    may attend (its ancestors and itself; for ``None``, causally), -inf elsewhere."""
    if ancestor_rows is None:
        allowed = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    else:
        allowed = unpack_mask(ancestor_rows[:q_len], q_len)
    return torch.zeros(q_len, q_len).masked_fill_(~allowed, float("-inf"))


def tree_attention_torch(
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
    block_size: int | None = None,
    biases: Mapping[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Writes ``out`` rows of ``requests`` (default: all); plain requests run causal.

    ``read_blocks(block_ids)`` returns those blocks' keys and values as
    ``[n, kv_heads, block_size, head_size]`` (any strides), for caches whose blocks are
    packed (CPU_ATTN's keys are); by default they are read from ``key_cache`` and
    ``value_cache`` (``[blocks, block_size, kv_heads, head_size]``); with ``read_blocks``,
    give ``block_size``. ``biases[r]`` is ``tree_bias`` of request r, when the caller has it
    already (the CPU backend builds them once per step, for all layers).
    """
    page = key_cache.shape[1] if read_blocks is None else block_size
    if read_blocks is None:
        def read_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (key_cache.index_select(0, blocks).transpose(1, 2),
                    value_cache.index_select(0, blocks).transpose(1, 2))

    num_heads, head_size = query.shape[1:]
    qsl, lens, trees = query_start_loc.tolist(), seq_lens.tolist(), tree_index.tolist()
    for r in range(len(lens)) if requests is None else requests:
        start, end, seq_len = qsl[r], qsl[r + 1], lens[r]
        q_len = end - start
        ctx = seq_len - q_len
        k_blocks, v_blocks = read_blocks(block_table[r, : -(-seq_len // page)].long())
        kv_heads = k_blocks.shape[1]
        group = num_heads // kv_heads
        # Keys and values [kv_heads, seq_len, D]; the query heads sharing a KV head are rows of
        # one matrix, [kv_heads, group * q_len, D], so each head group is one matmul.
        k = k_blocks.float().permute(1, 0, 2, 3).reshape(kv_heads, -1, head_size)[:, :seq_len]
        v = v_blocks.float().permute(1, 0, 2, 3).reshape(kv_heads, -1, head_size)[:, :seq_len]
        q = query[start:end].float().view(q_len, kv_heads, group, head_size)
        q = q.permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_size)
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
        bias = biases[r] if biases is not None and r in biases else tree_bias(
            ancestor_mask[trees[r]] if trees[r] >= 0 else None, q_len)
        scores.view(kv_heads, group, q_len, seq_len)[..., ctx:] += bias
        o = torch.bmm(scores.softmax(-1), v).view(kv_heads, group, q_len, head_size)
        out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
    return out
