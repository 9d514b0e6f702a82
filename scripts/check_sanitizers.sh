#!/usr/bin/env bash
# The native ops under sanitizers, in a scratch copy of the checkout (the regular build is
# left alone). Not part of scripts/test.sh (about 10 minutes); run it after changing csrc/.
#  1. AddressSanitizer + libstdc++ assertions (-D_GLIBCXX_ASSERTIONS): the CPU tree-op tests,
#     and the CUDA kernels on the CPU emulator (tests/cuda_emulator), whose global and
#     shared-memory accesses are then bounds-checked.
#  2. ThreadSanitizer: the CUDA kernels on the emulator, where a block's threads are real
#     threads, so a missing __syncthreads() shows as a data race. The CPU ops (the oracle)
#     run on one thread: libgomp is not instrumented, so its threads would be false alarms.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
WORK=$(mktemp -d /tmp/vllm-ddtree-sanitizers.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK"
cd "$WORK"
export PYTHONPATH=$WORK
build_ops() {  # the native ops (vllm_ddtree._C) with extra compiler flags
  CFLAGS="$1" LDFLAGS="$2" "$PY" setup.py -q build_ext --inplace --force >build.log 2>&1 \
    || { tail -20 build.log; exit 1; }
}
run_emulated() {  # the emulated kernels' tests, built with $1, under the runtime in $2
  DDTREE_EMULATOR_CFLAGS="$1" LD_PRELOAD="$2" \
    "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_cuda_emulated.py "${@:3}"
}

# libstdc++ is preloaded too, or ASan cannot intercept the exceptions of TORCH_CHECK.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
ASAN_RUNTIME="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
echo "== AddressSanitizer: CPU ops, CUDA kernels on the emulator"
build_ops "-fsanitize=address -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS -O1" \
  "-fsanitize=address"
LD_PRELOAD="$ASAN_RUNTIME" "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_tree_build.py \
  tests/ops/test_tree_verify.py tests/ops/test_tree_compact.py tests/ops/test_native_ops.py \
  -k "not nvcc and not entry_point" "$@"
run_emulated "-fsanitize=address -fno-omit-frame-pointer" "$ASAN_RUNTIME" "$@"

echo "== ThreadSanitizer: CUDA kernels on the emulator"
build_ops "" ""
TSAN_OPTIONS=halt_on_error=1:report_signal_unsafe=0 OMP_NUM_THREADS=1 \
  run_emulated "-fsanitize=thread -g" "$(gcc -print-file-name=libtsan.so)" "$@"
