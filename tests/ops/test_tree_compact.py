"""compact_tree: accepted nodes' KV entries (paged caches of any vLLM 0.32 layout) and hidden
rows land bit-identical in the slots right after the root; nothing else is touched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import follow_choices, random_topk

from vllm_ddtree import ops, reference

# Physical orders of a layer's logical [num_blocks, heads, block_size, C] view, as in
# vllm/v1/kv_cache_layout.py (the layer axis dropped): BHNC and BNHC.
LAYOUTS = {"BHNC": (0, 1, 2, 3), "BNHC": (0, 2, 1, 3)}


def make_cache(gen, num_blocks, heads, block_size, width, dtype, layout) -> torch.Tensor:
    physical = [num_blocks, heads, block_size, width]
    order = LAYOUTS[layout]
    data = torch.randn([physical[i] for i in order], generator=gen).to(dtype)
    inverse = [order.index(i) for i in range(4)]
    return data.permute(inverse)  # logical view, physical strides


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@st.composite
def compact_cases(draw):
    return dict(seed=draw(st.integers(0, 2**32 - 1)), num_reqs=draw(st.integers(1, 5)),
                depth=draw(st.integers(1, 16)),
                budget=draw(st.sampled_from([1, 3, 8, 20, 40, 64])),
                walked=draw(st.booleans()),  # else any increasing paths, deep ones common
                block_size=draw(st.sampled_from([16, 32])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16,
                                            torch.float8_e4m3fn])),
                layout=draw(st.sampled_from(sorted(LAYOUTS))),
                p_follow=draw(st.sampled_from([0.3, 0.9, 1.0])),
                plain=draw(st.integers(0, 2)))  # requests without a tree (prefill/decode)


def compact_inputs(case: dict) -> dict:
    """Caches, hidden rows and a verify step's bookkeeping for a random batch: tree requests
    with accepted paths, mixed with requests without a tree. Paths are walked (real build +
    verify), or with case["walked"] false any increasing node indices (all compaction
    relies on: parents precede children), which move nodes from every path position; walks
    on these random trees seldom move one from deeper than position 4."""
    gen = torch.Generator().manual_seed(case["seed"])
    R, depth = case["num_reqs"], case["depth"]
    B = min(case["budget"], sum(8 ** d for d in range(1, depth + 1)))
    if case["walked"]:
        roots, logprobs, ids = random_topk(case["seed"], R, depth, 8, 8, ties=False)
        trees = ops.build_tree(roots, logprobs, ids, B, spine=False)
        verdict = ops.verify_tree(trees, follow_choices(trees, case["seed"], case["p_follow"]),
                                  depth)
        accepted, num_accepted = verdict.accepted, verdict.num_accepted
    else:
        accepted, num_accepted = increasing_paths(gen, R, depth, B)
    lens = [B + 1] * R + [int(torch.randint(1, 9, (), generator=gen))
                          for _ in range(case["plain"])]
    order = torch.randperm(len(lens), generator=gen).tolist()
    pad = torch.full((case["plain"], depth), -1, dtype=torch.int32)
    bs = case["block_size"]
    total = sum(lens)
    num_blocks = total // bs + 3
    return dict(
        kv_caches=[make_cache(gen, num_blocks, 2, bs, 16, case["dtype"], case["layout"])
                   for _ in range(2)],
        hidden_states=torch.randn(total, 24, generator=gen).to(torch.bfloat16),
        slot_mapping=torch.randperm(num_blocks * bs, generator=gen)[:total],
        query_start_loc=torch.tensor([0] + [lens[i] for i in order]).cumsum(0).to(torch.int32),
        accepted=torch.cat([accepted, pad])[order],
        num_accepted=torch.cat([num_accepted,
                                torch.zeros(case["plain"], dtype=torch.int32)])[order])


def increasing_paths(gen: torch.Generator, num_reqs: int, depth: int, budget: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted paths of num_reqs requests as verify_tree gives them (node indices padded
    with -1 to `depth`, and counts): each a random increasing run of indices in 1..budget,
    the first request's as long as can be (min(depth, budget)), the others' of any length
    up to that."""
    accepted = torch.full((num_reqs, depth), -1, dtype=torch.int32)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    longest = min(depth, budget)
    for r in range(num_reqs):
        n = longest if r == 0 else int(torch.randint(0, longest + 1, (), generator=gen))
        nodes = torch.randperm(budget, generator=gen)[:n].sort().values + 1
        accepted[r, :n], num_accepted[r] = nodes, n
    return accepted, num_accepted


def step_args(inputs: dict) -> list[torch.Tensor]:
    """compact_tree's arguments after the caches and hidden rows, from compact_inputs."""
    return [inputs[k] for k in ("slot_mapping", "query_start_loc", "accepted", "num_accepted")]


def caches_of_two_geometries(case: dict, inputs: dict, count: int) -> list[torch.Tensor]:
    """`count` caches for compact_inputs' slots, of two geometries interleaved: the case's
    (as inputs' caches) and a float32 BNHC one with other heads and widths."""
    gen = torch.Generator().manual_seed(case["seed"])
    num_blocks, _, block_size, _ = inputs["kv_caches"][0].shape
    geometries = [(2, 16, case["dtype"], case["layout"]), (4, 8, torch.float32, "BNHC")]
    return [make_cache(gen, num_blocks, heads, block_size, width, dtype, layout)
            for i in range(count) for heads, width, dtype, layout in [geometries[i % 2]]]


@settings(max_examples=400, deadline=None)
@given(case=compact_cases())
def test_compact_moves_accepted_entries_and_nothing_else(case) -> None:
    inputs = compact_inputs(case)
    caches, hidden = inputs["kv_caches"], inputs["hidden_states"]
    slot_mapping, query_start_loc = inputs["slot_mapping"], inputs["query_start_loc"]
    accepted, num_accepted = inputs["accepted"], inputs["num_accepted"]
    bs, num_blocks = case["block_size"], caches[0].shape[0]
    lens = query_start_loc.diff().tolist()
    total = int(query_start_loc[-1])
    before = [c.clone() for c in caches], hidden.clone()
    want_caches, want_hidden = [c.clone() for c in caches], hidden.clone()
    reference.compact_tree(want_caches, want_hidden, slot_mapping, query_start_loc,
                           accepted, num_accepted)
    ops.compact_tree(caches, hidden, slot_mapping, query_start_loc,
                     ops.Verdict(accepted, num_accepted, None))
    for got, want in zip(caches, want_caches):
        assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(hidden), bits(want_hidden))

    # Direct statement of the contract, independent of the reference.
    moved_slots, moved_rows = set(), set()
    for r in range(len(lens)):
        start = int(query_start_loc[r])
        for j in range(int(num_accepted[r])):
            src, dst = start + int(accepted[r, j]), start + j + 1
            moved_rows.add(dst)
            s, d = int(slot_mapping[src]), int(slot_mapping[dst])
            moved_slots.add(d)
            for old, new in zip(before[0], caches):
                assert torch.equal(bits(new[d // bs, :, d % bs]), bits(old[s // bs, :, s % bs]))
            assert torch.equal(bits(hidden[dst]), bits(before[1][src]))
    for old, new in zip(before[0], caches):
        for slot in range(num_blocks * bs):
            if slot not in moved_slots:
                assert torch.equal(bits(new[slot // bs, :, slot % bs]),
                                   bits(old[slot // bs, :, slot % bs]))
    untouched = [i for i in range(total) if i not in moved_rows]
    assert torch.equal(bits(hidden[untouched]), bits(before[1][untouched]))


def test_in_order_path_copies_nothing() -> None:
    cache = torch.arange(2 * 1 * 16 * 4, dtype=torch.float32).reshape(2, 1, 16, 4)
    hidden = torch.arange(12.0).reshape(4, 3)
    before = cache.clone(), hidden.clone()
    # A chain: nodes 1, 2, 3 accepted are already at rows/slots 1, 2, 3.
    verdict = ops.Verdict(torch.tensor([[1, 2, 3]], dtype=torch.int32),
                          torch.tensor([3], dtype=torch.int32), None)
    ops.compact_tree([cache], hidden, torch.tensor([5, 6, 7, 8]),
                     torch.tensor([0, 4], dtype=torch.int32), verdict)
    assert torch.equal(cache, before[0]) and torch.equal(hidden, before[1])


def args(**change):
    base = dict(kv_caches=[torch.zeros(2, 1, 16, 4)], hidden_states=torch.zeros(4, 3),
                slot_mapping=torch.arange(4), query_start_loc=torch.tensor([0, 4]),
                accepted=torch.tensor([[2, -1]], dtype=torch.int32),
                num_accepted=torch.tensor([1], dtype=torch.int32))
    return list((base | change).values())


@settings(max_examples=100, deadline=None)
@given(case=compact_cases())
def test_a_cache_listed_twice_is_compacted_as_once(case) -> None:
    # Cross-layer KV sharing lists one cache under two layers (the CUDA op's twin test is
    # in tests/cuda).
    inputs = compact_inputs(case)
    step = step_args(inputs)
    once, twice = inputs["kv_caches"][0], inputs["kv_caches"][0].clone()
    torch.ops.vllm_ddtree.compact_tree([once], torch.empty(0), *step)
    torch.ops.vllm_ddtree.compact_tree([twice, twice], torch.empty(0), *step)
    assert torch.equal(bits(once), bits(twice))


@pytest.mark.parametrize("change, message", [
    (dict(accepted=torch.tensor([[9, -1]], dtype=torch.int32)), "argument 'accepted'"),
    (dict(accepted=torch.tensor([[0, -1]], dtype=torch.int32)), "argument 'accepted'"),
    (dict(num_accepted=torch.tensor([3], dtype=torch.int32)), "argument 'num_accepted'"),
    (dict(slot_mapping=torch.tensor([0, 1, 99, 3])), "argument 'slot_mapping'"),
    (dict(slot_mapping=torch.tensor([0, 1])), "argument 'slot_mapping'"),
    (dict(slot_mapping=torch.zeros(0, dtype=torch.long)), "argument 'slot_mapping' must not be"),
    (dict(kv_caches=[torch.zeros(2, 16, 4)]), "argument 'kv_caches'"),
    (dict(query_start_loc=torch.tensor([0, 2, 4])), "argument 'query_start_loc'"),
    (dict(query_start_loc=torch.tensor([-2, 4])), "argument 'query_start_loc' must be non-neg"),
    (dict(accepted=torch.tensor([[2, -1]])), "argument 'accepted' has wrong dtype"),
    (dict(hidden_states=torch.zeros(2, 3)), "argument 'hidden_states'"),
    (dict(num_accepted=torch.tensor([1], dtype=torch.int32, device="meta")),
     "argument 'num_accepted' must be on cpu"),
])
def test_compact_rejects_bad_input_by_name(change, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.vllm_ddtree.compact_tree(*args(**change))


def test_the_runner_compacts_a_cache_group_as_its_attention_lays_it_out() -> None:
    # The CUDA backend's caches are compacted as plain views, CPU_ATTN's through its
    # packing; a group attending through anything else, or through two layouts, is refused
    # by name rather than compacted in the wrong layout.
    from types import SimpleNamespace

    from vllm_ddtree.attention.backend import TreeAttentionImpl
    from vllm_ddtree.attention.cpu_backend import CPUAttnCompaction, TreeAttentionCPUImpl
    from vllm_ddtree.spec_decode.accepted_path import kv_compaction

    def layer(cls: type) -> SimpleNamespace:
        return SimpleNamespace(impl=cls.__new__(cls), isa="vec")

    cache = torch.zeros(4, 2, 16, 64)
    assert callable(kv_compaction([(layer(TreeAttentionImpl), cache)]))
    assert isinstance(kv_compaction([(layer(TreeAttentionCPUImpl), cache)]), CPUAttnCompaction)

    class OtherImpl:
        pass

    for impls in ([OtherImpl], [TreeAttentionImpl, TreeAttentionCPUImpl]):
        with pytest.raises(RuntimeError, match="OtherImpl|TreeAttentionCPUImpl"):
            kv_compaction([(layer(cls), cache) for cls in impls])
