"""scripts/setup_env.sh: re-running it on a set-up environment changes nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_ddtree.patching.installer import STATE_DIR
from vllm_ddtree.upstream import installed_vllm_root

REPO = Path(__file__).resolve().parent.parent


def fingerprint() -> dict[str, tuple[int, bytes]]:
    root = installed_vllm_root()
    paths = [*REPO.glob("vllm_ddtree/_C*.so"), root / STATE_DIR / "state.json",
             root / "vllm/config/speculative.py"]
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}


def test_rerun_changes_nothing() -> None:
    before = fingerprint()
    result = subprocess.run(["bash", str(REPO / "scripts/setup_env.sh")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vLLM 0.32.0 already installed" in result.stdout
    assert "native ops up to date" in result.stdout
    assert "already applied: nothing changed" in result.stdout
    assert fingerprint() == before
