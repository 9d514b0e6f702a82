"""PyTorch versions of V2's sampling kernels (``vllm/v1/worker/gpu/sample/``): temperature
and Gumbel-max sampling (``gumbel.py``), logit bias / allowed tokens / min tokens
(``logit_bias.py``), penalties and their token counts (``penalties.py``), and logprobs and
ranks (``logprob.py``).

Each processes all rows of a launch at once ([rows, vocab] tensor ops). The Gumbel noise
comes from :mod:`.rng` (the same hash, bit for bit), so a seed samples the same token as
the Triton kernel. Rows and columns are addressed as the kernels address them, through
the strides they are given (:func:`_rows`). Values stored into a narrower dtype (bf16,
fp16 logits) are rounded to nearest even, as compiled Triton does (Triton's interpreter
truncates to bf16 instead); the default sampler path works on fp32 logits.
"""

from __future__ import annotations

import numpy as np
import torch

from cpu_standin.kernels import pointer, ranges, rng, torch_kernel

GUMBEL = "vllm.v1.worker.gpu.sample.gumbel"
LOGIT_BIAS = "vllm.v1.worker.gpu.sample.logit_bias"
PENALTIES = "vllm.v1.worker.gpu.sample.penalties"
LOGPROB = "vllm.v1.worker.gpu.sample.logprob"

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers


def _rows(t: torch.Tensor, num_rows: int, stride: int, width: int) -> torch.Tensor:
    """The [num_rows, width] matrix a kernel addresses as ``t + row * stride + col``."""
    return t.as_strided((num_rows, width), (int(stride), 1))


def _block_argmax(x: np.ndarray, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``tl.max(x_block, return_indices=True)`` of every row's blocks: the maximum and the
    first index reaching it in each block, NaNs ignored (as the interpreter's nanmax and
    nanargmax, which count a NaN as -inf). ``x`` is [rows, num_blocks * block_size]; in
    NumPy, whose argmax over a row's blocks is ten times faster than torch's."""
    blocks = x.reshape(x.shape[0], num_blocks, -1)
    values, idx = blocks.max(axis=2), blocks.argmax(axis=2)
    nan = np.isnan(values)  # (blocks holding a NaN, which max and argmax take)
    if nan.any():
        fixed = blocks[nan]
        fixed[np.isnan(fixed)] = _NEG_INF
        values[nan], idx[nan] = fixed.max(axis=1), fixed.argmax(axis=1)
    return values, idx


# -------------------------------------------------------------------------- gumbel.py


@torch_kernel(f"{GUMBEL}._temperature_kernel")
def temperature(grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, temperature_ptr,
                vocab_size, BLOCK_SIZE) -> None:
    num_tokens = grid[0]
    width = min(int(vocab_size), grid[1] * BLOCK_SIZE)
    if not num_tokens or width <= 0:
        return
    req = pointer(expanded_idx_mapping_ptr)[:num_tokens].long()
    temp = pointer(temperature_ptr)[req.clamp(min=0)].float()
    # Temperatures 0 (greedy) and 1 leave the row alone; so do rows without a request
    # (-1), whose temperature the kernel would read out of bounds.
    rows = ((temp != 0.0) & (temp != 1.0) & (req >= 0)).nonzero().squeeze(1)
    if not rows.numel():
        return
    logits = _rows(logits_ptr, num_tokens, logits_stride, width)
    logits[rows] = (logits[rows].float() / temp[rows, None]).to(logits.dtype)


@torch_kernel(f"{GUMBEL}._gumbel_sample_kernel")
def gumbel_sample(grid, local_argmax_ptr, local_argmax_stride, local_max_ptr,
                  local_max_stride, logits_cache_ptr, logits_cache_stride_0,
                  logits_cache_stride_1, logits_cache_col_ptr, logits_cache_source_ptr,
                  logits_cache_source_stride, logits_cache_row_mapping_ptr, logits_ptr,
                  logits_stride, bias_ptr, bias_stride, expanded_idx_mapping_ptr, seeds_ptr,
                  pos_ptr, temp_ptr, vocab_size, BLOCK_SIZE, IS_DRAFTING, APPLY_TEMPERATURE,
                  USE_FP64, PER_TOKEN_COL=False, HAS_BIAS=False) -> None:
    num_tokens, num_blocks = grid
    if not num_tokens or not num_blocks:
        return
    vocab_size = int(vocab_size)
    width = min(vocab_size, num_blocks * BLOCK_SIZE)  # the columns the grid covers
    logits = _rows(logits_ptr, num_tokens, logits_stride, width)
    if HAS_BIAS:
        # Rounded to the logits dtype, as the kernel does.
        bias = _rows(bias_ptr, num_tokens, bias_stride, width)
        logits = (logits.float() + bias.float()).to(logits.dtype)
    logits = logits.float()

    req = pointer(expanded_idx_mapping_ptr)[:num_tokens].long()
    valid = req >= 0
    safe = req.clamp(min=0)
    # Rows without a request sample greedily (temperature 0), with seed 0.
    temp = torch.where(valid, pointer(temp_ptr)[safe].float(), 0.0)
    seed = torch.where(valid, pointer(seeds_ptr)[safe].long(), 0)
    pos = pointer(pos_ptr)[:num_tokens].long()

    if logits_cache_ptr is not None:
        # Cache the logits before temperature (the rejection sampler divides on load).
        cols = pointer(logits_cache_col_ptr)
        col = cols[:num_tokens].long() if PER_TOKEN_COL else cols[:1].long().expand(num_tokens)
        if logits_cache_row_mapping_ptr is not None:
            row = torch.where(valid, pointer(logits_cache_row_mapping_ptr)[safe].long(), -1)
        else:
            row = req
        source = logits if logits_cache_source_ptr is None else _rows(
            logits_cache_source_ptr, num_tokens, logits_cache_source_stride, width)
        cache = pointer(logits_cache_ptr)
        rows = (row >= 0).nonzero().squeeze(1)
        if rows.numel():
            start = row[rows] * logits_cache_stride_0 + col[rows] * logits_cache_stride_1
            cache[start[:, None] + torch.arange(width)] = source[rows].to(cache.dtype)
        seed = seed ^ (col << 32)  # spec_step_seed

    buf = torch.full((num_tokens, num_blocks * BLOCK_SIZE), _NEG_INF,
                     dtype=torch.float64 if USE_FP64 else torch.float32)
    noisy = (temp != 0.0).nonzero().squeeze(1)
    if APPLY_TEMPERATURE and noisy.numel():
        logits = logits.clone()
        logits[noisy] = logits[noisy] / temp[noisy, None]
    buf[:, :width] = logits  # (to fp64 after the temperature, as the kernel)
    if noisy.numel():
        noise = rng.gumbel_noise(seed[noisy, None], pos[noisy, None],
                                 torch.arange(width, dtype=torch.int32), use_fp64=USE_FP64,
                                 is_drafting=IS_DRAFTING)
        buf[noisy, :width] += noise

    values, idx = _block_argmax(buf.numpy(), num_blocks)
    local_max = _rows(local_max_ptr, num_tokens, local_max_stride, num_blocks)
    local_max.copy_(torch.from_numpy(values))
    local_argmax = _rows(local_argmax_ptr, num_tokens, local_argmax_stride, num_blocks)
    local_argmax.copy_(torch.from_numpy(idx) + torch.arange(num_blocks) * BLOCK_SIZE)


@torch_kernel(f"{GUMBEL}._gumbel_combine_kernel")
def gumbel_combine(grid, local_argmax_ptr, local_argmax_stride, local_max_ptr,
                   local_max_stride, sampled_ptr, num_blocks, PADDED_NUM_BLOCKS=None) -> None:
    num_rows = grid[0]
    num_blocks = int(num_blocks)
    if not num_rows or num_blocks <= 0:
        return
    values = _rows(local_max_ptr, num_rows, local_max_stride, num_blocks)
    # As torch.argmax: the first NaN block wins, otherwise the first maximum.
    nan = torch.isnan(values)
    winner = torch.where(nan.any(dim=1), nan.to(torch.int8).argmax(dim=1),
                         values.argmax(dim=1))
    argmax = _rows(local_argmax_ptr, num_rows, local_argmax_stride, num_blocks)
    sampled = pointer(sampled_ptr)[:num_rows]
    sampled.copy_(argmax.gather(1, winner[:, None]).squeeze(1))


# ---------------------------------------------------------------------- logit_bias.py


def _entries(req: torch.Tensor, counts: torch.Tensor, *tables: tuple[torch.Tensor, int]
             ) -> tuple[torch.Tensor, ...]:
    """The first ``counts[i]`` entries of row ``req[i]`` of [max_num_reqs, stride] tables
    given as (pointer, stride), flattened: the index i of each, then its value in every
    table."""
    i, j, _ = ranges(counts)
    return (i, *(pointer(ptr)[req[i] * int(stride) + j] for ptr, stride in tables))


@torch_kernel(f"{LOGIT_BIAS}._bias_kernel")
def bias(grid, logits_ptr, logits_stride, vocab_size, expanded_idx_mapping_ptr,
         num_allowed_token_ids_ptr, allowed_token_ids_ptr, allowed_token_ids_stride,
         num_logit_bias_ptr, bias_token_ids_ptr, bias_token_ids_stride, bias_ptr, bias_stride,
         pos_ptr, min_lens_ptr, num_stop_token_ids_ptr, restore_when_all_masked_ptr,
         stop_token_ids_ptr, stop_token_ids_stride, BLOCK_SIZE, LOGITS_BLOCK_SIZE=None,
         CHECK_ALL_MASKED_ROWS=False) -> None:
    num_tokens = grid[0]
    vocab_size = int(vocab_size)
    if not num_tokens or vocab_size <= 0:
        return
    req = pointer(expanded_idx_mapping_ptr)[:num_tokens].long()
    # (Rows without a request, -1, are left alone: the kernel would read out of bounds.)
    valid = req >= 0
    safe = req.clamp(min=0)
    logits = _rows(logits_ptr, num_tokens, logits_stride, vocab_size)
    flat = pointer(logits_ptr)
    row_start = torch.arange(num_tokens) * int(logits_stride)

    def counts(ptr: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, pointer(ptr)[safe].long(), 0).clamp(0, BLOCK_SIZE)

    # Allowed token IDs: every other logit of the row becomes -inf.
    num_allowed = counts(num_allowed_token_ids_ptr)
    rows = (num_allowed > 0).nonzero().squeeze(1)
    if rows.numel():
        i, tokens = _entries(safe[rows], num_allowed[rows],
                             (allowed_token_ids_ptr, allowed_token_ids_stride))
        keep = torch.zeros(rows.numel(), vocab_size, dtype=torch.bool)
        keep[i, tokens.long()] = True
        logits[rows] = logits[rows].masked_fill(~keep, _NEG_INF)

    # Logit bias, added in fp32 (token IDs of a request are distinct: a dict's keys).
    num_bias = counts(num_logit_bias_ptr)
    rows = (num_bias > 0).nonzero().squeeze(1)
    if rows.numel():
        i, tokens, values = _entries(safe[rows], num_bias[rows],
                                     (bias_token_ids_ptr, bias_token_ids_stride),
                                     (bias_ptr, bias_stride))
        dst = row_start[rows][i] + tokens.long()
        flat[dst] = (flat[dst].float() + values.float()).to(flat.dtype)

    # Min tokens: stop tokens are banned until the sequence reaches its minimum length.
    num_stop = counts(num_stop_token_ids_ptr)
    pos = pointer(pos_ptr)[:num_tokens].long()
    min_len = pointer(min_lens_ptr)[safe].long()
    rows = ((num_stop > 0) & (pos + 1 < min_len)).nonzero().squeeze(1)
    if not rows.numel():
        return
    i, tokens = _entries(safe[rows], num_stop[rows], (stop_token_ids_ptr, stop_token_ids_stride))
    dst = row_start[rows][i] + tokens.long()
    saved = flat[dst].clone()
    flat[dst] = _NEG_INF
    if CHECK_ALL_MASKED_ROWS:
        # Rows asking for it get their stop tokens back when nothing else is left
        # (every logit -inf, NaNs ignored as the interpreter's nanmax does); only the
        # finite ones.
        restore = pointer(restore_when_all_masked_ptr)[safe[rows]] != 0
        row_logits = logits[rows].float()
        all_masked = (torch.isnan(row_logits) | (row_logits == _NEG_INF)).all(dim=1)
        back = (restore & all_masked)[i] & torch.isfinite(saved.float())
        flat[dst[back]] = saved[back]


# ----------------------------------------------------------------------- penalties.py


@torch_kernel(f"{PENALTIES}._penalties_kernel")
def penalties(grid, logits_ptr, logits_stride, expanded_idx_mapping_ptr, token_ids_ptr,
              expanded_local_pos_ptr, repetition_penalty_ptr, frequency_penalty_ptr,
              presence_penalty_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride,
              output_bin_counts_ptr, output_bin_counts_stride, vocab_size,
              BLOCK_SIZE) -> None:
    num_tokens = grid[0]
    width = min(int(vocab_size), grid[1] * BLOCK_SIZE)
    if not num_tokens or width <= 0:
        return
    req = pointer(expanded_idx_mapping_ptr)[:num_tokens].long()
    # (Rows without a request, -1, are left alone: the kernel would read out of bounds.)
    safe = req.clamp(min=0)
    rep = pointer(repetition_penalty_ptr)[safe]
    freq = pointer(frequency_penalty_ptr)[safe]
    pres = pointer(presence_penalty_ptr)[safe]
    use_rep = rep != 1.0
    rows = ((req >= 0) & (use_rep | (freq != 0.0) | (pres != 0.0))).nonzero().squeeze(1)
    if not rows.numel():
        return
    req, rep, freq, pres, use_rep = safe[rows], rep[rows], freq[rows], pres[rows], use_rep[rows]

    counts = _rows(output_bin_counts_ptr, int(req.max()) + 1, output_bin_counts_stride,
                   width)[req]
    # This step's draft tokens before each position count as output already: those of
    # the row's request at positions 1..pos of its rows (token_ids[row - pos + 1 .. row]).
    local_pos = pointer(expanded_local_pos_ptr)[rows].long()
    k, j, _ = ranges(local_pos.clamp(min=0))
    if k.numel():
        prev = pointer(token_ids_ptr)[rows[k] - local_pos[k] + 1 + j].long()
        inside = (prev >= 0) & (prev < width)  # (no column matches the others)
        counts.index_put_((k[inside], prev[inside]),
                          torch.ones(int(inside.sum()), dtype=counts.dtype), accumulate=True)
    in_output = counts > 0

    logits = _rows(logits_ptr, num_tokens, logits_stride, width)
    x = logits[rows].float()
    rep_rows = use_rep.nonzero().squeeze(1)
    if rep_rows.numel():
        # Tokens of the prompt (a bit each in int32 words) or the output are penalized:
        # positive logits divided by the penalty, the others multiplied.
        words = -(-width // 32)
        packed = _rows(prompt_bin_mask_ptr, int(req.max()) + 1, prompt_bin_mask_stride,
                       words)[req[rep_rows]].long()
        in_prompt = ((packed[:, :, None] >> torch.arange(32)) & 1).bool()
        in_prompt = in_prompt.view(rep_rows.numel(), words * 32)[:, :width]
        r = rep[rep_rows, None]
        scale = torch.where(in_prompt | in_output[rep_rows], r, torch.ones_like(r))
        xr = x[rep_rows]
        x[rep_rows] = xr * torch.where(xr > 0, torch.ones_like(scale) / scale, scale)
    x = x - freq[:, None] * counts.float()
    x = x - pres[:, None] * in_output.float()
    logits[rows] = x.to(logits.dtype)


@torch_kernel(f"{PENALTIES}._bincount_kernel")
def bincount(grid, expanded_idx_mapping_ptr, all_token_ids_ptr, all_token_ids_stride,
             prompt_len_ptr, prefill_len_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride,
             output_bin_counts_ptr, output_bin_counts_stride, BLOCK_SIZE) -> None:
    num_tokens, num_blocks = grid
    span = num_blocks * BLOCK_SIZE  # the positions the grid covers
    if not num_tokens or span <= 0:
        return
    req = pointer(expanded_idx_mapping_ptr)[:num_tokens].long()
    prompt_len = pointer(prompt_len_ptr)[req].long()
    prefill_len = pointer(prefill_len_ptr)[req].long()
    position = torch.arange(span)
    # A block starting at or past the prefill length is skipped whole.
    covered = (position // BLOCK_SIZE * BLOCK_SIZE)[None, :] < prefill_len[:, None]
    in_prompt = covered & (position[None, :] < prompt_len[:, None])
    in_output = (covered & (position[None, :] >= prompt_len[:, None])
                 & (position[None, :] < prefill_len[:, None]))
    if not (in_prompt.any() or in_output.any()):
        return
    src = req[:, None] * int(all_token_ids_stride) + position[None, :]
    all_token_ids = pointer(all_token_ids_ptr)

    # Prompt tokens set their bit (token % 32 of word token // 32), OR-ed into the mask.
    t, p = in_prompt.nonzero(as_tuple=True)
    if t.numel():
        tokens = all_token_ids[src[t, p]].long()
        reqs, inverse = torch.unique(req, return_inverse=True)
        words = int(tokens.max()) // 32 + 1
        present = torch.zeros(reqs.numel(), words * 32, dtype=torch.bool)
        present[inverse[t], tokens] = True
        # Little-endian bytes of bits, read as int32 words (x86 and ARM hosts).
        bits = torch.from_numpy(
            np.packbits(present.numpy(), axis=1, bitorder="little").view("<i4"))
        r, w = bits.nonzero(as_tuple=True)
        mask = pointer(prompt_bin_mask_ptr)
        dst = reqs[r] * int(prompt_bin_mask_stride) + w
        mask[dst] = mask[dst] | bits[r, w]

    # Output tokens (between the prompt and the prefill length) are counted.
    t, p = in_output.nonzero(as_tuple=True)
    if t.numel():
        tokens = all_token_ids[src[t, p]].long()
        out = pointer(output_bin_counts_ptr)
        out.index_put_((req[t] * int(output_bin_counts_stride) + tokens,),
                       torch.ones(t.numel(), dtype=out.dtype), accumulate=True)


# ------------------------------------------------------------------------- logprob.py


@torch_kernel(f"{LOGPROB}._topk_log_softmax_kernel")
def topk_log_softmax(grid, output_ptr, logits_ptr, logits_stride, topk_ids_ptr,
                     topk_ids_stride, topk, vocab_size, BLOCK_SIZE,
                     TOPK_BLOCK_SIZE=None) -> None:
    num_rows = grid[0]
    vocab_size, topk = int(vocab_size), int(topk)
    if not num_rows or topk <= 0 or vocab_size <= 0:
        return
    logits = _rows(logits_ptr, num_rows, logits_stride, vocab_size)
    num_blocks = -(-vocab_size // BLOCK_SIZE)
    x = torch.zeros(num_rows, num_blocks * BLOCK_SIZE, dtype=torch.float32)
    x[:, :vocab_size] = logits
    # NaNs are skipped by the maximum (the interpreter's nanmax).
    max_val = x[:, :vocab_size].masked_fill(torch.isnan(x[:, :vocab_size]), _NEG_INF)
    max_val = max_val.amax(dim=1)
    # exp and the block sums in NumPy, as the interpreter computes them (its exp differs
    # from torch's in the last bit; a block's np.sum is pairwise), the block sums then
    # accumulated in order: the log-softmax comes out bit for bit.
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x.numpy() - max_val.numpy()[:, None])
        e[:, vocab_size:] = 0.0
        block_sums = e.reshape(num_rows, num_blocks, BLOCK_SIZE).sum(axis=2)
        se = np.cumsum(block_sums, axis=1, dtype=np.float32)[:, -1]
        with np.errstate(divide="ignore"):
            lse = torch.from_numpy(np.log(se))
    ids = _rows(topk_ids_ptr, num_rows, topk_ids_stride, topk).long()
    picked = pointer(logits_ptr)[torch.arange(num_rows)[:, None] * int(logits_stride) + ids]
    out = picked.float() - max_val[:, None] - lse[:, None]
    pointer(output_ptr)[:num_rows * topk].view(num_rows, topk).copy_(out)


@torch_kernel(f"{LOGPROB}._ranks_kernel")
def ranks(grid, output_ptr, logits_ptr, logits_stride, token_ids_ptr, vocab_size,
          BLOCK_SIZE) -> None:
    num_rows = grid[0]
    vocab_size = int(vocab_size)
    if not num_rows:
        return
    logits = _rows(logits_ptr, num_rows, logits_stride, vocab_size)
    token = pointer(token_ids_ptr)[:num_rows].long()
    x = pointer(logits_ptr)[torch.arange(num_rows) * int(logits_stride) + token]
    n = (logits >= x[:, None]).sum(dim=1)
    # The last block's padding loads as -inf, which ranks with a sampled -inf.
    padding = -(-vocab_size // BLOCK_SIZE) * BLOCK_SIZE - vocab_size
    n += torch.where(x == _NEG_INF, padding, 0)
    out = pointer(output_ptr)[:num_rows]
    out.copy_(n.to(out.dtype))


# --------------------------------------------------------------- structured_outputs.py


@torch_kernel("vllm.v1.worker.gpu.structured_outputs._apply_grammar_bitmask_kernel")
def grammar_bitmask(grid, logits_ptr, logits_stride, logits_indices_ptr, cu_num_logits_ptr,
                    bitmask_ptr, bitmask_stride, vocab_size, MASK_STRIDE, BLOCK_SIZE):
    """Bitmask row i masks logits row ``cu_num_logits[req] + position`` (mapping i =
    req * MASK_STRIDE + position; positions past the request's logits rows skip): a token
    whose bit is 0 gets -inf."""
    n = grid[0]
    mapping = logits_indices_ptr[:n].long()
    req, pos = mapping // MASK_STRIDE, mapping % MASK_STRIDE
    cu = cu_num_logits_ptr.long()
    first = cu[req]
    active = pos < cu[req + 1] - first
    if not bool(active.any()):
        return None
    packed = _rows(bitmask_ptr, n, bitmask_stride, bitmask_stride)[active]
    bits = (packed[:, :, None] >> torch.arange(32, dtype=packed.dtype)) & 1
    allowed = bits.reshape(packed.shape[0], -1)[:, :vocab_size] != 0
    rows = (first + pos)[active]
    num_rows = int(rows.max()) + 1
    logits = _rows(logits_ptr, num_rows, logits_stride, vocab_size)
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
    return None
