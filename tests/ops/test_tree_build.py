"""build_tree: the CPU op equals the Python reference, selects the B most probable prefixes,
keeps the layout's invariants, and lays the greedy spine when asked; and JetSpec's build
(widths): the same against its reference, each expanded node with all its children."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import num_expanded, num_prefixes, random_topk

from vllm_ddtree import ops, reference
from vllm_ddtree.ranked_topk import ranked_topk
from vllm_ddtree.tree import MAX_BUDGET, rank_by_logprob, topk_ranked


def vocabularies(max_vocab: int) -> st.SearchStrategy[int]:
    """Vocabulary sizes up to ``max_vocab`` (a brute-force check's cap: 64 drafts at depth
    4 are 17M prefixes)."""
    return st.sampled_from([v for v in (1, 2, 3, 5, 17, 64) if v < max_vocab] + [max_vocab])


@st.composite
def build_cases(draw, max_depth=16, max_vocab=300, max_reqs=4):
    depth = draw(st.integers(1, max_depth))
    vocab = draw(vocabularies(max_vocab))
    k = draw(st.integers(1, vocab))
    budget = draw(st.integers(1, min(MAX_BUDGET, num_prefixes(depth, k))))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), num_reqs=draw(st.integers(1, max_reqs)),
                depth=depth, vocab=vocab, k=k, budget=budget, ties=draw(st.booleans()),
                spine=draw(st.booleans()))


@st.composite
def jetspec_cases(draw, max_depth=16, max_vocab=300, max_reqs=4):
    """JetSpec's build: per-depth widths (one, as JetSpec's default, or fanout caps)."""
    depth = draw(st.integers(1, max_depth))
    vocab = draw(vocabularies(max_vocab))
    widths = draw(st.lists(st.integers(1, min(vocab, 9)), min_size=1, max_size=4))
    k = draw(st.integers(max(widths), vocab))
    budget = draw(st.integers(1, min(MAX_BUDGET, num_expanded(depth, widths))))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), num_reqs=draw(st.integers(1, max_reqs)),
                depth=depth, vocab=vocab, k=k, budget=budget, ties=draw(st.booleans()),
                spine=draw(st.booleans()), widths=widths)


def assert_same_trees(got, want) -> None:
    for name, a, b in zip(got._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs"


@settings(max_examples=1500, deadline=None)
@given(case=build_cases())
def test_build_matches_reference(case) -> None:
    roots, logprobs, ids = random_topk(case["seed"], case["num_reqs"], case["depth"],
                                       case["vocab"], case["k"], case["ties"])
    got = ops.build_tree(roots, logprobs, ids, case["budget"], case["spine"])
    assert_same_trees(got, reference.build_tree(roots, logprobs, ids, case["budget"],
                                                case["spine"]))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), budget=st.sampled_from([1, 16, 64, 256, 1024]),
       depth=st.integers(1, 16), spine=st.booleans())
def test_build_from_logits_matches_reference(seed, budget, depth, spine) -> None:
    logits = torch.randn(2, depth, 2000, generator=torch.Generator().manual_seed(seed))
    roots = torch.tensor([5, 7])
    got = ops.build_tree_from_logits(roots, logits, budget, spine)
    logprobs, ids = topk_ranked(logits, budget)
    assert_same_trees(got, reference.build_tree(roots, logprobs, ids, budget, spine))


@settings(max_examples=400, deadline=None)
@given(case=build_cases(max_depth=4, max_vocab=4))
def test_best_first_tree_is_optimal(case) -> None:
    """The selected prefixes score exactly the B best of all prefixes (brute force)."""
    roots, logprobs, ids = random_topk(case["seed"], 1, case["depth"], case["vocab"],
                                       case["k"], case["ties"])
    trees = ops.build_tree(roots, logprobs, ids, case["budget"], spine=False)
    lp = logprobs[0].numpy()
    every = []
    for d in range(1, case["depth"] + 1):
        for ranks in itertools.product(range(case["k"]), repeat=d):
            score = np.float32(0)
            for pos, rank in enumerate(ranks):
                score = np.float32(score + lp[pos, rank])
            every.append(score)
    best = sorted(every, reverse=True)[:case["budget"]]
    chosen = sorted(trees.scores[0, 1:].tolist(), reverse=True)
    assert chosen == [float(s) for s in best]


@settings(max_examples=400, deadline=None)
@given(case=build_cases(max_depth=8, max_vocab=64))
def test_tree_invariants(case) -> None:
    roots, logprobs, ids = random_topk(case["seed"], case["num_reqs"], case["depth"],
                                       case["vocab"], case["k"], case["ties"])
    t = ops.build_tree(roots, logprobs, ids, case["budget"], case["spine"])
    N = case["budget"] + 1
    for r in range(case["num_reqs"]):
        par, dep, tok = t.parents[r].tolist(), t.depths[r].tolist(), t.token_ids[r].tolist()
        assert par[0] == -1 and dep[0] == 0 and tok[0] == roots[r]
        children: dict[int, list[int]] = {}
        for i in range(1, N):
            assert 0 <= par[i] < i, "parents precede children"
            assert dep[i] == dep[par[i]] + 1 <= case["depth"]
            assert tok[i] in ids[r, dep[i] - 1].tolist()
            assert t.scores[r, i] <= t.scores[r, par[i]]
            children.setdefault(par[i], []).append(i)
        for p, kids in children.items():
            assert len({tok[k] for k in kids}) == len(kids), "siblings are distinct tokens"
            assert t.first_child[r, p] == kids[0]
            assert [t.next_sibling[r, k].item() for k in kids] == kids[1:] + [-1]
        for i in range(N):
            ancestors, j = set(), i
            while j >= 0:
                ancestors.add(j)
                j = par[j]
            words = t.ancestor_mask[r, i].view(torch.uint32).tolist() if hasattr(
                torch, "uint32") else t.ancestor_mask[r, i].tolist()
            bits = {w * 32 + b for w, word in enumerate(words) for b in range(32)
                    if (word >> b) & 1}
            assert bits == ancestors


@settings(max_examples=400, deadline=None)
@given(case=build_cases(max_depth=8, max_vocab=64), cut=st.floats(0, 1))
def test_a_trees_first_nodes_are_the_tree_of_that_budget(case, cut) -> None:
    """Nodes 0..b of a budget-B tree are the budget-b tree (b <= B), links past b cut: so a
    tree cut to fewer drafts (vLLM's dynamic speculative decoding picks how many per step)
    is still the best tree of its size."""
    roots, logprobs, ids = random_topk(case["seed"], case["num_reqs"], case["depth"],
                                       case["vocab"], case["k"], case["ties"])
    big = ops.build_tree(roots, logprobs, ids, case["budget"], case["spine"])
    b = max(1, round(cut * case["budget"]))
    small = ops.build_tree(roots, logprobs, ids, b, case["spine"])
    for name in ("token_ids", "parents", "depths", "scores"):
        assert torch.equal(getattr(big, name)[:, :b + 1], getattr(small, name)), name
    for name in ("first_child", "next_sibling"):
        links = getattr(big, name)[:, :b + 1]
        assert torch.equal(torch.where(links > b, -1, links), getattr(small, name)), name
    words = small.ancestor_mask.shape[-1]
    assert torch.equal(big.ancestor_mask[:, :b + 1, :words], small.ancestor_mask)


@pytest.mark.parametrize("budget", [16, 256, 1024])
@pytest.mark.parametrize("spine", [False, True])
def test_build_split_across_threads_equals_one_thread(budget, spine) -> None:
    """The CPU op hands batches of trees to several intra-op threads; each tree must come
    out as if built alone (no shared scratch between threads)."""
    roots, logprobs, ids = random_topk(budget, 64, 15, 2 * budget, budget, ties=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.build_tree(roots, logprobs, ids, budget, spine)
        torch.set_num_threads(2)
        assert_same_trees(ops.build_tree(roots, logprobs, ids, budget, spine), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("spine", [False, True])
def test_spine_lays_the_rank0_chain_first(spine) -> None:
    # Depth 1 is very sure of two tokens, deeper positions are flat: best-first spends the
    # budget on depth-1 siblings and omits most of the chain; the spine keeps it.
    logits = torch.zeros(1, 6, 50)
    logits[0, 0, 3], logits[0, 0, 4] = 20.0, 19.9
    logits[0, 1:, 7] = 1.0
    trees = ops.build_tree_from_logits(torch.tensor([1]), logits, budget=6, spine=spine)
    chain_tokens = [3, 7, 7, 7, 7, 7]
    if spine:
        assert trees.token_ids[0, 1:].tolist() == chain_tokens
        assert trees.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5]
    else:
        assert trees.depths[0].max() < 6


@pytest.mark.parametrize("spine", [False, True])
def test_budget_one_is_the_first_chain_token(spine) -> None:
    logits = torch.randn(3, 5, 100, generator=torch.Generator().manual_seed(1))
    trees = ops.build_tree_from_logits(torch.tensor([1, 2, 3]), logits, budget=1, spine=spine)
    assert trees.token_ids[:, 1].tolist() == logits[:, 0].argmax(-1).tolist()
    assert trees.parents[:, 1].tolist() == [0, 0, 0]


def test_ties_follow_the_documented_rule() -> None:
    # All log-probs equal: score ties everywhere. Rule: parent index, then rank.
    logprobs = torch.zeros(1, 2, 3)
    ids = torch.tensor([[[10, 11, 12], [20, 21, 22]]])
    trees = ops.build_tree(torch.tensor([0]), logprobs, ids, budget=7, spine=False)
    # Root's children first (parent 0, ranks 0..2), then node 1's children by rank.
    assert trees.token_ids[0].tolist() == [0, 10, 11, 12, 20, 21, 22, 20]
    assert trees.parents[0].tolist() == [-1, 0, 0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "argument 'budget' must be in \\[1, 1024\\]"),
    (dict(budget=1025), "argument 'budget' must be in \\[1, 1024\\]"),
    (dict(budget=100, k=2, depth=3), "argument 'budget' is 100, but depth 3 with top-2"),
    (dict(logprobs_dtype=torch.float16), "argument 'topk_logprobs' has wrong dtype"),
    (dict(ids_dtype=torch.int32), "argument 'topk_ids' has wrong dtype"),
    (dict(ids_shape=(2, 3, 3)), "argument 'topk_ids' must have the shape of topk_logprobs"),
    (dict(roots_shape=(3,)), "argument 'root_tokens' has size 3"),
    (dict(logprobs_device="meta"), "argument 'topk_ids' must be on meta like 'topk_logprobs'"),
    (dict(flat=True), "argument 'topk_logprobs' must be 3-D"),
])
def test_build_rejects_bad_input_by_name(kwargs, message) -> None:
    depth, k = kwargs.get("depth", 4), kwargs.get("k", 4)
    logprobs = torch.zeros(2, depth, k, dtype=kwargs.get("logprobs_dtype", torch.float32),
                           device=kwargs.get("logprobs_device", "cpu"))
    ids = torch.zeros(kwargs.get("ids_shape", (2, depth, k)),
                      dtype=kwargs.get("ids_dtype", torch.int64))
    roots = torch.zeros(kwargs.get("roots_shape", (2,)), dtype=torch.int64)
    if kwargs.get("flat"):
        logprobs = logprobs.flatten(1)
    with pytest.raises(RuntimeError, match=message):
        ops.build_tree(roots, logprobs, ids, kwargs.get("budget", 8))


def test_build_from_logits_names_a_bad_logits_shape() -> None:
    with pytest.raises(ValueError, match="argument 'logits' must be 3-D"):
        ops.build_tree_from_logits(torch.tensor([0]), torch.zeros(1, 100), budget=4)


def lowest_ids_ranked(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path's ranking of the top k by logit, equal logits by id ascending: the
    tokens the CUDA top-k keeps at a tied cut."""
    return rank_by_logprob(x, torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k])


def assert_ranked(logprobs: torch.Tensor, ids: torch.Tensor) -> None:
    """Log-probs descending; equal ones by id ascending."""
    down = logprobs[..., 1:] <= logprobs[..., :-1]
    tied = logprobs[..., 1:] == logprobs[..., :-1]
    assert down.all()
    assert (ids[..., 1:] > ids[..., :-1])[tied].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, k, splits", [(1, 1, 1), (7, 7, 1), (2048, 16, 1), (2048, 16, 2),
                                              (5000, 100, 1), (5000, 100, 3), (3000, 1000, 2)])
def test_ranked_topk_matches_float64(dtype, vocab, k, splits) -> None:
    """The Triton top-k (CUDA's topk_ranked; here under Triton's interpreter): log-probs
    of the top-k equal float64's, for logits far from 0 (a naive exp overflows), rows partly
    -inf, vocabularies shorter than, equal to and spanning its block, one row split over
    programs or not; ranked by value, then id; the top-k's tokens."""
    x = torch.randn(3, 4, vocab, generator=torch.Generator().manual_seed(vocab)) * 8 + 120
    x[1, 2, :(vocab - 1) // 2] = float("-inf")
    x = x.to(dtype)
    logprobs, ranked = ranked_topk(x, k, splits)
    assert logprobs.dtype == torch.float32 and ranked.dtype == torch.int64
    exact = torch.log_softmax(x.double(), -1).gather(-1, ranked)
    torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=2e-5)
    want = lowest_ids_ranked(x, k)[1]
    assert torch.equal(ranked.sort(-1).values, want.sort(-1).values)
    assert_ranked(logprobs, ranked)


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 8),
       vocab=st.sampled_from([1, 2, 5, 17, 64, 300, 1500, 3000]), k_share=st.floats(0, 1),
       ties=st.booleans(), splits=st.integers(1, 6))
def test_ranked_topk_equals_the_cpu_path(seed, rows, vocab, k_share, ties, splits) -> None:
    """About 360 rows (the interpreter takes about half a second a case). Vocabularies up
    to 3000: one tile (under 1024 entries, a smaller tile), and two or three tiles of 1024
    a split; tests/cuda runs more on the GPU, Qwen3's vocabulary among them."""
    k = 1 + int(k_share * (min(vocab, 1024) - 1))
    check_ranked_topk(seed, rows, vocab, k, ties, splits, "cpu")


def check_ranked_topk(seed, rows, vocab, k, ties, splits, device) -> None:
    """bfloat16 logits (as drafters give them; with ``ties``, integers): the Triton top-k's
    tokens and order are the CPU path's (at a tied cut, the lowest ids), its log-probs
    within float32 rounding, however a row is split."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    x = (torch.round(x) if ties else x).to(torch.bfloat16)
    want_logprobs, want_ids = lowest_ids_ranked(x, k)
    logprobs, ids = ranked_topk(x.to(device), k, splits)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, rtol=0, atol=5e-6)


@pytest.mark.parametrize("order", ["ascending", "descending", "ascending ties"])
@pytest.mark.parametrize("k, splits", [(64, 1), (1000, 1), (200, 4)])
def test_ranked_topk_keeps_the_best_whatever_the_order(order, k, splits) -> None:
    """Logits that grow along the vocabulary make every tile's keys beat the best so far
    (a sort per tile); falling ones pass none after the first: both give the top k."""
    x = torch.arange(6000, dtype=torch.float32) / 100
    x = {"ascending": x, "descending": x.flip(0), "ascending ties": torch.floor(x / 2)}[order]
    x = x.expand(2, -1).contiguous()
    want_logprobs, want_ids = lowest_ids_ranked(x, k)
    logprobs, ids = ranked_topk(x, k, splits)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=5e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranked_topk_orders_ties_as_the_cpu_path(dtype) -> None:
    """Integer logits (many exact ties, as bfloat16 logits have): the kernel's sort of
    (log-prob, id) keys gives the CPU path's two stable sorts' order, token for token."""
    x = torch.round(torch.randn(2, 5, 3000, generator=torch.Generator().manual_seed(1)) * 2)
    x = x.to(dtype)
    want_logprobs, want_ids = lowest_ids_ranked(x, 64)  # CPU: log-softmax, two sorts
    logprobs, ids = ranked_topk(x, 64, 2)
    assert torch.equal(ids, want_ids)
    assert_ranked(logprobs, ids)
    assert (logprobs[..., 1:] == logprobs[..., :-1]).sum() > 200  # ties it had to order
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=2e-6)
    assert torch.equal(ids[..., 0], x.float().argmax(-1))  # the first of tied maxima


def test_ranked_topk_names_a_bad_k() -> None:
    with pytest.raises(ValueError, match="argument 'k' must be in"):
        ranked_topk(torch.zeros(2, 10), 11)


def test_auto_splits_fill_the_gpu_from_shapes(monkeypatch) -> None:
    """Rows split to fill 2 programs per multiprocessor, within MAX_SPLITS and one block
    of the vocabulary each; none off CUDA."""
    from vllm_ddtree import ranked_topk as rk

    monkeypatch.setattr(rk, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert rk.auto_splits(15, 151936, cuda) == 17
    assert rk.auto_splits(1, 151936, cuda) == rk.MAX_SPLITS
    assert rk.auto_splits(480, 151936, cuda) == 1
    assert rk.auto_splits(1, 3000, cuda) == 3
    assert rk.auto_splits(1, 151936, torch.device("cpu")) == 1


@settings(max_examples=1500, deadline=None)
@given(case=jetspec_cases())
def test_jetspec_build_matches_reference(case) -> None:
    roots, logprobs, ids = random_topk(case["seed"], case["num_reqs"], case["depth"],
                                       case["vocab"], case["k"], case["ties"])
    got = ops.build_tree(roots, logprobs, ids, case["budget"], case["spine"], case["widths"])
    assert_same_trees(got, reference.build_tree(roots, logprobs, ids, case["budget"],
                                                case["spine"], tuple(case["widths"])))


@settings(max_examples=400, deadline=None)
@given(case=jetspec_cases(max_depth=8, max_vocab=64))
def test_jetspec_build_expands_whole_nodes_best_first(case) -> None:
    """Every node with children has its first w(depth) ranks (the last one expanded may be
    cut by the budget), and nodes are expanded in order of score: no unexpanded node with
    room below it outscores an expanded one. With spine the rank-0 chain comes first."""
    roots, logprobs, ids = random_topk(case["seed"], case["num_reqs"], case["depth"],
                                       case["vocab"], case["k"], case["ties"])
    B, widths = case["budget"], case["widths"]
    trees = ops.build_tree(roots, logprobs, ids, B, case["spine"], widths)
    for r in range(case["num_reqs"]):
        parents, depths = trees.parents[r].tolist(), trees.depths[r].tolist()
        scores = trees.scores[r].tolist()
        children: dict[int, list[int]] = {}
        for i in range(1, B + 1):
            children.setdefault(parents[i], []).append(i)
        last = parents[B]  # the node expanded last, whose children the budget may cut
        chain = min(case["depth"], B) if case["spine"] else 0
        for p, kids in children.items():
            w = widths[min(depths[p], len(widths) - 1)]
            if p != last and p >= chain:
                assert len(kids) == w, (p, kids, w)
        expanded = [p for p in children if p >= chain]
        leaves = [i for i in range(B + 1) if i not in children and depths[i] < case["depth"]
                  and i >= chain]
        if expanded and leaves:
            assert min(scores[p] for p in expanded) >= max(scores[i] for i in leaves) - 1e-6
        if case["spine"]:
            assert parents[1:chain + 1] == list(range(chain))
            assert all(int(trees.token_ids[r, i]) == int(ids[r, i - 1, 0])
                       for i in range(1, chain + 1))


def test_jetspec_ties_follow_the_documented_rule() -> None:
    """All log-probs equal: the root is expanded (ranks 0..W-1), then its children in index
    order, each with all its W children."""
    logprobs = torch.zeros(1, 2, 3)
    ids = torch.tensor([[[10, 11, 12], [20, 21, 22]]])
    got = ops.build_tree(torch.tensor([0]), logprobs, ids, budget=6, widths=[2])
    assert got.token_ids[0].tolist() == [0, 10, 11, 20, 21, 20, 21]
    assert got.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("widths, message", [
    ([0], "argument 'widths' entry 0 is 0: must be in \\[1, 4\\]"),
    ([2, 5], "argument 'widths' entry 1 is 5: must be in \\[1, 4\\]"),
    ([1] * 33, "argument 'widths' takes at most 32"),
    ([1], "argument 'budget' is 8, but depth 4 with these widths allows only 4 nodes"),
])
def test_jetspec_build_rejects_bad_widths_by_name(widths, message) -> None:
    logprobs, ids = torch.zeros(2, 4, 4), torch.zeros(2, 4, 4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=message):
        ops.build_tree(torch.zeros(2, dtype=torch.int64), logprobs, ids, 8, widths=widths)


def test_ranked_topk_needs_nothing_of_tree_and_takes_every_budget() -> None:
    """No import cycle: tree.topk_ranked calls ranked_topk, which imports nothing of tree;
    and ranked_topk takes k up to the largest budget, so no budget leaves the kernel path."""
    import subprocess
    import sys

    from vllm_ddtree import ranked_topk

    code = ("import sys, vllm_ddtree.ranked_topk; "
            "sys.exit('vllm_ddtree.tree' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
    assert MAX_BUDGET <= ranked_topk.MAX_K
