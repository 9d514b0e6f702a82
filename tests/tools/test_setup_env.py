"""scripts/setup_env.sh: re-running it on a set-up environment changes nothing."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

from vllm_ddtree.patching.installer import STATE_DIR
from vllm_ddtree.upstream import installed_vllm_root, pinned_version

REPO = Path(__file__).resolve().parents[2]


def fingerprint() -> dict[str, tuple[int, bytes]]:
    root = installed_vllm_root()
    # This Python's native ops only: a parallel test builds another Python's beside them
    # (tests/tools/test_gpu_bundle_env.py).
    native_ops = REPO / "vllm_ddtree" / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    paths = [native_ops, root / STATE_DIR / "state.json",
             root / "vllm/config/vllm.py"]
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}


def test_rerun_changes_nothing() -> None:
    before = fingerprint()
    result = subprocess.run(["bash", str(REPO / "scripts/setup_env.sh")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"vLLM {pinned_version()} CPU stand-in already installed" in result.stdout
    assert "native ops up to date" in result.stdout
    assert "already applied: nothing changed" in result.stdout
    assert fingerprint() == before
