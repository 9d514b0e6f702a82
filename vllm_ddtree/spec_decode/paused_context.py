"""A paused drafter's context (adaptive trees), stored in batches.

DFlash drafts from the context K/V of every earlier position, computed from the target's
hidden states. While adaptive trees keep the drafter paused, each step's rows are still
committed context; projecting them to K/V every step costs a CPU about as much as the rest
of the step's overhead, so the rows' combined hidden states, positions and slots are queued
here and stored in one call (``flush``) when the drafter drafts again, when the queue is
full, and when a request left the batch (its blocks may go to another request, whose rows
must land after the queued ones: one call writes a slot once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PausedContext:
    def __init__(self, rows: int, hidden_size: int, num_groups: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.states = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(num_groups, rows, dtype=torch.int64, device=device)
        self.num_rows = 0
        self._req_ids: set[str] = set()

    def add(self, states: torch.Tensor, positions: torch.Tensor,
            slots: list[torch.Tensor], req_ids: list[str],
            store: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], None]) -> None:
        """Queues a step's rows; stores the queue first when it is full or a request left
        the batch since the last step queued."""
        n = states.shape[0]
        current = set(req_ids)
        if self.num_rows + n > self.states.shape[0] or not self._req_ids <= current:
            self.flush(store)
        self._req_ids = current
        if n > self.states.shape[0]:  # a step longer than the queue: stored at once
            store(states, positions, slots)
            return
        end = self.num_rows + n
        self.states[self.num_rows:end].copy_(states)
        self.positions[self.num_rows:end].copy_(positions)
        for g, s in enumerate(slots):
            self.slots[g, self.num_rows:end].copy_(s)
        self.num_rows = end

    def flush(self, store: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], None]
              ) -> None:
        """``store(states, positions, slots per group)`` for the queued rows, in order."""
        n, self.num_rows = self.num_rows, 0
        self._req_ids = set()
        if n:
            store(self.states[:n], self.positions[:n], list(self.slots[:, :n]))
