"""Structured output on trees: a request's grammar mask rows along its tree, in the scheduler.

vLLM's scheduler fills one bitmask row per scheduled position by walking a chain's drafts
in order (``StructuredOutputManager.grammar_bitmask``), and the worker masks the verify
step's logits row by row before the walk. A tree's logits rows are its nodes (the root, then
node k = draft k), so a tree's rows are filled by a depth-first walk of the grammar instead
(patch 0014 calls ``fill_tree_rows``): row k holds the grammar's mask after node k's path,
row 0 the grammar as it stands. A node whose token the grammar rejects, its descendants, and
the children of a node after which the grammar terminated get unmasked rows, as vLLM's chain
walk gives the rows past an invalid draft: the target can never reach them (the parent's row
forbids their token), and a row that allows nothing would leave no token to sample. The
tree's shape comes from the worker with its drafts (``DraftTokenIds.draft_parents``,
``DDTreeSpeculator.draft_parents``); requests drafting chains send none and keep vLLM's
chain walk and its trimming of invalid drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def take_tree_drafts(request: Any, draft_token_ids: Any, index: int) -> list[int] | None:
    """Keeps the tree shape of a request's new drafts on it (``spec_tree_parents``); its
    drafts as the scheduler schedules them (padding stripped: a tree is not trimmed at the
    first draft the grammar rejects, which is not the end of its other branches), or None
    for a chain."""
    from vllm.v1.structured_output.utils import strip_speculative_padding

    parents = draft_token_ids.draft_parents
    tree = parents[index] if parents is not None else None
    request.spec_tree_parents = tree
    if tree is None:
        return None
    return strip_speculative_padding(draft_token_ids.draft_token_ids[index])


def fill_tree_rows(manager: Any, grammar: Any, request: Any, req_id: str,
                   tokens: list[int], base_index: int) -> bool:
    """Fills the request's rows of ``manager``'s bitmask along its tree, from
    ``base_index``; False (nothing filled) for a request without one, or whose grammar
    does not constrain from its first position (reasoning: the worker drafts chains)."""
    parents = getattr(request, "spec_tree_parents", None)
    if parents is None:
        return False
    if tuple(manager._get_constraint_bounds(request, ())) != (0, 0):
        return False

    def fill(row: int, masked: bool) -> None:
        manager._fill_bitmasks(((grammar, base_index + row, masked, ()),))

    n = min(len(tokens), len(parents))  # scheduled past the drafts: padding
    walk_tree(grammar, req_id, tokens[:n], parents, fill)
    for row in range(n + 1, len(tokens) + 1):
        fill(row, False)
    return True


def walk_tree(grammar: Any, req_id: str, tokens: list[int], parents: list[int],
              fill: Callable[[int, bool], None]) -> None:
    """``fill(row, masked)`` for rows 0..len(tokens) of a tree whose node k (1-based) has
    token ``tokens[k - 1]`` and parent ``parents[k - 1]`` (0: the root; parents come first):
    masked from the grammar's state after node k's path, or unmasked. The grammar is left
    as it was (accepts rolled back)."""
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for k in range(1, n + 1):
        children[parents[k - 1]].append(k)

    def unmasked(node: int) -> None:
        fill(node, False)
        for child in children[node]:
            unmasked(child)

    def visit(node: int) -> None:
        for child in children[node]:
            token = tokens[child - 1]
            if token >= 0 and not grammar.is_terminated() and grammar.accept_tokens(
                    req_id, [token]):
                fill(child, True)
                visit(child)
                grammar.rollback(1)
            else:
                unmasked(child)

    fill(0, True)
    visit(0)
