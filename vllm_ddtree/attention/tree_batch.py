"""The trees of the current step, handed from the runner to the attention backends.

vLLM's metadata builders see only ``CommonAttentionMetadata``, which has no room for a
tree. The DDTree runner writes the step's trees here (persistent buffers, so a captured
CUDA graph reads fresh values) before attention metadata is built; a request whose
``tree_index`` is -1 has no tree and attends causally. With no ``TreeBatch`` installed for
the engine, TREE_ATTN is plain causal attention.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from vllm_ddtree.tree import mask_words


class TreeBatch:
    def __init__(self, max_num_reqs: int, budget: int, device: torch.device | str) -> None:
        self.tree_index = torch.full((max_num_reqs,), -1, dtype=torch.int32, device=device)
        self.ancestor_mask = torch.zeros(max_num_reqs, budget + 1, mask_words(budget + 1),
                                         dtype=torch.int32, device=device)
        # Node depths, for sliding windows (which count positions, and siblings share one).
        self.depths = torch.zeros(max_num_reqs, budget + 1, dtype=torch.int32, device=device)
        # Attention layers that never see the trees (the drafter's, whose builders share
        # the target's config and so find this batch; a builder of the target's may list
        # them too).
        self.excluded_layers: set[str] = set()

    def set_trees(self, tree_index: torch.Tensor, ancestor_mask: torch.Tensor,
                  depths: torch.Tensor) -> None:
        """In place: row r of the batch uses tree ``tree_index[r]`` (-1: none)."""
        n, t = tree_index.shape[0], ancestor_mask.shape[0]
        self.tree_index[:n].copy_(tree_index)
        self.tree_index[n:].fill_(-1)
        self.ancestor_mask[:t].copy_(ancestor_mask)
        self.depths[:t].copy_(depths)

    def point(self, tree_index: torch.Tensor) -> None:
        """Row r of the batch uses tree ``tree_index[r]`` (-1: none) of the masks and depths
        already in place (written per request-state slot by vLLM 0.34's speculator)."""
        n = tree_index.shape[0]
        self.tree_index[:n].copy_(tree_index)
        self.tree_index[n:].fill_(-1)

    def sees(self, layer_names: Collection[str]) -> bool:
        """Whether a metadata builder of these layers builds tree metadata (a builder that
        names no layers does)."""
        return not layer_names or not set(layer_names) <= self.excluded_layers

    def clear(self) -> None:
        self.tree_index.fill_(-1)


# Per engine (keyed by VllmConfig.instance_id): several engines may share a process.
_installed: dict[str, TreeBatch] = {}


def install(vllm_config: Any, batch: TreeBatch | None) -> None:
    if batch is None:
        _installed.pop(vllm_config.instance_id, None)
    else:
        _installed[vllm_config.instance_id] = batch


def current(vllm_config: Any) -> TreeBatch | None:
    return _installed.get(getattr(vllm_config, "instance_id", None))
