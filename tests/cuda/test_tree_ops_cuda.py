"""The CUDA ops equal the CPU ops (the oracle) on the CPU suite's random cases, and the tree
pipeline (top-k ranking, build, verify, compaction) runs inside a captured CUDA graph (so
none syncs with the host)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree_build import build_cases, check_ranked_topk, jetspec_cases, lowest_ids_ranked
from test_tree_compact import (
    caches_of_two_geometries,
    compact_cases,
    compact_inputs,
    step_args,
)
from test_tree_verify import verify_cases
from tree_cases import follow_choices, random_topk, wide_trees

from vllm_ddtree import ops

CUDA = torch.device("cuda")


def to(device, *tensors):
    return [t.to(device) for t in tensors]


@settings(max_examples=1000, deadline=None)
@given(case=build_cases())
def test_build_cuda_equals_cpu(case) -> None:
    inputs = random_topk(case["seed"], case["num_reqs"], case["depth"], case["vocab"],
                         case["k"], case["ties"])
    want = ops.build_tree(*inputs, case["budget"], case["spine"])
    got = ops.build_tree(*to(CUDA, *inputs), case["budget"], case["spine"])
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name


@settings(max_examples=500, deadline=None)
@given(case=jetspec_cases())
def test_jetspec_build_cuda_equals_cpu(case) -> None:
    inputs = random_topk(case["seed"], case["num_reqs"], case["depth"], case["vocab"],
                         case["k"], case["ties"])
    args = (case["budget"], case["spine"], case["widths"])
    want = ops.build_tree(*inputs, *args)
    got = ops.build_tree(*to(CUDA, *inputs), *args)
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("depth, k", [(16, 1024), (64, 1024)])
@pytest.mark.parametrize("spine", [False, True])
def test_build_cuda_equals_cpu_at_the_largest_budget(depth, k, spine) -> None:
    # The kernel stages the top-k log-probs in shared memory where they fit: at depth 16 by
    # opting in past 48 KiB (105 KiB in all), at depth 64 they do not (297 KiB) and are read
    # from global memory.
    inputs = random_topk(depth * k, 3, depth, 2 * k, k, ties=False)
    want = ops.build_tree(*inputs, 1024, spine)
    got = ops.build_tree(*to(CUDA, *inputs), 1024, spine)
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name


@settings(max_examples=1000, deadline=None)
@given(case=verify_cases())
def test_verify_cuda_equals_cpu(case) -> None:
    inputs = random_topk(case["seed"], case["num_reqs"], case["depth"], case["vocab"],
                         case["k"], ties=False)
    trees = ops.build_tree(*inputs, case["budget"], case["spine"])
    choices = follow_choices(trees, case["seed"], case["p_follow"])
    want = ops.verify_tree(trees, choices, case["depth"])
    got = ops.verify_tree(ops.DraftTrees(*to(CUDA, *trees)), choices.to(CUDA), case["depth"])
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("num_nodes", [1025, 3000])
def test_verify_cuda_equals_cpu_on_a_wide_tree(num_nodes) -> None:
    # Staged in shared memory up to 2048 nodes, read from global memory past that.
    inputs = wide_trees(num_nodes)
    want = torch.ops.vllm_ddtree.verify_tree(*inputs, 4)
    assert want[1].tolist() == [2, 0]
    got = torch.ops.vllm_ddtree.verify_tree(*to(CUDA, *inputs), 4)
    for a, b in zip(want, got):
        assert torch.equal(a, b.cpu())


@settings(max_examples=300, deadline=None)
@given(case=compact_cases())
def test_compact_cuda_equals_cpu(case) -> None:
    cpu = compact_inputs(case)
    gpu = {k: ([c.to(CUDA) for c in v] if k == "kv_caches" else v.to(CUDA))
           for k, v in cpu.items()}
    for inputs in (cpu, gpu):
        torch.ops.vllm_ddtree.compact_tree(*inputs.values())
    for a, b in zip(cpu["kv_caches"], gpu["kv_caches"]):
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    assert torch.equal(cpu["hidden_states"], gpu["hidden_states"].cpu())


@settings(max_examples=100, deadline=None)
@given(case=compact_cases())
def test_compact_cuda_with_a_cache_listed_twice(case) -> None:
    # Cross-layer KV sharing lists one cache under two layers: it is compacted once, as the
    # CPU op (which copies every cache per path step) leaves it.
    inputs = compact_inputs(case)
    cache = inputs["kv_caches"][0]
    step = step_args(inputs)
    want = cache.clone()
    torch.ops.vllm_ddtree.compact_tree([want], torch.empty(0), *step)
    got = cache.to(CUDA)
    torch.ops.vllm_ddtree.compact_tree([got, got], torch.empty(0, device=CUDA),
                                       *to(CUDA, *step))
    assert torch.equal(want.view(torch.uint8), got.cpu().view(torch.uint8))


@settings(max_examples=50, deadline=None)
@given(case=compact_cases())
def test_compact_cuda_many_caches_of_two_geometries(case) -> None:
    # The CUDA op compacts the caches of one geometry in one launch, at most 64 at a time:
    # 140 caches of two geometries interleaved (70 each, two launches each), one listed
    # twice, end as the CPU op leaves them.
    inputs = compact_inputs(case)
    caches = caches_of_two_geometries(case, inputs, 140)
    step = step_args(inputs)
    want, want_hidden = [c.clone() for c in caches], inputs["hidden_states"].clone()
    torch.ops.vllm_ddtree.compact_tree(want, want_hidden, *step)
    got, got_hidden = [c.to(CUDA) for c in caches], inputs["hidden_states"].to(CUDA)
    torch.ops.vllm_ddtree.compact_tree(got + [got[7]], got_hidden, *to(CUDA, *step))
    assert torch.equal(want_hidden, got_hidden.cpu())
    for a, b in zip(want, got):
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))


def test_tree_positions_cuda_equals_cpu() -> None:
    seq_lens = torch.randint(0, 10_000, (7,))
    depths = torch.randint(0, 16, (7, 65), dtype=torch.int32)
    want = ops.tree_positions(seq_lens, depths)
    assert torch.equal(ops.tree_positions(seq_lens.to(CUDA), depths.to(CUDA)).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_ranked_cuda_equals_cpu(dtype) -> None:
    """On CUDA the log-probs are top-k logits minus a Triton log-sum-exp (no float32 copy
    of the logits); on CPU, log-softmax at the top-k ids. Both are held to float64: the
    CPU's float32 log-softmax is off by up to 1.9e-5 here (measured), the lane-blocked
    log-sum-exp by about 1.2e-6 (emulated on CPU), so CUDA != CPU at 1e-5 says nothing."""
    logits = (torch.randn(8, 15, 151936, generator=torch.Generator().manual_seed(0)) * 3
              ).to(dtype)
    want_values, want_ids = ops.topk_ranked(logits, 256)
    values, ids = ops.topk_ranked(logits.to(CUDA), 256)
    exact = torch.log_softmax(logits.double(), dim=-1).gather(-1, ids.cpu())
    torch.testing.assert_close(values.cpu().double(), exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(values.cpu(), want_values, rtol=0, atol=5e-5)
    # Ids agree wherever values are not within rounding of a neighbour's, nor of the k-th
    # value: which of the tokens tied at the cut make it is each device's topk's choice.
    distinct = ((want_values[..., 1:] - want_values[..., :-1]).abs() > 1e-4) & (
        (want_values[..., 1:] - want_values[..., -1:]).abs() > 1e-4)
    assert torch.equal(ids.cpu()[..., 1:][distinct], want_ids[..., 1:][distinct])


def test_topk_ranked_cuda_orders_ties_as_the_cpu_path() -> None:
    """Integer bfloat16 logits (many exact ties): the CUDA top-k keeps the lowest ids at a
    tied cut and its sort gives the CPU path's order, token for token."""
    x = torch.round(torch.randn(4, 15, 151936, generator=torch.Generator().manual_seed(1))
                    * 2).to(torch.bfloat16)
    want_values, want_ids = lowest_ids_ranked(x, 256)
    values, ids = ops.topk_ranked(x.to(CUDA), 256)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(values.cpu(), want_values, rtol=0, atol=5e-5)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 8),
       vocab=st.sampled_from([5000, 151936]), k=st.sampled_from([16, 256, 1000]),
       ties=st.booleans(), splits=st.integers(1, 40))
def test_ranked_topk_cuda_equals_the_cpu_path(seed, rows, vocab, k, ties, splits) -> None:
    """The CPU suite's property test of the Triton top-k on the GPU: more rows, Qwen3's
    vocabulary, up to 40 splits asked (32 taken); few k and vocabularies, as each pair
    compiles anew."""
    check_ranked_topk(seed, rows, vocab, k, ties, splits, CUDA)


@pytest.mark.parametrize("k", [16, 256, 1000, 1024])
@pytest.mark.parametrize("splits", [1, 5, 32])
def test_ranked_topk_cuda_splits_agree(k, splits) -> None:
    """A row split over 1 to 32 programs: the same tokens in the same order as the CPU
    reference (distinct float32 logits), whatever the split."""
    from vllm_ddtree.ranked_topk import ranked_topk

    x = torch.randn(3, 151936, generator=torch.Generator().manual_seed(k)) * 4
    want_values, want_ids = lowest_ids_ranked(x, k)
    values, ids = ranked_topk(x.to(CUDA), k, splits)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(values.cpu(), want_values, rtol=0, atol=2e-5)


@pytest.mark.parametrize("B", [64, 256, 1024])  # past 48 KiB of smem the build opts in
@pytest.mark.parametrize("spine", [False, True])
@pytest.mark.parametrize("widths", [[], [7]])  # best-first, JetSpec's
def test_tree_pipeline_captures_in_a_cuda_graph(B, spine, widths) -> None:
    """Top-k, the parallel build, verify and compaction replayed from one graph on new
    logits: the build equals the CPU op on the graph's own top-k, bit for bit."""
    R, L, V = 4, 15, 1000
    logits = torch.randn(R, L, V, device=CUDA)
    roots = torch.randint(0, V, (R,), device=CUDA)
    choices = torch.randint(0, V, (R, B + 1), device=CUDA)
    blocks = R * (B + 1) // 16 + 2
    cache = torch.randn(blocks, 2, 16, 32, device=CUDA)
    hidden = torch.randn(R * (B + 1), 8, device=CUDA)
    slots = torch.randperm(blocks * 16, device=CUDA)[: R * (B + 1)]
    qsl = torch.arange(R + 1, device=CUDA, dtype=torch.int32) * (B + 1)

    def step():
        logprobs, ids = ops.topk_ranked(logits, max(widths) if widths else B)
        trees = ops.build_tree(roots, logprobs, ids, B, spine, widths)
        # The target follows the first child twice, then its own random choice.
        target = torch.where(trees.depths < 2,
                             trees.token_ids.gather(1, trees.first_child.clamp(min=0).long()),
                             choices)
        verdict = ops.verify_tree(trees, target, L)
        ops.compact_tree([cache], hidden, slots, qsl, verdict)
        return logprobs, ids, trees, verdict

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logprobs, ids, trees, verdict = step()
    for seed in range(3):
        gen = torch.Generator(device=CUDA).manual_seed(seed)
        logits.copy_(torch.randn(R, L, V, device=CUDA, generator=gen) * (1 + 3 * seed))
        cache_before, hidden_before = cache.clone(), hidden.clone()
        graph.replay()
        torch.cuda.synchronize()
        want_trees = ops.build_tree(roots.cpu(), logprobs.cpu(), ids.cpu(), B, spine, widths)
        for name, a, b in zip(want_trees._fields, want_trees, trees):
            assert torch.equal(a, b.cpu()), name
        # The followed chain of two (a flat best-first tree may lack the second).
        assert (verdict.num_accepted >= (2 if spine else 1)).all()
        cpu_cache, cpu_hidden = cache_before.cpu(), hidden_before.cpu()
        ops.compact_tree([cpu_cache], cpu_hidden, slots.cpu(), qsl.cpu(),
                         ops.Verdict(*(t.cpu() for t in verdict)))
        assert torch.equal(cache.cpu(), cpu_cache) and torch.equal(hidden.cpu(), cpu_hidden)
