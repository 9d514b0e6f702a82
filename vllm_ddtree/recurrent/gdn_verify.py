"""Tree verification in vLLM's Gated DeltaNet layers (Qwen3-Next, Qwen3.5), and the commit.

vLLM speculates on GDN layers as on a chain: each request has ``1 + num_speculative_tokens``
recurrent-state slots and one conv buffer widened by as many columns; a verify step starts
from slot ``num_accepted - 1`` (and the conv window at that column), and the next step's
``num_accepted`` (accepted drafts + 1, counted by the runner from the verdict) says where to
resume. Under ddtree a layer's verify rows are a tree:

- ``spec_forward`` (in place of vLLM's spec path, through a hook in the layer) computes each
  node's conv and gated-delta-rule output over its own path, reading the committed window
  and state and writing neither; it keeps the layer's inputs of the step (the stash).
- ``commit`` (after the walk, from the runner's compaction) replays each request's accepted
  path from the committed state and window and stores the results in the slot and column
  that the next step's ``num_accepted`` points at: the state a chain of that path leaves.

No recurrent state is formed per tree node, and none survives the step but the committed
one. The stash holds the step's conv inputs, keys, values and gates per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllm_ddtree.tree import Verdict

# The layer kinds whose recurrent state the tree path covers: the model classes whose
# recurrent layers are vLLM's Qwen Gated DeltaNet.
GDN_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                     "Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForCausalLM")


def stash_bytes_per_row(text_config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """What the stash keeps per verify row and GDN layer (one tensor-parallel rank): the
    conv inputs and outputs (keys and values are views of the output) in the model's dtype,
    and two float32 gates per value head."""
    c = text_config
    hk, hv = c.linear_num_key_heads // tp_size, c.linear_num_value_heads // tp_size
    channels = 2 * hk * c.linear_key_head_dim + hv * c.linear_value_head_dim
    return 2 * channels * dtype.itemsize + 2 * hv * 4


def _impl(device: torch.device) -> Any:
    if device.type == "cuda":
        from vllm_ddtree.recurrent import triton_tree_gdn
        return triton_tree_gdn
    from vllm_ddtree.recurrent import torch_tree_gdn
    return torch_tree_gdn


def _conv_weight(layer: Any) -> torch.Tensor:
    """The conv weight ``[C, W]``: on CPU vLLM's unpacked copy (AMX packs it in place)."""
    w = layer.conv1d.weight
    if w.device.type != "cpu":
        return w.view(w.size(0), w.size(-1))
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _unpacked_conv_weight
    return _unpacked_conv_weight(layer)


@dataclass
class _Stash:
    """One GDN layer's verify step, in buffers allocated at the layer's first step and
    rewritten by every later one (inside a captured graph too): its caches, the spec rows'
    conv inputs and outputs and gates, and per batch row its state slots and the committed
    column it read."""
    layer: Any
    conv_buf: torch.Tensor  # [slots, C, W - 1 + extra] (the cache: fixed)
    ssm_state: torch.Tensor  # [slots, Hv, K, V] (the backend's view: fixed)
    width: int
    x: torch.Tensor  # [rows, C] conv inputs of the spec rows
    conv_out: torch.Tensor  # [rows, C] (q, k, v: layer.rearrange_mixed_qkv)
    g: torch.Tensor  # [rows, Hv] float32
    beta: torch.Tensor  # [rows, Hv] float32
    slots: torch.Tensor  # [batch rows, 1 + depth] state slots (0 where not verified)
    read_at: torch.Tensor  # [batch rows] the committed column read: num_accepted - 1


class GDNTreeVerify:
    """Per engine: the step's trees for the GDN layers, their stash, and the commit.

    Graph-safe: what the commit reads lives in buffers allocated once, written inside the
    forward by device operations only, with no host read, so that a CUDA graph's replay
    (whose Python never runs) refreshes them as an eager step does. Host state: whether the
    step verifies (``begin_step``), and the layers' stash buffers (kept from the first step).
    """

    def __init__(self, depth: int, max_reqs: int, max_nodes: int, max_rows: int,
                 device: torch.device | str = "cpu") -> None:
        self.depth, self.max_rows = depth, max_rows
        # Local parents per batch row (the step's trees, written by begin_step): chains
        # until then, so that a graph captured before any step verifies chains.
        node = torch.arange(max_nodes, device=device)
        self.parents = (node - 1).repeat(max_reqs, 1)
        # Each batch row's first spec row in the step, -1 for a row not verified.
        self.row0 = torch.full((max_reqs,), -1, dtype=torch.long, device=device)
        self.stash: dict[int, _Stash] = {}  # by id(layer), in the order the layers run
        self.verifying = False  # begin_step: this step has trees (the commit follows)
        self._forest: tuple[torch.Tensor, ...] | None = None  # the step's, from its first layer
        self.commits = 0  # layer steps committed (host count, for tests and stats)

    @property
    def active(self) -> bool:
        """Whether the layers' spec rows take the tree path: within a verify step, and while
        a CUDA graph is captured (ddtree captures FULL graphs of verify steps only, with
        tree_budget + 1 rows a request; its replays then verify trees)."""
        return self.verifying or (self.parents.is_cuda and
                                  torch.cuda.is_current_stream_capturing())

    def begin_step(self, parents: torch.Tensor | None) -> None:
        """This step's local parents per batch row (None: no verify step)."""
        self.verifying, self._forest = parents is not None, None
        if parents is not None:
            self.parents[:parents.shape[0], :parents.shape[1]].copy_(parents)

    def _rows(self, md: Any, T: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """Each spec row's parent row (-1: a root) and spec request, and each spec request's
        batch row, from the step's metadata (the same for every GDN layer of the step),
        without a host read; each batch row's first spec row goes to ``row0``."""
        if self._forest is None:
            S = md.num_spec_decodes
            qsl = md.spec_query_start_loc[:S + 1].long()
            mask = md.spec_sequence_masks
            is_spec = torch.ones(S, dtype=torch.bool, device=dev) if mask is None \
                else mask.bool()
            count = is_spec.long().cumsum(0)  # spec requests up to each batch row
            # The i-th spec request is the batch row holding the i-th True.
            batch_rows = torch.searchsorted(count, torch.arange(1, S + 1, device=dev))
            rank = count - 1
            self.row0.fill_(-1)
            n = is_spec.shape[0]
            self.row0[:n] = torch.where(is_spec, qsl[rank.clamp(0, S)], -1)
            t = torch.arange(T, device=dev)
            req = torch.searchsorted(qsl[1:], t, right=True).clamp(max=S - 1)
            node = t - qsl[req]
            local = self.parents[batch_rows[req], node.clamp(max=self.parents.shape[1] - 1)]
            parents = torch.where((local >= 0) & (node > 0), qsl[req] + local, -1)
            self._forest = parents, req, batch_rows
        return self._forest

    def spec_forward(self, layer: Any, md: Any, x: torch.Tensor, b: torch.Tensor,
                     a: torch.Tensor, conv_buf: torch.Tensor, ssm_state: torch.Tensor,
                     width: int, state_len: int) -> torch.Tensor:
        """The spec rows' core output ``[T, Hv, V]`` over their trees (the arguments of
        vLLM's CPU _spec_forward; from the CUDA path, patch 0008, the same values)."""
        S, T = md.num_spec_decodes, x.shape[0]
        parents, req, batch_rows = self._rows(md, T, x.device)
        slots = md.spec_state_indices_tensor[:S].long()
        read_at = md.num_accepted_tokens[:S].long() - 1
        impl = _impl(x.device)
        conv_out = impl.tree_conv(x, _conv_weight(layer), layer.conv1d.bias, conv_buf,
                                  parents, slots[req, 0], offsets=read_at[req])
        q, k, v = (y.squeeze(0) for y in layer.rearrange_mixed_qkv(conv_out))
        # Qwen's gates, as vLLM's fused kernels compute them (softplus threshold 20).
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
        beta = b.float().sigmoid()
        out = impl.tree_gdn(q, k, v, g, beta, ssm_state, parents,
                            slots.gather(1, read_at[:, None])[req, 0], k.shape[-1] ** -0.5,
                            max_depth=self.depth)
        st = self._stash_of(layer, conv_buf, ssm_state, width, x, g, slots.shape[1])
        st.x[:T].copy_(x)
        st.conv_out[:T].copy_(conv_out)
        st.g[:T].copy_(g)
        st.beta[:T].copy_(beta)
        st.slots.zero_()
        st.slots[batch_rows, :slots.shape[1]] = slots
        st.read_at.zero_()
        st.read_at[batch_rows] = read_at
        return out

    def _stash_of(self, layer: Any, conv_buf: torch.Tensor, ssm_state: torch.Tensor,
                  width: int, x: torch.Tensor, g: torch.Tensor, cols: int) -> _Stash:
        st = self.stash.get(id(layer))
        if st is None:
            rows, reqs = self.max_rows, self.row0.shape[0]

            def empty(*shape: int, like: torch.Tensor) -> torch.Tensor:
                return torch.zeros(*shape, dtype=like.dtype, device=like.device)

            st = _Stash(layer, conv_buf, ssm_state, width, empty(rows, x.shape[1], like=x),
                        empty(rows, x.shape[1], like=x), empty(rows, g.shape[1], like=g),
                        empty(rows, g.shape[1], like=g),
                        torch.zeros(reqs, cols, dtype=torch.long, device=x.device),
                        torch.zeros(reqs, dtype=torch.long, device=x.device))
            self.stash[id(layer)] = st
        st.conv_buf, st.ssm_state, st.width = conv_buf, ssm_state, width  # the engine's: fixed
        return st

    def commit(self, verdict: Verdict) -> None:
        """After the walk: each GDN layer's accepted paths into the committed state, for
        every batch row verified (``row0``); others are left alone."""
        if not (self.verifying and self.stash):
            self.verifying = False
            return
        R = verdict.accepted.shape[0]
        accepted = verdict.accepted.long()  # [R, D] local nodes
        n = verdict.num_accepted.long()
        local = torch.cat([torch.zeros_like(accepted[:, :1]), accepted], 1)
        row0 = self.row0[:R, None]
        paths = torch.where((local >= 0) & (row0 >= 0), row0 + local, -1)
        for st in self.stash.values():
            impl = _impl(st.x.device)
            q, k, v = (y.squeeze(0) for y in st.layer.rearrange_mixed_qkv(st.conv_out))
            slots, read_at = st.slots[:R], st.read_at[:R]
            impl.commit_conv(st.conv_buf, st.x, paths, slots[:, 0], st.width,
                             read_at=read_at, write_at=n)
            # Every accepted row's state in its column, as vLLM's chain leaves them: align
            # mode checkpoints a block boundary inside the path from there.
            impl.commit_gdn(st.ssm_state, k, v, st.g, st.beta, paths,
                            slots.gather(1, read_at[:, None])[:, 0], slots[:, :paths.shape[1]])
        self.commits += len(self.stash)
        self.verifying, self._forest = False, None


def gdn_layers(runner: Any) -> list[Any]:
    """The target's Gated DeltaNet layers (those with a tree path: vLLM's Qwen GDN)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    context = runner.compilation_config.static_forward_context
    return [m for m in context.values() if isinstance(m, QwenGatedDeltaNetAttention)]
