#!/usr/bin/env python3
"""Median time per request of the tree ops, side by side with a pure-Python heap build and
walk (the host-side approach of the public vLLM DDTree port), in one run.

    .venv/bin/python scripts/bench_tree_ops.py [--device cpu|cuda] [--reqs 8] [--repeats 50]
    .venv/bin/python scripts/bench_tree_ops.py --device cuda --graphs [--verify-step-us U]

Prints a markdown table; --json FILE also writes the numbers. With --graphs (CUDA only) it
times, per step instead, the whole tree pipeline of a decode step (top-k of bfloat16
logits, spine build, verify, compaction of 36 layers) eager and by CUDA-graph replay, and
each stage's graph alone, at 1, 8 and 32 requests and budgets 64, 256 and 1024 (random
logits, as in the eager table); --verify-step-us adds the pipeline's share of a verify step
(the throughput benchmark's).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
from collections.abc import Callable

import torch

from vllm_ddtree import ops
from vllm_ddtree.tree import topk_ranked

DEPTH, VOCAB, LAYERS = 15, 151936, 36  # Qwen3-8B's


def median_us(fn: Callable[[], object], repeats: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def one_thread(fn: Callable[[], float]) -> float:
    """``fn()`` with torch's intra-op threads (which the CPU build op splits trees across)
    limited to one, as the Python heap has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def python_heap_build(roots, logprobs, ids, budget):
    """Host-side best-first build of the kind vLLM PR #42910 uses: top-k copied to the host,
    one heapq per request whose entries carry (-logw, rank path, parent, depth, rank, logw),
    the rank path breaking ties; nodes (token, parent, depth) out, no attention mask."""
    lp, id_lists = logprobs.cpu().tolist(), ids.cpu().tolist()
    trees = []
    for r, root in enumerate(roots.tolist()):
        L, K = len(lp[r]), len(lp[r][0])
        nodes = [(root, -1, 0)]
        heap = [(-lp[r][0][0], (0,), 0, 1, 0, lp[r][0][0])]
        while len(nodes) <= budget and heap:
            _, path, parent, depth, rank, logw = heapq.heappop(heap)
            nodes.append((id_lists[r][depth - 1][rank], parent, depth))
            if rank + 1 < K:
                w = logw - lp[r][depth - 1][rank] + lp[r][depth - 1][rank + 1]
                heapq.heappush(heap, (-w, path[:-1] + (rank + 1,), parent, depth, rank + 1, w))
            if depth < L:
                w = logw + lp[r][depth][0]
                heapq.heappush(heap, (-w, path + (0,), len(nodes) - 1, depth + 1, 0, w))
        trees.append(nodes)
    return trees


def python_walk(trees, choices, depth):
    tokens, first, nxt = (trees.token_ids.tolist(), trees.first_child.tolist(),
                          trees.next_sibling.tolist())
    out = []
    for r, want in enumerate(choices.tolist()):
        node, path = 0, []
        while len(path) < depth:
            c = first[r][node]
            while c != -1 and tokens[r][c] != want[node]:
                c = nxt[r][c]
            if c == -1:
                break
            path.append(c)
            node = c
        out.append(path)
    return out


def bench_budget(budget: int, R: int, dev: str, repeats: int, gen: torch.Generator) -> dict:
    """Median µs per request of every op at one budget."""
    logits = (torch.randn(R, DEPTH, VOCAB, generator=gen) * 3).to(dev)
    roots = torch.randint(0, VOCAB, (R,), generator=gen).to(dev)
    logprobs, ids = topk_ranked(logits, budget)
    trees = ops.build_tree(roots, logprobs, ids, budget)
    # Target choices that follow each node's first child: long accepted paths.
    choices = trees.token_ids.gather(1, trees.first_child.clamp(min=0).long())
    verdict = ops.verify_tree(trees, choices, DEPTH)
    # Qwen3-8B's per-layer cache in the Triton layout (8 KV heads, K and V of 128 side by
    # side), one layer and all 36 (the CUDA op compacts same-shaped caches in one launch).
    caches = [torch.randn(R * (budget + 1) // 16 + 2, 8, 16, 256, device=dev,
                          dtype=torch.bfloat16) for _ in range(LAYERS)]
    hidden = torch.randn(R * (budget + 1), 4096, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(R + 1, device=dev, dtype=torch.int32) * (budget + 1)
    slots = torch.arange(R * (budget + 1), device=dev)
    timings = {
        "build_from_logits": median_us(
            lambda: ops.build_tree_from_logits(roots, logits, budget), repeats, dev),
        # The top-k alone; torch.topk alone (on CUDA the Triton top-k replaces it, the
        # log-sum-exp and the ranking); and a float32 log-softmax of the whole logits
        # first, as it was before either kernel.
        "topk_ranked": median_us(lambda: topk_ranked(logits, budget), repeats, dev),
        "torch_topk": median_us(lambda: torch.topk(logits, budget), repeats, dev),
        "topk_of_log_softmax": median_us(
            lambda: torch.topk(torch.log_softmax(logits.float(), -1), budget), repeats, dev),
        "build_from_topk": median_us(
            lambda: ops.build_tree(roots, logprobs, ids, budget), repeats, dev),
        "build_from_topk_1_thread": one_thread(lambda: median_us(
            lambda: ops.build_tree(roots, logprobs, ids, budget), repeats, dev)),
        "python_heap_build": median_us(
            lambda: python_heap_build(roots, logprobs, ids, budget), max(5, repeats // 5), dev),
        "verify": median_us(lambda: ops.verify_tree(trees, choices, DEPTH), repeats, dev),
        "python_walk": median_us(lambda: python_walk(trees, choices, DEPTH), repeats, dev),
        "compact_1_layer": median_us(
            lambda: ops.compact_tree(caches[:1], hidden, slots, qsl, verdict), repeats, dev),
        f"compact_{LAYERS}_layers": median_us(
            lambda: ops.compact_tree(caches, hidden, slots, qsl, verdict), repeats, dev),
    }
    return {"budget": budget, **{k: v / R for k, v in timings.items()}}


def graph_us(fn: Callable[[], object], repeats: int) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph (warmed up outside)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay, repeats, "cuda")


def bench_graphs(budget: int, R: int, repeats: int, gen: torch.Generator) -> dict:
    """Median µs per decode step of the tree pipeline, eager and replayed, at one size."""
    dev = "cuda"
    logits = (torch.randn(R, DEPTH, VOCAB, generator=gen) * 3).to(dev, torch.bfloat16)
    roots = torch.randint(0, VOCAB, (R,), generator=gen).to(dev)
    caches = [torch.randn(R * (budget + 1) // 16 + 2, 8, 16, 256, device=dev,
                          dtype=torch.bfloat16) for _ in range(LAYERS)]
    hidden = torch.randn(R * (budget + 1), 4096, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(R + 1, device=dev, dtype=torch.int32) * (budget + 1)
    slots = torch.arange(R * (budget + 1), device=dev)

    def follow(trees):  # the target takes every node's first child: long accepted paths
        return trees.token_ids.gather(1, trees.first_child.clamp(min=0).long())

    def pipeline():
        logprobs, ids = topk_ranked(logits, budget)
        trees = ops.build_tree(roots, logprobs, ids, budget, spine=True)
        verdict = ops.verify_tree(trees, follow(trees), DEPTH)
        ops.compact_tree(caches, hidden, slots, qsl, verdict)

    logprobs, ids = topk_ranked(logits, budget)
    trees = ops.build_tree(roots, logprobs, ids, budget, spine=True)
    choices = follow(trees)
    verdict = ops.verify_tree(trees, choices, DEPTH)
    return {"reqs": R, "budget": budget,
            "eager_pipeline": median_us(pipeline, repeats, dev),
            "graph_pipeline": graph_us(pipeline, repeats),
            "graph_topk_ranked": graph_us(lambda: topk_ranked(logits, budget), repeats),
            "graph_build": graph_us(
                lambda: ops.build_tree(roots, logprobs, ids, budget, spine=True), repeats),
            "graph_verify": graph_us(lambda: ops.verify_tree(trees, choices, DEPTH), repeats),
            f"graph_compact_{LAYERS}_layers": graph_us(
                lambda: ops.compact_tree(caches, hidden, slots, qsl, verdict), repeats)}


def main_graphs(args) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for R in (int(r) for r in args.graph_reqs.split(",")):
        for budget in (int(b) for b in args.graph_budgets.split(",")):
            rows.append(bench_graphs(budget, R, args.repeats, gen))
            print(f"{R} requests, budget {budget}: done", flush=True)
    cols = list(rows[0])
    share = args.verify_step_us is not None
    print(f"\nmedian µs per decode step of the tree pipeline (random bfloat16 logits, depth "
          f"{DEPTH}, vocab {VOCAB}; eager and CUDA-graph replay)\n")
    print("| " + " | ".join(cols) + (f" | graph share of a {args.verify_step_us:.0f}-µs "
                                     "verify step |" if share else " |"))
    print("|" + "---|" * (len(cols) + share))
    for r in rows:
        cells = [str(r["reqs"]), str(r["budget"])] + [f"{r[c]:.1f}" for c in cols[2:]]
        if share:
            cells.append(f"{100 * r['graph_pipeline'] / args.verify_step_us:.1f}%")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": "cuda", "mode": "graphs", "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reqs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--budgets", default="16,64,256,1024")
    parser.add_argument("--json", default=None)
    parser.add_argument("--graphs", action="store_true",
                        help="time the whole pipeline per step, eager and graph-replayed")
    parser.add_argument("--graph-reqs", default="1,8,32")
    parser.add_argument("--graph-budgets", default="64,256,1024")
    parser.add_argument("--verify-step-us", type=float, default=None,
                        help="a verify step's µs, for the pipeline's share of it")
    args = parser.parse_args()
    if args.graphs:
        if args.device != "cuda" or not torch.cuda.is_available():
            parser.error("--graphs needs --device cuda and a GPU (it replays CUDA graphs)")
        main_graphs(args)
        return
    dev, R = args.device, args.reqs
    gen = torch.Generator().manual_seed(0)
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        rows.append(bench_budget(budget, R, dev, args.repeats, gen))
        print(f"budget {budget}: done", flush=True)
    cols = list(rows[0])
    print(f"\nmedian µs per request ({R} requests, depth {DEPTH}, vocab {VOCAB}, {dev}, "
          f"{torch.get_num_threads()} threads)\n")
    print("| " + " | ".join(cols) + " | heap speed-up (python / topk) | on 1 thread |")
    print("|" + "---|" * (len(cols) + 2))
    for r in rows:
        cells = [str(r["budget"])] + [f"{r[c]:.2f}" for c in cols[1:]]
        speedup = r["python_heap_build"] / r["build_from_topk"]
        speedup_1 = r["python_heap_build"] / r["build_from_topk_1_thread"]
        print("| " + " | ".join(cells) + f" | {speedup:.0f}x | {speedup_1:.0f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "reqs": R, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
