"""Batches for the tree Gated DeltaNet tests: several requests' trees (random, chains, stars,
deep), each with its own committed state slot, as the rows of one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def random_parents(n: int, g: torch.Generator, kind: str = "random") -> list[int]:
    """Local parents (-1 for the root) of an ``n``-node tree in topological order."""
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "deep":  # a long spine with a few side branches
        return [-1] + [i - 1 if i % 5 else max(i - 3, 0) for i in range(1, n)]
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@dataclass
class Batch:
    parents: torch.Tensor  # [T] global row of each row's parent, -1 for a root
    slots: torch.Tensor  # [T] the row's request's state slot
    sizes: list[int]  # rows per request, in order
    request_slots: list[int]
    depth: int  # the deepest row's depth


def batch_of(trees: list[list[int]], num_slots: int, g: torch.Generator) -> Batch:
    """Requests with these local-parent lists, in distinct random slots."""
    slots_of = torch.randperm(num_slots, generator=g)[:len(trees)].tolist()
    parents, slots, start, depth = [], [], 0, 0
    for tree, slot in zip(trees, slots_of):
        d = [0] * len(tree)
        for i, p in enumerate(tree):
            parents.append(p + start if p >= 0 else -1)
            slots.append(slot)
            d[i] = d[p] + 1 if p >= 0 else 0
        depth = max([depth, *d])
        start += len(tree)
    return Batch(torch.tensor(parents, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64),
                 [len(t) for t in trees], slots_of, depth)


def gdn_inputs(T: int, Hk: int, Hv: int, K: int, V: int, num_slots: int, g: torch.Generator,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random layer inputs at the scales the layer gives: gates as Qwen3-Next computes them."""
    def r(*shape):
        return torch.randn(*shape, generator=g)

    a, b = r(T, Hv), r(T, Hv)
    A_log, dt_bias = r(Hv) * 0.5, r(Hv) * 0.5
    g_decay = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    return {"q": r(T, Hk, K).to(dtype), "k": r(T, Hk, K).to(dtype), "v": r(T, Hv, V).to(dtype),
            "g": g_decay.float(), "beta": b.sigmoid().float(),
            "state": (r(num_slots, Hv, K, V) * 0.1).float()}


def paths_of(batch: Batch, accepted: list[list[int]]) -> torch.Tensor:
    """``[R, P]`` global rows of each request's accepted path (local rows given), -1 padded."""
    P = max(len(p) for p in accepted)
    starts = [sum(batch.sizes[:i]) for i in range(len(batch.sizes))]
    return torch.tensor([[s + i for i in p] + [-1] * (P - len(p))
                         for s, p in zip(starts, accepted)], dtype=torch.int64)


def random_path(parents: list[int], g: torch.Generator) -> list[int]:
    """A random root-to-node path of a tree (local rows)."""
    node = int(torch.randint(0, len(parents), (1,), generator=g))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]
