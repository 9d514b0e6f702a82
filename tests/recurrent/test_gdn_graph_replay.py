"""The GDN tree path under a CUDA graph, emulated on CPU (vllm_ddtree/recurrent/gdn_verify.py).

A CUDA graph replays the device work its capture recorded, at the tensors the capture used,
and none of the Python around it. The emulation records the same: every aten op run inside
``spec_forward`` (torch's dispatch) and every Triton launch (the kernels on the interpreter),
with the tensors they read and wrote; a replay runs them again and writes each op's results
into the tensors the capture allocated. Then, step after step, the engine's Python side runs
as it does around a replay (``begin_step`` before it, ``commit`` after it) with new trees,
new verdicts and new metadata written into the same buffers: the outputs, committed states
and conv windows must equal an eager step's. A host read inside the step (``.item()``, a
data-dependent shape) would be recorded as an op that a graph cannot hold: there is none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_gdn_verify import CONV, HV, SPEC, W, caches, fake_layer
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vllm_ddtree.recurrent import gdn_verify
from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify
from vllm_ddtree.tree import Verdict

HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
              "aten::item"}


class Recorder(TorchDispatchMode):
    """A capture: the aten ops and Triton launches run under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.ops.append(("aten", func, args, kwargs or {}, out))
        return out

    def launch(self, kernel, grid, args, kwargs) -> None:  # noqa: ANN001
        self.ops.append(("triton", kernel, grid, args, kwargs))
        with _disable_current_modes():
            kernel[grid](*args, **kwargs)

    def replay(self) -> None:
        for op in self.ops:
            if op[0] == "triton":
                _, kernel, grid, args, kwargs = op
                kernel[grid](*args, **kwargs)
                continue
            _, func, args, kwargs, recorded = op
            out = func(*args, **kwargs)
            for new, old in zip(_tensors(out), _tensors(recorded)):
                if new is not old and new.data_ptr() != old.data_ptr():
                    old.copy_(new)  # the capture's address holds the replay's result


def _tensors(value) -> list[torch.Tensor]:  # noqa: ANN001
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.fixture
def recorded_triton(monkeypatch: pytest.MonkeyPatch):
    """The Triton GDN kernels as the CUDA path launches them, through the recorder while
    one is capturing."""
    from vllm_ddtree.recurrent import triton_tree_gdn as tg

    state = SimpleNamespace(recorder=None)

    class Launcher:
        def __init__(self, kernel) -> None:  # noqa: ANN001
            self.kernel = kernel

        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def run(*args, **kwargs) -> None:
                if state.recorder is not None:
                    state.recorder.launch(self.kernel, grid, args, kwargs)
                else:
                    self.kernel[grid](*args, **kwargs)
            return run

    for name in ("_tree_conv_kernel", "_tree_gdn_kernel", "_commit_gdn_kernel",
                 "_commit_conv_kernel"):
        monkeypatch.setattr(tg, name, Launcher(getattr(tg, name)))
    monkeypatch.setattr(gdn_verify, "_impl", lambda device: tg)
    return state


def step_inputs(g: torch.Generator, lens: list[int], trees: list[list[int]],
                accepted_before: list[int], rows: int):
    """A step of spec requests (query lengths ``lens``, local parents ``trees``) beside one
    batch row that is not verified (a prefill), padded to ``rows`` spec rows."""
    T = sum(lens)
    x = torch.zeros(rows, CONV, dtype=torch.bfloat16)
    x[:T] = torch.randn(T, CONV, generator=g).bfloat16()
    a = torch.zeros(rows, HV, dtype=torch.bfloat16)
    b = torch.zeros(rows, HV, dtype=torch.bfloat16)
    a[:T] = torch.randn(T, HV, generator=g).bfloat16()
    b[:T] = torch.randn(T, HV, generator=g).bfloat16()
    parents = torch.full((len(lens) + 1, SPEC + 1), -1)
    for r, tree in enumerate(trees):
        parents[r + (r >= 1), :len(tree)] = torch.tensor(tree)  # batch row 1 is the prefill
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.tensor([True, False] + [True] * (len(lens) - 1))
    return x, a, b, parents, qsl, mask, torch.tensor(accepted_before, dtype=torch.int32)


STEPS = [  # (query lengths, trees, accepted before, accepted nodes per batch row)
    ([5, 4, 3], [[-1, 0, 0, 1, 3], [-1, 0, 1, 1], [-1, 0, 0]], [1, 3, 2],
     [[1, 3, 4, -1], [-1] * 4, [1, 2, -1, -1], [2, -1, -1, -1]]),
    ([3, 5, 4], [[-1, 0, 1], [-1, 0, 1, 2, 3], [-1, 0, 0, 0]], [4, 1, 3],
     [[1, 2, -1, -1], [-1] * 4, [1, 2, 3, 4], [3, -1, -1, -1]]),
    ([4, 4, 4], [[-1, 0, 0, 2], [-1, 0, 1, 0], [-1, 0, 1, 2]], [5, 2, 1],
     [[2, 3, -1, -1], [-1] * 4, [1, 2, -1, -1], [-1] * 4]),
]


def test_a_replayed_step_verifies_and_commits_as_an_eager_one(recorded_triton) -> None:
    """Captured once (with the chains the verifier holds before any step, as at start-up),
    replayed for three steps of other trees and request lengths (the same rows in all),
    other verdicts and other committed columns, with a batch row not verified among them:
    outputs, committed states and windows equal the eager path's, step after step; the
    capture read nothing on the host. (Host-computed row offsets, a mutation tried, fail.)"""
    g = torch.Generator().manual_seed(0)
    layer = fake_layer(g)
    S, rows = 3, 12
    slots = torch.randperm(4 * (SPEC + 1) + 2, generator=g)[:4 * (SPEC + 1)].view(4, SPEC + 1)
    conv0, state0 = caches(g, 4 * (SPEC + 1) + 2)
    spec_slots = slots[[0, 2, 3]]
    # The engine's persistent buffers: the step's inputs and metadata, the caches.
    x, a, b = (torch.zeros(rows, n, dtype=torch.bfloat16) for n in (CONV, HV, HV))
    md = SimpleNamespace(num_spec_decodes=S, spec_query_start_loc=torch.zeros(S + 1,
                         dtype=torch.int32), spec_state_indices_tensor=spec_slots.clone(),
                         spec_sequence_masks=torch.zeros(4, dtype=torch.bool),
                         spec_sequence_masks_cpu=None,
                         num_accepted_tokens=torch.ones(S, dtype=torch.int32))
    conv, state = conv0.clone(), state0.clone()
    verify = GDNTreeVerify(4, max_reqs=4, max_nodes=SPEC + 1, max_rows=rows)
    want_conv, want_state = conv0.clone(), state0.clone()
    eager = GDNTreeVerify(4, max_reqs=4, max_nodes=SPEC + 1, max_rows=rows)

    def write_step(step) -> tuple:  # noqa: ANN001
        lens, trees, before, accepted = step
        sx, sa, sb, parents, qsl, mask, acc = step_inputs(g, lens, trees, before, rows)
        x.copy_(sx), a.copy_(sa), b.copy_(sb)
        md.spec_query_start_loc.copy_(qsl), md.spec_sequence_masks.copy_(mask)
        md.num_accepted_tokens.copy_(acc)
        nodes = torch.tensor(accepted, dtype=torch.int32)
        verdict = Verdict(nodes, (nodes >= 0).sum(1).int(),
                          torch.zeros(4, 5, dtype=torch.int64))
        return parents, verdict

    write_step(STEPS[0])
    recorder = Recorder()
    recorded_triton.recorder = recorder
    with recorder:  # the capture: what the layer's forward runs, once
        out = verify.spec_forward(layer, md, x, b, a, conv, state, W, W - 1 + SPEC)
    recorded_triton.recorder = None
    assert not {str(op[1].name()) for op in recorder.ops if op[0] == "aten"} & HOST_READS
    assert any(op[0] == "triton" for op in recorder.ops)

    for step in STEPS:
        parents, verdict = write_step(step)
        verify.begin_step(parents)  # the engine's Python around the replay
        recorder.replay()
        verify.commit(verdict)

        eager.begin_step(parents)
        want = eager.spec_forward(layer, md, x, b, a, want_conv, want_state, W, W - 1 + SPEC)
        eager.commit(verdict)
        T = sum(step[0])
        torch.testing.assert_close(out[:T].float(), want[:T].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(state.float(), want_state.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(conv, want_conv)
    assert not torch.equal(state, state0)  # the steps committed something
