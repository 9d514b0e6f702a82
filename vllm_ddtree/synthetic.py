"""Synthetic acceptance for trees: a benchmarking mode, never for serving.

With ``rejection_sample_method: "synthetic"`` vLLM accepts a chain's drafts at chosen rates
whatever the models say, so that speed can be measured at a given acceptance length with
random weights. This is the same for trees: the rates are per tree depth (unconditional:
rate i is the chance that a path reaches depth i + 1). Per request and step a length L is
drawn (the leading successes of u_i < conditional rate i), capped at the deepest node of
the request's tree, and a node at depth exactly L is picked uniformly at random; the
target's choices along its root path are overridden so that the walk (``verify_tree``)
accepts that path, and the walk is cut at its end. The bonus token stays the target's own
choice at the path's end, and compaction, logprobs and counters run as for real
verification. The output is NOT the target's: drafts are accepted regardless of it.

Everything runs on the device with no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import torch


class SyntheticAcceptance:
    """Per-depth acceptance rates on the device, made once, and the step's override."""

    def __init__(self, rates: list[float], device: torch.device) -> None:
        try:  # vLLM 0.34 (Model Runner V2)
            from vllm.v1.worker.gpu.spec_decode.rejection_sampler import (
                unconditional_to_conditional_rates,
            )
        except ImportError:
            from vllm.v1.spec_decode.utils import unconditional_to_conditional_rates

        self.depth = len(rates)
        # Built once at construction: a tensor from a list per step would sync the stream.
        self.conditional = torch.tensor(unconditional_to_conditional_rates(rates),
                                        dtype=torch.float32, device=device)

    def override(self, choice: torch.Tensor, token_ids: torch.Tensor, parents: torch.Tensor,
                 depths: torch.Tensor, first_child: torch.Tensor, valid: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(choice, first_child) for ``verify_tree``, so that it accepts a drawn path."""
        lengths = draw_lengths(self.conditional, choice.shape[0])
        end = pick_path_ends(depths, valid, lengths)
        return force_path(choice, token_ids, parents, first_child, end, self.depth)


def draw_lengths(conditional: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [R]: per row the number of leading draws u_i < conditional[i]."""
    u = torch.rand(num_rows, conditional.shape[0], device=conditional.device)
    return (u < conditional).to(torch.int64).cumprod(dim=1).sum(dim=1)


def pick_path_ends(depths: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor
                   ) -> torch.Tensor:
    """int64 [R]: per row a valid node, uniformly at random among those at depth
    min(length, deepest valid depth). Such a node exists: the deepest node's ancestors sit
    at every smaller depth (the root at 0), and they are valid too (parents precede
    children, and a row's valid nodes are a prefix)."""
    depths = torch.where(valid, depths.to(torch.int64), -1)
    length = torch.minimum(lengths, depths.max(dim=1).values)
    at_length = depths == length[:, None]
    keys = torch.rand(depths.shape, device=depths.device)
    return torch.where(at_length, keys, -1.0).argmax(dim=1)


def force_path(choice: torch.Tensor, token_ids: torch.Tensor, parents: torch.Tensor,
               first_child: torch.Tensor, end: torch.Tensor, max_depth: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Choices that lead the walk from the root to ``end`` (each ancestor's choice becomes
    the token of its child on the path; siblings hold distinct tokens, so it picks that
    child), and links with ``end``'s children cut, so the walk stops there even where the
    target's own choice at ``end`` is one of their tokens (as vLLM's synthetic chain
    rejects there whatever the target says). ``max_depth`` bounds the path's length."""
    choice, parents = choice.clone(), parents.to(torch.int64)
    cur = end[:, None]
    for _ in range(max_depth):
        below_root = cur > 0
        parent = parents.gather(1, cur).clamp(min=0)
        # At the root (no parent) this rewrites the root's choice with itself.
        token = torch.where(below_root, token_ids.gather(1, cur).to(choice.dtype),
                            choice.gather(1, parent))
        choice.scatter_(1, parent, token)
        cur = torch.where(below_root, parent, 0)
    cut = first_child.scatter(1, end[:, None], -1)
    return choice, cut
