"""A device tensor's copy on the host: on a CPU the tensor itself; on a GPU two pinned
buffers filled by asynchronous copies, the one published a step before the latest being
read (its copy was issued a step ago, so waiting for it costs nothing in practice, as vLLM's
adaptive verification reads its confidences). The copy read is the same on every
tensor-parallel rank, so that their choices agree."""

from __future__ import annotations

import numpy as np
import torch


class HostCopy:
    def __init__(self, src: torch.Tensor) -> None:
        self.src = src
        self.cuda = src.device.type == "cuda"
        if self.cuda:
            self._buffers = [torch.zeros(src.shape, dtype=src.dtype, pin_memory=True)
                             for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
            self._newest = 0

    def publish(self) -> None:
        if self.cuda:
            self._newest ^= 1
            self._buffers[self._newest].copy_(self.src, non_blocking=True)
            self._events[self._newest].record()

    def latest(self) -> np.ndarray:
        if not self.cuda:
            return self.src.numpy()
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        older = self._newest ^ 1
        with gpu_sync_allowed():
            self._events[older].synchronize()
        return self._buffers[older].numpy()

    def fill_row(self, row: int, value: float) -> None:
        """A row reset on the device and in both host copies (a new request's slot)."""
        self.src[row] = value
        for buffer in self._buffers if self.cuda else ():
            buffer[row] = value
