"""Plain-Python references of the native ops: obviously correct, slow; the tests' oracle.

They follow vllm_ddtree/tree.py to the letter, including float32 score arithmetic.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from vllm_ddtree.tree import DraftTrees, Verdict, mask_words


def _build_one(root: int, lp: np.ndarray, ids: list, budget: int, spine: bool,
               widths: list[int]) -> tuple:
    """One request's tree as lists (tokens, parents, depths, first, next, mask, scores)."""
    L, K = lp.shape
    N = budget + 1
    tokens, parents, depths, scores = [root], [-1], [0], [np.float32(0)]
    heap: list[tuple] = []

    def push(score, parent, rank, pos):
        # heapq pops the smallest: the tie rule as a tuple.
        heapq.heappush(heap, (-float(score), parent, rank, pos, score))

    def add(score, parent, rank, pos):
        tokens.append(ids[pos][rank])
        parents.append(parent)
        depths.append(pos + 1)
        scores.append(score)
        return len(tokens) - 1

    def sibling(parent, rank, pos):
        if rank + 1 < K:
            push(scores[parent] + lp[pos, rank + 1], parent, rank + 1, pos)

    if widths:
        _expand(lp, budget, spine, widths, scores, depths, add)
        return _links(tokens, parents, depths, scores, N)
    if spine:
        parent = 0
        for pos in range(min(L, budget)):
            score = scores[parent] + lp[pos, 0]
            sibling(parent, 0, pos)
            parent = add(score, parent, 0, pos)
    else:
        push(lp[0, 0], 0, 0, 0)
    while len(tokens) < N:
        _, parent, rank, pos, score = heapq.heappop(heap)
        node = add(score, parent, rank, pos)
        sibling(parent, rank, pos)
        if pos + 1 < L:
            push(score + lp[pos + 1, 0], node, 0, pos + 1)
    return _links(tokens, parents, depths, scores, N)


def _expand(lp: np.ndarray, budget: int, spine: bool, widths: list[int], scores: list,
            depths: list, add) -> None:
    """JetSpec's build: expand the best unexpanded node by (score descending, index
    ascending), appending its children of ranks 0 .. width - 1, until budget + 1 nodes."""
    L = lp.shape[0]
    unexpanded = [(0.0, 0)]  # (-score, node index)
    first_rank = {}
    if spine:
        parent = 0
        for pos in range(min(L, budget)):
            first_rank[parent] = 1  # its rank-0 child is the chain's next node
            parent = add(scores[parent] + lp[pos, 0], parent, 0, pos)
            heapq.heappush(unexpanded, (-float(scores[parent]), parent))
    while len(scores) <= budget and unexpanded:
        _, node = heapq.heappop(unexpanded)
        pos = depths[node]
        if pos >= L:
            continue
        for rank in range(first_rank.get(node, 0), widths[min(pos, len(widths) - 1)]):
            if len(scores) > budget:
                break
            child = add(scores[node] + lp[pos, rank], node, rank, pos)
            heapq.heappush(unexpanded, (-float(scores[child]), child))


def _links(tokens: list, parents: list, depths: list, scores: list, N: int) -> tuple:
    children: list[list[int]] = [[] for _ in range(N)]
    for i in range(1, N):
        children[parents[i]].append(i)  # in index order = in rank order
    first = [c[0] if c else -1 for c in children]
    nxt = [-1] * N
    for c in children:
        for a, b in zip(c, c[1:]):
            nxt[a] = b
    mask = np.zeros((N, mask_words(N)), dtype=np.uint32)
    for i in range(N):
        j = i
        while j >= 0:
            mask[i, j // 32] |= np.uint32(1 << (j % 32))
            j = parents[j]
    return tokens, parents, depths, first, nxt, mask.view(np.int32), scores


def build_tree(root_tokens: torch.Tensor, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor,
               budget: int, spine: bool, widths: tuple[int, ...] = ()) -> DraftTrees:
    R, L, K = topk_logprobs.shape
    N, W = budget + 1, mask_words(budget + 1)
    lp = topk_logprobs.cpu().numpy().astype(np.float32)
    ids = topk_ids.cpu().tolist()
    rows = [_build_one(int(root_tokens[r]), lp[r], ids[r], budget, spine, list(widths))
            for r in range(R)]
    dtypes = (np.int64, np.int32, np.int32, np.int32, np.int32, np.int32, np.float32)
    shapes = ((R, N),) * 5 + ((R, N, W), (R, N))
    return DraftTrees(*(torch.from_numpy(np.array([row[f] for row in rows], dtype=dtype)
                                         .reshape(shape))
                        for f, (dtype, shape) in enumerate(zip(dtypes, shapes))))


def verify_tree(trees: DraftTrees, target_tokens: torch.Tensor, max_depth: int) -> Verdict:
    R, N = trees.token_ids.shape
    accepted = torch.full((R, max_depth), -1, dtype=torch.int32)
    output = torch.full((R, max_depth + 1), -1, dtype=torch.int64)
    num = torch.zeros(R, dtype=torch.int32)
    tokens, parents = trees.token_ids.tolist(), trees.parents.tolist()
    target = target_tokens.tolist()
    for r in range(R):
        node, path = 0, []
        while len(path) < max_depth:
            children = [c for c in range(1, N) if parents[r][c] == node]
            match = [c for c in children if tokens[r][c] == target[r][node]]
            if not match:
                break
            node = match[0]
            path.append(node)
        num[r] = len(path)
        accepted[r, :len(path)] = torch.tensor(path, dtype=torch.int32)
        output[r, :len(path)] = torch.tensor([tokens[r][c] for c in path], dtype=torch.int64)
        output[r, len(path)] = target[r][node]
    return Verdict(accepted, num, output)


def compact_tree(kv_caches: list[torch.Tensor], hidden_states: torch.Tensor,
                 slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                 accepted: torch.Tensor, num_accepted: torch.Tensor) -> None:
    for r in range(accepted.shape[0]):
        start = int(query_start_loc[r])
        for j in range(int(num_accepted[r])):
            src, dst = start + int(accepted[r, j]), start + j + 1
            for cache in kv_caches:
                bs = cache.shape[2]
                s, d = int(slot_mapping[src]), int(slot_mapping[dst])
                cache[d // bs, :, d % bs] = cache[s // bs, :, s % bs].clone()
            if hidden_states.numel():
                hidden_states[dst] = hidden_states[src].clone()


def tree_positions(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    return seq_lens.unsqueeze(1) + depths.to(torch.int64)
