#!/usr/bin/env python3
"""Compile the package's Triton kernels for GPUs ahead of time, on any machine.

The CPU tests run the kernels under Triton's interpreter, which accepts code that the GPU
compiler rejects and knows no shared-memory limit. This runs each kernel's own Python
launcher (the tree-attention, top-k ranking and tree Gated DeltaNet wrappers) on CPU tensors
shaped as the backend and the benchmark launch them, catches the launches instead of running
them, and compiles each with Triton's compiler for Hopper (sm_90) and Blackwell (sm_100)
down to a cubin. A compile error, or shared memory over a block's 227 KiB, fails it.
Registers and stack (spill) bytes per thread are printed, from Triton's cuobjdump, to read
beside the GPU benchmark.

    .venv/bin/python scripts/check_triton_compile.py [--targets 90,100]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Compiled, never interpreted: the CPU stand-in environment sets TRITON_INTERPRET=1 (for
# vLLM's kernels), which makes every @triton.jit kernel an interpreted one.
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAUNCH_OPTIONS = ("num_warps", "num_stages")  # launch keywords that are not constexprs
MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90 and sm_100
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}


def signature(fn, args: tuple, constexprs: dict) -> dict[str, str]:
    """Triton's types for one launch's arguments, as its launcher would infer them."""
    types = {}
    for name, value in zip(fn.arg_names, args):
        if isinstance(value, torch.Tensor):
            types[name] = "*" + DTYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value)}")
    return types | dict.fromkeys(constexprs, "constexpr")


@contextlib.contextmanager
def caught_launches(module, *names: str) -> Iterator[list]:
    """Replace ``module``'s kernels by recorders: ``kernel[grid](...)`` records the launch."""
    launches, originals = [], {name: getattr(module, name) for name in names}

    class Recorder:
        def __init__(self, fn) -> None:
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    for name, fn in originals.items():
        setattr(module, name, Recorder(fn))
    try:
        yield launches
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def tree_attention_launches() -> list:
    """The attention launches of the backend (its default tiles, no splits) and of the
    benchmark's sweep, over dtypes, head sizes, GQA ratios and page sizes; and gpt-oss's
    layers (a sliding window and sinks, or sinks alone), split or not."""
    from vllm_ddtree.attention import triton_tree_attention as tta

    cases = [(dtype, head, qpk, page, config, None, False)
             for dtype, head, qpk, page in itertools.product(
                 (torch.float16, torch.bfloat16, torch.float32), (64, 128), (1, 4, 8), (16, 32))
             for config in [(None, None, 1, tta.NUM_WARPS)]]  # the backend's own tiles
    cases += [(torch.bfloat16, head, qpk, 16, (None, None, 1, tta.NUM_WARPS), None, False)
              for head, qpk in [(32, 1), (96, 2), (256, 1), (256, 8), (128, 32)]]
    cases += [(torch.bfloat16, 128, 4, 16, config, None, False)  # the sweep's shape: Qwen3-8B's
              for config in tta.SWEPT_CONFIGS]
    cases += [(dtype, 64, 8, 16, (None, None, splits, tta.NUM_WARPS), window,
               True) for dtype, splits, window in itertools.product(
                   (torch.bfloat16, torch.float16), (1, 4), (128, None))]
    with caught_launches(tta, "_tree_attention_kernel", "_merge_splits") as launches:
        for dtype, head, qpk, page, (block_m, tile_n, splits, warps), window, sinks in cases:
            kv_heads, reqs, nodes = 2, 4, 65
            query = torch.empty(reqs * nodes, kv_heads * qpk, head, dtype=dtype)
            cache = torch.empty(64, page, kv_heads, head, dtype=dtype)
            tta.tree_attention(
                query, cache, cache, torch.empty_like(query),
                torch.zeros(reqs, 16, dtype=torch.int32), torch.zeros(reqs, dtype=torch.int32),
                torch.zeros(reqs + 1, dtype=torch.int32), torch.zeros(reqs, dtype=torch.int32),
                torch.zeros(reqs, nodes, 3, dtype=torch.int32), 0.1, block_m=block_m,
                tile_n=tile_n, num_splits=splits, num_warps=warps, sliding_window=window,
                sinks=torch.zeros(kv_heads * qpk) if sinks else None,
                depths=torch.zeros(reqs, nodes, dtype=torch.int32))
    return launches


def ranked_topk_launches() -> list:
    """The drafter's top-k ranking at Qwen3's vocabulary, budgets 16 to 1024."""
    from vllm_ddtree import ranked_topk as rk

    with caught_launches(rk, "_partial_topk_kernel", "_ranked_topk_kernel") as launches:
        for dtype, k in itertools.product((torch.float16, torch.bfloat16, torch.float32),
                                          (16, 64, 256, 1000, 1024)):
            rk.ranked_topk(torch.empty(4, 15, 151936, dtype=dtype), k, splits=8)
    return launches


def tree_gdn_launches() -> list:
    """The tree Gated DeltaNet kernels at Qwen3.5 / Qwen3-Next shapes (16 key and 32 or 48
    value heads of 128, conv width 4) and a small one, in bf16 and fp32, budget 64 at depth
    15; the recurrent state in fp32 or bf16."""
    from vllm_ddtree.recurrent import triton_tree_gdn as tg

    names = ("_tree_conv_kernel", "_tree_gdn_kernel", "_commit_gdn_kernel",
             "_commit_conv_kernel")
    with caught_launches(tg, *names) as launches:
        for dtype, state_dtype, (hk, hv, d) in itertools.product(
                (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                ((16, 32, 128), (16, 48, 128), (2, 4, 64))):
            rows, reqs, conv = 4 * 65, 4, 2 * hk * d + hv * d
            idx = torch.zeros(rows, dtype=torch.int64)
            paths, slots = torch.zeros(reqs, 16, dtype=torch.int64), idx[:reqs]
            x = torch.empty(rows, conv, dtype=dtype)
            conv_state = torch.empty(8, conv, 3 + 15, dtype=dtype)  # widened by the depth
            q, k = torch.empty(rows, hk, d, dtype=dtype), torch.empty(rows, hk, d, dtype=dtype)
            v, g = torch.empty(rows, hv, d, dtype=dtype), torch.empty(rows, hv)
            state = torch.empty(8, hv, d, d, dtype=state_dtype)
            tg.tree_conv(x, torch.empty(conv, 4, dtype=dtype), None, conv_state, idx, idx,
                         offsets=idx)
            tg.tree_gdn(q, k, v, g, g, state, idx, idx, d ** -0.5, max_depth=15)
            tg.commit_gdn(state, k, v, g, g, paths, slots, slots)
            tg.commit_gdn(state, k, v, g, g, paths, slots, paths)  # a slot per accepted row
            tg.commit_conv(conv_state, x, paths, slots, 4, read_at=slots, write_at=slots)
    return launches


def resource_usage(cubin: bytes) -> str:
    """``REG:n STACK:n`` of a cubin, from the cuobjdump that Triton ships ('' without it)."""
    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not tool.is_file():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f", {usage[1]} registers, {usage[2]} B stack" if usage else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="90,100", help="compute capabilities")
    args = parser.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    seen, failures = set(), []
    launches = tree_attention_launches() + ranked_topk_launches() + tree_gdn_launches()
    for (fn, call_args, kwargs), arch in itertools.product(
            launches, (int(t) for t in args.targets.split(","))):
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
        types = signature(fn, call_args, constexprs)
        key = (fn.__name__, arch, tuple(types.items()), tuple(kwargs.items()))
        if key in seen:
            continue
        seen.add(key)
        what = f"sm_{arch} {fn.__name__} {kwargs} {types[fn.arg_names[0]]}"
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=types, constexprs=constexprs),
                                    target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as e:  # noqa: BLE001  (every failure is reported, then counted)
            failures.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}")
            print(f"FAIL {what}", flush=True)
            continue
        shared = kernel.metadata.shared
        if shared > MAX_SHARED:
            failures.append(f"{what}: {shared} bytes of shared memory")
        print(f"ok   {what}: {shared} B shared{resource_usage(kernel.asm['cubin'])}",
              flush=True)
    print(f"\n{len(seen)} compiled with Triton {triton.__version__}, {len(failures)} failed")
    for failure in failures:
        print(f"  {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
