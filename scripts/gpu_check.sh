#!/usr/bin/env bash
# The device check, in one run of a few minutes on a machine with a CUDA GPU: build the CUDA
# ops for this GPU, run the CUDA tests (CUDA == CPU on the property cases, CUDA-graph
# capture, the tree-attention kernel == the dense reference), and time the tree ops and tree
# attention against causal attention. Everything printed also goes to $OUT/gpu_check.log
# (default OUT=/tmp/gpu_check), beside the benchmarks' JSON: few files, as a lent machine
# brings back at most eight.
#
#   scripts/gpu_check.sh            # uses .venv/bin/python if present, else python3
#   STEP_LIMIT_S=60 scripts/gpu_check.sh   # caps every step's time limit (seconds)
#   TOTAL_LIMIT_S=480 scripts/gpu_check.sh # the whole run's budget, for a machine lent for
#                                          # one command of limited time (see check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
# check NAME LIMIT CMD...: runs CMD for at most LIMIT seconds (or STEP_LIMIT_S, if less). A
# failure or a hang is recorded and the run goes on, so that one device run brings back
# every result it can; the summary at the end names the failures, and the exit status is
# their number. Under TOTAL_LIMIT_S a step also gets no more than what is left of the run,
# less RESERVE_S for a killed step's grace and the summary, and a step that would get under
# MIN_STEP_S is not run (counted as a failure): the summary is written before the device
# command's own limit kills the run.
RESERVE_S=15 MIN_STEP_S=20
failed=()
check() {
  local name=$1 limit=$2 rc left
  shift 2
  [ -n "${STEP_LIMIT_S:-}" ] && [ "$STEP_LIMIT_S" -lt "$limit" ] && limit=$STEP_LIMIT_S
  if [ -n "${deadline:-}" ]; then
    left=$(( deadline - $(date +%s) - RESERVE_S ))
    if [ "$left" -lt "$MIN_STEP_S" ]; then
      failed+=("$name (not run: TOTAL_LIMIT_S spent)")
      echo "gpu_check: NOT RUN: $name: TOTAL_LIMIT_S spent"
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  set +e
  timeout -k 10 "$limit" "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    failed+=("$name (timed out after $limit s)")
    echo "gpu_check: FAILED: $name: timed out after $limit s"
  elif [ "$rc" -ne 0 ]; then
    failed+=("$name (exit $rc)")
    echo "gpu_check: FAILED: $name"
  fi
  return 0
}

# The whole run, its output also in $OUT/gpu_check.log (a pipe to tee, which the script
# waits for: the log is complete when the script returns).
main() {
  [ -n "${TOTAL_LIMIT_S:-}" ] && deadline=$(( $(date +%s) + TOTAL_LIMIT_S ))
  step "device"
  nvidia-smi -L
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'

  step "build the native ops with CUDA for this GPU"
  arch=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  before=${#failed[@]}
  check "CUDA build" 300 env FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" \
    "$PY" setup.py -q build_ext --inplace
  if [ ${#failed[@]} -gt "$before" ]; then  # the Triton kernel's checks need only the CPU ops
    check "CPU-only build, after the CUDA build failed" 300 env FORCE_CPU=1 \
      "$PY" setup.py -q build_ext --inplace
  fi
  check "loading the ops" 60 "$PY" -c \
    'import torch, vllm_ddtree.ops; print(torch.ops.vllm_ddtree.build_tree.default)'

  step "CUDA tests"
  # In 8 processes where pytest-xdist is installed (the lent machines have it): the
  # property cases' generation and CPU oracles are host work, and the GPU has room for all.
  parallel=()
  "$PY" -c 'import xdist' 2>/dev/null && parallel=(-n 8)
  check "CUDA tests" 240 "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    "${parallel[@]}" tests/cuda

  step "tree op timings (CUDA events, median)"
  for reqs in 1 8 32; do
    check "tree op timings, $reqs requests" 90 "$PY" scripts/bench_tree_ops.py --device cuda \
      --reqs "$reqs" --json "$OUT/bench_tree_ops_cuda_r$reqs.json"
  done
  step "tree attention vs causal (CUDA events, median)"
  check "tree attention benchmark" 180 \
    "$PY" scripts/bench_tree_attention.py --json "$OUT/bench_tree_attention.json"
  check "tree attention benchmark, gpt-oss window and sinks" 90 \
    "$PY" scripts/bench_tree_attention.py --shape gpt-oss --budgets 64 \
    --json "$OUT/bench_tree_attention_gpt_oss.json"

  if ! "$PY" -c 'import vllm' 2>/dev/null; then
    step "vLLM is not installed here: ddtree end to end, the acceptance benchmark and TP=2 did not run"
  else
    step "ddtree end to end"
    check "ddtree end to end" 600 \
      "$PY" -m pytest -q -p no:cacheprovider tests/test_ddtree_engine.py
    step "acceptance and throughput: none vs dflash vs ddtree, CUDA graphs"
    # Real checkpoints when TARGET_MODEL and DRAFTER_MODEL (and PROMPTS, a JSON list) are
    # given, else the trained tiny pair if it is here (PAIR; default the training script's
    # output; to carry it to a lent GPU, copy it to .tiny-pair/, which git ignores, and set
    # PAIR=.tiny-pair).
    PAIR=${PAIR:-$HOME/.cache/vllm-ddtree/tiny-pair}
    if [ -n "${TARGET_MODEL:-}" ] && [ -n "${DRAFTER_MODEL:-}" ]; then
      check "acceptance benchmark" 1800 \
        "$PY" scripts/bench_acceptance.py --target "$TARGET_MODEL" --drafter "$DRAFTER_MODEL" \
        ${PROMPTS:+--prompts "$PROMPTS"} --dtype bfloat16 --cuda-graphs --concurrency 1 8 32 \
        --budgets 16 64 256 --dynamic 64:512 --repeats 3 --out "$OUT/bench_acceptance"
    elif [ -f "$PAIR/heldout_prompts.json" ]; then
      check "acceptance benchmark" 1800 \
        "$PY" scripts/bench_acceptance.py --pair "$PAIR" --cuda-graphs --concurrency 1 8 32 \
        --dynamic 64:512 --repeats 3 --out "$OUT/bench_acceptance"
    else
      echo "no checkpoints given and no tiny pair at $PAIR: the acceptance benchmark did not run"
    fi
    step "ddtree with tensor parallelism 2 (needs two GPUs)"
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      check "ddtree TP=2" 600 "$PY" -m pytest -q -p no:cacheprovider tests/test_ddtree_parallel.py
    else
      echo "fewer than two GPUs: the TP=2 run did not happen"
    fi
  fi
  echo
  if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_check: done, every step passed; results in $OUT"
  else
    printf 'gpu_check: FAILED: %s\n' "${failed[@]}"
    echo "gpu_check: results in $OUT"
  fi
  exit ${#failed[@]}  # from main's subshell: the number of failures
}

main 2>&1 | tee "$OUT/gpu_check.log"
