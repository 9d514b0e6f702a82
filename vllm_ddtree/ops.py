"""Python face of the native ops in ``csrc/``: loading, fake (meta) implementations, wrappers.

The CPU implementation is the oracle for the CUDA one; vllm_ddtree/reference.py is the
oracle for both. None of these wrappers syncs with the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import vllm_ddtree._C  # noqa: F401  (loads the library: registers torch.ops.vllm_ddtree.*)
from vllm_ddtree.tree import DraftTrees, Verdict, mask_words, topk_ranked

_ops = torch.ops.vllm_ddtree


def _same_device(op: str, **tensors: torch.Tensor) -> None:
    """A fake implementation is picked when any argument is a meta/fake tensor, so the
    device check of the native implementations must be repeated here."""
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.device != ref.device:
            raise RuntimeError(f"{op}: argument '{name}' must be on {ref.device} like "
                               f"'{first}', got {t.device}")


@torch.library.register_fake("vllm_ddtree::tree_positions")
def _tree_positions_fake(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    _same_device("tree_positions", seq_lens=seq_lens, depths=depths)
    return seq_lens.new_empty(depths.shape)


@torch.library.register_fake("vllm_ddtree::build_tree")
def _build_tree_fake(root_tokens, topk_logprobs, topk_ids, budget, spine, widths=()):
    _same_device("build_tree", topk_logprobs=topk_logprobs, topk_ids=topk_ids,
                 root_tokens=root_tokens)
    R, N = topk_logprobs.shape[0], budget + 1
    i32 = dict(dtype=torch.int32, device=topk_logprobs.device)
    return (topk_ids.new_empty(R, N), *(torch.empty(R, N, **i32) for _ in range(4)),
            torch.empty(R, N, mask_words(N), **i32), topk_logprobs.new_empty(R, N))


@torch.library.register_fake("vllm_ddtree::verify_tree")
def _verify_tree_fake(token_ids, first_child, next_sibling, target_tokens, max_depth):
    _same_device("verify_tree", token_ids=token_ids, first_child=first_child,
                 next_sibling=next_sibling, target_tokens=target_tokens)
    R = token_ids.shape[0]
    return (first_child.new_empty(R, max_depth), first_child.new_empty(R),
            token_ids.new_empty(R, max_depth + 1))


@torch.library.register_fake("vllm_ddtree::compact_tree")
def _compact_tree_fake(kv_caches, hidden_states, slot_mapping, query_start_loc, accepted,
                       num_accepted):
    _same_device("compact_tree", accepted=accepted, num_accepted=num_accepted,
                 query_start_loc=query_start_loc, slot_mapping=slot_mapping,
                 **{f"kv_caches[{i}]": c for i, c in enumerate(kv_caches)})
    return None


def tree_positions(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Position of every tree node: ``seq_lens[r] + depths[r, i]`` (siblings share one)."""
    return _ops.tree_positions(seq_lens, depths)


def build_tree(root_tokens: torch.Tensor, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor,
               budget: int, spine: bool = False, widths: Sequence[int] = ()) -> DraftTrees:
    """The batch of trees from per-depth top-k log-probs and ids ``[R, L, K]``, rank-sorted:
    DDTree's best-first build, or with ``widths`` JetSpec's (vllm_ddtree/tree.py)."""
    return DraftTrees(*_ops.build_tree(root_tokens, topk_logprobs, topk_ids, budget, spine,
                                       list(widths)))


def build_tree_from_logits(root_tokens: torch.Tensor, logits: torch.Tensor, budget: int,
                           spine: bool = False, widths: Sequence[int] = ()) -> DraftTrees:
    """The batch of trees from the drafter's logits ``[R, L, V]``."""
    if logits.dim() != 3:
        raise ValueError(f"build_tree_from_logits: argument 'logits' must be 3-D "
                         f"[num_reqs, depth, vocab], got shape {tuple(logits.shape)}")
    k = max(widths) if widths else budget  # JetSpec's build reads only the widths' ranks
    logprobs, ids = topk_ranked(logits, min(k, logits.shape[-1]))
    return build_tree(root_tokens, logprobs, ids, budget, spine, widths)


def verify_tree(trees: DraftTrees, target_tokens: torch.Tensor, max_depth: int) -> Verdict:
    """Walk the trees along the target's choice at every node (argmax, or samples)."""
    return Verdict(*_ops.verify_tree(trees.token_ids, trees.first_child, trees.next_sibling,
                                     target_tokens, max_depth))


def compact_tree(kv_caches: list[torch.Tensor], hidden_states: torch.Tensor,
                 slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                 verdict: Verdict) -> None:
    """In place: each accepted node's KV entry (every cache) and hidden row moves to the
    slot/row right after the root, so the accepted path is contiguous like a chain's."""
    _ops.compact_tree(kv_caches, hidden_states, slot_mapping, query_start_loc,
                      verdict.accepted, verdict.num_accepted)
