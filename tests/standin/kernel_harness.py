"""Runs a V2 wrapper (or a kernel launch) twice on the same inputs: once with the Triton
kernel in Triton's interpreter, once with its PyTorch version from
cpu_standin.kernels, and compares every tensor argument afterwards (outputs
and in-place updates) and the return values."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from vllm.triton_utils import dispatcher

from cpu_standin import kernels


def _swap(name: str, impl: Any) -> tuple[Any, str, Any]:
    host, attr = dispatcher._resolve_kernel(name)
    original = getattr(host, attr)
    while isinstance(original, dispatcher.KernelOverride):  # installed by an engine test
        original = dispatcher._registry[name][0]
    setattr(host, attr, impl if impl is not None else original)
    return host, attr, original


def triton_kernel(name: str) -> Any:
    """The Triton kernel ``name`` itself (never an installed override)."""
    host, attr, original = _swap(name, None)
    return original


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return [t for v in vars(value).values() for t in _tensors(v)]
    return []


def assert_same(got: Any, want: Any, where: str, exact: bool = True,
                atol: float = 1e-5, rtol: float = 1e-5) -> None:
    got_t, want_t = _tensors(got), _tensors(want)
    assert len(got_t) == len(want_t), where
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{where}[{i}]: {g.shape} {w.shape}"
        if exact or not g.is_floating_point():
            assert torch.equal(g, w), f"{where}[{i}] differs:\n{g}\n{w}"
        else:
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=f"{where}[{i}] differs")


def run_both(name: str, call: Callable[..., Any], *args: Any, exact: bool = True,
             atol: float = 1e-5, rtol: float = 1e-5, fallback: bool = False,
             **kwargs: Any) -> tuple[Any, Any]:
    """``call(*args, **kwargs)`` with kernel ``name`` as Triton (interpreted) and as
    PyTorch, each on its own deep copy of the arguments; asserts that the arguments after
    the call and the return values agree (bit for bit unless ``exact`` is False) and
    returns the two argument sets (Triton's, PyTorch's). The PyTorch version must run
    every launch itself, or hand every launch back to Triton when ``fallback``."""
    impl = kernels.load()[name]
    impl.triton, fallbacks = triton_kernel(name), impl.fallbacks
    results = []
    for use_torch in (False, True):
        a, kw = copy.deepcopy(args), copy.deepcopy(kwargs)
        host, attr, original = _swap(name, None)
        if use_torch:
            setattr(host, attr, dispatcher.KernelOverride(original, impl))
        try:
            ret = call(*a, **kw)
        finally:
            setattr(host, attr, original)
        results.append(((a, kw), ret))
    (want_args, want_ret), (got_args, got_ret) = results
    if fallback:
        assert impl.fallbacks > fallbacks, f"{name}: the PyTorch version ran the launch"
    else:
        assert impl.fallbacks == fallbacks, f"{name}: handed back to Triton"
    assert_same(got_args, want_args, f"{name}: arguments after the call", exact, atol, rtol)
    assert_same(got_ret, want_ret, f"{name}: return value", exact, atol, rtol)
    return want_args, got_args
