"""The CUDA ops' own source (csrc/cuda/tree_ops.cu: launch code and kernels) run on CPU
threads by tests/cuda_emulator, against the CPU ops as the oracle, on the cases of the CUDA
suite (tests/cuda, which needs a GPU). What this shows: the kernels' indexing, shared-memory
layouts and sizes, barriers and launch configurations (the 48 KiB opt-in included) give the
CPU ops' results. What it cannot: timing, graph capture, the compiler's device code.

The build kernel runs both builds (best-first, JetSpec's) in parallel within a request where
the input allows (rank-sorted log-probs at most 0) and serially otherwise; the emulator
counts which ran, so the tests below show the path they exercise, at several block widths
(the emulator's cap on the kernel's threads: 32 for the many small cases, a GPU's 1024 for
the largest)."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from test_tree_build import build_cases, jetspec_cases
from test_tree_compact import (
    caches_of_two_geometries,
    compact_cases,
    compact_inputs,
    step_args,
)
from test_tree_verify import verify_cases
from tree_cases import follow_choices, num_prefixes, random_topk, wide_trees

from vllm_ddtree import ops


def assert_equal_outputs(want, got) -> None:
    """Equal bit for bit (NaN scores included)."""
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        if a.dtype == torch.float32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"


@contextmanager
def build_threads(emulated, threads: int):
    """The build kernel launched with at most ``threads`` per block; yields a function
    returning (parallel, serial) builds since the block began."""
    emulated.set_build_max_threads(threads)
    emulated.take_build_counts()
    counts = [0, 0]

    def taken() -> tuple[int, int]:
        parallel, serial = emulated.take_build_counts()
        counts[0] += parallel
        counts[1] += serial
        return counts[0], counts[1]

    try:
        yield taken
    finally:
        emulated.set_build_max_threads(1024)


def assert_build_equals_cpu(emulated, case) -> tuple[torch.Tensor, ...]:
    inputs = random_topk(case["seed"], case["num_reqs"], case["depth"], case["vocab"],
                         case["k"], case["ties"])
    args = (*inputs, case["budget"], case["spine"])
    assert_equal_outputs(torch.ops.vllm_ddtree.build_tree(*args), emulated.build_tree(*args))
    return inputs


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(case=build_cases())
def test_build_kernel_equals_cpu(emulated_cuda_ops, case) -> None:
    with build_threads(emulated_cuda_ops, 32) as taken:
        assert_build_equals_cpu(emulated_cuda_ops, case)
        parallel, serial = taken()
    # Sorted log-probs without ties at the threshold: always the parallel build.
    assert serial == 0 or case["ties"]
    assert parallel + serial == case["num_reqs"]


def assert_parallel_build_equals_cpu(emulated, threads: int, case) -> None:
    # More than one warp: the block scan across warps, the strided loops.
    with build_threads(emulated, threads) as taken:
        assert_build_equals_cpu(emulated, case)
        assert taken()[1] == 0 or case["ties"]


@pytest.mark.slow
@pytest.mark.parametrize("threads", [64, 256])
@settings(max_examples=40, deadline=None)
@given(case=build_cases())
def test_parallel_build_at_several_block_widths(emulated_cuda_ops, threads, case) -> None:
    assert_parallel_build_equals_cpu(emulated_cuda_ops, threads, case)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)  # the emulator takes about 2 s a case at 1024
@given(case=build_cases())
def test_parallel_build_at_the_widest_block(emulated_cuda_ops, case) -> None:
    """32 warps: the scan of the warps' sums fills a whole warp."""
    assert_parallel_build_equals_cpu(emulated_cuda_ops, 1024, case)


@pytest.mark.slow
def test_parallel_build_resolves_ties_by_the_tie_rule(emulated_cuda_ops) -> None:
    """Integer log-probs: prefixes of equal score under different parents, at every depth,
    which the parallel build orders by walking up the parents. Most requests take it (a
    score tied more times than its enumeration holds goes serial)."""
    with build_threads(emulated_cuda_ops, 64) as taken:
        for seed in range(40):
            depth, k = 2 + seed % 7, 4 + seed % 9
            assert_build_equals_cpu(emulated_cuda_ops, dict(
                seed=seed, num_reqs=2, depth=depth, vocab=17, k=k,
                budget=min(10 + 13 * seed, num_prefixes(depth, k)), ties=True,
                spine=seed % 2 == 0))
        parallel, serial = taken()
    assert parallel >= 60 and parallel + serial == 80, (parallel, serial)


@pytest.mark.parametrize("spoil", ["unsorted", "positive", "nan", "negative_zero"])
def test_build_kernel_goes_serial_on_input_the_parallel_build_cannot_take(
        emulated_cuda_ops, spoil) -> None:
    roots, logprobs, ids = random_topk(7, 3, 6, 40, 12, ties=False)
    if spoil == "unsorted":
        logprobs = logprobs.flip(-1).contiguous()
    elif spoil == "positive":
        logprobs = logprobs + 3.0
    elif spoil == "nan":
        logprobs[1, 2, 5] = float("nan")
    else:  # -0.0: sorted, not above 0, but the serial build's scores tell it from +0.0
        logprobs[1, :, 0] = -0.0
    with build_threads(emulated_cuda_ops, 64) as taken:
        for spine, widths in itertools.product((False, True), ([], [3, 2])):
            args = (roots, logprobs, ids, 100, spine, widths)
            assert_equal_outputs(torch.ops.vllm_ddtree.build_tree(*args),
                                 emulated_cuda_ops.build_tree(*args))
        parallel, serial = taken()
    # NaN and -0.0 spoil request 1 only.
    assert (parallel, serial) == ((8, 4) if spoil in ("nan", "negative_zero") else (0, 12))


@pytest.mark.slow
@pytest.mark.parametrize("depth, k", [(16, 1024), (64, 1024)])
@pytest.mark.parametrize("spine", [False, True])
def test_build_kernel_at_the_largest_budget(emulated_cuda_ops, depth, k, spine) -> None:
    # As a GPU launches it: 1024 threads, shared memory opted in past the 48 KiB default
    # (which the emulator refuses otherwise), the log-probs staged at depth 16 (224 KiB in
    # all) and read from global memory at depth 64.
    inputs = random_topk(depth * k, 2, depth, 2 * k, k, ties=False)
    want = torch.ops.vllm_ddtree.build_tree(*inputs, 1024, spine)
    with build_threads(emulated_cuda_ops, 1024) as taken:
        assert_equal_outputs(want, emulated_cuda_ops.build_tree(*inputs, 1024, spine))
        assert taken() == (2, 0)


@settings(max_examples=1000, deadline=None)
@given(case=verify_cases())
def test_verify_kernel_equals_cpu(emulated_cuda_ops, case) -> None:
    inputs = random_topk(case["seed"], case["num_reqs"], case["depth"], case["vocab"],
                         case["k"], ties=False)
    trees = ops.build_tree(*inputs, case["budget"], case["spine"])
    choices = follow_choices(trees, case["seed"], case["p_follow"])
    args = (trees.token_ids, trees.first_child, trees.next_sibling, choices, case["depth"])
    assert_equal_outputs(torch.ops.vllm_ddtree.verify_tree(*args),
                         emulated_cuda_ops.verify_tree(*args))


@pytest.mark.parametrize("num_nodes", [1025, 3000])  # staged in shared memory; not staged
def test_verify_kernel_on_a_wide_tree(emulated_cuda_ops, num_nodes) -> None:
    args = (*wide_trees(num_nodes), 4)
    want = torch.ops.vllm_ddtree.verify_tree(*args)
    assert want[1].tolist() == [2, 0]
    assert_equal_outputs(want, emulated_cuda_ops.verify_tree(*args))


def compacted(compact, inputs: dict, caches: list[torch.Tensor]) -> tuple:
    caches = [c.clone() for c in caches]
    hidden = inputs["hidden_states"].clone()
    compact(caches, hidden, *step_args(inputs))
    return caches, hidden


def assert_same_bits(want: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a.contiguous().view(torch.uint8),
                           b.contiguous().view(torch.uint8)), f"tensor {i} differs"


@settings(max_examples=300, deadline=None)
@given(case=compact_cases())
def test_compact_kernel_equals_cpu(emulated_cuda_ops, case) -> None:
    inputs = compact_inputs(case)
    caches = inputs["kv_caches"]
    want, want_hidden = compacted(torch.ops.vllm_ddtree.compact_tree, inputs, caches)
    got, got_hidden = compacted(emulated_cuda_ops.compact_tree, inputs, caches)
    assert_same_bits(want + [want_hidden], got + [got_hidden])


@settings(max_examples=3, deadline=None)  # R x 141 blocks of 256 threads
@given(case=compact_cases())
def test_compact_kernel_many_caches_of_two_geometries(emulated_cuda_ops, case) -> None:
    # One launch per geometry for up to 64 caches: 140 caches of two interleaved geometries
    # (two launches each), one listed twice (compacted once, as the CPU op leaves it).
    inputs = compact_inputs(case)
    caches = caches_of_two_geometries(case, inputs, 140)
    want, want_hidden = compacted(torch.ops.vllm_ddtree.compact_tree, inputs, caches)
    got, got_hidden = [c.clone() for c in caches], inputs["hidden_states"].clone()
    emulated_cuda_ops.compact_tree(got + [got[7]], got_hidden, *step_args(inputs))
    assert_same_bits(want + [want_hidden], got + [got_hidden])


def test_tree_positions_kernel_equals_cpu(emulated_cuda_ops) -> None:
    seq_lens = torch.randint(0, 10_000, (7,))
    depths = torch.randint(0, 16, (7, 300), dtype=torch.int32)  # 2100 positions: 17 blocks
    want = torch.ops.vllm_ddtree.tree_positions(seq_lens, depths)
    assert torch.equal(emulated_cuda_ops.tree_positions(seq_lens, depths), want)


def test_the_emulator_enforces_the_device_limits(emulated_cuda_ops) -> None:
    """Each rule the results above rely on is one the emulator can fail."""
    emulated_cuda_ops.fill_smem(48 * 1024, True)  # (re)sets the kernel's limit to the default
    emulated_cuda_ops.fill_smem(48 * 1024, False)
    with pytest.raises(RuntimeError, match="too many resources"):
        emulated_cuda_ops.fill_smem(48 * 1024 + 4, False)  # past the default, not opted in
    emulated_cuda_ops.fill_smem(100 * 1024, True)
    with pytest.raises(RuntimeError, match="emulated CUDA call failed"):
        emulated_cuda_ops.fill_smem(228 * 1024, True)  # past an H200's 227 KiB
    with pytest.raises(RuntimeError, match="wrote past its dynamic shared memory"):
        emulated_cuda_ops.write_past_smem(100)
    with pytest.raises(RuntimeError, match="reached from different places"):
        emulated_cuda_ops.divergent_sync()


def test_empty_batches(emulated_cuda_ops) -> None:
    # No request (or no node): the launch code must launch nothing, since an empty grid is
    # an invalid launch on a GPU (and in the emulator).
    roots, logprobs, ids = random_topk(0, 1, 4, 50, 8, ties=False)
    empty = (roots[:0], logprobs[:0], ids[:0], 16, True)
    want = torch.ops.vllm_ddtree.build_tree(*empty)
    assert want[0].shape == (0, 17)
    assert_equal_outputs(want, emulated_cuda_ops.build_tree(*empty))
    args = (want[0], want[3], want[4], want[0], 4)
    assert_equal_outputs(torch.ops.vllm_ddtree.verify_tree(*args),
                         emulated_cuda_ops.verify_tree(*args))
    cache = torch.randn(4, 2, 16, 8)
    step = (torch.arange(8), torch.zeros(1, dtype=torch.int32),
            torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    got = cache.clone()
    emulated_cuda_ops.compact_tree([got], torch.empty(0, 8), *step)
    assert torch.equal(got, cache)
    for shape in [(0, 5), (3, 0)]:
        depths = torch.zeros(shape, dtype=torch.int32)
        seq_lens = torch.zeros(shape[0], dtype=torch.long)
        assert emulated_cuda_ops.tree_positions(seq_lens, depths).shape == shape


def assert_jetspec_build_equals_cpu(emulated, case) -> None:
    inputs = random_topk(case["seed"], case["num_reqs"], case["depth"], case["vocab"],
                         case["k"], case["ties"])
    args = (*inputs, case["budget"], case["spine"], case["widths"])
    assert_equal_outputs(torch.ops.vllm_ddtree.build_tree(*args), emulated.build_tree(*args))


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(case=jetspec_cases())
def test_jetspec_build_kernel_equals_cpu(emulated_cuda_ops, case) -> None:
    with build_threads(emulated_cuda_ops, 32) as taken:
        assert_jetspec_build_equals_cpu(emulated_cuda_ops, case)
        parallel, serial = taken()
    assert serial == 0 or case["ties"]
    assert parallel + serial == case["num_reqs"]


@pytest.mark.slow
@pytest.mark.parametrize("threads", [64, 256])
@settings(max_examples=40, deadline=None)
@given(case=jetspec_cases())
def test_parallel_jetspec_build_at_several_block_widths(emulated_cuda_ops, threads,
                                                        case) -> None:
    with build_threads(emulated_cuda_ops, threads) as taken:
        assert_jetspec_build_equals_cpu(emulated_cuda_ops, case)
        assert taken()[1] == 0 or case["ties"]


@pytest.mark.parametrize("spine", [False, True])
def test_jetspec_build_kernel_at_the_largest_budget(emulated_cuda_ops, spine) -> None:
    # JetSpec's default shape: width 7 at every depth, depth 16, budget 1024, 1024 threads.
    inputs = random_topk(5, 2, 16, 2000, 7, ties=False)
    want = torch.ops.vllm_ddtree.build_tree(*inputs, 1024, spine, [7])
    with build_threads(emulated_cuda_ops, 1024) as taken:
        assert_equal_outputs(want, emulated_cuda_ops.build_tree(*inputs, 1024, spine, [7]))
        assert taken() == (2, 0)
