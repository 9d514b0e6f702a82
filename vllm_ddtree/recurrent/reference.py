"""Float64 references for recurrent layers on a token tree: every node run as a chain.

A node's output is what the layer gives when its root-to-node path is run as a plain
sequence after the request's committed state: the definition that the tree kernels
(vllm_ddtree/recurrent/tree_gdn.py, triton_tree_gdn.py) must meet. Slow on purpose: one
Python loop per node and per step, in float64.

Layouts (those of the kernels): rows ``t`` of a batch, ``parents[t]`` the row of a node's
parent or -1 for a root, ``slots[t]`` the state slot its request's committed state is in.
Conv: ``x [T, C]`` (the layer's input before the conv), ``weight [C, W]``, ``conv_state
[S, C, W - 1]`` (the last W - 1 inputs, oldest first). Gated delta rule: ``q, k [T, Hk, K]``,
``v [T, Hv, V]``, ``g, beta [T, Hv]`` (log decay and write strength), ``state [S, Hv, K, V]``;
value head ``h`` reads key head ``h // (Hv // Hk)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # vLLM's (FLA's) in-kernel q/k norm: x / sqrt(sum(x^2) + eps)


def l2norm_of(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def path_of(parents: list[int], t: int) -> list[int]:
    """Rows from the root to ``t``."""
    path = [t]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def conv_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               history: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU of the chain ``x [L, C]`` after ``history [C, W-1]``;
    output ``[L, C]``."""
    seq = torch.cat([history.T, x], 0).double()  # [W-1+L, C]
    W = weight.shape[1]
    out = torch.stack([(seq[i:i + W].T * weight.double()).sum(1) for i in range(len(x))])
    if bias is not None:
        out = out + bias.double()
    return F.silu(out)


def gdn_chain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor, scale: float,
              l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule along a chain from ``state [Hv, K, V]``: per step the state decays
    by exp(g), the value's prediction error times beta is written at the key, and the output
    reads the state at the (scaled) query. Returns the outputs ``[L, Hv, V]`` and the final
    state."""
    q, k, v, g, beta, S = (a.double() for a in (q, k, v, g, beta, state))
    if l2norm:
        q, k = l2norm_of(q), l2norm_of(k)
    group = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    S, outs = S.clone(), []
    for t in range(len(q)):
        S = S * g[t].exp()[:, None, None]
        err = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * err)
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
    return torch.stack(outs), S


def tree_conv(x, weight, bias, conv_state, parents, slots) -> torch.Tensor:
    """Each row's conv output over its own path (float64, ``[T, C]``)."""
    parents, slots = parents.tolist(), slots.tolist()
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(len(x)):
        path = path_of(parents, t)
        out[t] = conv_chain(x[path], weight, bias, conv_state[slots[t]])[-1]
    return out


def tree_gdn(q, k, v, g, beta, state, parents, slots, scale, l2norm=True) -> torch.Tensor:
    """Each row's gated-delta-rule output over its own path (float64, ``[T, Hv, V]``)."""
    parents, slots = parents.tolist(), slots.tolist()
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(len(q)):
        p = path_of(parents, t)
        out[t] = gdn_chain(q[p], k[p], v[p], g[p], beta[p], state[slots[t]], scale, l2norm)[0][-1]
    return out
