"""CUDA tests: run by scripts/gpu_check.sh on a machine with a GPU; never collected by the
CPU suite (pyproject's norecursedirs). Without a GPU they fail: they cannot pass vacuously."""

import sys
from pathlib import Path

import pytest
import torch

# The shared helpers (tests/*.py), and the CPU suite's cases these tests run on the GPU
# (tests/ops/test_tree_*.py, tests/attention/test_tree_attention.py).
TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS / "ops"), str(TESTS / "attention")]


@pytest.fixture(autouse=True)
def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("these tests need a CUDA GPU: run scripts/gpu_check.sh on one")
