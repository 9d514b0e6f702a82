"""The key under which Triton's JIT compiles a launch for a CUDA GPU, worked out on CPU.

Triton compiles a kernel once per key: its constexprs, each argument's type and
specialization (pointer alignment to 16 bytes, integers equal to 1 or divisible by 16) and
the launch options (num_warps, ...). A launch with a key not seen before in the process
compiles. Here the key comes from Triton's own argument binder for the kernel, made for a
CUDA (sm_90) backend, so a launch run on CPU (under the interpreter, or through vLLM's CPU
kernel overrides) yields the key the same launch would compile under on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Key = tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]


def vllm_kernel(module: Any, name: str) -> Any:
    """A Triton kernel of vLLM's, defined anew from vLLM's source with Triton's language:
    on a CPU-only machine vLLM defines its kernels with a stand-in for Triton, and its CPU
    platform then replaces them (by its C++ overrides, once per engine)."""
    import ast
    import inspect

    import triton
    import triton.language as tl

    path = inspect.getsourcefile(module)
    node = next(n for n in ast.parse(Path(path).read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []  # line numbers kept: Triton reads the source back
    namespace = {"tl": tl, "triton": triton}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return triton.jit(namespace[name])


def _jit_function(kernel: Any) -> Any:
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    # Under the interpreter triton.jit gives an InterpretedFunction: the same kernel, with
    # its specialization settings.
    return JITFunction(kernel.fn, do_not_specialize=kernel.kwargs["do_not_specialize"],
                       do_not_specialize_on_alignment=kernel.kwargs[
                           "do_not_specialize_on_alignment"])


def cuda_key_function(kernel: Any) -> Callable[..., Key]:
    """For ``kernel``: a function of a launch's arguments (as the kernel takes them, and
    the launch options) giving the launch's key on a CUDA GPU, as pairs of (argument name,
    specialization) and the options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit_function(kernel)
    binder = create_function_from_signature(jit.signature, jit.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))

    def key(*args: Any, **kwargs: Any) -> Key:
        _, specialization, options = binder(*args, **kwargs)
        return (tuple(zip(jit.arg_names, specialization)), tuple(sorted(options.items())))

    return key


def constexpr(key: Key, name: str) -> Any:
    return dict(key[0])[name][1]


def record_launches(monkeypatch: Any, kernels: dict[str, Any],
                    execute: bool = True) -> list[tuple[str, Key]]:
    """Record each launch of these interpreted kernels, (name, key), in launch order; the
    kernels run unless ``execute`` is False."""
    launches: list[tuple[str, Key]] = []
    for name, kernel in kernels.items():
        key = cuda_key_function(kernel)

        def run(*args, grid, warmup, _name=name, _key=key, _run=kernel.run, **kwargs):
            launches.append((_name, _key(*args, **kwargs)))
            if execute:
                return _run(*args, grid=grid, warmup=warmup, **kwargs)
        monkeypatch.setattr(kernel, "run", run)
    return launches
