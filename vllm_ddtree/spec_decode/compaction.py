"""Compaction of the accepted path's KV entries: after a verify step each accepted node's
entry moves to the slot right after the root, so the committed context is contiguous like a
chain's, and the scheduler's rollback (drafts - accepted) frees the rest. The layers'
attention implementation knows its cache layout (TREE_ATTN's CUDA or CPU backend:
``kv_compaction``). Imports nothing of vLLM's runners: both runners' ddtree paths use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (slot_mapping, query_start_loc, verdict) -> None
Compaction = Callable[[torch.Tensor, torch.Tensor, Any], None]


def target_kv_compactions(vllm_config: Any, kv_cache_config: Any,
                          draft_layers: set[str]) -> list[tuple[int, Compaction]]:
    """Per KV-cache group with target attention layers: its id and its compaction."""
    context = vllm_config.compilation_config.static_forward_context
    found = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        # Layers sharing another's cache (cross-layer KV sharing) list the same tensor
        # again; compact_tree compacts a repeated cache once.
        layers = [(context[name], context[name].kv_cache) for name in group.layer_names
                  if name not in draft_layers and name in context]
        layers = [(layer, c) for layer, c in layers
                  if isinstance(c, torch.Tensor) and c.dim() == 4]
        if layers:
            found.append((gid, kv_compaction(layers)))
    return found


def kv_compaction(caches: list) -> Compaction:
    """compact_tree bound to a KV-cache group's (layer, cache) pairs, as the layers'
    attention implementation lays its cache out (TREE_ATTN's CUDA or CPU backend)."""
    impls = {type(layer.impl) for layer, _ in caches}
    if len(impls) != 1 or not hasattr(next(iter(impls)), "kv_compaction"):
        raise RuntimeError(f"method 'ddtree' compacts TREE_ATTN caches, and a KV-cache group "
                           f"of the target attends through {sorted(c.__name__ for c in impls)}")
    return next(iter(impls)).kv_compaction(caches)
