"""CUDA tests: run by scripts/gpu_check.sh on a machine with a GPU; never collected by the
CPU suite (pyproject's norecursedirs). Without a GPU they fail: they cannot pass vacuously."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(autouse=True)
def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("these tests need a CUDA GPU: run scripts/gpu_check.sh on one")
