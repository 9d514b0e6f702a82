"""Tree attention, both implementations (the Triton kernel under TRITON_INTERPRET=1, and the
CPU path's torch ops), against a dense float64 reference: dtypes, head sizes, GQA, page
sizes, tree shapes, contexts across block boundaries, batches mixing tree, prefill and decode
requests, sliding windows and attention sinks."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_cases import SHAPES, dense_reference, make_batch

from vllm_ddtree.attention import triton_tree_attention as tta
from vllm_ddtree.attention.torch_tree_attention import tree_attention_torch
from vllm_ddtree.attention.triton_tree_attention import SWEPT_CONFIGS, tree_attention

IMPLS = {"triton": tree_attention, "torch": tree_attention_torch}
# Max abs error against the float64 reference: fp32 is exact up to summation order; bf16
# output and probabilities carry 8 mantissa bits (values are O(1)).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def run(impl: str, batch, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    IMPLS[impl](batch.query, batch.key_cache, batch.value_cache, out, batch.block_table,
                batch.seq_lens, batch.query_start_loc, batch.tree_index, batch.ancestor_mask,
                batch.scale, depths=batch.depths, **kwargs)
    return out


CASES = [  # (kinds, num_nodes, context lengths): crossing and landing on block boundaries
    (["chain"], 16, [31]),
    (["star"], 17, [32]),
    (["deep"], 33, [0]),
    (["bushy"], 65, [47]),
    (["bushy", "prefill", "decode", "chain"], 20, [37, 5, 70, 0]),
    (["decode", "star", "prefill", "deep", "bushy"], 9, [1, 16, 0, 95, 64]),
    (["prefill", "decode"], 5, [3, 33]),  # no tree in the batch at all
]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("dtype, head_size, heads, page", [
    (torch.float32, 64, (4, 4), 16),
    (torch.float32, 128, (8, 2), 32),
    (torch.bfloat16, 64, (8, 2), 16),
    (torch.bfloat16, 128, (4, 1), 32),
])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_dense_reference(impl, dtype, head_size, heads, page, case) -> None:
    kinds, num_nodes, contexts = CASES[case]
    batch = make_batch(case, kinds, num_nodes, contexts, heads[0], heads[1], head_size, page,
                       dtype)
    err = (run(impl, batch).double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err}"


def sinks_for(batch, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch.query.shape[1], generator=gen) * 2).to(batch.query.dtype)


# (sliding window, sinks): a window of 1 sees only the query's own position (no ancestor);
# of 3, a deep node loses its upper ancestors and every node most of the context; of 24,
# long contexts are cut.
WINDOW_SINKS = [(1, False), (3, False), (24, True), (None, True)]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("dtype, head_size, heads, page", [
    (torch.float32, 64, (8, 2), 16),
    (torch.bfloat16, 128, (4, 1), 32),
])
@pytest.mark.parametrize("window, with_sinks", WINDOW_SINKS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_window_and_sinks_match_dense_reference(impl, dtype, head_size, heads, page, window,
                                                with_sinks, case) -> None:
    kinds, num_nodes, contexts = CASES[case]
    batch = make_batch(case, kinds, num_nodes, contexts, heads[0], heads[1], head_size, page,
                       dtype)
    sinks = sinks_for(batch, case) if with_sinks else None
    got = run(impl, batch, sliding_window=window, sinks=sinks)
    err = (got.double() - dense_reference(batch, window, sinks)).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err}"


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_wrong_window_or_sink_is_caught(impl) -> None:
    # Off by one position, or sinks left out: the comparison notices.
    batch = make_batch(4, ["deep", "prefill"], 12, [40, 30], 4, 2, 64, 16, torch.float32)
    sinks = sinks_for(batch, 1)
    want = dense_reference(batch, 8, sinks)
    assert (run(impl, batch, sliding_window=8, sinks=sinks).double() - want).abs().max() <= 1e-4
    assert (run(impl, batch, sliding_window=9, sinks=sinks).double() - want).abs().max() > 1e-2
    assert (run(impl, batch, sliding_window=8).double() - want).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("splits, tile_n", [(2, 16), (4, 32), (8, 16)])
def test_window_and_sinks_with_split_keys(splits, tile_n) -> None:
    # Splits share out the window's keys only; the sink enters one split's sum, once.
    batch = make_batch(6, ["decode", "bushy", "prefill", "deep", "star"], 24,
                       [3, 90, 50, 130, 17], 8, 2, 64, 16, torch.float32)
    sinks = sinks_for(batch, 2)
    for window in (5, 40, None):
        out = torch.full_like(batch.query, float("nan"))
        tree_attention(batch.query, batch.key_cache, batch.value_cache, out,
                       batch.block_table, batch.seq_lens, batch.query_start_loc,
                       batch.tree_index, batch.ancestor_mask, batch.scale,
                       sliding_window=window, sinks=sinks, depths=batch.depths,
                       tile_n=tile_n, num_splits=splits)
        err = (out.double() - dense_reference(batch, window, sinks)).abs().max().item()
        assert err <= TOLERANCE[torch.float32], (window, err)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_visible_sibling_is_caught(impl) -> None:
    # The comparison must notice a mask that is wrong in a single bit: node 2 of a star
    # (a sibling of node 1) made visible to node 1.
    batch = make_batch(3, ["star"], 8, [20], 4, 2, 64, 16, torch.float32)
    want = dense_reference(batch)
    assert (run(impl, batch).double() - want).abs().max() <= TOLERANCE[torch.float32]
    batch.ancestor_mask[0, 1, 0] |= 1 << 2
    err = (run(impl, batch).double() - want).abs()
    assert err[1].max() > 1e-2, "a wrong mask went unnoticed"
    assert err[[0, 2, 3, 4, 5, 6, 7]].max() <= TOLERANCE[torch.float32]  # only node 1 moved


def test_both_implementations_agree_on_many_random_batches() -> None:
    for seed, (a, b) in enumerate(itertools.product(SHAPES + ("prefill", "decode"), repeat=2)):
        gen = torch.Generator().manual_seed(seed)
        contexts = torch.randint(0, 80, (2,), generator=gen).tolist()
        batch = make_batch(seed, [a, b], 1 + seed % 40, contexts, 4, 2, 32, 16, torch.float32)
        want = dense_reference(batch)
        for impl in IMPLS:
            assert (run(impl, batch).double() - want).abs().max() <= 1e-4, (impl, a, b)


def test_torch_path_pads_requests_of_similar_length_into_one_group(monkeypatch) -> None:
    # Four requests of 52-58 keys share one padded group: the prefill's 5 query rows are
    # padded to 12 and three requests' keys to 58, and padding must stay hidden. The request
    # of 312 keys would make the padding cost more than PADDING_SLACK, so it goes alone.
    from vllm_ddtree.attention import torch_tree_attention
    from vllm_ddtree.attention.torch_tree_attention import plan_tree_groups

    batch = make_batch(1, ["bushy", "chain", "prefill", "deep", "star"], 12,
                       [40, 46, 50, 300, 44], 4, 2, 32, 16, torch.float32)
    assert batch.query_start_loc.diff().tolist() == [12, 12, 5, 12, 12]

    def plan() -> list[tuple[tuple[int, int], int]]:
        groups = plan_tree_groups(batch.query_start_loc, batch.seq_lens, batch.block_table,
                                  batch.tree_index, batch.ancestor_mask, list(range(5)), 16, 4)
        return [(tuple(g.query_rows.shape), g.num_keys) for g in groups]

    assert plan() == [((4, 12), 58), ((1, 12), 312)]
    err = (run("torch", batch).double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], err
    # Capped at two requests' scores (4 heads x 12 rows x up to 58 keys each), the four
    # make two groups of two.
    monkeypatch.setattr(torch_tree_attention, "GROUP_MAX_SCORES", 2 * 4 * 12 * 58)
    assert plan() == [((2, 12), 55), ((2, 12), 58), ((1, 12), 312)]
    err = (run("torch", batch).double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], err


def test_rejects_heads_not_a_multiple_of_kv_heads() -> None:
    batch = make_batch(0, ["chain"], 4, [3], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="argument 'query' has 3 heads"):
        run("triton", batch.__class__(**{**batch.__dict__, "query": batch.query[:, :3]}))


@pytest.mark.parametrize("block_m, tile_n, page, heads, splits", [
    (16, 16, 32, (8, 2), 1), (32, 64, 16, (8, 2), 1), (64, 32, 32, (8, 2), 1),
    (16, 32, 16, (6, 2), 1),  # 3 query heads per KV head: 5 tokens x 3 heads fill 15 of 16 rows
    (16, 32, 16, (32, 1), 1),  # 32 query heads per KV head: the tile grows to 32 rows
    (16, 32, 16, (8, 2), 2), (16, 16, 16, (6, 2), 4), (32, 32, 32, (8, 2), 8),
    (16, 16, 16, (4, 4), 16),  # more splits than some requests have key tiles
])
def test_kernel_tile_sizes_and_splits(block_m, tile_n, page, heads, splits) -> None:
    # Key tiles smaller than, equal to and spanning several pages; query tiles of any size,
    # packing the query heads of one KV head however many there are; keys split across
    # programs and merged.
    batch = make_batch(5, ["decode", "star", "prefill", "deep", "bushy"], 40, [1, 16, 0, 95, 64],
                       heads[0], heads[1], 64, page, torch.float32)
    out = torch.full_like(batch.query, float("nan"))
    tree_attention(batch.query, batch.key_cache, batch.value_cache, out, batch.block_table,
                   batch.seq_lens, batch.query_start_loc, batch.tree_index,
                   batch.ancestor_mask, batch.scale, block_m=block_m, tile_n=tile_n,
                   num_splits=splits)
    assert (out.double() - dense_reference(batch)).abs().max() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_keys_match_dense_reference_in_bf16(case) -> None:
    kinds, num_nodes, contexts = CASES[case]
    batch = make_batch(case, kinds, num_nodes, [c + 200 for c in contexts], 8, 2, 128, 16,
                       torch.bfloat16)
    out = torch.full_like(batch.query, float("nan"))
    tree_attention(batch.query, batch.key_cache, batch.value_cache, out, batch.block_table,
                   batch.seq_lens, batch.query_start_loc, batch.tree_index,
                   batch.ancestor_mask, batch.scale, num_splits=4)
    err = (out.double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], f"max abs error {err}"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_splits=3), "argument 'num_splits' must be a power of 2"),
    (dict(tile_n=8), "argument 'tile_n' must be a power of 2 of at least 16"),
    (dict(block_m=24), "argument 'block_m' must be a power of 2 of at least 16"),
    (dict(sliding_window=0), "argument 'sliding_window' must be at least 1"),
    (dict(sliding_window=4, depths=None), "argument 'depths' is needed"),
    (dict(sinks=torch.zeros(3)), r"argument 'sinks' must have shape \(4,\)"),
])
def test_rejects_bad_tiles_and_split_counts(kwargs, message) -> None:
    # The interpreter would run tile_n=8; the GPU compiler rejects it (check_triton_compile).
    batch = make_batch(0, ["chain"], 4, [3], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        tree_attention(batch.query, batch.key_cache, batch.value_cache,
                       torch.empty_like(batch.query), batch.block_table, batch.seq_lens,
                       batch.query_start_loc, batch.tree_index, batch.ancestor_mask,
                       batch.scale, **{"depths": batch.depths, **kwargs})


def test_auto_splits_fill_the_gpu_from_shapes_alone(monkeypatch) -> None:
    # 132 multiprocessors (an H200) and 4 programs each: few programs are split (at most 4
    # ways), a full grid is not, and off CUDA nothing is.
    monkeypatch.setattr(tta, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert [tta.auto_splits(p, cuda) for p in (1, 24, 144, 264, 265, 600)] == [4, 4, 2, 2, 1, 1]
    assert tta.auto_splits(24, torch.device("cpu")) == 1


@pytest.mark.parametrize("dtype, window, tiles", [
    (torch.bfloat16, None, (tta.BLOCK_M, tta.TILE_N)),
    (torch.bfloat16, 8, (tta.SMALL_BLOCK_M, tta.SMALL_TILE_N)),
    (torch.float32, None, (tta.SMALL_BLOCK_M, tta.SMALL_TILE_N)),
])
def test_default_tiles(monkeypatch, dtype, window, tiles) -> None:
    # The launch the backend makes (no tiles named): 64 x 64, but 16 x 32 for a windowed
    # layer or fp32 (see the module's constants for the measurements behind them).
    launches = []
    monkeypatch.setattr(tta, "_tree_attention_kernel", type("Recorder", (), {
        "__getitem__": lambda self, grid: lambda *args, **kw: launches.append(kw)})())
    batch = make_batch(0, ["chain"], 4, [3], 4, 2, 32, 16, dtype)
    tree_attention(batch.query, batch.key_cache, batch.value_cache,
                   torch.empty_like(batch.query), batch.block_table, batch.seq_lens,
                   batch.query_start_loc, batch.tree_index, batch.ancestor_mask, batch.scale,
                   sliding_window=window, depths=batch.depths)
    (launch,) = launches
    assert (launch["BLOCK_M"], launch["TILE_N"], launch["NUM_SPLITS"]) == (*tiles, 1)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_cache_of_over_2_31_elements(impl) -> None:
    # A GPU's KV cache easily holds more than 2**31 elements: a block's offset must not wrap
    # around in int32 (it did: a segfault here, an illegal access on a GPU). The cache is
    # allocated lazily: only the blocks written below take memory.
    batch = make_batch(0, ["bushy", "decode"], 9, [20, 5], 2, 1, 64, 16, torch.bfloat16)
    skip = 2**31 // batch.key_cache[0].numel() + 7
    for name in ("key_cache", "value_cache"):
        small = getattr(batch, name)
        big = torch.empty(skip + small.shape[0], *small.shape[1:], dtype=small.dtype)
        big[skip:] = small
        setattr(batch, name, big)
    batch.block_table += skip
    err = (run(impl, batch).double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], f"max abs error {err}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_the_largest_tree_matches_dense_reference(impl) -> None:
    # tree_budget 1024: 1,025 nodes, 33 mask words per node; a deep chain and a bushy tree
    # in one batch, beside a decode, over contexts across blocks.
    batch = make_batch(9, ["deep", "decode", "bushy"], 1025, [50, 7, 33], 2, 1, 32, 16,
                       torch.float32)
    assert batch.ancestor_mask.shape[-1] == 33
    err = (run(impl, batch).double() - dense_reference(batch)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err}"


@pytest.mark.slow
@pytest.mark.parametrize("shape, context", [("qwen3-8b", 20), ("gpt-oss", 140)])
def test_bench_tree_attention_runs(tmp_path, shape: str, context: int) -> None:
    # The GPU benchmark's code path, tiny, on the interpreter: a device run must not be the
    # first to execute it. Its own check (kernel, all causal, == SDPA) runs first; gpt-oss's
    # context reaches past its 128-position window.
    script = Path(__file__).resolve().parents[2] / "scripts/bench_tree_attention.py"
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--shape", shape, "--contexts",
         str(context), "--reqs", "2", "--budgets", "4", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["sdpa_max_abs_diff"] <= TOLERANCE[torch.bfloat16]
    assert row["tree_ms"] > 0 and row["sdpa_causal_ms"] > 0
    if shape == "gpt-oss":
        assert row["shape"]["window"] == 128 and row["tree_no_window_ms"] > 0
    else:
        assert len(row["configs_ms"]) == len(SWEPT_CONFIGS)


@pytest.mark.slow
@pytest.mark.scheduled_first
@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_kernels_compile_for_hopper_and_blackwell(arch: str) -> None:
    """The interpreter runs what the GPU compiler may reject: scripts/check_triton_compile.py
    compiles every kernel as the backend and the benchmark launch it, for sm_90 and sm_100
    (a test each: six minutes each on an empty Triton cache), to cubins, and checks their
    shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "scripts/check_triton_compile.py"
    result = subprocess.run([sys.executable, str(script), "--targets", arch.removeprefix("sm_")],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    for kernel in ("_tree_attention_kernel", "_merge_splits", "_partial_topk_kernel",
                   "_ranked_topk_kernel", "_tree_conv_kernel", "_tree_gdn_kernel",
                   "_commit_gdn_kernel", "_commit_conv_kernel"):
        assert any(line.startswith(f"ok   {arch} {kernel} ") for line in compiled), kernel
    assert all(line.startswith(f"ok   {arch} ") for line in compiled)


def test_varlen_decode_graph_layout_matches_dense_reference() -> None:
    """Adaptive trees' verify step as a varlen FULL decode graph replays it (TREE_ATTN
    declares lengths 1..tree_budget + 1 a request): each request verifies a prefix of its
    tree, its length only in query_start_loc, the tokens padded to the graph's size and
    the requests with empty ones. The real rows are the dense reference's. (The Triton
    kernel: the CPU's torch path runs no graphs, so never sees padding.)"""
    import dataclasses

    kinds, num_nodes = ["bushy", "deep", "chain", "star", "bushy"], 17
    full = make_batch(7, kinds, num_nodes, [37, 5, 70, 0, 16], 8, 2, 64, 16, torch.float32)
    keep = [17, 1, 9, 4, 12]  # each request's verified prefix (1: the root alone)
    starts = full.query_start_loc.tolist()
    rows = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, keep)])
    context = [int(s) - num_nodes for s in full.seq_lens]
    trimmed = dataclasses.replace(
        full, query=full.query[rows],
        seq_lens=torch.tensor([c + k for c, k in zip(context, keep)], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *keep]).cumsum(0).to(torch.int32))
    pad_tokens, pad_reqs = 11, 3
    real = trimmed.query.shape[0]
    padded = dataclasses.replace(
        trimmed,
        query=torch.cat([trimmed.query, torch.randn(pad_tokens, *trimmed.query.shape[1:])]),
        block_table=torch.cat([trimmed.block_table,
                               torch.zeros(pad_reqs, trimmed.block_table.shape[1],
                                           dtype=torch.int32)]),
        seq_lens=torch.cat([trimmed.seq_lens, torch.zeros(pad_reqs, dtype=torch.int32)]),
        query_start_loc=torch.cat([trimmed.query_start_loc,
                                   torch.full((pad_reqs,), real, dtype=torch.int32)]),
        tree_index=torch.cat([trimmed.tree_index, torch.full((pad_reqs,), -1,
                                                             dtype=torch.int32)]))
    err = (run("triton", padded)[:real].double() - dense_reference(trimmed)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err}"
