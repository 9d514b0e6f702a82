#!/usr/bin/env python3
"""Tree attention vs plain causal attention over the same query tokens, on a GPU: the Triton
kernel of vllm_ddtree with each request's tree, and the same kernel with every request
causal. Median of repeated CUDA-event timings, side by side, one run.

    python3 scripts/bench_tree_attention.py [--repeats 50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from vllm_ddtree import ops
from vllm_ddtree.attention.triton_tree_attention import tree_attention

HEADS, KV_HEADS, HEAD_SIZE, PAGE = 32, 8, 128, 16  # Qwen3-8B's attention shape


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(budget: int, num_reqs: int, context: int, repeats: int) -> dict:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    q_len, seq_len = budget + 1, context + budget + 1
    blocks_per_req = -(-seq_len // PAGE)
    key_cache = torch.randn(num_reqs * blocks_per_req, PAGE, KV_HEADS, HEAD_SIZE, device=dev,
                            dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_reqs * blocks_per_req, device=dev, dtype=torch.int32)
    block_table = block_table.view(num_reqs, blocks_per_req)
    query = torch.randn(num_reqs * q_len, HEADS, HEAD_SIZE, device=dev, dtype=dtype)
    out = torch.empty_like(query)
    seq_lens = torch.full((num_reqs,), seq_len, device=dev, dtype=torch.int32)
    qsl = torch.arange(num_reqs + 1, device=dev, dtype=torch.int32) * q_len
    logits = torch.randn(num_reqs, 15, 4096, device=dev) * 3
    trees = ops.build_tree_from_logits(torch.zeros(num_reqs, dtype=torch.long, device=dev),
                                       logits, budget)
    tree_index = torch.arange(num_reqs, device=dev, dtype=torch.int32)
    causal_index = torch.full_like(tree_index, -1)

    def run(index):
        return lambda: tree_attention(query, key_cache, value_cache, out, block_table,
                                      seq_lens, qsl, index, trees.ancestor_mask,
                                      HEAD_SIZE ** -0.5)

    tree_ms, causal_ms = median_ms(run(tree_index), repeats), median_ms(run(causal_index),
                                                                        repeats)
    return {"budget": budget, "reqs": num_reqs, "context": context, "tree_ms": tree_ms,
            "causal_ms": causal_ms, "overhead": tree_ms / causal_ms - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [bench(b, r, c, args.repeats) for c in (1024, 8192) for r in (1, 8, 32)
            for b in (16, 64, 256)]
    print(f"tree vs causal attention ({torch.cuda.get_device_name()}, bf16, {HEADS} heads, "
          f"{KV_HEADS} KV heads, head {HEAD_SIZE}, page {PAGE}; median ms)\n")
    print("| context | requests | budget | tree | causal | tree overhead |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['reqs']} | {r['budget']} | {r['tree_ms']:.3f} | "
              f"{r['causal_ms']:.3f} | {100 * r['overhead']:+.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
