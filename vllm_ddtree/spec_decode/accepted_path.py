"""The accepted path's commit, in one place: after a verify step each accepted node's KV
entry moves to the slot right after the root, so the committed context is contiguous like a
chain's and the scheduler's rollback (drafts - accepted) frees the rest; the Gated DeltaNet
layers' state becomes the state after the accepted path (recurrent/gdn_verify.py); and,
before drafting, the target's hidden states move likewise, so DFlash's context rows are the
accepted path. The layers' attention implementation knows its cache layout (TREE_ATTN's
CUDA or CPU backend: ``kv_compaction``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ddtree import ops
from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify

# (slot_mapping, query_start_loc, verdict) -> None
Compaction = Callable[[torch.Tensor, torch.Tensor, Any], None]


class AcceptedPathCommit:
    """Bound once the KV cache exists (the speculator's set_attn); ``path`` is the tree
    rejection sampler's output (rejection_sampler.TreeVerifyOutput)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, block_tables: Any,
                 draft_layers: set[str], gdn: GDNTreeVerify | None) -> None:
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.block_tables, self.draft_layers, self.gdn = block_tables, draft_layers, gdn
        self._compactions: list[tuple[int, Compaction]] | None = None

    def caches(self, path: Any) -> None:
        """Right after the walk: the KV caches and the recurrent states."""
        if self._compactions is None:  # bound once the caches are bound to the layers
            self._compactions = target_kv_compactions(
                self.vllm_config, self.kv_cache_config, self.draft_layers)
        for gid, compact in self._compactions:
            compact(self.block_tables.slot_mappings[gid], path.roots, path.verdict)
        if self.gdn is not None:
            self.gdn.commit(path.verdict)

    @staticmethod
    def hidden_states(path: Any, hidden_states: list[torch.Tensor]) -> None:
        """Before drafting: the accepted path's rows of the target's hidden states."""
        for h in hidden_states:
            ops.compact_tree([], h, path.roots.new_zeros(1), path.roots, path.verdict)


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
