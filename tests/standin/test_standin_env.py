"""The stand-in environment itself: its settings come from its .pth file, it refuses a GPU
machine and a vLLM whose op schemas it has not checked, an op library with another schema
fails at import naming the op, and the fused_experts_cpu adapter refuses what 0.32's op
cannot compute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_standin import SETTINGS, VLLM_VERSION, ops


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python of this environment, without the settings in its
    environment variables (as a user starts it)."""
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    return subprocess.run([sys.executable, "-c", code], env=clean | env, text=True,
                          capture_output=True, timeout=300)


def test_settings_come_from_the_environment() -> None:
    done = python("import os, json; print(json.dumps({k: os.environ.get(k) for k in "
                  f"{list(SETTINGS)!r}}}))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == __import__("json").dumps(SETTINGS)


def test_vllm_runs_on_the_cpu_platform_with_the_checked_op_library() -> None:
    done = python("from vllm import LLM; from vllm.platforms import current_platform as p; "
                  "import vllm._C, vllm._cpu_ops as c; "
                  "print(p.device_type, c.fused_experts_cpu.__module__)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["cpu", "cpu_standin.ops"]


def test_a_gpu_machine_is_refused_before_vllm_runs(tmp_path: Path) -> None:
    marker = tmp_path / "nvidiactl"
    marker.touch()
    done = python("import os; print(os.environ.get('TRITON_INTERPRET')); import vllm",
                  VLLM_DDTREE_GPU_MARKERS=str(marker))
    assert done.returncode != 0 and done.stdout.strip() == "None"  # nothing was set
    assert f"vLLM {VLLM_VERSION} CPU stand-in" in done.stderr and str(marker) in done.stderr
    assert "torch.ops._C" in done.stderr


def test_another_vllm_version_is_refused_naming_it(tmp_path: Path) -> None:
    meta = tmp_path / "vllm-0.33.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    done = python("import vllm", PYTHONPATH=str(tmp_path))
    assert done.returncode != 0
    assert "vLLM 0.33.0" in done.stderr and f"vLLM {VLLM_VERSION} only" in done.stderr
    assert "fused_experts_cpu" in done.stderr


def test_the_loaded_library_has_the_checked_schemas() -> None:
    import vllm._C  # noqa: F401  (checked when it loaded; checked again here)

    loaded = ops.loaded_schemas()
    assert len(loaded) >= 50 and "_C::fused_experts_cpu" in loaded
    ops.check_schemas(loaded)


@pytest.mark.parametrize("change", ["schema", "new op"])
def test_another_schema_fails_naming_the_op(change: str) -> None:
    import vllm._C  # noqa: F401

    loaded = ops.loaded_schemas()
    if change == "schema":
        name = "_C::fused_experts_cpu"
        loaded[name] = loaded[name].replace("bool is_vnni)", "bool is_vnni, int act_method)")
    else:
        name = "_C::rms_norm_v2"
        loaded[name] = f"{name}(Tensor x) -> Tensor"
    with pytest.raises(ImportError, match=f"op {name} of the loaded op library"):
        ops.check_schemas(loaded)


def test_fused_experts_cpu_refuses_an_activation_032_cannot_compute() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(NotImplementedError, match="fused_experts_cpu: act_method=2"):
        ops.fused_experts_cpu(x, x, x, x, x, x, 0, None, None, None, None, None,
                              act_method=2)  # GELU_AND_MUL
    with pytest.raises(NotImplementedError, match="act_method=0 with alpha=1.7"):
        ops.fused_experts_cpu(x, x, x, x, x, x, 0, None, None, None, None, None, alpha=1.7,
                              limit=7.0, act_method=0)


def test_fused_experts_cpu_computes_silu_and_mul_through_032s_op() -> None:
    """0.34's call (act_method last) on 0.32's op: a bf16 mixture of experts against its
    definition (2 of 4 experts a token, SiLU(gate) * up)."""
    import vllm._C  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 3, 64, 32, 4, 2
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).bfloat16()
    weights = torch.rand(tokens, k, generator=gen)
    ids = torch.randint(0, experts, (tokens, k), generator=gen, dtype=torch.int32)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    ops.fused_experts_cpu(out, x, torch.ops._C.convert_weight_packed(w1),
                          torch.ops._C.convert_weight_packed(w2), weights, ids, 0, None, None,
                          None, None, None, is_vnni=True, act_method=ops.SILU_AND_MUL)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            gate, up = (w1[ids[t, j]].float() @ x[t].float()).split(inter)
            want[t] += weights[t, j] * (w2[ids[t, j]].float()
                                        @ (torch.nn.functional.silu(gate) * up))
    assert (out.float() - want).abs().max() < 0.02 * want.abs().max()


def test_doctor_says_which_environment_this_is() -> None:
    done = subprocess.run([sys.executable, "-m", "vllm_ddtree.cli", "doctor"], text=True,
                          capture_output=True, timeout=300)
    assert f"ok      environment        the vLLM {VLLM_VERSION} CPU stand-in" in done.stdout
    assert "all 10 checks passed" in done.stdout and done.returncode == 0, done.stdout
    assert "needs a GPU" not in done.stdout
