"""The batch of draft trees: one flattened, fixed-shape structure per verify step.

This is the single definition of the layout; the native ops (csrc/), the tree-attention
backend and the runner all read it. For ``R`` requests, budget ``B`` (draft nodes per request)
and ``N = B + 1`` nodes per request:

======================  =========  =============  ==============================================
field                   dtype      shape          meaning
======================  =========  =============  ==============================================
``token_ids``           int64      [R, N]         node 0 is the root (the bonus token already
                                                  committed); nodes 1..B are drafts
``parents``             int32      [R, N]         parent node index; -1 for the root
``depths``              int32      [R, N]         0 for the root; a draft at drafter position d
                                                  (0-based) has depth d + 1; its position is
                                                  context length + depth (siblings share one)
``first_child``         int32      [R, N]         lowest-ranked child, -1 if none
``next_sibling``        int32      [R, N]         next child of the same parent by rank, -1 if none
``ancestor_mask``       int32      [R, N, W]      W = ceil(N / 32); bit j (word j // 32, bit
                                                  j % 32) is set when node j is node i itself or
                                                  one of its ancestors (the root included)
``scores``              float32    [R, N]         log-probability of the node's prefix; 0 at root
======================  =========  =============  ==============================================

Order: nodes are numbered in the order the builder selects them, so parents precede
children and node indices increase along every root-to-leaf path.

Selection (DDTree's best-first construction): per depth the candidates are the top-K tokens
of the drafter's log-softmax, ranked by log-probability (descending; ``topk_ranked`` orders
equal values by token id). A prefix scores the sum of its tokens' log-probabilities, and
the builder takes the B best prefixes: at each step the best candidate by (score descending,
parent index ascending, rank ascending) — the tie rule. A candidate is a node's next-ranked
sibling or its first (rank-0) child, so the set is closed under ancestors. With ``spine``
the rank-0 chain (depths 1..min(L, B)) is laid first and the rest is best-first.

JetSpec's build (``widths``; arXiv 2606.18394): the builder repeatedly takes the best node
not yet expanded, by (score descending, node index ascending), and appends its children of
ranks 0 .. w(depth) - 1 (``widths[min(depth, len - 1)]``) until B nodes; the last node
expanded may get fewer. It is not the B best prefixes: an expanded node takes its
low-ranked children too. With ``spine`` the rank-0 chain is laid first, as above, and a
chain node's rank-0 child is the next chain node.

Spine guarantee, either build: with ``spine`` nodes 1..min(L, B) are the drafter's greedy
chain, so a tree accepts at least what the DFlash chain of that depth would. Without it
neither build promises the chain past the first token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_BUDGET = 1024  # the CUDA builder keeps a request's heap in shared memory
# Devices where topk_ranked takes the top-k with Triton kernels (vllm_ddtree/ranked_topk.py):
# one pass over the vocabulary for the top-k and the log-sum-exp, no float32 copy of the
# logits. On CPU torch's topk and fused log-softmax are faster than the interpreter.
RANKING_KERNEL_DEVICES = ("cuda",)


class DraftTrees(NamedTuple):
    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    ancestor_mask: torch.Tensor
    scores: torch.Tensor


class Verdict(NamedTuple):
    """What verification of a batch of trees decided."""

    accepted: torch.Tensor  # int32 [R, D]: accepted node indices along the path, -1 padded
    num_accepted: torch.Tensor  # int32 [R]: accepted drafts (the root not counted)
    output_tokens: torch.Tensor  # int64 [R, D + 1]: accepted tokens then the bonus, -1 padded


def mask_words(num_nodes: int) -> int:
    return (num_nodes + 31) // 32


def topk_ranked(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-softmax values and token ids per row, equal values ordered by token id.

    ``logits`` [..., V] → (float32 [..., k], int64 [..., k]). Runs on the logits' device
    with no host sync. Which of several tokens tied exactly at the k-th value make the cut
    is torch.topk's choice on CPU; on CUDA the lowest ids.
    """
    if logits.device.type in RANKING_KERNEL_DEVICES:
        from vllm_ddtree.ranked_topk import MAX_K, ranked_topk  # Triton: loaded only here

        if k <= MAX_K:
            return ranked_topk(logits.contiguous(), k)
    ids = torch.topk(logits, k, dim=-1).indices  # the same tokens as log-softmax's top-k
    return rank_by_logprob(logits, ids)


def rank_by_logprob(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens ``ids`` [..., k] of ``logits`` [..., V] as topk_ranked returns them: float32
    log-softmax values, descending, equal values by id."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    # Two stable sorts: by id, then by value descending; equal values keep id order.
    ids, order = torch.sort(ids, dim=-1)
    logprobs = torch.gather(logprobs, -1, order)
    logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return logprobs, torch.gather(ids, -1, order)
