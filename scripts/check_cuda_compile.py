#!/usr/bin/env python3
"""Compile every csrc/**/*.cu with nvcc against torch's headers, without linking.

On a CPU-only machine this is how a CUDA compile error fails CI: the CPU build of torch
ships the CUDA headers, but not the libraries to link the extension against.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def find_nvcc() -> str:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("check_cuda_compile: nvcc not found (set NVCC or put it on PATH)")


def compile_all(arch: str) -> list[Path]:
    from torch.utils.cpp_extension import include_paths

    nvcc = find_nvcc()
    sources = sorted((REPO / "csrc").rglob("*.cu"))
    if not sources:
        raise SystemExit("check_cuda_compile: no .cu files under csrc/")
    abi = int(__import__("torch")._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory() as out:
        # The CPU build of torch lacks this one generated header of c10_cuda; a CUDA build
        # ships it with exactly this content.
        shim = Path(out) / "shim" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        shim.parent.mkdir(parents=True)
        shim.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"],
                                       Path(out) / "shim"]]
        for src in sources:
            cmd = [nvcc, "-c", str(src), "-o", str(Path(out) / (src.stem + ".o")),
                   "-std=c++20", f"-arch={arch}", "-O2", "--expt-relaxed-constexpr",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=_C",
                   *includes]
            print(f"nvcc {src.relative_to(REPO)} ({arch})", flush=True)
            subprocess.run(cmd, check=True)
    return sources


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    try:
        compiled = compile_all(args.arch)
    except subprocess.CalledProcessError as e:
        print(f"check_cuda_compile: nvcc failed ({e.returncode})", file=sys.stderr)
        return 1
    print(f"compiled {len(compiled)} CUDA file(s) for {args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
