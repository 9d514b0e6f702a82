#!/usr/bin/env bash
# The whole test suite: sets the environment up (scripts/setup_env.sh), lints, then runs
# unit and end-to-end tests on CPU and the CUDA and Triton compile checks. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check vllm_ddtree tests scripts setup.py
exec .venv/bin/python -m pytest -ra "$@"
