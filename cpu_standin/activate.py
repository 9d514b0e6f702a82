"""Loaded by the stand-in environment's ``.pth`` file at every Python start (stdlib only,
cheap): sets the environment's settings and hooks the vLLM modules the stand-in changes,
right after each one is imported. On a machine with a GPU it sets nothing and refuses
``import vllm``: this environment's op library is a CPU build.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType

from cpu_standin import SETTINGS, VLLM_VERSION, gpu_marker


class RefuseOnGpu(importlib.abc.MetaPathFinder):
    """Refuses ``import vllm`` before any of it runs."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001
        if name != "vllm":
            return None
        raise ImportError(
            f"this is the vLLM {VLLM_VERSION} CPU stand-in environment "
            f"(cpu_standin), and this machine has a GPU ({gpu_marker()}): its op "
            "library torch.ops._C "
            "(_C.abi3.so) is a CPU build. Build the CUDA environment instead: "
            "scripts/setup_env.sh")


def _check_version(module: ModuleType) -> None:
    from importlib.metadata import version

    found = version("vllm")
    if found != VLLM_VERSION:
        raise ImportError(
            f"vLLM {found}: the CPU stand-in checked its op schemas (torch.ops._C."
            f"fused_experts_cpu first among them) and Triton kernels for vLLM {VLLM_VERSION} "
            f"only; rebuild with scripts/setup_env.sh")


def _after_op_library(module: ModuleType) -> None:
    from cpu_standin import ops

    ops.check_schemas()


def _after_cpu_ops(module: ModuleType) -> None:
    from cpu_standin import ops

    ops.install(module)


def _after_topk_topp(module: ModuleType) -> None:
    # Its Triton top-k/top-p kernel breaks the interpreter (topk_topp_triton.py:128, "'int'
    # object has no attribute 'to'"); the PyTorch path it falls back to is exact.
    module.HAS_TRITON = False


def _after_cpu_platform(module: ModuleType) -> None:
    module.CpuPlatform.register_triton_kernel_overrides = classmethod(
        lambda cls: _worker_starts())


def _worker_starts() -> None:
    """Called by every worker before its model loads."""
    from cpu_standin import kernels

    # VLLM_DDTREE_TORCH_KERNELS=0 leaves every kernel to Triton's interpreter (to compare).
    if os.environ.get("VLLM_DDTREE_TORCH_KERNELS", "1") != "0":
        kernels.install()
    # vLLM collects garbage 8 times while a worker starts (its memory profiler, the model
    # loader), each a pass over every object of the imported modules (0.3-0.4 s each here);
    # it freezes them itself once started (freeze_gc_heap). Freezing them now, the modules
    # all imported, makes start-up 1-2 s shorter and changes nothing else.
    gc.freeze()


HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "vllm": _check_version,
    "vllm._C": _after_op_library,
    "vllm._cpu_ops": _after_cpu_ops,
    "vllm.v1.sample.ops.topk_topp_sampler": _after_topk_topp,
    "vllm.platforms.cpu": _after_cpu_platform,
}


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[ModuleType], None]):
        self.loader, self.hook = loader, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.hook(module)


class PostImportHooks(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` right after module ``name`` executes, before anyone who
    imported it gets it."""

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):  # noqa: ANN001
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, hook)
                return spec
        return None


def activate() -> None:
    if any(isinstance(f, (PostImportHooks, RefuseOnGpu)) for f in sys.meta_path):
        return
    if gpu_marker() is not None:
        sys.meta_path.insert(0, RefuseOnGpu())
        return
    for key, value in SETTINGS.items():
        os.environ.setdefault(key, value)
    sys.meta_path.insert(0, PostImportHooks(HOOKS))


activate()
