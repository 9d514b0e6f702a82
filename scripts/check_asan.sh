#!/usr/bin/env bash
# Run the CPU tree-op tests against a build of the native ops with AddressSanitizer and
# libstdc++ assertions (-D_GLIBCXX_ASSERTIONS), in a scratch copy of the checkout so the
# regular build is left alone. Not part of scripts/test.sh (a few minutes); run it after
# changing csrc/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
WORK=$(mktemp -d /tmp/vllm-ddtree-asan.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK"
cd "$WORK"
CFLAGS="-fsanitize=address -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS -O1" \
  LDFLAGS="-fsanitize=address" "$PY" setup.py -q build_ext --inplace >build.log 2>&1 \
  || { tail -20 build.log; exit 1; }
# libstdc++ is preloaded too, or ASan cannot intercept the exceptions of TORCH_CHECK.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONPATH=$WORK \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_tree_build.py tests/test_tree_verify.py \
  tests/test_tree_compact.py tests/test_native_ops.py -k "not nvcc and not entry_point" "$@"
