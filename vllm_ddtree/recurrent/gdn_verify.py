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
class _Stashed:
    """One GDN layer's verify step: where its committed window and state live, and the
    inputs of its spec rows."""
    conv_buf: torch.Tensor  # [slots, C, W - 1 + extra]
    ssm_state: torch.Tensor  # [slots, Hv, K, V] (the backend's view)
    width: int
    x: torch.Tensor  # [T, C] conv inputs of the spec rows
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    slots: torch.Tensor  # [S, 1 + num_spec] state slots of the spec requests
    read_at: torch.Tensor  # [S] the committed column / slot: num_accepted - 1


@dataclass
class _Forest:
    """The step's spec rows as a forest: the same for every GDN layer of the step (their
    state slots differ: each layer may be a KV-cache group of its own)."""
    qsl: torch.Tensor  # [S + 1] spec rows of each spec request
    batch_rows: torch.Tensor  # [S] the spec requests' rows in the batch (and the verdict)
    req: torch.Tensor  # [T] each row's spec request
    parents: torch.Tensor  # [T] each row's parent row, -1 for a root


class GDNTreeVerify:
    """Per engine: the step's trees for the GDN layers, their stash, and the commit."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.parents: torch.Tensor | None = None  # [R, N] local parents per batch row
        self.stash: list[_Stashed] = []
        self.forest: _Forest | None = None  # built by the step's first GDN layer
        self.commits = 0  # layer steps committed (host count, for tests and stats)

    @property
    def active(self) -> bool:
        """Within a ddtree verify step (else the layers run vLLM's own spec path)."""
        return self.parents is not None

    def begin_step(self, parents: torch.Tensor | None) -> None:
        """This step's local parents per batch row (None: no verify step)."""
        self.parents = parents
        self.stash.clear()
        self.forest = None

    def _forest(self, md: Any, T: int, dev: torch.device) -> _Forest:
        if self.forest is None:
            S = md.num_spec_decodes
            qsl = md.spec_query_start_loc[:S + 1].long()
            mask = md.spec_sequence_masks_cpu
            batch_rows = (torch.arange(S) if mask is None else mask.nonzero()[:, 0]).to(dev)
            t = torch.arange(T, device=dev)
            req = torch.searchsorted(qsl[1:], t, right=True)
            node = t - qsl[req]
            local = self.parents.long()[batch_rows[req],
                                        node.clamp(max=self.parents.shape[1] - 1)]
            parents = torch.where((local >= 0) & (node > 0), qsl[req] + local, -1)
            self.forest = _Forest(qsl, batch_rows, req, parents)
        return self.forest

    def spec_forward(self, layer: Any, md: Any, x: torch.Tensor, b: torch.Tensor,
                     a: torch.Tensor, conv_buf: torch.Tensor, ssm_state: torch.Tensor,
                     width: int, state_len: int) -> torch.Tensor:
        """The spec rows' core output ``[T, Hv, V]`` over their trees (the arguments of
        vLLM's CPU _spec_forward; from the CUDA path, patch 0008, the same values)."""
        assert self.parents is not None, "spec_forward outside a ddtree verify step"
        S = md.num_spec_decodes
        f = self._forest(md, x.shape[0], x.device)
        slots = md.spec_state_indices_tensor[:S].long()
        read_at = md.num_accepted_tokens[:S].long() - 1
        impl = _impl(x.device)
        conv_out = impl.tree_conv(x, _conv_weight(layer), layer.conv1d.bias, conv_buf,
                                  f.parents, slots[f.req, 0], offsets=read_at[f.req])
        q, k, v = (y.squeeze(0) for y in layer.rearrange_mixed_qkv(conv_out))
        # Qwen's gates, as vLLM's fused kernels compute them (softplus threshold 20).
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
        beta = b.float().sigmoid()
        out = impl.tree_gdn(q, k, v, g, beta, ssm_state, f.parents,
                            slots.gather(1, read_at[:, None])[f.req, 0], k.shape[-1] ** -0.5,
                            max_depth=self.depth)
        self.stash.append(_Stashed(conv_buf, ssm_state, width, x, k, v, g, beta, slots,
                                   read_at))
        return out

    def commit(self, verdict: Verdict) -> None:
        """After the walk: each GDN layer's accepted paths into the committed state."""
        if self.stash:
            f = self.forest
            accepted = verdict.accepted.long()[f.batch_rows]  # [S, D] local nodes
            n = verdict.num_accepted.long()[f.batch_rows]
            local = torch.cat([torch.zeros_like(accepted[:, :1]), accepted], 1)
            paths = torch.where(local >= 0, f.qsl[:-1, None] + local, -1)
        for s in self.stash:
            impl = _impl(s.x.device)
            impl.commit_conv(s.conv_buf, s.x, paths, s.slots[:, 0], s.width,
                             read_at=s.read_at, write_at=n)
            # Every accepted row's state in its column, as vLLM's chain leaves them: align
            # mode checkpoints a block boundary inside the path from there.
            impl.commit_gdn(s.ssm_state, s.k, s.v, s.g, s.beta, paths,
                            s.slots.gather(1, s.read_at[:, None])[:, 0],
                            s.slots[:, :paths.shape[1]])
        self.commits += len(self.stash)
        self.stash.clear()
        self.parents = self.forest = None


def gdn_layers(runner: Any) -> list[Any]:
    """The target's Gated DeltaNet layers (those with a tree path: vLLM's Qwen GDN)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    context = runner.compilation_config.static_forward_context
    return [m for m in context.values() if isinstance(m, QwenGatedDeltaNetAttention)]
