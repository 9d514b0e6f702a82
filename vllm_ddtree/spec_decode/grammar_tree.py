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

Nodes the grammar forbids are not verified where the drafts reach the scheduler before the
step is scheduled (synchronous scheduling: ``take_tree_drafts`` with the manager): the
scheduler keeps the nodes its grammar allows, in build order (a valid tree: a node's parent
is allowed when it is), schedules those, and tells the worker which they are
(``SchedulerOutput.spec_tree_nodes``; ``DDTreeSpeculator.keep_drafts`` renumbers the stored
tree so they come first). Under async scheduling the step is launched before its drafts
reach the scheduler, as for vLLM's chains: every node is verified, forbidden ones masked out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class SpecTree:
    """A request's drafts as a tree, on the scheduler's request (``spec_tree``)."""

    parents: list[int]  # each draft's parent (0: the root, -1: no node)
    nodes: list[int] | None = None  # the worker's numbers of the drafts kept; None: all


def take_tree_drafts(request: Any, draft_token_ids: Any, index: int,
                     manager: Any = None) -> list[int] | None:
    """Keeps the tree shape of a request's new drafts on it (``spec_tree``); its drafts as
    the scheduler schedules them (padding stripped: a tree is not trimmed at the first draft
    the grammar rejects, which is not the end of its other branches; with ``manager``, the
    structured output manager, only the nodes its grammar allows or no longer constrains:
    ``spec_tree.nodes``, unless they are a prefix of the tree), or None for a chain."""
    from vllm.v1.structured_output.utils import strip_speculative_padding

    parents = draft_token_ids.draft_parents
    tree = parents[index] if parents is not None else None
    request.spec_tree = None if tree is None else SpecTree(tree)
    if request.spec_tree is None:
        return None
    tokens = strip_speculative_padding(draft_token_ids.draft_token_ids[index])
    grammar = _tree_grammar(manager, request) if manager is not None else None
    if grammar is None:
        return tokens
    kept: list[int] = []
    walk_tree(grammar, request.request_id, tokens, tree,
              lambda node, masked: masked and node and kept.append(node), kept.append)
    kept.sort()  # build order: parents first
    if kept == list(range(1, len(kept) + 1)):  # a prefix: the worker's tree as it is
        return tokens[:len(kept)]
    number = {node: i + 1 for i, node in enumerate(kept)}
    request.spec_tree = SpecTree([number.get(tree[k - 1], 0) for k in kept], kept)
    return [tokens[k - 1] for k in kept]


def scheduled_tree_nodes(requests: dict[str, Any],
                         scheduled: dict[str, list[int]]) -> dict[str, list[int]] | None:
    """The worker's numbers of each scheduled tree's drafts, where the scheduler kept some
    (``SchedulerOutput.spec_tree_nodes``), or None."""
    kept = {}
    for req_id, tokens in scheduled.items():
        tree = getattr(requests.get(req_id), "spec_tree", None)
        if tree is not None and tree.nodes is not None and len(tree.nodes) >= len(tokens):
            kept[req_id] = tree.nodes[:len(tokens)]
    return kept or None


def fill_tree_rows(manager: Any, grammar: Any, request: Any, req_id: str,
                   tokens: list[int], base_index: int) -> bool:
    """Fills the request's rows of ``manager``'s bitmask along its tree, from
    ``base_index``; False (nothing filled) for a request without one, or whose grammar
    does not constrain from its first position (reasoning: the worker drafts chains)."""
    tree = getattr(request, "spec_tree", None)
    if tree is None or not _constrains_from_start(manager, request):
        return False

    def fill(row: int, masked: bool) -> None:
        manager._fill_bitmasks(((grammar, base_index + row, masked, ()),))

    n = min(len(tokens), len(tree.parents))  # scheduled past the drafts: padding
    walk_tree(grammar, req_id, tokens[:n], tree.parents, fill)
    for row in range(n + 1, len(tokens) + 1):
        fill(row, False)
    return True


def _constrains_from_start(manager: Any, request: Any) -> bool:
    return tuple(manager._get_constraint_bounds(request, ())) == (0, 0)


def _tree_grammar(manager: Any, request: Any) -> Any:
    """The request's grammar, where it masks its tree's nodes from the first (a compiled
    grammar, no reasoning ahead of it), else None."""
    structured = request.structured_output_request if request.use_structured_output \
        else None
    grammar = structured.grammar if structured is not None else None
    if grammar is None or not _constrains_from_start(manager, request):
        return None
    return grammar


def walk_tree(grammar: Any, req_id: str, tokens: list[int], parents: list[int],
              fill: Callable[[int, bool], None],
              past_end: Callable[[int], None] | None = None) -> None:
    """``fill(row, masked)`` for rows 0..len(tokens) of a tree whose node k (1-based) has
    token ``tokens[k - 1]`` and parent ``parents[k - 1]`` (0: the root; parents come first;
    -1: not a node, as adaptive trees pad theirs): masked from the grammar's state after
    node k's path, or unmasked. ``past_end(k)`` for the unmasked nodes whose path passes a
    node after which the grammar terminated (nothing constrains them: they may be accepted,
    unlike a node the grammar rejects). The grammar is left as it was (accepts rolled
    back)."""
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for k in range(1, n + 1):
        if parents[k - 1] >= 0:
            children[parents[k - 1]].append(k)
        else:
            fill(k, False)

    def unmasked(node: int, free: bool) -> None:
        fill(node, False)
        if free and past_end is not None:
            past_end(node)
        for child in children[node]:
            unmasked(child, free)

    def visit(node: int) -> None:
        for child in children[node]:
            token = tokens[child - 1]
            if grammar.is_terminated():
                unmasked(child, True)
            elif token >= 0 and grammar.accept_tokens(req_id, [token]):
                fill(child, True)
                visit(child)
                grammar.rollback(1)
            else:
                unmasked(child, False)

    fill(0, True)
    visit(0)
