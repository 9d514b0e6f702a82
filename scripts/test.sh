#!/usr/bin/env bash
# The whole test suite: sets the environment up (scripts/setup_env.sh), lints, then runs
# unit and end-to-end tests on CPU (tests/, a folder a part: ops, attention, recurrent, engine
# (the engine on vLLM's Model Runner V2), tools, standin) and the CUDA and Triton compile
# checks, one pytest-xdist worker per core. Extra arguments go to pytest: `-m "not slow"` is
# the fast tier (no engine tests but one smoke test each), `-n 0` runs in one process, test
# paths (e.g. tests/ops) run those only. Ends with the 15 slowest tests and the run's total,
# so a change that slows the suite shows in its own log; per file: scripts/suite_times.py
# .test-times.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup_env.sh
.venv/bin/ruff check vllm_ddtree cpu_standin gpu_machine tests scripts setup.py
set_up=$((SECONDS - start))
rc=0
.venv/bin/python -m pytest -ra -n auto --dist loadgroup --durations=15 \
  --junitxml=.test-times.xml "$@" || rc=$?
echo "[test] total $((SECONDS - start)) s: set-up and lint $set_up s, pytest $((SECONDS - start - set_up)) s"
exit "$rc"
