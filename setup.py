"""Builds vllm_ddtree and its native ops, vllm_ddtree._C, with torch's cpp_extension.

C++ CPU sources always; CUDA sources too when torch is a CUDA build and nvcc is found.
FORCE_CUDA=1 / FORCE_CPU=1 override; TORCH_CUDA_ARCH_LIST defaults to Hopper and Blackwell.
"""

import glob
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def _toolkit_root() -> str | None:
    """The CUDA toolkit that nvcc belongs to, as nvcc itself reports it: the nvcc on PATH may
    be a wrapper script, from which torch would guess the wrong root (and no libraries)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    dry = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True)
    for line in (dry.stdout + dry.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.realpath(line.split("=", 1)[1].strip())
    return None


def _cudart_link_dir(cuda_home: str) -> list[str]:
    """A folder to add to the link path when the toolkit has no unversioned libcudart.so
    (pip's CUDA packages ship only libcudart.so.13), which torch links the extension with."""
    dirs = [f"{cuda_home}/lib64", f"{cuda_home}/lib", *glob.glob(f"{cuda_home}/targets/*/lib")]
    if any(Path(d, "libcudart.so").exists() for d in dirs):
        return []
    import torch

    site = Path(torch.__file__).parent.parent
    found = [f for d in dirs for f in sorted(glob.glob(f"{d}/libcudart.so.*"))]
    found += sorted(glob.glob(f"{site}/nvidia/cu*/lib/libcudart.so.*"))  # torch's own
    if not found:
        return []
    link_dir = HERE / "build" / "cudart-link"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / "libcudart.so"
    link.unlink(missing_ok=True)
    link.symlink_to(found[0])
    return [str(link_dir)]


def _cuda_include_dirs(cuda_home: str, site: Path | None = None) -> list[str]:
    """Header folders to add when the toolkit has nvcc but no CUDA runtime headers (an image
    with the cuda-nvcc package alone): those of pip's CUDA packages beside torch (``site``),
    which torch's CUDA wheel depends on."""
    own = [f"{cuda_home}/include", *glob.glob(f"{cuda_home}/targets/*/include")]
    if any(Path(d, "cuda_runtime.h").exists() for d in own):
        return []
    if site is None:
        import torch

        site = Path(torch.__file__).parent.parent
    found = sorted(glob.glob(f"{site}/nvidia/*/include/cuda_runtime.h"))
    return sorted({str(Path(h).parent) for h in found})


def _extensions() -> tuple[list, dict]:
    if os.environ.get("FORCE_CPU") != "1" and not (os.environ.get("CUDA_HOME")
                                                   or os.environ.get("CUDA_PATH")):
        root = _toolkit_root()  # before cpp_extension reads CUDA_HOME at import
        if root:
            os.environ["CUDA_HOME"] = root
    import torch
    from torch.utils.cpp_extension import (
        CUDA_HOME,
        BuildExtension,
        CppExtension,
        CUDAExtension,
    )

    if os.environ.get("FORCE_CPU") == "1":
        use_cuda = False
    elif os.environ.get("FORCE_CUDA") == "1":
        use_cuda = True
    else:
        use_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.cpp"))
    sources += sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc/cpu").glob("*.cpp"))
    # OpenMP, so that at::parallel_for splits a batch's trees across torch's threads.
    flags = {"cxx": ["-O3", "-std=c++20", "-fopenmp"]}
    link = ["-fopenmp"]
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0;10.0+PTX")
        sources += sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc/cuda").glob("*.cu"))
        flags["nvcc"] = ["-O3", "-std=c++20"]
        for d in _cuda_include_dirs(CUDA_HOME):  # after the toolkit's own (-I) folders
            flags["cxx"] += ["-isystem", d]
            flags["nvcc"] += ["-isystem", d]
        ext = CUDAExtension("vllm_ddtree._C", sources, extra_compile_args=flags,
                            extra_link_args=link, library_dirs=_cudart_link_dir(CUDA_HOME))
    else:
        ext = CppExtension("vllm_ddtree._C", sources, extra_compile_args=flags,
                           extra_link_args=link)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    name="vllm-ddtree",
    version="0.1.0",
    description="DDTree speculative decoding for vLLM",
    packages=find_packages(include=["vllm_ddtree", "vllm_ddtree.*"]),
    python_requires=">=3.10",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["vllm-ddtree = vllm_ddtree.cli:main"],
        "vllm.general_plugins": ["ddtree = vllm_ddtree:register"],
    },
)
