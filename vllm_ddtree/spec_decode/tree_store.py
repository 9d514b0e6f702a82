"""The trees drafted last, by request-state slot: one record the drafting writes and the
next verify step reads (the walk's links, the positions' depths, TREE_ATTN's masks).

Requests whose logits processing reads the drafts before a row as that row's history
(penalties, bad words, a thinking budget: vLLM's kernels count the rows before it; structured
output under a reasoning parser) draft the drafter's greedy chain instead, in their first
``depth`` nodes, and are verified as a chain:
causal attention, chain positions, vLLM's own processing (``chain_only``, set per request;
``chain``, how the stored drafts were built).
"""

from __future__ import annotations

import torch

from vllm_ddtree import ops
from vllm_ddtree.attention.tree_batch import TreeBatch
from vllm_ddtree.spec_decode.adaptive.reorder import renumbered
from vllm_ddtree.tree import mask_words


class TreeStore:
    """Row ``max_num_reqs`` takes padded rows. ``attention`` is TREE_ATTN's view of the
    store (its masks and depths are the store's tensors) with the step's pointers."""

    def __init__(self, max_num_reqs: int, budget: int, depth: int,
                 device: torch.device, scored: bool = False) -> None:
        rows, nodes = max_num_reqs + 1, budget + 1

        def links() -> torch.Tensor:
            return torch.full((rows, nodes), -1, dtype=torch.int32, device=device)

        self.padding_slot, self.depth = max_num_reqs, depth
        self.first_child, self.next_sibling, self.parents = links(), links(), links()
        self.depths = torch.zeros(rows, nodes, dtype=torch.int32, device=device)
        self.ancestor_mask = torch.zeros(rows, nodes, mask_words(nodes), dtype=torch.int32,
                                         device=device)
        # Adaptive trees only (``scored``): each node's path log-probability under the
        # drafter, non-increasing along the node order (they verify prefixes; reorder.py).
        self.scores = torch.zeros(rows, budget, dtype=torch.float32, device=device) \
            if scored else None
        self.chain_only = torch.zeros(rows, dtype=torch.bool, device=device)
        self.chain = torch.zeros(rows, dtype=torch.bool, device=device)
        self.attention = TreeBatch.over(self.ancestor_mask, self.depths)
        node = torch.arange(nodes, dtype=torch.int32, device=device)
        self._chain_depths, self._chain_parents = node, node - 1
        self._chain_child = torch.where(node < depth, node + 1, -1).to(torch.int32)

    def write(self, slots: torch.Tensor, trees: ops.DraftTrees,
              greedy: torch.Tensor) -> torch.Tensor:
        """Stores the trees (``greedy``: the drafter's argmax per depth, [R, depth]) and
        returns the drafts, [R, budget]: the trees' nodes, or the greedy chain."""
        slots = torch.where(slots < 0, self.padding_slot, slots)
        chain = self.chain_only[slots]
        rows = chain[:, None]
        drafts = trees.token_ids[:, 1:].clone()
        drafts[:, :self.depth] = torch.where(rows, greedy, drafts[:, :self.depth])
        self.first_child[slots] = torch.where(rows, self._chain_child, trees.first_child)
        self.next_sibling[slots] = torch.where(rows, -1, trees.next_sibling)
        self.parents[slots] = torch.where(rows, self._chain_parents, trees.parents)
        self.depths[slots] = torch.where(rows, self._chain_depths, trees.depths)
        self.ancestor_mask[slots] = trees.ancestor_mask
        self.chain[slots] = chain
        if self.scores is not None:
            self.scores[slots] = self._scores(trees, rows)
        return drafts

    def renumber(self, slots: torch.Tensor, old: torch.Tensor,
                 drafts: torch.Tensor) -> None:
        """Renumbers the stored trees of ``slots`` and their drafts (``drafts``, V2's
        ``[max_num_reqs, budget]`` by slot): new node i is old node ``old[:, i]``."""
        root = drafts.new_zeros(slots.shape[0], 1)
        scores = None if self.scores is None else torch.nn.functional.pad(
            self.scores[slots], (1, 0))
        trees = renumbered(ops.DraftTrees(
            torch.cat([root, drafts[slots]], dim=1), self.parents[slots], self.depths[slots],
            self.first_child[slots], self.next_sibling[slots], self.ancestor_mask[slots],
            scores), old)
        drafts[slots] = trees.token_ids[:, 1:]
        self.parents[slots], self.depths[slots] = trees.parents, trees.depths
        self.first_child[slots], self.next_sibling[slots] = trees.first_child, \
            trees.next_sibling
        self.ancestor_mask[slots] = trees.ancestor_mask
        if self.scores is not None:
            self.scores[slots] = trees.scores[:, 1:]

    def saved(self) -> list[torch.Tensor]:
        """A copy of what drafting writes (``restore`` puts it back): dummy runs mid-serving
        (adaptive trees' first profile) draft into the store too."""
        return [t.clone() for t in self._drafted()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, old in zip(self._drafted(), saved, strict=True):
            t.copy_(old)

    def _drafted(self) -> list[torch.Tensor]:
        return [t for t in (self.first_child, self.next_sibling, self.parents, self.depths,
                            self.ancestor_mask, self.chain, self.scores) if t is not None]

    def _scores(self, trees: ops.DraftTrees, chain: torch.Tensor) -> torch.Tensor:
        """The nodes' path log-probs; a chain's node at depth d takes the best tree node's
        at depth d (the greedy path's: a path's probability is the product of per-depth
        marginals), -inf past the chain or the tree's depth."""
        scores = trees.scores[:, 1:].float()
        depths = trees.depths[:, 1:].long().clamp(min=0)
        best = torch.full((scores.shape[0], scores.shape[1] + 1), float("-inf"),
                          device=scores.device).scatter_reduce(1, depths, scores, "amax")
        node = self._chain_depths[1:].long()
        chain_scores = best.gather(1, node.clamp(max=self.depth)[None].expand_as(depths))
        chain_scores = torch.where(node <= self.depth, chain_scores, float("-inf"))
        scores = torch.where(chain, chain_scores, scores)
        return torch.cummin(scores, dim=1).values
