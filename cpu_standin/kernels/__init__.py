"""PyTorch versions of Model Runner V2's Triton kernels, for CPUs without triton-cpu.

Each is launched exactly as the Triton kernel it replaces, ``kernel[grid](*args, **kwargs)``
with the kernel's own arguments (tensors where the kernel takes pointers), so vLLM's
wrappers and call sites stay as they are. ``install`` hands them to vLLM's override point
(``vllm.triton_utils.dispatcher.register_kernels``), which the CPU platform calls in every
worker before a kernel runs. Kernels without a version here still run in Triton's
interpreter (``interpreted`` lists them).

One module a part of V2: ``inputs`` (input batch, block tables, buffers, hybrid state),
``sampling`` (temperature, Gumbel sampling, bias, penalties, logprobs), ``rejection``
(DFlash's drafter inputs and the rejection sampler), ``mamba`` (the hybrid models' prefix
caching: running-state columns and state copies across block boundaries).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

MODULES = ("inputs", "sampling", "rejection", "mamba")
KERNELS: dict[str, TorchKernel] = {}
# Returned by a PyTorch version for a launch it does not cover (a rarely used flag): the
# Triton kernel runs instead, interpreted.
FALLBACK = object()
# Triton's launch options, which launch sites may pass beside the kernel's arguments.
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl",
                            "enable_fp_fusion", "grid"})


def pointer(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel's pointer sees it: a 1-D view from its first element to the end of
    its storage."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((n,), (1,))


def ranges(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For rows of ``lens[i]`` (>= 0) elements each, flattened: (row, index within row) of
    every element, and their number."""
    total = int(lens.sum()) if lens.numel() else 0
    row = torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens
    return row, torch.arange(total) - first[row], total


class TorchKernel:
    """A PyTorch function standing in for a Triton kernel: ``self[grid](*args, **kwargs)``
    calls ``fn(grid, *args, **kwargs)``, ``grid`` the launch grid as a tuple of ints, with
    the kernel's own parameter names. Where ``fn`` returns FALLBACK (before writing
    anything), the Triton kernel ``triton`` runs the launch."""

    def __init__(self, name: str, fn: Callable[..., Any]):
        self.name, self.fn = name, fn
        self.__name__ = fn.__name__
        self.triton: Any = None  # set by install() (and by the tests' harness)
        self.fallbacks = 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if callable(grid):
            raise TypeError(f"{self.name}: a grid computed from meta-parameters is not "
                            "supported by its PyTorch version")
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        grid = tuple(int(g) for g in grid)
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        result = self.fn(grid, *args,
                         **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
        if result is FALLBACK:
            self.fallbacks += 1
            return self.triton[grid](*args, **kwargs)
        return result

    def __repr__(self) -> str:
        return f"TorchKernel({self.name})"


def torch_kernel(name: str) -> Callable[[Callable[..., Any]], TorchKernel]:
    """Registers ``fn`` as the PyTorch version of the Triton kernel ``name`` (its fully
    qualified name, as ``register_kernels`` takes it)."""

    def register(fn: Callable[..., Any]) -> TorchKernel:
        if name in KERNELS:
            raise ValueError(f"two PyTorch versions of {name}")
        KERNELS[name] = TorchKernel(name, fn)
        return KERNELS[name]

    return register


def load() -> dict[str, TorchKernel]:
    """Every PyTorch version, by kernel name."""
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return KERNELS


def install() -> None:
    """Replaces V2's Triton kernels that have a PyTorch version (idempotent)."""
    from vllm.triton_utils import dispatcher

    todo = {name: impl for name, impl in load().items()
            if dispatcher._registry.get(name, (None, None))[1] is not impl}
    for name, impl in todo.items():
        host, attr = dispatcher._resolve_kernel(name)
        impl.triton = getattr(host, attr)
    if todo:
        dispatcher.register_kernels(todo)


def interpreted(package: str = "vllm.v1.worker") -> list[str]:
    """Triton kernels under ``package`` (all of it imported) without a PyTorch version here:
    they run in Triton's interpreter in this environment. Kernels by vLLM's naming
    (``*_kernel``); ``@triton.jit`` helpers are inlined into the kernels that call them."""
    import pkgutil
    import sys

    from triton.runtime.jit import KernelInterface

    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001  (modules for other hardware fail to import here)
            continue
    found = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith(package) or module is None:
            continue
        for attr, value in vars(module).items():
            defined_in = getattr(getattr(value, "fn", None), "__module__", None)
            if (isinstance(value, KernelInterface) and defined_in == name
                    and attr.endswith("_kernel")):
                found.add(f"{name}.{attr}")
    return sorted(found - set(load()))
