"""Builds vllm_ddtree and its native ops, vllm_ddtree._C, with torch's cpp_extension.

C++ CPU sources always; CUDA sources too when torch is a CUDA build and nvcc is found.
FORCE_CUDA=1 / FORCE_CPU=1 override; TORCH_CUDA_ARCH_LIST defaults to Hopper and Blackwell.
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def _extensions() -> tuple[list, dict]:
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
        ext = CUDAExtension("vllm_ddtree._C", sources, extra_compile_args=flags,
                            extra_link_args=link)
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
