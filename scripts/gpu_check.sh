#!/usr/bin/env bash
# The device check, in one run of a few minutes on a machine with a CUDA GPU: build the CUDA
# ops for this GPU, run the CUDA tests (CUDA == CPU on the property cases, CUDA-graph
# capture, the tree-attention kernel == the dense reference), and time the tree ops and tree
# attention against causal attention. Logs and tables go to $OUT (default /tmp/gpu_check).
#
#   scripts/gpu_check.sh            # uses .venv/bin/python if present, else python3
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
# check NAME LOG CMD...: runs CMD, its output shown and appended to LOG. A failure is
# recorded and the run goes on, so that one device run brings back every result it can;
# the summary at the end names the failures, and the exit status is their number.
failed=()
check() {
  local name=$1 log=$2 rc
  shift 2
  set +e
  "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || { failed+=("$name (exit $rc)"); echo "gpu_check: FAILED: $name"; }
}

step "device"
nvidia-smi -L
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'

step "build the native ops with CUDA for this GPU"
arch=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} \
  "$PY" setup.py -q build_ext --inplace 2>&1 | tee "$OUT/build.log" | grep -v -i warning || true
"$PY" -c 'import torch, vllm_ddtree.ops; print(torch.ops.vllm_ddtree.build_tree.default)'

step "CUDA tests"
check "CUDA tests" "$OUT/cuda_tests.log" "$PY" -m pytest -q -p no:cacheprovider tests/cuda

step "tree op timings (CUDA events, median)"
for reqs in 1 8 32; do
  check "tree op timings, $reqs requests" "$OUT/bench_tree_ops_cuda.md" \
    "$PY" scripts/bench_tree_ops.py --device cuda --reqs "$reqs" \
    --json "$OUT/bench_tree_ops_cuda_r$reqs.json"
done
step "tree attention vs causal (CUDA events, median)"
check "tree attention benchmark" "$OUT/bench_tree_attention.md" \
  "$PY" scripts/bench_tree_attention.py --json "$OUT/bench_tree_attention.json"
check "tree attention benchmark, gpt-oss window and sinks" "$OUT/bench_tree_attention.md" \
  "$PY" scripts/bench_tree_attention.py --shape gpt-oss --budgets 64 \
  --json "$OUT/bench_tree_attention_gpt_oss.json"
step "ddtree end to end (needs vLLM in this environment)"
if "$PY" -c 'import vllm' 2>/dev/null; then
  check "ddtree end to end" "$OUT/ddtree_engine.log" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_ddtree_engine.py
else
  echo "vLLM is not installed here: the ddtree end-to-end tests did not run" \
    | tee "$OUT/ddtree_engine.log"
fi
step "acceptance and throughput: none vs dflash vs ddtree, CUDA graphs (needs vLLM)"
# Real checkpoints when TARGET_MODEL and DRAFTER_MODEL (and PROMPTS, a JSON list) are given,
# else the trained tiny pair if it is here (PAIR; default the training script's output; to
# carry it to a lent GPU, copy it to .tiny-pair/, which git ignores, and set PAIR=.tiny-pair).
PAIR=${PAIR:-$HOME/.cache/vllm-ddtree/tiny-pair}
if ! "$PY" -c 'import vllm' 2>/dev/null; then
  echo "vLLM is not installed here: the acceptance benchmark did not run" \
    | tee "$OUT/bench_acceptance.md"
elif [ -n "${TARGET_MODEL:-}" ] && [ -n "${DRAFTER_MODEL:-}" ]; then
  check "acceptance benchmark" "$OUT/bench_acceptance.md" \
    "$PY" scripts/bench_acceptance.py --target "$TARGET_MODEL" --drafter "$DRAFTER_MODEL" \
    ${PROMPTS:+--prompts "$PROMPTS"} --dtype bfloat16 --cuda-graphs --concurrency 1 8 32 \
    --budgets 16 64 256 --dynamic 64:512 --repeats 3 --out "$OUT/bench_acceptance"
elif [ -f "$PAIR/heldout_prompts.json" ]; then
  check "acceptance benchmark" "$OUT/bench_acceptance.md" \
    "$PY" scripts/bench_acceptance.py --pair "$PAIR" --cuda-graphs --concurrency 1 8 32 \
    --dynamic 64:512 --repeats 3 --out "$OUT/bench_acceptance"
else
  echo "no checkpoints given and no tiny pair at $PAIR: the acceptance benchmark did not run" \
    | tee "$OUT/bench_acceptance.md"
fi
step "ddtree with tensor parallelism 2 (needs two GPUs and vLLM)"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && "$PY" -c 'import vllm' 2>/dev/null; then
  check "ddtree TP=2" "$OUT/ddtree_tp2.log" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_ddtree_parallel.py
else
  echo "fewer than two GPUs, or no vLLM here: the TP=2 run did not happen" \
    | tee "$OUT/ddtree_tp2.log"
fi
echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_check: done, every step passed; results in $OUT"
else
  printf 'gpu_check: FAILED: %s\n' "${failed[@]}"
  echo "gpu_check: results in $OUT"
fi
exit ${#failed[@]}
