"""Trees renumbered, so that a prefix of a tree's nodes is the nodes to verify and a valid
tree. ``by_score``: in decreasing path probability (a child is never more probable than its
parent; ties keep build order, parents first): adaptive trees verify prefixes, and the build
orders (the spine first, JetSpec's expansion order) are not that order. ``renumbered``: any
order, e.g. the nodes a grammar allows first (structured output: TreeStore.renumber). On
the device, fixed shapes, no sync."""

from __future__ import annotations

import torch

from vllm_ddtree.tree import DraftTrees, mask_words


def by_score(trees: DraftTrees) -> DraftTrees:
    R, N = trees.scores.shape
    old = torch.cat([trees.scores.new_zeros(R, 1, dtype=torch.long), torch.argsort(
        -trees.scores[:, 1:], dim=1, stable=True) + 1], dim=1)
    return renumbered(trees, old)


def renumbered(trees: DraftTrees, old: torch.Tensor) -> DraftTrees:
    """The trees with their nodes in a new order: new node i is old node ``old[:, i]``
    (``[R, N]``; the root stays first, a parent before its children). ``scores`` may be
    None."""
    R, N = trees.parents.shape
    old = old.long()
    node = torch.arange(N, device=old.device)
    new = torch.empty_like(old).scatter_(1, old, node.expand(R, N))

    def moved(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.gather(1, old.to(t.device)) if t is not None and t.dim() == 2 else t

    old_parents = moved(trees.parents).long()
    parents = torch.where(old_parents >= 0, new.gather(1, old_parents.clamp(min=0)), -1)
    first_child, next_sibling = _links(parents)
    bits = _unpack(trees.ancestor_mask, N)  # [R, old node, old ancestor]
    bits = bits.gather(1, old[:, :, None].expand(R, N, N))
    bits = bits.gather(2, old[:, None, :].expand(R, N, N))
    i32 = torch.int32
    return DraftTrees(moved(trees.token_ids), parents.to(i32), moved(trees.depths),
                      first_child.to(i32), next_sibling.to(i32),
                      _pack(bits, trees.ancestor_mask.shape[-1]), moved(trees.scores))


def padded(trees: DraftTrees, budget: int) -> DraftTrees:
    """Trees of fewer nodes, as trees of ``budget`` nodes below the root: the extra nodes
    unlinked, never verified (a path log-prob of -inf)."""
    R, N = trees.scores.shape
    extra = budget + 1 - N
    if extra <= 0:
        return trees

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, extra), value=value)

    words = mask_words(budget + 1) - trees.ancestor_mask.shape[-1]
    mask = torch.nn.functional.pad(trees.ancestor_mask, (0, words, 0, extra))
    return DraftTrees(pad(trees.token_ids, 0), pad(trees.parents, -1), pad(trees.depths, 0),
                      pad(trees.first_child, -1), pad(trees.next_sibling, -1), mask,
                      pad(trees.scores, float("-inf")))


def _links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling links from parent links (children in index order)."""
    R, N = parents.shape
    node = torch.arange(N, device=parents.device).expand(R, N)
    key = torch.where(parents >= 0, parents * N + node, -1)  # the root sorts first
    order = torch.argsort(key, dim=1)[:, 1:]  # the other nodes, by (parent, index)
    sorted_parents = parents.gather(1, order)
    same = sorted_parents[:, 1:] == sorted_parents[:, :-1]
    following = torch.where(same, order[:, 1:], -1)
    next_sibling = torch.full_like(parents, -1).scatter_(
        1, order[:, :-1], following)
    first = torch.full_like(parents, N).scatter_reduce(
        1, parents.clamp(min=0)[:, 1:], node[:, 1:], "amin")
    return torch.where(first == N, -1, first), next_sibling


def _unpack(words: torch.Tensor, n: int) -> torch.Tensor:
    shift = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words[..., None] >> shift) & 1
    return bits.flatten(-2)[..., :n].bool()


def _pack(bits: torch.Tensor, num_words: int) -> torch.Tensor:
    R, N, n = bits.shape
    padded = torch.zeros(R, N, num_words * 32, dtype=torch.int64, device=bits.device)
    padded[..., :n] = bits
    shift = torch.arange(32, device=bits.device, dtype=torch.int64)
    words = (padded.view(R, N, num_words, 32) << shift).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
