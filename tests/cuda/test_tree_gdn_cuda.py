"""The tree Gated DeltaNet kernels (vllm_ddtree/recurrent/triton_tree_gdn.py) on the GPU,
against the float64 reference that runs each node's path as a chain, at Qwen3.5 / Qwen3-Next
GDN shapes (16 key and 32 value heads of 128), with bf16 inputs and fp32 or bf16 states."""

from __future__ import annotations

import pytest
import torch
from gdn_cases import batch_of, gdn_inputs, paths_of, random_parents, random_path

from vllm_ddtree.recurrent import reference as ref
from vllm_ddtree.recurrent import triton_tree_gdn as tg


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kinds", [["random"] * 4, ["chain", "star", "deep", "random"]])
def test_tree_gdn_and_commit_on_the_gpu(kinds: list[str], state_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    trees = [random_parents(65 if k != "deep" else 16, g, k) for k in kinds]
    batch = batch_of(trees, num_slots=8, g=g)
    x = gdn_inputs(batch.parents.numel(), 16, 32, 128, 128, 8, g, torch.bfloat16)
    x["state"] = x["state"].to(state_dtype)
    dev = {k: v.cuda() for k, v in x.items()}
    parents, slots = batch.parents.cuda(), batch.slots.cuda()
    got = tg.tree_gdn(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], dev["state"],
                      parents, slots, 128 ** -0.5, max_depth=batch.depth)
    want = ref.tree_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], batch.parents,
                        batch.slots, 128 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), want, atol=3e-2, rtol=3e-2)
    paths = paths_of(batch, [random_path(t, g) for t in trees])
    request_slots = torch.tensor(batch.request_slots)
    state = dev["state"].clone()
    tg.commit_gdn(state, dev["k"], dev["v"], dev["g"], dev["beta"], paths.cuda(),
                  request_slots.cuda())
    for r, slot in enumerate(batch.request_slots):
        rows = paths[r][paths[r] >= 0]
        _, final = ref.gdn_chain(x["q"][rows], x["k"][rows], x["v"][rows], x["g"][rows],
                                 x["beta"][rows], x["state"][slot], 1.0)
        torch.testing.assert_close(state[slot].double().cpu(), final, atol=3e-2, rtol=3e-2)


def test_tree_conv_on_the_gpu() -> None:
    g = torch.Generator().manual_seed(1)
    trees = [random_parents(65, g) for _ in range(4)]
    batch = batch_of(trees, num_slots=6, g=g)
    T, C = batch.parents.numel(), 2 * 16 * 128 + 32 * 128
    x = torch.randn(T, C, generator=g).bfloat16()
    weight, conv_state = torch.randn(C, 4, generator=g).bfloat16(), torch.randn(
        6, C, 3 + 15, generator=g).bfloat16()
    offsets = torch.randint(0, 16, (T,), generator=g)
    got = tg.tree_conv(x.cuda(), weight.cuda(), None, conv_state.cuda(), batch.parents.cuda(),
                       batch.slots.cuda(), offsets=offsets.cuda())
    windows = torch.stack([conv_state[s, :, o:o + 3] for s, o in zip(batch.slots.tolist(),
                                                                    offsets.tolist())])
    want = ref.tree_conv(x, weight, None, windows, batch.parents, torch.arange(T))
    torch.testing.assert_close(got.double().cpu(), want, atol=3e-2, rtol=3e-2)
