"""Tests of the vLLM 0.34 CPU stand-in environment: run by its own Python
(.venv-034/bin/python -m pytest tests/v034; scripts/test.sh does). The .pth file of that
environment already set TRITON_INTERPRET=1, so Triton kernels here run interpreted."""

import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from importlib.metadata import version

    from vllm_ddtree.cpu_standin import VLLM_VERSION

    if version("vllm") != VLLM_VERSION or os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(
            f"tests/v034 run in the vLLM {VLLM_VERSION} CPU stand-in environment: "
            ".venv-034/bin/python -m pytest tests/v034 (scripts/setup_env.sh --vllm "
            f"{VLLM_VERSION} builds it)")


# The tests' shared helpers (tests/*.py) and this folder's.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
