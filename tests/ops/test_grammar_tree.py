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
    tokens, parents = [], []
    for branch in branches:
        parent = 0
        for token in branch:
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens)
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
