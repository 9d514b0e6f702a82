"""Gated DeltaNet on a token tree as Triton kernels (CUDA; run under TRITON_INTERPRET=1 in the
CPU tests). Same functions, layouts and results as torch_tree_gdn.py.

- ``tree_conv``: a program per (row, channel block) walks up to W - 1 parents, then into the
  committed window.
- ``tree_gdn``: a program per (row, value head, value block) collects its row's path (at most
  ``max_depth + 1`` rows, walking parents) and runs the gated delta rule along it from the
  committed state, in registers. Rows share no state and none is written: O(rows x depth)
  steps instead of the sweep's O(rows), for no per-node state buffer at all.
- ``commit_conv`` / ``commit_gdn``: a program per (request, channel / value block) replays
  the accepted path into its slot, in place.

No host sync: shapes and ``max_depth`` alone decide the grids and constexprs, so launches
can be captured in a CUDA graph when their inputs live in persistent buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6  # as reference.L2NORM_EPS (vLLM's in-kernel q/k norm)
BLOCK_C = 64  # conv channels per program
BLOCK_V = 32  # value columns per program: a [K, 32] fp32 state tile in registers


@triton.jit
def _tree_conv_kernel(X, Wt, Bias, ConvState, Out, parents, slots, offsets, C,
                      stride_xt, stride_wc, stride_sn, stride_sc, stride_sw, stride_ot,
                      WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                      BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < C
    slot = tl.load(slots + t).to(tl.int64)
    first = 0
    if HAS_OFFSETS:
        first = tl.load(offsets + t)
    acc = tl.zeros([BLOCK], tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
    cur = t.to(tl.int64)
    past = 0  # lags past the root so far: the window's newest entry comes first
    for lag in tl.static_range(WIDTH):
        w = tl.load(Wt + offs * stride_wc + (WIDTH - 1 - lag), mask=ok, other=0.0)
        if cur >= 0:
            xv = tl.load(X + cur * stride_xt + offs, mask=ok, other=0.0).to(tl.float32)
            cur = tl.load(parents + cur).to(tl.int64)
        else:
            past += 1
            xv = tl.load(ConvState + slot * stride_sn + offs * stride_sc
                         + (first + WIDTH - 1 - past) * stride_sw, mask=ok,
                         other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xv
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(Out + t * stride_ot + offs, out.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _delta_step(h, k, v, g, beta):
    """One gated-delta-rule step of the state tile ``h [K, BV]`` (fp32)."""
    h = h * tl.exp(g)
    err = (v - tl.sum(h * k[:, None], 0)) * beta
    return h + k[:, None] * err[None, :]


@triton.jit
def _load_key(Kp, row, head, stride_kt, stride_kh, offs_k, k_ok, L2NORM: tl.constexpr):
    k = tl.load(Kp + row * stride_kt + head * stride_kh + offs_k, mask=k_ok,
                other=0.0).to(tl.float32)
    if L2NORM:
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    return k


@triton.jit
def _tree_gdn_kernel(Q, Kp, Vp, G, Beta, State, Out, parents, slots, scale, Kdim, Vdim,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_gt, stride_bt, stride_sn, stride_sh, stride_sk, stride_sv,
                     stride_ot, stride_oh,
                     GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     MAX_PATH: tl.constexpr, L2NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < Kdim, offs_v < Vdim
    hk = h // GROUP
    # The path, leaf first: entry i is the row's i-th ancestor.
    steps = tl.arange(0, MAX_PATH)
    path = tl.full([MAX_PATH], -1, tl.int64)
    cur = t.to(tl.int64)
    n = 0
    while (cur >= 0) & (n < MAX_PATH):
        path = tl.where(steps == n, cur, path)
        cur = tl.load(parents + cur).to(tl.int64)
        n += 1
    slot = tl.load(slots + t).to(tl.int64)
    hs = tl.load(State + slot * stride_sn + h * stride_sh + offs_k[:, None] * stride_sk
                 + offs_v[None, :] * stride_sv, mask=k_ok[:, None] & v_ok[None, :],
                 other=0.0).to(tl.float32)
    for j in range(n):  # root first
        node = tl.sum(tl.where(steps == n - 1 - j, path, 0))
        k = _load_key(Kp, node, hk, stride_kt, stride_kh, offs_k, k_ok, L2NORM)
        v = tl.load(Vp + node * stride_vt + h * stride_vh + offs_v, mask=v_ok,
                    other=0.0).to(tl.float32)
        g = tl.load(G + node * stride_gt + h).to(tl.float32)
        beta = tl.load(Beta + node * stride_bt + h).to(tl.float32)
        hs = _delta_step(hs, k, v, g, beta)
    q = _load_key(Q, t, hk, stride_qt, stride_qh, offs_k, k_ok, L2NORM) * scale
    out = tl.sum(hs * q[:, None], 0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_v, out.to(Out.dtype.element_ty),
             mask=v_ok)


@triton.jit
def _commit_gdn_kernel(Kp, Vp, G, Beta, State, paths, slots, dst_slots, P, Kdim, Vdim,
                       stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                       stride_sn, stride_sh, stride_sk, stride_sv, stride_pr, stride_dr,
                       GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       L2NORM: tl.constexpr, PER_ROW: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < Kdim, offs_v < Vdim
    tile = h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    tile_ok = k_ok[:, None] & v_ok[None, :]
    hs = tl.load(State + tl.load(slots + r).to(tl.int64) * stride_sn + tile, mask=tile_ok,
                 other=0.0).to(tl.float32)
    for j in range(P):
        node = tl.load(paths + r * stride_pr + j).to(tl.int64)
        if node >= 0:
            k = _load_key(Kp, node, h // GROUP, stride_kt, stride_kh, offs_k, k_ok, L2NORM)
            v = tl.load(Vp + node * stride_vt + h * stride_vh + offs_v, mask=v_ok,
                        other=0.0).to(tl.float32)
            g = tl.load(G + node * stride_gt + h).to(tl.float32)
            beta = tl.load(Beta + node * stride_bt + h).to(tl.float32)
            hs = _delta_step(hs, k, v, g, beta)
            if PER_ROW:  # the state after each accepted row in its own slot
                dst = tl.load(dst_slots + r * stride_dr + j).to(tl.int64)
                tl.store(State + dst * stride_sn + tile, hs.to(State.dtype.element_ty),
                         mask=tile_ok)
    if not PER_ROW:
        tl.store(State + tl.load(dst_slots + r).to(tl.int64) * stride_sn + tile,
                 hs.to(State.dtype.element_ty), mask=tile_ok)


@triton.jit
def _commit_conv_kernel(X, ConvState, paths, slots, read_at, write_at, P, C, NCOLS,
                        stride_xt, stride_sn, stride_sc, stride_sw, stride_pr,
                        W1: tl.constexpr, BCOLS: tl.constexpr, MAX_P: tl.constexpr,
                        HAS_OFFSETS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < C
    steps = tl.arange(0, MAX_P)
    length = tl.sum((tl.load(paths + r * stride_pr + steps, mask=steps < P, other=-1) >= 0)
                    .to(tl.int32))
    slot = tl.load(slots + r).to(tl.int64)
    read, write = 0, 0
    if HAS_OFFSETS:
        read, write = tl.load(read_at + r), tl.load(write_at + r)
    # Column c takes entry c + length - write of (old window, then the path), up to the
    # new window's end (torch_tree_gdn.commit_conv); all loads before the store.
    c = tl.arange(0, BCOLS)
    at = c + length - write
    live = (at >= 0) & (c < write + W1) & (c < NCOLS) & (length > 0)
    from_old = at < W1
    base = ConvState + slot * stride_sn + offs[:, None] * stride_sc
    old = tl.load(base + (read + at)[None, :] * stride_sw,
                  mask=ok[:, None] & (live & from_old)[None, :], other=0.0)
    node = tl.load(paths + r * stride_pr + (at - W1), mask=live & ~from_old, other=0)
    new = tl.load(X + node.to(tl.int64)[None, :] * stride_xt + offs[:, None],
                  mask=ok[:, None] & (live & ~from_old)[None, :], other=0.0)
    window = tl.where(from_old[None, :], old.to(tl.float32), new.to(tl.float32))
    tl.store(base + c[None, :] * stride_sw, window.to(ConvState.dtype.element_ty),
             mask=ok[:, None] & live[None, :])


def tree_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              conv_state: torch.Tensor, parents: torch.Tensor, slots: torch.Tensor,
              offsets: torch.Tensor | None = None) -> torch.Tensor:
    T, C = x.shape
    parents, slots, offsets = _dense(parents), _dense(slots), _dense(offsets)
    out = torch.empty_like(x)
    if T:
        _tree_conv_kernel[(T, triton.cdiv(C, BLOCK_C))](
            x, weight, bias if bias is not None else weight, conv_state, out, parents, slots,
            offsets if offsets is not None else slots, C, x.stride(0), weight.stride(0),
            *conv_state.stride(), out.stride(0), WIDTH=weight.shape[1],
            HAS_BIAS=bias is not None, HAS_OFFSETS=offsets is not None, BLOCK=BLOCK_C)
    return out


def _dense(index: torch.Tensor | None) -> torch.Tensor | None:
    """An index vector as the kernels read it (element i at i): vLLM's slot tables are 2-D,
    and a column of one (``slots[:, 0]``) is strided."""
    return None if index is None else index.contiguous()


def _gdn_blocks(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    Kdim, Vdim = k.shape[2], v.shape[2]
    return triton.next_power_of_2(Kdim), min(BLOCK_V, triton.next_power_of_2(Vdim)), Vdim


def tree_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor, parents: torch.Tensor,
             slots: torch.Tensor, scale: float, l2norm: bool = True,
             max_depth: int | None = None) -> torch.Tensor:
    """As torch_tree_gdn.tree_gdn; ``max_depth`` (required) bounds every row's depth (rows
    deeper than it would read a truncated path: the caller's trees are that deep at most)."""
    if max_depth is None:
        raise ValueError("tree_gdn: the Triton kernel needs max_depth (the deepest row's depth)")
    T, Hv, Vdim = v.shape
    out = torch.empty_like(v)
    parents, slots = _dense(parents), _dense(slots)
    BK, BV, _ = _gdn_blocks(k, v)
    if T:
        _tree_gdn_kernel[(T, Hv, triton.cdiv(Vdim, BV))](
            q, k, v, g, beta, state, out, parents, slots, scale, k.shape[2], Vdim,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), beta.stride(0), *state.stride(), out.stride(0), out.stride(1),
            GROUP=Hv // k.shape[1], BK=BK, BV=BV,
            MAX_PATH=triton.next_power_of_2(max_depth + 1), L2NORM=l2norm)
    return out


def commit_conv(conv_state: torch.Tensor, x: torch.Tensor, paths: torch.Tensor,
                slots: torch.Tensor, width: int, read_at: torch.Tensor | None = None,
                write_at: torch.Tensor | None = None) -> None:
    R, P = paths.shape
    C, ncols = conv_state.shape[1], conv_state.shape[2]
    slots, read_at, write_at = _dense(slots), _dense(read_at), _dense(write_at)
    if (read_at is None) != (write_at is None):  # the kernel takes both or neither
        read_at, write_at = (torch.zeros_like(slots) if a is None else a
                             for a in (read_at, write_at))
    if R:
        _commit_conv_kernel[(R, triton.cdiv(C, BLOCK_C))](
            x, conv_state, paths, slots, slots if read_at is None else read_at,
            slots if write_at is None else write_at, P, C, ncols, x.stride(0),
            *conv_state.stride(), paths.stride(0), W1=width - 1,
            BCOLS=triton.next_power_of_2(ncols), MAX_P=triton.next_power_of_2(P),
            HAS_OFFSETS=read_at is not None, BLOCK=BLOCK_C)


def commit_gdn(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, paths: torch.Tensor, slots: torch.Tensor,
               dst_slots: torch.Tensor | None = None, l2norm: bool = True) -> None:
    R, P = paths.shape
    Hv = v.shape[1]
    per_row = dst_slots is not None and dst_slots.dim() == 2
    slots, dst_slots = _dense(slots), _dense(dst_slots)
    BK, BV, Vdim = _gdn_blocks(k, v)
    if R:
        _commit_gdn_kernel[(R, Hv, triton.cdiv(Vdim, BV))](
            k, v, g, beta, state, paths, slots, slots if dst_slots is None else dst_slots,
            P, k.shape[2], Vdim,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            *state.stride(), paths.stride(0), dst_slots.stride(0) if per_row else 0,
            GROUP=Hv // k.shape[1], BK=BK, BV=BV, L2NORM=l2norm, PER_ROW=per_row)
