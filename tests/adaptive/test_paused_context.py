"""A paused drafter's context queue (vllm_ddtree/spec_decode/paused_context.py): rows are
stored in step order, in one call, before the drafter drafts, when the queue is full, and
before the rows of a step that a request left (its slots may be another's next)."""

from __future__ import annotations

import torch

from vllm_ddtree.spec_decode.paused_context import PausedContext


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[float], list[int], list[list[int]]]] = []

    def __call__(self, states: torch.Tensor, positions: torch.Tensor,
                 slots: list[torch.Tensor]) -> None:
        assert (states[:, 1:] == states[:, :1] + 0.5).all()  # the parts side by side
        self.calls.append((states[:, 0].tolist(), positions.tolist(),
                           [s.tolist() for s in slots]))


def step(queue: PausedContext, store: Recorder, first: int, n: int,
         req_ids: list[str]) -> None:
    rows = torch.arange(first, first + n)
    states = [rows[:, None].float(), rows[:, None].float().expand(n, 2) + 0.5]
    queue.add(states, rows + 100, [rows + 1000, rows + 2000], req_ids, store)


def test_rows_are_stored_in_order_in_one_call_when_drafting_resumes() -> None:
    queue, store = PausedContext(16, 3, 2, torch.float32, torch.device("cpu")), Recorder()
    for first in (0, 2, 4):
        step(queue, store, first, 2, ["a", "b"])
    assert store.calls == [] and queue.num_rows == 6
    queue.flush(store)
    assert store.calls == [([0, 1, 2, 3, 4, 5], list(range(100, 106)),
                            [list(range(1000, 1006)), list(range(2000, 2006))])]
    queue.flush(store)
    assert len(store.calls) == 1 and queue.num_rows == 0


def test_a_request_leaving_or_a_full_queue_stores_the_queue_first() -> None:
    queue, store = PausedContext(6, 3, 2, torch.float32, torch.device("cpu")), Recorder()
    step(queue, store, 0, 2, ["a", "b"])
    step(queue, store, 2, 3, ["a", "b", "c"])  # a request joined: queued
    assert store.calls == []
    step(queue, store, 5, 2, ["b", "c"])  # "a" left: what it queued is stored first
    assert [c[0] for c in store.calls] == [[0, 1, 2, 3, 4]]
    step(queue, store, 7, 3, ["b", "c"])
    step(queue, store, 10, 3, ["b", "c"])  # 2 + 3 + 3 rows > 6: the queue first
    assert [c[0] for c in store.calls] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    step(queue, store, 13, 7, ["b", "c"])  # longer than the queue: after it, at once
    assert [c[0] for c in store.calls][2:] == [[10, 11, 12], list(range(13, 20))]
    assert queue.num_rows == 0
