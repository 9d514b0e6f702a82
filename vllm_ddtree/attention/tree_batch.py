"""The trees of the current step, as TREE_ATTN's metadata builders read them.

vLLM's metadata builders see only ``CommonAttentionMetadata``, which has no room for a
tree. The ddtree speculator hands its ``TreeBatch`` to the target's TREE_ATTN builders
(``TreeBatchReader.read_trees``, in its ``set_attn``), never to the drafter's, which are
other builder objects: the draft layers cannot see the target's trees. The verifier points
the batch at the step's trees (persistent buffers, so a captured CUDA graph reads fresh
values) before attention metadata is built; a request whose ``tree_index`` is -1 has no
tree and attends causally. A builder handed no batch is plain causal attention.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree import mask_words


class TreeBatch:
    def __init__(self, max_num_reqs: int, budget: int, device: torch.device | str) -> None:
        self.tree_index = torch.full((max_num_reqs,), -1, dtype=torch.int32, device=device)
        self.ancestor_mask = torch.zeros(max_num_reqs, budget + 1, mask_words(budget + 1),
                                         dtype=torch.int32, device=device)
        # Node depths, for sliding windows (which count positions, and siblings share one).
        self.depths = torch.zeros(max_num_reqs, budget + 1, dtype=torch.int32, device=device)
        # (max tokens, max requests) per step while the step's forward is the warm-up one
        # (set_warm_up): the CUDA backend then compiles every kernel variant a later step
        # may pick.
        self.warm_up: tuple[int, int] | None = None

    @classmethod
    def over(cls, ancestor_mask: torch.Tensor, depths: torch.Tensor) -> TreeBatch:
        """A batch that reads the trees stored in these tensors ([slots, nodes, words] and
        [slots, nodes]: the speculator's TreeStore), by slot."""
        batch = cls(ancestor_mask.shape[0], 0, ancestor_mask.device)
        batch.ancestor_mask, batch.depths = ancestor_mask, depths
        return batch

    def set_trees(self, tree_index: torch.Tensor, ancestor_mask: torch.Tensor,
                  depths: torch.Tensor) -> None:
        """In place: row r of the batch uses tree ``tree_index[r]`` (-1: none)."""
        t = ancestor_mask.shape[0]
        self.point(tree_index)
        self.ancestor_mask[:t].copy_(ancestor_mask)
        self.depths[:t].copy_(depths)

    def point(self, tree_index: torch.Tensor) -> None:
        """Row r of the batch uses tree ``tree_index[r]`` (-1: none) of the masks and depths
        already in place (written per request-state slot by the speculator)."""
        n = tree_index.shape[0]
        self.tree_index[:n].copy_(tree_index)
        self.tree_index[n:].fill_(-1)

    def clear(self) -> None:
        self.tree_index.fill_(-1)

    def set_warm_up(self, bounds: tuple[int, int] | None) -> None:
        """(max tokens, max requests) per step for the next forward (the first tree step's,
        V2's start-up warm-up); None ends it."""
        self.warm_up = bounds


class TreeBatchReader:
    """A TREE_ATTN metadata builder's side of the hand-off: the batch it was handed."""

    trees: TreeBatch | None = None

    def read_trees(self, trees: TreeBatch) -> None:
        self.trees = trees


def hand_to_builders(attn_groups: list, trees: TreeBatch) -> int:
    """Hands ``trees`` to every TREE_ATTN builder of these attention groups (the target's:
    the runner's groups exclude the drafter's layers); returns how many took it."""
    handed = 0
    for groups in attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                if isinstance(builder, TreeBatchReader):
                    builder.read_trees(trees)
                    handed += 1
    return handed
