"""Row-wise log-sum-exp of the drafter's logits in float32, reading them once (Triton).

The tree build needs log-probabilities only for each depth's top-k tokens: their logits
minus the row's log-sum-exp. ``torch.log_softmax`` would write a float32 copy of the whole
``[rows, vocab]`` logits to get them (2.3 GB for 256 requests of depth 15 over a 151,936-token
vocabulary); this kernel keeps one float per row. One launch, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries per loop step


@triton.jit
def _row_logsumexp_kernel(X, Out, vocab, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_row
    # Per lane: the running max and the sum of exp(x - max), rescaled when the max grows.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        s = s * tl.exp(m - base) + tl.exp(x - base)
        m = m_new
    top = tl.max(m, axis=0)
    base = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(s * tl.exp(m - base), axis=0)
    tl.store(Out + row, base + tl.log(total))


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(x), -1))`` in float32 for ``x`` [..., V] (any float dtype, last dim
    contiguous); -inf for a row of -inf."""
    if x.stride(-1) != 1:
        raise ValueError("row_logsumexp: argument 'x' must be contiguous in its last dim")
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0] > 0:
        _row_logsumexp_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0),
                                                BLOCK=BLOCK)
    return out.view(x.shape[:-1])
