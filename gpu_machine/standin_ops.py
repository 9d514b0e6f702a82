"""Pure-PyTorch stand-ins for the ``torch.ops._C`` ops that vLLM's dense Qwen3 target and
DFlash drafter need, and the engine settings that keep vLLM on its native paths around them
(schemas checked against vLLM 0.32's CUDA library; what vLLM 0.34's CUDA path dereferences at
import is covered too: tests/tools/test_gpu_bundle_env.py).

For the lent GPU machine only, and there only when the official wheel's compiled
``vllm/_C_stable_libtorch.abi3.so`` fails to load or to run: when it works it is the real
thing and this module stays unused. ``register()`` must run before anything imports
``vllm._custom_ops`` or vLLM's compilation passes (they dereference ``torch.ops._C.<op>`` at
import), and the engine must get ``standin_engine_kwargs()`` and ``STANDIN_ENV``, so that the
model runs vLLM's native PyTorch forms and only the drafter's context-KV precompute
(``qwen3_dflash.py:609,643,693``, which calls the ops unconditionally) reaches them.

The ops have the CUDA library's exact schemas, argument names included (vLLM finds mutated
arguments by name, e.g. ``result`` at ``fix_functionalization.py:111,144``), in three kinds:

- implemented (``IMPLEMENTED``): rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul,
  in place like the CUDA kernels (they write result / input / residual / query / key) and with
  the kernels' arithmetic: fp32 compute, rounded to the storage dtype where the kernels round;
- called at import (``CALLED_AT_IMPORT``): the CUTLASS capability queries, answering False,
  what a build without those kernels answers;
- schema only (``SCHEMA_ONLY``): the quant and fusion ops that import-time code looks up;
  calling one raises NotImplementedError.

Numbers measured with these stand-ins (unfused PyTorch, not CUDA kernels: throughput above
all) must be labeled as measured with the vllm-ddtree stand-in ops.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

# --- implemented ops --------------------------------------------------------------------------


def _rms_norm(result: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
              epsilon: float) -> None:
    # A 2-D weight [G, D] is the drafter's stacked per-layer K-norm (qwen3_dflash.py:643): the
    # CUDA kernel takes row g of it for every row of input[g] (weight.size(0) == input.size(0)).
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        w = weight.float()
        if weight.dim() == 2:
            if weight.shape[0] != input.shape[0] or weight.shape[1] != input.shape[-1]:
                raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not fit input "
                                 f"{tuple(input.shape)} (want [input.size(0), input.size(-1)])")
            w = w.view(w.shape[0], *([1] * (input.dim() - 2)), w.shape[1])
        elif weight.dim() != 1:
            raise ValueError("rms_norm weight must be 1D or 2D")
        y = y * w
    result.copy_(y)


def _fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor | None, epsilon: float) -> None:
    # The kernel stores input + residual in the storage dtype first and normalises that
    # rounded sum (vLLM's native form normalises the fp32 sum).
    summed = (input.float() + residual.float()).to(residual.dtype)
    residual.copy_(summed)
    _rms_norm(input, summed, weight, epsilon)


def _rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                      head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                      rope_dim_offset: int = 0, inverse: bool = False) -> None:
    # Rotates dims [rope_dim_offset, rope_dim_offset + rot_dim) of every head, rot_dim being
    # cos_sin_cache.size(1); query/key are [tokens, heads * head_size] or [tokens, heads,
    # head_size] (tokens possibly [batch, seq]). inverse rotates by -angle.
    rot_dim = cos_sin_cache.shape[1]
    if rope_dim_offset + rot_dim > head_size:
        raise ValueError(f"rotary_embedding: rope_dim_offset {rope_dim_offset} + rot_dim "
                         f"{rot_dim} > head_size {head_size}")
    num_tokens = positions.numel()
    if num_tokens == 0:
        return  # nothing to rotate, and view(0, -1, ...) would be ambiguous
    cos, sin = cos_sin_cache.index_select(0, positions.reshape(-1)).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if inverse:
        sin = -sin
    for t in (query, key):
        if t is None:
            continue
        # view, not reshape: the rotation must land in the caller's tensor.
        rot = t.view(num_tokens, -1, head_size)[..., rope_dim_offset:rope_dim_offset + rot_dim]
        if is_neox:
            x, y = rot[..., :rot_dim // 2], rot[..., rot_dim // 2:]
        else:
            x, y = rot[..., 0::2], rot[..., 1::2]
        xf, yf = x.float(), y.float()
        # Both results before either write: for fp32, xf and yf are x and y themselves.
        new_x = xf * cos - yf * sin
        new_y = yf * cos + xf * sin
        x.copy_(new_x)
        y.copy_(new_y)


def _silu_and_mul(result: torch.Tensor, input: torch.Tensor) -> None:
    # The kernel rounds silu(gate) to the storage dtype before multiplying, as this does.
    d = input.shape[-1] // 2
    result.copy_(F.silu(input[..., :d]) * input[..., d:])


# (schema, kernel); the schemas are the CUDA library's (strings in _C_stable_libtorch.abi3.so).
IMPLEMENTED: tuple[tuple[str, Callable[..., None]], ...] = (
    ("rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()", _rms_norm),
    ("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
     _fused_add_rms_norm),
    ("rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
     "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
     _rotary_embedding),
    ("silu_and_mul(Tensor! result, Tensor input) -> ()", _silu_and_mul),
)


def _no_cutlass_kernel(cuda_device_capability: int) -> bool:
    return False


# Called at import: quantization/utils/w8a8_utils.py:41 (block fp8, via _custom_ops.py:768)
# and quantization/online/fp8.py:209 in a class body (fp8, via _custom_ops.py:764).
CALLED_AT_IMPORT: tuple[tuple[str, Callable[..., bool]], ...] = (
    ("cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool", _no_cutlass_kernel),
    ("cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool",
     _no_cutlass_kernel),
)

# Dereferenced (``torch.ops._C.<op>.default``) without a hasattr guard at import on CUDA by
# the fusion passes that compilation/passes/pass_manager.py:32-48 imports, and at compile time
# by compilation/passes/utility/fix_functionalization.py:98-162. Guarded look-ups
# (per_token_group_fp8_quant, scaled_fp4_quant, silu_and_mul_nvfp4_quant,
# rms_norm_per_block_quant) are left undefined, so vLLM sees those features as absent.
SCHEMA_ONLY: tuple[str, ...] = (
    # matcher_utils.py:37-39, rms_quant_fusion.py:159-161
    "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
    "int[]? group_shape=None) -> ()",
    "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, "
    "Tensor? scale_ub) -> ()",
    # rms_quant_fusion.py:189-198
    "rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, Tensor scale, "
    "float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor! residual, "
    "Tensor weight, Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor weight, "
    "Tensor! scale, float epsilon, Tensor? scale_ub, Tensor!? residual) -> ()",
    # act_quant_fusion.py:34,43-44
    "silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()",
    "silu_and_mul_per_block_quant(Tensor! out, Tensor input, Tensor! scales, int group_size, "
    "Tensor? scale_ub=None, bool is_scale_transposed=False) -> ()",
    # qk_norm_rope_fusion.py:26
    "fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
    "int head_dim, float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, "
    "bool is_neox, Tensor position_ids, int forced_token_heads_per_warp=-1) -> ()",
)

# torch.library drops a library's registrations when the object is freed: keep them.
_LIBRARIES: dict[str, torch.library.Library] = {}


def op_name(schema: str) -> str:
    return schema.split("(", 1)[0]


def _not_implemented(namespace: str, name: str) -> Callable[..., None]:
    def kernel(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"torch.ops.{namespace}.{name} is a vllm-ddtree stand-in with a schema only (no "
            "kernel): vLLM reached a path the stand-in settings (standin_engine_kwargs) avoid")
    return kernel


def _no_outputs(*args: Any, **kwargs: Any) -> None:
    """Fake (meta) kernel of the in-place ops: nothing to allocate, so torch.compile can trace
    them."""


def register(namespace: str = "_C") -> list[str]:
    """Define the stand-in ops in ``torch.ops.<namespace>``, skipping any already defined there
    (the real library's, or an earlier call's: never redefined); return the names defined."""
    ops = getattr(torch.ops, namespace)
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    entries = ([(s, k, True) for s, k in IMPLEMENTED]
               + [(s, k, False) for s, k in CALLED_AT_IMPORT]
               + [(s, _not_implemented(namespace, op_name(s)), False) for s in SCHEMA_ONLY])
    registered = []
    for schema, kernel, traceable in entries:
        name = op_name(schema)
        if hasattr(ops, name):
            continue
        lib.define(schema)
        # CompositeExplicitAutograd: one kernel for every device (CPU, CUDA).
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        if traceable:
            torch.library.register_fake(f"{namespace}::{name}", _no_outputs, lib=lib)
        registered.append(name)
    return registered


# --- engine settings --------------------------------------------------------------------------


class Setting(NamedTuple):
    kind: str  # "engine": an LLM / EngineArgs keyword argument; "env": an environment variable
    name: str
    value: Any
    where: str  # where vLLM 0.32 reads it
    why: str


NATIVE_SETTINGS: tuple[Setting, ...] = (
    Setting("engine", "compilation_config", {"custom_ops": ["none"]},
            "config/compilation.py:480 (custom_ops); config/vllm.py:1765-1772",
            "without Inductor (eager, or another backend) vLLM appends 'all' and RoPE and "
            "SiluAndMul call torch.ops._C; 'none' picks their forward_native"),
    Setting("engine", "ir_op_priority", {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
            "engine/arg_utils.py:509,2764-2778 -> config/kernel.py:31,34; the platform's "
            "defaults (platforms/cuda.py:718) appended after it (config/kernel.py:448-465)",
            "without Inductor the CUDA default is ['vllm_c', 'native'] and RMSNorm calls "
            "torch.ops._C.rms_norm; 'native' first also keeps fuse_norm_quant off "
            "(config/vllm.py:155)"),
    Setting("env", "VLLM_USE_FLASHINFER_SAMPLER", "0", "envs.py:50,878",
            "on by default: the sampler then imports vLLM's FlashInfer backend "
            "(v1/sample/ops/topk_topp_sampler.py:101), and the machine has no flashinfer"),
)

STANDIN_ENV: dict[str, str] = {s.name: s.value for s in NATIVE_SETTINGS if s.kind == "env"}


def standin_engine_kwargs() -> dict[str, Any]:
    """The LLM / EngineArgs keyword arguments of NATIVE_SETTINGS, as fresh copies a caller may
    extend (e.g. add keys to compilation_config)."""
    return {s.name: copy.deepcopy(s.value) for s in NATIVE_SETTINGS if s.kind == "engine"}
