"""The engine on vLLM 0.34's Model Runner V2, in the CPU stand-in environment (.venv, built by
scripts/setup_env.sh on a machine without a GPU): its .pth file already set
TRITON_INTERPRET=1, so Triton kernels here run interpreted."""

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
            ".venv/bin/python -m pytest tests/v034 (scripts/setup_env.sh builds it)")


# The tests' shared helpers (tests/*.py) and this folder's.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
