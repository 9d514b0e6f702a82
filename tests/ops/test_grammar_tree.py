"""A grammar's mask rows along a tree (vllm_ddtree/spec_decode/grammar_tree.py), with vLLM's
xgrammar grammar object on the tiny pair's tokenizer: a chain given as a tree gets vLLM's
own chain walk's rows; every node of a branching tree gets the chain walk's row along its
path; rejected nodes, their descendants and the children of a terminated grammar are
unmasked; the grammar is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_ddtree.spec_decode.grammar_tree import walk_tree

PAIR = Path(__file__).resolve().parents[2] / "models" / "tiny-pair"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PAIR / "target"))


def grammar_of(tokenizer, regex: str):
    """vLLM's XgrammarGrammar for ``regex`` (as its xgrammar backend builds it)."""
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_regex(regex)
    return XgrammarGrammar(vocab_size=len(tokenizer), matcher=xgr.GrammarMatcher(compiled),
                           ctx=compiled)


def rows_of(grammar, tokens: list[int], parents: list[int], vocab: int) -> torch.Tensor:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(tokens) + 1, vocab)

    def fill(row: int, masked: bool) -> None:
        if masked and not grammar.is_terminated():
            grammar.fill_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)

    walk_tree(grammar, "r", tokens, parents, fill)
    return bitmask


def chain_rows(grammar, tokens: list[int], vocab: int) -> torch.Tensor:
    """vLLM's chain walk (StructuredOutputManager.grammar_bitmask's serial loop)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(tokens) + 1, vocab)
    accepted, invalid = 0, False
    for i, token in enumerate([*tokens, -1]):
        if invalid or grammar.is_terminated():
            bitmask[i].fill_(-1)
        else:
            grammar.fill_bitmask(bitmask, i)
        if invalid or token == -1:
            invalid = True
        elif not grammar.is_terminated() and grammar.accept_tokens("r", [token]):
            accepted += 1
        else:
            invalid = True
    grammar.rollback(accepted)
    return bitmask


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def tree_of(branches: list[list[int]]) -> tuple[list[int], list[int]]:
    """Tokens and parents (0: the root) of a tree whose root's branches are ``branches``."""
    tokens, parents = [], []
    for branch in branches:
        parent = 0
        for token in branch:
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens)
    return tokens, parents


def test_a_chain_as_a_tree_gets_the_chain_walks_rows(tokenizer) -> None:
    grammar = grammar_of(tokenizer, r"def [a-z]+\(x\): return x \+ [0-9]+")
    vocab = len(tokenizer)
    for text in ("def foo(x): return x + 12", "def foo(x) return", "def foo(x): return x - 1"):
        tokens = ids(tokenizer, text)
        parents = list(range(len(tokens)))  # node k's parent: k - 1
        assert torch.equal(rows_of(grammar, tokens, parents, vocab),
                           chain_rows(grammar, tokens, vocab)), text
        assert grammar.num_processed_tokens == 0  # left as it was


def test_each_node_gets_the_chain_walks_row_along_its_path(tokenizer) -> None:
    """A tree of three branches: a valid one, one the grammar rejects midway, one that
    completes the choice and goes on; each node's row is the chain walk's along its path."""
    grammar = grammar_of(tokenizer, r"(yes|no|maybe)")
    vocab = len(tokenizer)
    branches = [ids(tokenizer, "maybe"), ids(tokenizer, "nothing"), ids(tokenizer, "yes")
                + ids(tokenizer, " sir")]
    tokens, parents = tree_of(branches)
    got = rows_of(grammar, tokens, parents, vocab)
    for node in range(1, len(tokens) + 1):
        path = []
        k = node
        while k:
            path.append(tokens[k - 1])
            k = parents[k - 1]
        want = chain_rows(grammar, path[::-1], vocab)
        assert torch.equal(got[node], want[len(path)]), node
    assert torch.equal(got[0], chain_rows(grammar, [], vocab)[0])
    full = torch.full_like(got[0], -1)
    assert torch.equal(got[-1], full)  # " sir" after "yes": rejected, unmasked
    assert not torch.equal(got[1], full)  # inside the grammar: masked
    assert grammar.num_processed_tokens == 0  # left as it was
    # No row allows nothing (all -inf logits: NaN probabilities, no token to sample).
    assert all(bool((row != 0).any()) for row in got)


class _Request:
    """The scheduler's view of a structured request, as take_tree_drafts reads it."""

    def __init__(self, grammar) -> None:
        from types import SimpleNamespace

        self.request_id, self.use_structured_output = "r", True
        self.structured_output_request = SimpleNamespace(grammar=grammar)


class _Manager:
    @staticmethod
    def _get_constraint_bounds(request, tokens) -> tuple[int, int]:  # noqa: ANN001
        return 0, 0  # no reasoning: the grammar constrains from the first draft


def test_the_scheduler_keeps_the_nodes_the_grammar_allows(tokenizer) -> None:
    """Synchronous scheduling: of a tree's drafts, the scheduler keeps every node whose
    path the grammar accepts or has ended on (past the stop token nothing constrains the
    target) and no other, in build order (a valid tree, renumbered parents), skips padding
    nodes (parent -1), leaves the grammar as it was, and tells the worker which nodes the
    scheduled ones are (cut where fewer are scheduled); a prefix of the tree is sent as
    the tree as it is."""
    from types import SimpleNamespace

    from vllm_ddtree.spec_decode.grammar_tree import scheduled_tree_nodes, take_tree_drafts

    grammar = grammar_of(tokenizer, r"(yes|no|maybe) sir")
    end = tokenizer.eos_token_id
    branches = [ids(tokenizer, "nothing"), ids(tokenizer, "maybe sir"),
                ids(tokenizer, "yes") + ids(tokenizer, " madam"),
                ids(tokenizer, "no sir") + [end] + ids(tokenizer, " ok")]
    tokens, parents = tree_of(branches)
    tokens.append(0)  # an adaptive tree's padding: not a node
    parents.append(-1)

    def path(k: int) -> list[int]:
        return path(parents[k - 1]) + [tokens[k - 1]] if k else []

    def allowed(seq: list[int]) -> bool:
        if end in seq:  # past the end: nothing constrains
            seq = seq[:seq.index(end) + 1]
        return len(grammar.validate_tokens(seq)) == len(seq)

    want = [k for k in range(1, len(tokens)) if allowed(path(k))]
    assert [tokens[k - 1] for k in want][-len(ids(tokenizer, " ok")):] == ids(tokenizer, " ok")
    assert 0 < len(want) < len(tokens) - 1  # some kept, some not
    request = _Request(grammar)
    drafts = SimpleNamespace(draft_parents=[parents], draft_token_ids=[list(tokens)])
    kept = take_tree_drafts(request, drafts, 0, _Manager())
    assert request.spec_tree.nodes == want
    assert kept == [tokens[k - 1] for k in want]
    new = request.spec_tree.parents
    for i, k in enumerate(want, start=1):  # the same tree, renumbered
        p = parents[k - 1]
        assert new[i - 1] == (want.index(p) + 1 if p else 0)
        assert new[i - 1] < i
    assert grammar.num_processed_tokens == 0
    # Without the manager (async scheduling: the step already runs), every node is kept.
    assert take_tree_drafts(request, drafts, 0) == tokens and request.spec_tree.nodes is None
    take_tree_drafts(request, drafts, 0, _Manager())
    assert scheduled_tree_nodes({"r": request}, {"r": kept[:2]}) == {"r": want[:2]}
    assert scheduled_tree_nodes({"r": request}, {"other": [1]}) is None
    # Nodes kept as a prefix need no renumbering: the tree is sent as it is.
    prefix = SimpleNamespace(draft_parents=[[0, 1, 2]],
                             draft_token_ids=[ids(tokenizer, "maybe sir")[:3]])
    assert take_tree_drafts(request, prefix, 0, _Manager()) == prefix.draft_token_ids[0]
    assert request.spec_tree.nodes is None


def test_the_worker_verifies_the_kept_nodes_as_the_same_tree(tokenizer) -> None:
    """DDTreeSpeculator.keep_drafts' renumbering (TreeStore.renumber): the kept nodes come
    first with their tokens, depths, parents and ancestry; verifying that prefix accepts
    what verifying the whole tree accepts when the other nodes cannot match (the grammar
    masks them out), for any target choices."""
    from vllm_ddtree import ops
    from vllm_ddtree.spec_decode.tree_store import TreeStore

    gen = torch.Generator().manual_seed(0)
    R, L, V, B = 3, 5, 30, 20
    logits = torch.randn(R, L, V, generator=gen) * 3
    built = ops.build_tree_from_logits(torch.randint(0, V, (R,), generator=gen), logits, B)
    store = TreeStore(R, B, L, torch.device("cpu"))
    slots = torch.arange(R)
    drafts = torch.zeros(R, B, dtype=torch.int64)
    drafts[slots] = store.write(slots, built, logits.argmax(-1))
    orders, kept = [], []
    for r in range(R):  # a parent-closed set: nodes whose path avoids a few dropped nodes
        dropped = set(torch.randperm(B, generator=gen)[:3].add(1).tolist())
        keep = []
        for k in range(1, B + 1):
            p = int(built.parents[r, k])
            if k not in dropped and (p == 0 or p in keep):
                keep.append(k)
        kept.append(keep)
        orders.append([0, *keep, *sorted(set(range(1, B + 1)) - set(keep))])
    before = [store.parents.clone(), drafts.clone()]

    def ancestry(mask: torch.Tensor, r: int, node: int) -> set[int]:
        return {j for j in range(B + 1) if int(mask[r, node, j // 32]) >> (j % 32) & 1}

    store.renumber(slots, torch.tensor(orders), drafts)
    for r in range(R):
        new_of = {old: new for new, old in enumerate(orders[r])}
        for new, old in enumerate(orders[r][1:], start=1):
            assert drafts[r, new - 1] == before[1][r, old - 1]
            assert store.depths[r, new] == built.depths[r, old]
            assert store.parents[r, new] == new_of[int(before[0][r, old])]
            assert ancestry(store.ancestor_mask, r, new) == {
                new_of[a] for a in ancestry(built.ancestor_mask, r, old)}
    for _ in range(20):
        choice = torch.randint(0, V, (R, B + 1), generator=gen)
        whole = ops.DraftTrees(built.token_ids.clone(), *built[1:])
        renumbered = ops.DraftTrees(torch.cat([built.token_ids[:, :1], drafts], 1),
                                    *(t[:R] for t in (store.parents, store.depths,
                                                      store.first_child, store.next_sibling,
                                                      store.ancestor_mask)), built.scores)
        new_choice = torch.empty_like(choice)
        for r in range(R):
            for k in torch.randperm(B, generator=gen).add(1).tolist()[:B // 2]:
                choice[r, int(built.parents[r, k])] = built.token_ids[r, k]  # accepts k
            for new, old in enumerate(orders[r]):
                new_choice[r, new] = choice[r, old]
            for k in set(range(1, B + 1)) - set(kept[r]):  # masked out: never matched
                whole.token_ids[r, k] = -1
            renumbered.token_ids[r, 1 + len(kept[r]):] = -1  # past the scheduled prefix
        a, b = ops.verify_tree(whole, choice, L), ops.verify_tree(renumbered, new_choice, L)
        assert torch.equal(a.output_tokens, b.output_tokens)
