"""Python face of the native ops in ``csrc/``: loading, fake (meta) implementations, wrappers.

The CPU implementation is the oracle for the CUDA one; the plain-Python references here
are the oracle for both.
"""

from __future__ import annotations

import torch

import vllm_ddtree._C  # noqa: F401  (loads the library: registers torch.ops.vllm_ddtree.*)


@torch.library.register_fake("vllm_ddtree::tree_positions")
def _tree_positions_fake(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    return seq_lens.new_empty(depths.shape)


def tree_positions(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Position of every tree node: ``seq_lens[r] + depths[r, i]`` (siblings share one)."""
    return torch.ops.vllm_ddtree.tree_positions(seq_lens, depths)


def tree_positions_reference(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    return seq_lens.unsqueeze(1) + depths.to(torch.int64)
