#!/usr/bin/env bash
# The device check, in one run of a few minutes on a machine with a CUDA GPU: vLLM itself
# (staged from the GPU bundle where the machine has no vLLM), ddtree lossless inside vLLM
# with CUDA graphs and the Triton TREE_ATTN, adaptive trees' cost curves measured at
# Qwen3-8B shapes and replayed, the throughput benchmark at those shapes
# (synthetic acceptance), then the CUDA ops' tests and timings and the tree-attention
# benchmarks, in that order: what is left out when time runs short comes last. Everything
# printed also goes to $OUT/gpu_check.log (default OUT=/tmp/gpu_check), beside the
# benchmarks' files: at most eight, as a lent machine brings back.
#
# On the lent H200 (Python 3.12, torch 2.11, no vLLM, 64 MiB carried a command): build the
# bundle here first (scripts/gpu_bundle.py, into .gpu-bundle/, which git ignores; its
# manifest.json says which parts each command carries), then run back to back, since the
# machine keeps /tmp only about 30 s after a command:
#   device run  command="scripts/gpu_check.sh"  carry=[".gpu-bundle/command-1"]  timeout_s=120
#       brings command 1's parts (about 46 MiB beside the 13 MiB working tree), keeps them
#       under /tmp and exits 3, naming what the next command must bring;
#   device run  command="TOTAL_LIMIT_S=570 scripts/gpu_check.sh"
#               carry=[".gpu-bundle/command-2"]  timeout_s=600
#       brings the rest (about 35 MiB; 81 MiB in all: vLLM's compiled ops, its Python
#       tree, FA3, the dependencies), stages the
#       bundle in /tmp/vllm-bundle (every hash checked; nothing of the machine's replaced),
#       applies the series, checks the compiled ops (else their stand-in, said loudly) and
#       runs the whole check.
#
#   scripts/gpu_check.sh            # uses .venv/bin/python if present, else python3
#   STEP_LIMIT_S=60 scripts/gpu_check.sh   # caps every step's time limit (seconds)
#   TOTAL_LIMIT_S=480 scripts/gpu_check.sh # the whole run's budget, for a machine lent for
#                                          # one command of limited time (see check)
#   BUNDLE_DIR, BUNDLE_WORK                # the carried bundle (.gpu-bundle) and where it
#                                          # is staged (/tmp/vllm-bundle)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
BUNDLE_DIR=${BUNDLE_DIR:-.gpu-bundle} BUNDLE_WORK=${BUNDLE_WORK:-/tmp/vllm-bundle}
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
# Seconds left of TOTAL_LIMIT_S (a large number without one), less what later steps need.
left_s() {
  if [ -n "${deadline:-}" ]; then echo $(( deadline - $(date +%s) - RESERVE_S - ${1:-0} ))
  else echo 100000; fi
}

# The whole run, its output also in $OUT/gpu_check.log (a pipe to tee, which the script
# waits for: the log is complete when the script returns).
main() {
  [ -n "${TOTAL_LIMIT_S:-}" ] && deadline=$(( $(date +%s) + TOTAL_LIMIT_S ))
  step "device"
  nvidia-smi -L
  "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'

  # vLLM: the machine's own, or the GPU bundle carried here (parts over several commands).
  bundle=0
  if ! "$PY" -c 'import vllm' 2>/dev/null \
      && { compgen -G "$BUNDLE_DIR/command-*/manifest.json" >/dev/null \
           || [ -f "$BUNDLE_WORK/manifest.json" ]; }; then
    step "stage the vLLM bundle"
    set +e
    "$PY" -m gpu_machine.stage --bundle "$BUNDLE_DIR" --work "$BUNDLE_WORK" \
      --env-file "$BUNDLE_WORK.env"
    rc=$?
    set -e
    if [ "$rc" -eq 3 ]; then
      echo "gpu_check: bundle parts missing: run the next command within 30 s (see above)"
      exit 3
    elif [ "$rc" -ne 0 ] || [ ! -f "$BUNDLE_WORK.env" ]; then
      failed+=("vLLM bundle (exit $rc)")
      echo "gpu_check: FAILED: vLLM bundle; the vLLM steps are skipped"
    else
      # shellcheck disable=SC1090
      source "$BUNDLE_WORK.env"
      bundle=1
    fi
  fi

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

  if [ "$bundle" = 1 ]; then
    step "the series on the staged vLLM; its compiled ops, or their stand-in"
    check "patch series" 60 "$PY" -m vllm_ddtree.cli patches apply
    check "compiled ops" 240 "$PY" -m gpu_machine.compiled_ops \
      --site "$VLLM_DDTREE_BUNDLE_SITE" --env-file "$BUNDLE_WORK.env"
    # shellcheck disable=SC1090
    source "$BUNDLE_WORK.env"  # the stand-in's settings, if it was chosen
    check "selfcheck" 120 "$PY" -m vllm_ddtree.selfcheck
  fi

  if ! "$PY" -c 'import vllm' 2>/dev/null; then
    step "vLLM is not here (no bundle carried): the vLLM steps did not run"
  else
    step "ddtree inside vLLM: lossless against the target alone, CUDA graphs, Triton TREE_ATTN"
    check "ddtree lossless in vLLM" 300 "$PY" -m pytest -q -p no:cacheprovider -x \
      tests/cuda/test_engine_cuda.py
    step "ddtree on hybrid targets inside vLLM: the CUDA GDN tree path in FULL graphs, prefix caching on, lossless"
    check "ddtree lossless on hybrids in vLLM" 240 "$PY" -m pytest -q -p no:cacheprovider \
      tests/cuda/test_engine_hybrid_cuda.py
    step "hybrid verify steps beside the chain (tiny Qwen3-Next, synthetic acceptance)"
    # Its table alone comes back (a lent machine brings back eight files).
    hybrid=$(mktemp -d)
    check "hybrid throughput" 150 "$PY" scripts/bench_gpu_throughput.py --shape tiny-hybrid \
      --time-budget-s 120 --concurrency 1 8 --output-len 128 --chain-acceptance 4 \
      --tree 8:4.0 16:4.5 64:5.0 --dynamic --out "$hybrid"
    cp "$hybrid/throughput.md" "$OUT/throughput_hybrid.md" 2>/dev/null || true
    step "adaptive trees: this GPU's step-cost curves at Qwen3-8B shapes, replayed beside fixed budgets"
    # The start-up profile of an adaptive engine (dummy weights), then the tiny pair's
    # recorded trees and verdicts replayed on those curves (the table alone comes back).
    curves=$(mktemp -d)
    check "adaptive cost curves" 180 "$PY" scripts/replay_adaptive.py measure --shape 8b \
      --out "$curves/h200.json"
    check "adaptive replay on the measured curves" 60 "$PY" scripts/replay_adaptive.py replay \
      --trace docs/adaptive-replay/trace-tiny-pair.npz --curves "$curves/h200.json" \
      --out "$curves"
    cp "$curves/replay-trace-tiny-pair-h200.md" "$OUT/adaptive_replay_h200.md" 2>/dev/null || true
    step "throughput at Qwen3-8B shapes (dummy weights, synthetic acceptance)"
    # What is left, less about 3 minutes for the CUDA op tests and timings after it.
    budget=$(left_s 180)
    [ "$budget" -gt 420 ] && budget=420
    check "throughput benchmark" $(( budget > 20 ? budget + 30 : 20 )) \
      "$PY" scripts/bench_gpu_throughput.py --shape 8b --time-budget-s "$budget" \
      --out "$OUT/throughput"
  fi

  step "CUDA tests"
  # In 8 processes where pytest-xdist is installed (the lent machines have it): the
  # property cases' generation and CPU oracles are host work, and the GPU has room for all.
  parallel=()
  "$PY" -c 'import xdist' 2>/dev/null && parallel=(-n 8)
  check "CUDA tests" 240 "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    "${parallel[@]}" tests/cuda --ignore=tests/cuda/test_engine_cuda.py \
    --ignore=tests/cuda/test_engine_hybrid_cuda.py --ignore=tests/cuda/test_engine_tp2_cuda.py

  step "tree op timings (CUDA events, median)"
  timings=$(mktemp -d)
  for reqs in 1 8 32; do
    check "tree op timings, $reqs requests" 90 "$PY" scripts/bench_tree_ops.py --device cuda \
      --reqs "$reqs" --json "$timings/r$reqs.json"
  done
  step "tree pipeline under CUDA-graph replay (per step, median)"
  check "tree pipeline under graph replay" 150 "$PY" scripts/bench_tree_ops.py --device cuda \
    --graphs --json "$timings/graphs.json"
  # One file for the four (a lent machine brings back eight).
  if compgen -G "$timings/*.json" >/dev/null; then
    "$PY" -c 'import json, sys; json.dump([json.load(open(f)) for f in sys.argv[2:]],
      open(sys.argv[1], "w"), indent=1)' "$OUT/bench_tree_ops_cuda.json" "$timings"/*.json \
      || true
  fi
  step "tree attention vs causal (CUDA events, median)"
  check "tree attention benchmark" 180 \
    "$PY" scripts/bench_tree_attention.py --json "$OUT/bench_tree_attention.json"
  check "tree attention benchmark, gpt-oss window and sinks" 90 \
    "$PY" scripts/bench_tree_attention.py --shape gpt-oss --budgets 64 \
    --json "$OUT/bench_tree_attention_gpt_oss.json"

  if "$PY" -c 'import vllm' 2>/dev/null; then
    # Real checkpoints, where the machine has them (TARGET_MODEL, DRAFTER_MODEL, PROMPTS).
    if [ -n "${TARGET_MODEL:-}" ] && [ -n "${DRAFTER_MODEL:-}" ]; then
      step "acceptance and throughput on real checkpoints: none vs dflash vs ddtree"
      check "acceptance benchmark" 1800 \
        "$PY" scripts/bench_acceptance.py --target "$TARGET_MODEL" --drafter "$DRAFTER_MODEL" \
        ${PROMPTS:+--prompts "$PROMPTS"} --dtype bfloat16 --cuda-graphs --concurrency 1 8 32 \
        --budgets 16 64 256 --dynamic 64:512 --repeats 3 --out "$OUT/bench_acceptance"
    fi
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      step "ddtree with tensor parallelism 2"
      check "ddtree TP=2" 600 "$PY" -m pytest -q -p no:cacheprovider \
        tests/cuda/test_engine_tp2_cuda.py
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
