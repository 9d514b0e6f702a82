"""Tree attention on the CPU, in torch ops: the tree requests' keys and values read from the
paged cache, attended with an explicit mask (committed context, then ancestors).

``tree_attention_torch`` takes the arguments of ``triton_tree_attention.tree_attention``. The
batch layout is read on the host, which is fine on the CPU and is why the GPU path is the
Triton kernel. Work is planned once per step (``plan_tree_groups``) and run per layer
(``attend``): requests of similar length form a group, padded to its longest, so a layer
costs a few ops per group rather than per request (8 requests of 17 nodes: 0.5-0.7x the
time of one by one). The attention is written out (two batched matmuls and a softmax, in
float32): with a mask and grouped heads PyTorch's CPU SDPA takes its unfused math path, which
measured about twice as slow at verify-step shapes.

A sliding window is planned into the bias (a plan serves the layers of one window size),
over every key: a windowed group has no bias-free context. Attention sinks join the softmax
as one more logit per query head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# A group grows while its padded work (query rows x keys) stays within PADDING_SLACK of its
# requests' own, and its float32 scores (x query heads) within GROUP_MAX_SCORES: 64 MiB,
# where one request of a 32-head model at budget 1024 and 8k context alone has 1 GiB.
PADDING_SLACK = 1.5
GROUP_MAX_SCORES = 1 << 24


def unpack_mask(words: np.ndarray, num_keys: int) -> np.ndarray:
    """Bool [rows, num_keys] from int32 bit words [rows, W] (bit j of word j // 32)."""
    little = np.ascontiguousarray(words, dtype="<i4").view(np.uint8)  # bit j: byte j // 8
    return np.unpackbits(little, axis=1, count=num_keys, bitorder="little").view(bool)


@dataclass
class TreeGroup:
    """Requests attended together, padded to the group's longest query and key span."""

    query_rows: torch.Tensor  # long [R, q_max]: rows of the step's query (padding: row 0's)
    blocks: torch.Tensor  # long [R, blocks_max] (padding: the request's first block)
    bias: torch.Tensor  # float32 [R, q_max, keys_max - bias_from]: 0 visible, -inf not
    bias_from: int  # keys before it are every request's context: visible to all, no bias
    out_rows: torch.Tensor  # long [n]: the step's rows this group writes
    result_rows: torch.Tensor  # long [n]: where they are in the group's [R * q_max] results
    rows: slice | None  # a group of one request: its rows, sliced rather than gathered

    @property
    def num_keys(self) -> int:  # the group's longest key span
        return self.bias_from + self.bias.shape[-1]


def plan_tree_groups(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, tree_index: torch.Tensor,
                     ancestor_mask: torch.Tensor, requests: list[int], block_size: int,
                     num_heads: int, sliding_window: int | None = None) -> list[TreeGroup]:
    """Groups of ``requests`` (tree requests; one with ``tree_index`` -1 attends causally),
    by key span, each growing while within ``PADDING_SLACK`` and ``GROUP_MAX_SCORES``.
    Host work, once per step (per window size), in NumPy (a few microseconds an op where
    torch takes several)."""
    qsl, lens, trees = query_start_loc.tolist(), seq_lens.tolist(), tree_index.tolist()
    groups, current, own, q_max = [], [], 0, 0
    for r in sorted(requests, key=lambda r: lens[r]):  # r has the group's longest key span
        q_len = qsl[r + 1] - qsl[r]
        padded = (len(current) + 1) * max(q_max, q_len) * lens[r]
        if current and (padded > PADDING_SLACK * (own + q_len * lens[r])
                        or padded * num_heads > GROUP_MAX_SCORES):
            groups.append(current)
            current, own, q_max = [], 0, 0
        current.append(r)
        own, q_max = own + q_len * lens[r], max(q_max, q_len)
    if current:
        groups.append(current)
    block_table, ancestor_mask = block_table.numpy(), ancestor_mask.numpy()
    return [_group(members, qsl, lens, trees, block_table, ancestor_mask, block_size,
                   sliding_window) for members in groups]


def _group(members: list[int], qsl: list[int], lens: list[int], trees: list[int],
           block_table: np.ndarray, ancestor_mask: np.ndarray, block_size: int,
           sliding_window: int | None) -> TreeGroup:
    q_lens = [qsl[r + 1] - qsl[r] for r in members]
    q_max, keys_max = max(q_lens), max(lens[r] for r in members)
    blocks_max = -(-keys_max // block_size)
    n = len(members)
    query_rows = np.empty((n, q_max), dtype=np.int64)
    blocks = np.empty((n, blocks_max), dtype=np.int64)
    bias_from = 0 if sliding_window else min(lens[r] - q for r, q in zip(members, q_lens))
    bias = np.full((n, q_max, keys_max - bias_from), -np.inf, dtype=np.float32)
    out_rows, result_rows = [], []
    for i, (r, q_len) in enumerate(zip(members, q_lens)):
        seq_len, ctx = lens[r], lens[r] - q_len
        query_rows[i] = qsl[r]
        query_rows[i, :q_len] = np.arange(qsl[r], qsl[r + 1])
        owned = -(-seq_len // block_size)
        blocks[i] = block_table[r, 0]
        blocks[i, :owned] = block_table[r, :owned]
        if trees[r] >= 0:
            allowed = unpack_mask(ancestor_mask[trees[r], :q_len], q_len)
        else:
            allowed = np.tri(q_len, dtype=bool)
        if sliding_window:
            # Offsets from ctx (a node's depth: its ancestors, itself included, less one);
            # a key is seen from less than sliding_window positions back.
            depth = allowed.sum(1) - 1
            key_off = np.concatenate([np.arange(-ctx, 0), depth])
            allowed = np.concatenate([np.ones((q_len, ctx), dtype=bool), allowed], axis=1)
            allowed &= depth[:, None] - key_off[None, :] < sliding_window
            bias[i, :q_len, :seq_len][allowed] = 0.0
        else:
            bias[i, :q_len, :ctx - bias_from] = 0.0
            bias[i, :q_len, ctx - bias_from:seq_len - bias_from][allowed] = 0.0
        bias[i, q_len:] = bias[i, 0]  # padding rows: any finite row
        out_rows.append(np.arange(qsl[r], qsl[r + 1]))
        result_rows.append(np.arange(i * q_max, i * q_max + q_len))
    return TreeGroup(torch.from_numpy(query_rows), torch.from_numpy(blocks),
                     torch.from_numpy(bias), bias_from,
                     torch.from_numpy(np.concatenate(out_rows)),
                     torch.from_numpy(np.concatenate(result_rows)),
                     slice(qsl[members[0]], qsl[members[0] + 1]) if n == 1 else None)


def attend(query: torch.Tensor, out: torch.Tensor, groups: list[TreeGroup], scale: float,
           read_blocks: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
           sinks: torch.Tensor | None = None) -> None:
    """Writes the groups' rows of ``out``. ``read_blocks(block_ids)`` returns those blocks'
    keys and values as ``[n, kv_heads, block_size, head_size]`` (any strides). ``sinks``:
    one logit per query head, or None."""
    num_heads, head_size = query.shape[1:]
    for g in groups:
        n, q_max = g.query_rows.shape
        k_tiles, v_tiles = read_blocks(g.blocks.flatten())
        kv_heads = k_tiles.shape[1]
        per_kv = num_heads // kv_heads
        # The query heads sharing a KV head are rows of one matrix, so each is one matmul.
        one = g.rows is not None
        q = (query[g.rows] if one else query.index_select(0, g.query_rows.flatten())).float()
        q = q.view(n, q_max, kv_heads, per_kv, head_size).permute(0, 2, 3, 1, 4)
        q = q.reshape(n * kv_heads, per_kv * q_max, head_size)
        scores = torch.bmm(q, _spans(k_tiles, n, g.num_keys).transpose(1, 2)).mul_(scale)
        by_head = scores.view(n, kv_heads, per_kv, q_max, g.num_keys)
        by_head[..., g.bias_from:].add_(g.bias[:, None, None])
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.float().view(1, kv_heads, per_kv, 1, 1).expand(n, -1, -1, q_max, 1)
            probs = torch.cat([by_head, sink], -1).softmax(-1)[..., :-1]
            probs = probs.reshape(scores.shape)
        o = torch.bmm(probs, _spans(v_tiles, n, g.num_keys))
        o = o.view(n, kv_heads, per_kv, q_max, head_size).permute(0, 3, 1, 2, 4)
        o = o.reshape(n * q_max, num_heads, head_size)
        if one:
            out[g.rows] = o
        else:
            out.index_copy_(0, g.out_rows, o.index_select(0, g.result_rows).to(out.dtype))


def _spans(tiles: torch.Tensor, n: int, num_keys: int) -> torch.Tensor:
    """Tiles [n * blocks, kv_heads, block_size, D] as float32 spans [n * kv_heads, num_keys, D]."""
    _, kv_heads, block_size, head_size = tiles.shape
    tiles = tiles.float().view(n, -1, kv_heads, block_size, head_size).permute(0, 2, 1, 3, 4)
    return tiles.reshape(n * kv_heads, -1, head_size)[:, :num_keys]


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
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,  # unused: the plan reads depths off the masks
) -> torch.Tensor:
    """Every request of the batch, with caches ``[blocks, block_size, kv_heads, head_size]``;
    requests without a tree attend causally."""
    groups = plan_tree_groups(query_start_loc, seq_lens, block_table, tree_index,
                              ancestor_mask, list(range(seq_lens.shape[0])),
                              key_cache.shape[1], query.shape[1], sliding_window)

    def read_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (key_cache.index_select(0, blocks).transpose(1, 2),
                value_cache.index_select(0, blocks).transpose(1, 2))

    attend(query, out, groups, scale, read_blocks, sinks)
    return out
