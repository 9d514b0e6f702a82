"""On the GPU machine, after staging: do the wheel's compiled ops load and run here? If not,
put the pure-PyTorch stand-in (``standin_ops``) in their place, and say so loudly.

The probe runs in a child process (a crash in a CUDA library must not end the check): it
imports ``vllm._C_stable_libtorch`` and ``vllm.vllm_flash_attn`` and runs rms_norm,
fused_add_rms_norm, silu_and_mul and rotary_embedding on the GPU against the stand-in's
implementations. On failure the staged ``_C_stable_libtorch.abi3.so`` is set aside and a
module of that name that registers the stand-in is written in its place (in the staged
bundle, never in the machine's packages), and the env file gets ``VLLM_DDTREE_STANDIN_OPS=1``
plus the settings that keep vLLM on its native paths; scripts label their numbers then.

  python3 -m gpu_machine.compiled_ops --site /tmp/vllm-bundle/site --env-file F
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

COMPILED = "vllm/_C_stable_libtorch.abi3.so"
STUB = "vllm/_C_stable_libtorch.py"
STUB_TEXT = '''"""vllm-ddtree: the wheel's compiled ops failed to load or run on this machine (see
gpu_check.log); this module stands in for them with pure PyTorch (gpu_machine.
standin_ops). Numbers measured with it are labeled "compiled-op stand-in"."""

from gpu_machine.standin_ops import register

register()
'''
PROBE = r'''
import torch
import vllm._C_stable_libtorch  # noqa: F401
import vllm.vllm_flash_attn  # noqa: F401  (FA2 or FA3 must load)
from gpu_machine import standin_ops as s

torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16
x = torch.randn(64, 512, device=dev, dtype=bf16)
w = torch.randn(512, device=dev, dtype=bf16)
checks = {}

def compare(name, got, want, tol):
    torch.cuda.synchronize()
    err = (got.float() - want.float()).abs().max().item()
    checks[name] = err
    assert err <= tol, f"{name}: the compiled op is off the reference by {err} (> {tol})"

got, want = torch.empty_like(x), torch.empty_like(x)
torch.ops._C.rms_norm(got, x, w, 1e-6)
s._rms_norm(want, x, w, 1e-6)
compare("rms_norm", got, want, 0.05)
r1, r2, i1, i2 = x.clone(), x.clone(), x.flip(0).clone(), x.flip(0).clone()
torch.ops._C.fused_add_rms_norm(i1, r1, w, 1e-6)
s._fused_add_rms_norm(i2, r2, w, 1e-6)
compare("fused_add_rms_norm", i1, i2, 0.05)
gate = torch.randn(64, 1024, device=dev, dtype=bf16)
got, want = torch.empty_like(x), torch.empty_like(x)
torch.ops._C.silu_and_mul(got, gate)
s._silu_and_mul(want, gate)
compare("silu_and_mul", got, want, 0.05)
pos = torch.arange(64, device=dev)
inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=dev).float() / 128))
freqs = torch.outer(torch.arange(4096, device=dev).float(), inv)
cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(bf16)
q = torch.randn(64, 4 * 128, device=dev, dtype=bf16)
k = torch.randn(64, 2 * 128, device=dev, dtype=bf16)
q2, k2 = q.clone(), k.clone()
torch.ops._C.rotary_embedding(pos, q, k, 128, cache, True)
s._rotary_embedding(pos, q2, k2, 128, cache, True, 0, False)
compare("rotary_embedding", torch.cat([q, k], 1), torch.cat([q2, k2], 1), 0.05)
print("compiled ops ran; largest difference from the stand-in:", checks)
'''


def probe(timeout_s: int = 180) -> str | None:
    """None when the compiled ops load and run right here, else why not (the child's last
    lines)."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the probe did not finish in {timeout_s} s"
    if done.returncode == 0:
        print(done.stdout.strip())
        return None
    return "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])


def use_standin(site: Path) -> None:
    compiled = site / COMPILED
    if compiled.exists():
        compiled.rename(compiled.with_name(compiled.name + ".failed"))
    (site / STUB).write_text(STUB_TEXT)


def standin_env_lines() -> str:
    from gpu_machine.standin_ops import STANDIN_ENV

    env = {"VLLM_DDTREE_STANDIN_OPS": "1", **STANDIN_ENV}
    return "".join(f"export {k}={v}\n" for k, v in env.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, required=True, help="the staged bundle")
    parser.add_argument("--env-file", type=Path, required=True, help="appended to")
    args = parser.parse_args(argv)
    if (args.site / STUB).is_file():
        why = "set by an earlier command on this machine"
    else:
        why = probe()
        if why is None:
            print("compiled ops: vllm/_C_stable_libtorch loaded and ran on this GPU")
            return 0
        use_standin(args.site)
    with open(args.env_file, "a") as f:
        f.write(standin_env_lines())
    bar = "!" * 78
    print(f"{bar}\ncompiled ops: vLLM's compiled ops did not load or run here; the PURE-PYTORCH "
          f"STAND-IN\nis in their place (gpu_machine.standin_ops). Every number "
          f"below is labeled\n'compiled-op stand-in'. Why:\n{why}\n{bar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
