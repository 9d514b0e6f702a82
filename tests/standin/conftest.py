"""The CPU stand-in's own tests (cpu_standin/): its environment, its op library's schemas and
its PyTorch versions of V2's Triton kernels against the kernels in Triton's interpreter. They
run in the stand-in environment (.venv, built by scripts/setup_env.sh on a machine without a
GPU), whose .pth file imported cpu_standin.activate at this Python's start."""

import sys

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if "cpu_standin.activate" not in sys.modules:
        raise pytest.UsageError(
            "tests/standin run in the CPU stand-in environment: .venv/bin/python -m pytest "
            "tests/standin (scripts/setup_env.sh builds it)")
