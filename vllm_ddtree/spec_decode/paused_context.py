"""A paused drafter's context (adaptive trees), stored in batches.

DFlash drafts from the context K/V of every earlier position, computed from the target's
hidden states. While adaptive trees keep the drafter paused, each step's rows are still
committed context; combining and projecting them to K/V every step costs a CPU about as much
as the rest of the step's overhead, so the rows' hidden states (the target's aux layers side
by side, not yet combined), positions and slots are queued here and stored in one call
(``flush``) when the drafter drafts again, when the queue is full, and when a request left
the batch (its blocks may go to another request, whose rows must land after the queued
ones: one call writes a slot once). A departed request's rows are stored, not dropped: its
full blocks stay in the prefix cache, and a request that hits them drafts from their K/V.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Queue length in rows: 128 steps at concurrency 8; a step longer than it (a long prefill
# chunk) is stored at once. Allocated on the first paused step, after the memory profile:
# kept small (about 40 MiB at 5 aux layers of 4096 in bf16).
PAUSED_CONTEXT_ROWS = 1024

Store = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], None]


class PausedContext:
    def __init__(self, rows: int, width: int, num_groups: int, dtype: torch.dtype,
                 device: torch.device,
                 combine: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``rows`` of ``width`` (the parts' widths summed); ``combine`` turns queued rows
        into the hidden states the drafter stores (DFlash's fc over the aux layers)."""
        self.combine = combine
        self.states = torch.zeros(rows, width, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(num_groups, rows, dtype=torch.int64, device=device)
        self.num_rows = 0
        self._req_ids: set[str] = set()

    def add(self, states: list[torch.Tensor], positions: torch.Tensor,
            slots: list[torch.Tensor], req_ids: list[str], store: Store) -> None:
        """Queues a step's rows (``states``: their parts, concatenated along the last
        dimension); stores the queue first when it is full or a request left the batch
        since the last step queued."""
        n = positions.shape[0]
        current = set(req_ids)
        if self.num_rows + n > self.states.shape[0] or not self._req_ids <= current:
            self.flush(store)
        self._req_ids = current
        if n > self.states.shape[0]:  # a step longer than the queue: stored at once
            store(self._combined(torch.cat(states, dim=-1)), positions, slots)
            return
        end = self.num_rows + n
        torch.cat(states, dim=-1, out=self.states[self.num_rows:end])
        self.positions[self.num_rows:end].copy_(positions)
        for g, s in enumerate(slots):
            self.slots[g, self.num_rows:end].copy_(s)
        self.num_rows = end

    def flush(self, store: Store) -> None:
        """``store(hidden states, positions, slots per group)`` for the queued rows, in
        order, in one call."""
        n, self.num_rows = self.num_rows, 0
        self._req_ids = set()
        if n:
            store(self._combined(self.states[:n]), self.positions[:n], list(self.slots[:, :n]))

    def _combined(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.combine is None else self.combine(rows)
