"""verify_tree: the CPU op equals a reference walk on random trees and random choices; the
greedy spine never accepts less than the rank-0 chain; bad input is named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import follow_choices, num_prefixes, random_topk

from vllm_ddtree import ops, reference
from vllm_ddtree.tree import MAX_BUDGET


@st.composite
def verify_cases(draw):
    depth = draw(st.integers(1, 16))
    vocab = draw(st.sampled_from([2, 3, 8, 50]))
    k = draw(st.integers(1, vocab))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), num_reqs=draw(st.integers(1, 4)),
                depth=depth, vocab=vocab, k=k,
                budget=draw(st.integers(1, min(MAX_BUDGET, num_prefixes(depth, k), 300))),
                spine=draw(st.booleans()), p_follow=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])))


@settings(max_examples=1000, deadline=None)
@given(case=verify_cases())
def test_verify_matches_reference_walk(case) -> None:
    roots, logprobs, ids = random_topk(case["seed"], case["num_reqs"], case["depth"],
                                       case["vocab"], case["k"], ties=False)
    trees = ops.build_tree(roots, logprobs, ids, case["budget"], case["spine"])
    choices = follow_choices(trees, case["seed"], case["p_follow"])
    got = ops.verify_tree(trees, choices, case["depth"])
    want = reference.verify_tree(trees, choices, case["depth"])
    for name, a, b in zip(got._fields, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    if case["p_follow"] == 1.0:  # every node with children is followed: walk to a leaf
        for r in range(case["num_reqs"]):
            last = got.accepted[r, got.num_accepted[r] - 1] if got.num_accepted[r] else 0
            assert trees.first_child[r, last] == -1


@settings(max_examples=600, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), depth=st.integers(1, 16),
       budget=st.sampled_from([1, 2, 5, 16, 64, 256]), p_match=st.sampled_from([0.5, 0.8, 1.0]))
def test_spine_accepts_at_least_the_chain(seed, depth, budget, p_match) -> None:
    gen = torch.Generator().manual_seed(seed)
    budget = min(budget, num_prefixes(depth, 40))
    roots, logprobs, ids = random_topk(seed, 3, depth, 40, min(budget, 40), ties=False)
    trees = ops.build_tree(roots, logprobs, ids, budget, spine=True)
    chain = ids[:, :, 0]  # the rank-0 token per depth: what a DFlash chain drafts
    # The target agrees with the chain at each step with probability p_match, otherwise it
    # picks any token (sometimes one of the tree's other branches).
    choices = torch.randint(0, 40, trees.token_ids.shape, generator=gen)
    for r in range(3):
        for node in range(budget + 1):
            d = int(trees.depths[r, node])
            if d < depth and torch.rand((), generator=gen) < p_match:
                choices[r, node] = chain[r, d]
    verdict = ops.verify_tree(trees, choices, depth)
    for r in range(3):
        # Chain acceptance: walk the chain nodes (the spine is nodes 1..min(L, B)).
        chain_len, node = 0, 0
        while chain_len < min(depth, budget) and choices[r, node] == chain[r, chain_len]:
            chain_len += 1
            node = chain_len
        assert verdict.num_accepted[r] >= chain_len


def test_walk_follows_the_matching_branch() -> None:
    # root -> {1: a, 2: b}; 1 -> {3: c}; 2 -> {4: d}
    token_ids = torch.tensor([[100, 1, 2, 3, 4]])
    first_child = torch.tensor([[1, 3, 4, -1, -1]], dtype=torch.int32)
    next_sibling = torch.tensor([[-1, 2, -1, -1, -1]], dtype=torch.int32)
    trees = ops.DraftTrees(token_ids, torch.tensor([[-1, 0, 0, 1, 2]], dtype=torch.int32),
                           torch.tensor([[0, 1, 1, 2, 2]], dtype=torch.int32), first_child,
                           next_sibling, torch.zeros(1, 5, 1, dtype=torch.int32),
                           torch.zeros(1, 5))
    # The target picks b at the root, d after b, then 9 (no child): accept [2, 4], bonus 9.
    verdict = ops.verify_tree(trees, torch.tensor([[2, 7, 4, 7, 9]]), max_depth=2)
    assert verdict.accepted.tolist() == [[2, 4]]
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.output_tokens.tolist() == [[2, 4, 9]]
    # A miss at the root: nothing accepted, the target's token is the bonus.
    verdict = ops.verify_tree(trees, torch.tensor([[5, 7, 4, 7, 9]]), max_depth=2)
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.output_tokens.tolist() == [[5, -1, -1]]
    assert verdict.accepted.tolist() == [[-1, -1]]


def test_malformed_links_cannot_escape_the_tree() -> None:
    token_ids = torch.tensor([[0, 1, 1]])
    first_child = torch.tensor([[1, 99, -7]], dtype=torch.int32)  # out of range links
    next_sibling = torch.tensor([[2, 1, 1]], dtype=torch.int32)  # a cycle
    verdict = torch.ops.vllm_ddtree.verify_tree(token_ids, first_child, next_sibling,
                                                torch.tensor([[5, 1, 1]]), 4)
    assert verdict[1].tolist() == [0]  # no match among the root's children; terminates


@pytest.mark.parametrize("change, message", [
    (dict(first_child=torch.zeros(1, 3, dtype=torch.int64)), "'first_child' has wrong dtype"),
    (dict(target_tokens=torch.zeros(1, 4, dtype=torch.int64)),
     "'target_tokens' must have the shape of token_ids"),
    (dict(token_ids=torch.zeros(3, dtype=torch.int64)), "'token_ids' must be 2-D"),
    (dict(max_depth=-1), "'max_depth' must be in"),
    (dict(next_sibling=torch.zeros(1, 3, dtype=torch.int32, device="meta")),
     "'next_sibling' must be on cpu"),
])
def test_verify_rejects_bad_input_by_name(change, message) -> None:
    args = dict(token_ids=torch.zeros(1, 3, dtype=torch.int64),
                first_child=torch.full((1, 3), -1, dtype=torch.int32),
                next_sibling=torch.full((1, 3), -1, dtype=torch.int32),
                target_tokens=torch.zeros(1, 3, dtype=torch.int64), max_depth=2) | change
    with pytest.raises(RuntimeError, match=message):
        torch.ops.vllm_ddtree.verify_tree(*args.values())
