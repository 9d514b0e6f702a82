"""Random inputs for the tree-op tests: top-k log-probs with ties, trees, target choices.

Every case comes from one integer seed, which hypothesis prints for a failing case.
"""

from __future__ import annotations

import torch

from vllm_ddtree import ops
from vllm_ddtree.tree import DraftTrees


def num_prefixes(depth: int, k: int) -> int:
    return sum(k ** d for d in range(1, depth + 1))


def random_topk(seed: int, num_reqs: int, depth: int, vocab: int, k: int,
                ties: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-sorted top-k log-probs and distinct ids per (request, depth), and root tokens.

    With ``ties`` the log-probs take few distinct values, so equal scores are common.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 2
    if ties:
        logits = torch.round(logits)
    logprobs, ids = ops.topk_ranked(logits, k)
    if ties:
        # Exact small integers: many equal prefix sums (+0.0 for a rounded-away -0.3, as a
        # log-softmax gives).
        logprobs = torch.round(logprobs) + 0.0
    roots = torch.randint(0, vocab, (num_reqs,), generator=gen)
    return roots, logprobs, ids


def follow_choices(trees: DraftTrees, seed: int, p_follow: float) -> torch.Tensor:
    """Target choices per node: with probability p_follow one of the node's children's
    tokens (so walks go deep), else a random token (a likely miss)."""
    gen = torch.Generator().manual_seed(seed)
    R, N = trees.token_ids.shape
    choices = torch.randint(0, 50, (R, N), generator=gen)
    parents = trees.parents
    for r in range(R):
        for node in range(N):
            kids = (parents[r] == node).nonzero().flatten()
            if len(kids) and torch.rand((), generator=gen) < p_follow:
                pick = kids[torch.randint(0, len(kids), (), generator=gen)]
                choices[r, node] = trees.token_ids[r, pick]
    return choices


def wide_trees(num_nodes: int) -> tuple[torch.Tensor, ...]:
    """Two requests' trees of num_nodes nodes: a root with num_nodes - 2 children, the last
    with one child, and the target's choices. Request 0's follow the last child and its
    child (a walk scans the whole sibling list), request 1's match nothing: verify_tree
    accepts 2 and 0. Returns token_ids, first_child, next_sibling, choices."""
    n = num_nodes
    token_ids = torch.arange(n, dtype=torch.long).repeat(2, 1) + 7
    first_child = torch.full((2, n), -1, dtype=torch.int32)
    first_child[:, 0], first_child[:, n - 2] = 1, n - 1
    next_sibling = torch.full((2, n), -1, dtype=torch.int32)
    next_sibling[:, 1:n - 2] = torch.arange(2, n - 1, dtype=torch.int32)
    choices = torch.full((2, n), -1, dtype=torch.long)
    choices[0, 0], choices[0, n - 2] = token_ids[0, n - 2], token_ids[0, n - 1]
    return token_ids, first_child, next_sibling, choices


def num_expanded(depth: int, widths: list[int]) -> int:
    """Nodes JetSpec's build can place below the root with these per-depth widths."""
    total, level = 0, 1
    for d in range(depth):
        level *= widths[min(d, len(widths) - 1)]
        total += level
    return total
