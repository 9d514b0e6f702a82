#!/usr/bin/env python3
"""Tree attention vs plain causal attention over the same query tokens, on a GPU: the Triton
kernel of vllm_ddtree with each request's tree; the same kernel with every request causal
(the mask's cost); PyTorch's SDPA, causal over the same keys laid out contiguously (how the
kernel compares with a tuned causal kernel); and the kernel's tile sizes and key splits
swept. Median of
repeated CUDA-event timings, side by side, one run.

    python3 scripts/bench_tree_attention.py [--repeats 50] [--json FILE]
    python3 scripts/bench_tree_attention.py --shape gpt-oss   # a sliding window and sinks

--shape qwen3-8b (the default) is Qwen3-8B's attention; gpt-oss is a windowed layer of
gpt-oss (a 128-position window, sinks; no sweep): there the kernel is also timed without
the window (every key read), which shows what skipping the key tiles before the window buys.
Before timing a case it checks that the kernel's causal output equals SDPA's (windowed, a
sink as one more key). With --device cpu (Triton's interpreter, TRITON_INTERPRET=1) it runs
tiny cases as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from vllm_ddtree import ops
from vllm_ddtree.attention.triton_tree_attention import (
    NUM_WARPS,
    SWEPT_CONFIGS,
    default_launch,
    tree_attention,
)

PAGE = 16


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_size: int
    window: int | None  # vLLM's sliding window: positions a query sees, its own included
    sinks: bool


SHAPES = {"qwen3-8b": Shape(32, 8, 128, None, False),
          "gpt-oss": Shape(64, 8, 64, 128, True)}  # its sliding-window layers


def median_ms(fn, repeats: int, dev: torch.device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def bench(shape: Shape, budget: int, num_reqs: int, context: int, repeats: int,
          dev: torch.device, sweep: bool) -> dict:
    dtype = torch.bfloat16
    heads, kv_heads, head_size = shape.heads, shape.kv_heads, shape.head_size
    q_len, seq_len = budget + 1, context + budget + 1
    blocks_per_req = -(-seq_len // PAGE)
    key_cache = torch.randn(num_reqs * blocks_per_req, PAGE, kv_heads, head_size, device=dev,
                            dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_reqs * blocks_per_req, device=dev, dtype=torch.int32)
    block_table = block_table.view(num_reqs, blocks_per_req)
    query = torch.randn(num_reqs * q_len, heads, head_size, device=dev, dtype=dtype)
    out = torch.empty_like(query)
    seq_lens = torch.full((num_reqs,), seq_len, device=dev, dtype=torch.int32)
    qsl = torch.arange(num_reqs + 1, device=dev, dtype=torch.int32) * q_len
    # The trees are input here, not timed: built by the CPU op, so that this benchmark runs
    # even where the CUDA ops failed to build.
    logits = torch.randn(num_reqs, 15, 4096) * 3
    trees = ops.build_tree_from_logits(torch.zeros(num_reqs, dtype=torch.long), logits, budget)
    ancestor_mask, depths = trees.ancestor_mask.to(dev), trees.depths.to(dev)
    tree_index = torch.arange(num_reqs, device=dev, dtype=torch.int32)
    causal_index = torch.full_like(tree_index, -1)
    sinks = torch.linspace(-1.0, 2.0, heads, device=dev).to(dtype) if shape.sinks else None

    def run(index, config=(None, None, None, NUM_WARPS), window=shape.window):
        block_m, tile_n, splits, warps = config
        return lambda: tree_attention(query, key_cache, value_cache, out, block_table,
                                      seq_lens, qsl, index, ancestor_mask,
                                      head_size ** -0.5, sliding_window=window, sinks=sinks,
                                      depths=depths, block_m=block_m, tile_n=tile_n,
                                      num_splits=splits, num_warps=warps)

    # The same keys and values, contiguous per request: [reqs, kv_heads, seq_len, head].
    slots = (block_table.long()[:, :, None] * PAGE + torch.arange(PAGE, device=dev)).flatten(1)
    k = key_cache.flatten(0, 1)[slots[:, :seq_len]].transpose(1, 2).contiguous()
    v = value_cache.flatten(0, 1)[slots[:, :seq_len]].transpose(1, 2).contiguous()
    q = query.view(num_reqs, q_len, heads, head_size).transpose(1, 2)
    causal = shape.window is None and sinks is None
    if causal:
        mask = causal_lower_right(q_len, seq_len)
    else:  # a float mask: the window's band, and a sink as one more key (zero key and value)
        k = torch.cat([k, k.new_zeros(num_reqs, kv_heads, 1, head_size)], dim=2)
        v = torch.cat([v, v.new_zeros(num_reqs, kv_heads, 1, head_size)], dim=2)
        behind = (torch.arange(q_len, device=dev)[:, None] + context
                  - torch.arange(seq_len, device=dev))  # query position - key position
        seen = (behind >= 0) & (behind < (shape.window or seq_len))
        mask = torch.where(seen, 0.0, float("-inf")).to(dtype)
        sink_col = (sinks if sinks is not None else torch.full((heads,), float("-inf"),
                                                               device=dev)).to(dtype)
        mask = torch.cat([mask.expand(heads, q_len, seq_len),
                          sink_col[:, None, None].expand(heads, q_len, 1)], dim=2)[None]

    def sdpa():
        if causal:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        # A float mask with grouped heads: PyTorch's math kernel, the one sure to take it.
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    # Like is compared with like: the kernel, all causal, computes what SDPA computes.
    run(causal_index)()
    err = (out.view(num_reqs, q_len, heads, head_size).transpose(1, 2).float()
           - sdpa().float()).abs().max().item()
    if err > 3e-2:
        raise SystemExit(f"bench_tree_attention: kernel (causal) != SDPA, max abs error {err}")
    tree_ms = median_ms(run(tree_index), repeats, dev)
    causal_ms = median_ms(run(causal_index), repeats, dev)
    row = {"shape": shape._asdict(), "budget": budget, "reqs": num_reqs, "context": context,
           "tree_ms": tree_ms, "causal_ms": causal_ms, "overhead": tree_ms / causal_ms - 1,
           "sdpa_causal_ms": median_ms(sdpa, repeats, dev), "sdpa_max_abs_diff": err}
    if shape.window is not None:
        row["tree_no_window_ms"] = median_ms(run(tree_index, window=None), repeats, dev)
    if sweep:
        swept = {c: median_ms(run(tree_index, c), repeats, dev) for c in SWEPT_CONFIGS}
        best = min(swept, key=swept.get)
        row |= {"configs_ms": {config_name(c): ms for c, ms in swept.items()},
                "best_config": config_name(best), "best_config_ms": swept[best]}
    return row


def config_name(config: tuple[int, int, int | None, int]) -> str:
    """block_m x tile_n, then the split count (None: auto_splits's) and the warps where not
    the default."""
    m, n, splits, warps = config
    return (f"{m}x{n}" + ("/auto splits" if splits is None else
                          f"/{splits} splits" if splits > 1 else "")
            + (f"/{warps} warps" if warps != NUM_WARPS else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--reqs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev, shape = torch.device(args.device), SHAPES[args.shape]
    sweep = shape.window is None  # the sweep's configs are Qwen3-8B's (compile-checked)
    rows = [bench(shape, b, r, c, args.repeats, dev, sweep) for c in args.contexts
            for r in args.reqs for b in args.budgets]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU, Triton interpreter"
    extras = (f", window {shape.window}" if shape.window else "") + (
        ", sinks" if shape.sinks else "")
    default = (*default_launch(torch.bfloat16, shape.window is not None), NUM_WARPS)
    print(f"tree vs causal attention, {args.shape} ({name}, bf16, {shape.heads} heads, "
          f"{shape.kv_heads} KV heads, head {shape.head_size}, page {PAGE}{extras}; median "
          f"ms; kernel {config_name(default)} = rows (query token x "
          f"head) x keys per step)\n")
    last = (["tree, every key read (no window)"] if shape.window is not None else
            ["best config", "tree, best config"])
    sdpa = "SDPA causal" if shape.window is None else "SDPA math, window mask + sink key"
    print("| context | requests | budget | tree | causal, same kernel | tree overhead "
          f"| {sdpa} | tree / SDPA | " + " | ".join(last) + " |")
    print("|---" * (8 + len(last)) + "|")
    for r in rows:
        cells = ([f"{r['tree_no_window_ms']:.3f}"] if shape.window is not None else
                 [r["best_config"], f"{r['best_config_ms']:.3f}"])
        print(f"| {r['context']} | {r['reqs']} | {r['budget']} | {r['tree_ms']:.3f} | "
              f"{r['causal_ms']:.3f} | {100 * r['overhead']:+.1f}% | "
              f"{r['sdpa_causal_ms']:.3f} | {r['tree_ms'] / r['sdpa_causal_ms']:.2f}x | "
              + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
