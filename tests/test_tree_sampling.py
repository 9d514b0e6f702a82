"""Logits processing at tree nodes (vllm_ddtree.sampling) equals vLLM's own functions applied
to each node's history: the request's output, then the node's path below the root."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.sampling import _bad_words_table, _mask_bad_words

VOCAB, MAX_DEPTH = 6, 4


@st.composite
def bad_words_cases(draw):
    num_reqs = draw(st.integers(1, 3))
    token = st.integers(0, VOCAB - 1)
    outputs = [draw(st.lists(token, max_size=5)) for _ in range(num_reqs)]
    words = {r: draw(st.lists(st.lists(token, min_size=1, max_size=4), min_size=1, max_size=3))
             for r in range(num_reqs) if draw(st.booleans())}
    rows = draw(st.lists(st.tuples(st.integers(0, num_reqs - 1),
                                   st.lists(token, max_size=MAX_DEPTH)), min_size=1,
                         max_size=8))
    return outputs, words or {0: [[1, 2]]}, rows


@settings(max_examples=400, deadline=None)
@given(case=bad_words_cases())
def test_bad_words_at_nodes_equal_vllms_on_each_nodes_history(case) -> None:
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    outputs, words, rows = case
    # Each row is a node: its request and its path below the root, oldest first.
    request = torch.tensor([r for r, _ in rows])
    depth = torch.tensor([len(p) for _, p in rows])
    path = torch.full((len(rows), MAX_DEPTH), -1)
    for i, (_, p) in enumerate(rows):
        path[i, :len(p)] = torch.tensor(p[::-1], dtype=torch.int64)  # newest first
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    apply_bad_words(want, {i: words[r] for i, (r, _) in enumerate(rows) if r in words},
                    [outputs[r] + p for r, p in rows])
    got = logits.clone()
    sm = SimpleNamespace(bad_words_token_ids=words, output_token_ids=outputs)
    _mask_bad_words(got, request, depth, path, _bad_words_table(sm, len(outputs), got.device))
    assert torch.equal(got, want)
