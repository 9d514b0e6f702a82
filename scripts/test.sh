#!/usr/bin/env bash
# The whole test suite: sets the environment up (scripts/setup_env.sh), lints, then runs
# unit and end-to-end tests on CPU and the CUDA and Triton compile checks, one pytest-xdist
# worker per core; then tests/v034 in the vLLM 0.34 CPU stand-in environment (.venv-034,
# built by setup_env.sh --vllm 0.34.0). Extra arguments go to both pytest runs: `-m "not
# slow"` is the fast tier (no engine tests but one smoke test each), `-n 0` runs in one
# process; test paths go to the run of their environment only. Ends with the 15 slowest tests and
# the run's total, so a change that slows the suite shows in its own log; per file:
# scripts/suite_times.py .test-times.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup_env.sh
bash scripts/setup_env.sh --vllm 0.34.0
.venv/bin/ruff check vllm_ddtree gpu_machine tests scripts setup.py
set_up=$((SECONDS - start))
opts=() paths032=() paths034=()
for arg in "$@"; do
  case $arg in
    tests/v034*) paths034+=("$arg") ;;
    tests/*) paths032+=("$arg") ;;
    *) opts+=("$arg") ;;
  esac
done
rc=0
if [ ${#paths032[@]} -gt 0 ] || [ ${#paths034[@]} -eq 0 ]; then
  .venv/bin/python -m pytest -ra -n auto --dist loadgroup --durations=15 \
    --junitxml=.test-times.xml "${opts[@]}" "${paths032[@]}" || rc=$?
fi
if [ ${#paths034[@]} -gt 0 ] || [ ${#paths032[@]} -eq 0 ]; then
  [ ${#paths034[@]} -gt 0 ] || paths034=(tests/v034)
  .venv-034/bin/python -m pytest -ra -n auto --dist loadgroup --durations=15 \
    --junitxml=.test-times-034.xml "${opts[@]}" "${paths034[@]}" || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
fi
echo "[test] total $((SECONDS - start)) s: set-up and lint $set_up s, pytest $((SECONDS - start - set_up)) s"
exit "$rc"
