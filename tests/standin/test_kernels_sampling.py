"""The PyTorch versions of V2's sampling kernels (cpu_standin.kernels.sampling)
and the random-number replicas they use (``rng``), against the Triton originals run in
Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vllm.v1.worker.cpu.shm  # noqa: F401  (as the CPU worker: UVA buffers in plain memory)
from kernel_harness import run_both
from vllm.triton_utils import tl, triton
from vllm.v1.worker.gpu.sample import gumbel, logit_bias, logprob, penalties

from cpu_standin import kernels
from cpu_standin.kernels import rng

# ---------------------------------------------------------------------------------- rng

_SEEDS = [0, 1, -1, 12345, -(2**63), 2**63 - 1, 0x1234_5678_9ABC_DEF0, -987654321987]
_POSITIONS = [0, 1, 7, 2**31 - 1, 2**31, 2**32 + 5, 2**40 + 3]


@triton.jit
def _hash_kernel(out_ptr, seeds_ptr, pos_ptr, num_offsets, FN: tl.constexpr,
                 BLOCK: tl.constexpr):
    i = tl.program_id(0)
    seed = tl.load(seeds_ptr + i)
    pos = tl.load(pos_ptr + i)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < num_offsets
    if FN == 0:
        value = gumbel.murmur3_hash32(seed, pos, offsets).to(tl.int64)
    elif FN == 1:
        value = gumbel.murmur3_hash32(seed, pos, offsets, domain=0x9E3779B9).to(tl.int64)
    elif FN == 2:
        value = gumbel.murmur3_uniform32(seed, pos, offsets).to(tl.float64)
    elif FN == 3:
        value = gumbel.murmur3_uniform64(seed, pos, offsets)
    elif FN == 4:  # the fp32 noise of gumbel_noised_argmax
        u = gumbel.murmur3_uniform32(seed, pos, offsets)
        value = (-tl.log(-gumbel._log1p_neg_stable(u))).to(tl.float64)
    elif FN == 5:  # the fp64 noise
        value = -tl.log(-tl.log(gumbel.murmur3_uniform64(seed, pos, offsets)))
    elif FN == 6:
        value = gumbel.tl_rand32(seed, pos + offsets, includes_zero=True).to(tl.float64)
    elif FN == 7:
        value = gumbel.tl_rand32(seed, pos + offsets, includes_zero=False).to(tl.float64)
    else:
        value = gumbel.spec_step_seed(seed, offsets).to(tl.int64)
    tl.store(out_ptr + i * BLOCK + offsets, value, mask=mask)


def _triton(fn: int, seeds: torch.Tensor, pos: torch.Tensor, num_offsets: int,
            dtype: torch.dtype) -> torch.Tensor:
    block = triton.next_power_of_2(num_offsets)
    out = torch.zeros(seeds.numel(), block, dtype=dtype)
    _hash_kernel[(seeds.numel(),)](out, seeds, pos, num_offsets, FN=fn, BLOCK=block)
    return out[:, :num_offsets]


def _seeds_positions(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.tensor(_SEEDS + torch.randint(-2**62, 2**62, (n,), generator=gen).tolist())
    pos = torch.tensor((_POSITIONS * 3)[:len(_SEEDS)]
                       + torch.randint(0, 2**20, (n,), generator=gen).tolist())
    return seeds, pos


@pytest.mark.parametrize("fn", range(9))
def test_rng(fn: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(fn)
    seeds, pos = _seeds_positions(6, gen)
    num_offsets = 300
    offsets = torch.arange(num_offsets, dtype=torch.int32)
    s, p = seeds[:, None], pos[:, None]
    if fn in (0, 1):
        want = _triton(fn, seeds, pos, num_offsets, torch.int64)
        got = rng.murmur3_hash32(s, p, offsets, domain=0x9E3779B9 if fn else 0)
    elif fn == 2:
        want = _triton(fn, seeds, pos, num_offsets, torch.float64).float()
        got = rng.murmur3_uniform32(s, p, offsets)
    elif fn == 3:
        want = _triton(fn, seeds, pos, num_offsets, torch.float64)
        got = rng.murmur3_uniform64(s, p, offsets)
    elif fn in (4, 5):
        want = _triton(fn, seeds, pos, num_offsets, torch.float64)
        got = rng.gumbel_noise(s, p, offsets, use_fp64=fn == 5)
        if fn == 4:
            want = want.float()
        # computed in chunks of columns over large vocabularies
        monkeypatch.setattr(rng, "_CHUNK", 256)
        assert torch.equal(rng.gumbel_noise(s, p, offsets, use_fp64=fn == 5), got)
        # the drafter's stream: the position salted
        salted = rng.gumbel_noise(s, p - rng.DRAFT_NOISE_SALT, offsets, use_fp64=fn == 5,
                                  is_drafting=True)
        assert torch.equal(salted, got)
    elif fn in (6, 7):
        # Positions as the rejection sampler passes them (int64), many per seed.
        want = _triton(fn, seeds, pos, num_offsets, torch.float64).float()
        got = rng.tl_rand32(s, p + offsets.long(), includes_zero=fn == 6)
        if fn == 6:
            assert torch.equal(got, rng.philox_rand(s, p + offsets.long()))
        assert got.min() > 0 or fn == 6
    else:
        want = _triton(fn, seeds, pos, num_offsets, torch.int64)
        got = rng.spec_step_seed(s, offsets)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_rng_scalars() -> None:
    # 0-d operands (one seed, one position) broadcast as tensors do.
    got = rng.murmur3_hash32(torch.tensor(-5), torch.tensor(9), torch.arange(4))
    assert got.shape == (4,)
    assert torch.equal(got, rng.murmur3_hash32(torch.tensor([-5]), 9, np.arange(4)))
    assert rng.tl_rand32(3, torch.tensor(11), includes_zero=False).shape == ()


def test_log1p_neg_stable() -> None:
    u = torch.cat([torch.tensor([0.0, 1e-30, 0.2499999, 0.25, 0.5, 0.9999999]),
                   torch.rand(2000, generator=torch.Generator().manual_seed(3))])
    got = rng.log1p_neg_stable(u)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.log1p(-u.double()), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------- gumbel.py


def rand(gen: torch.Generator, low: int, high: int, *shape: int,
         dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


def randn_logits(gen: torch.Generator, num_tokens: int, vocab: int, pad: int = 0,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [num_tokens, vocab], rows ``pad`` wider than the vocabulary (strided)."""
    return (torch.randn(num_tokens, vocab + pad, generator=gen) * 3).to(dtype)[:, :vocab]


def temperatures(gen: torch.Generator, max_reqs: int) -> torch.Tensor:
    temp = torch.rand(max_reqs, generator=gen) * 2
    temp[0::4], temp[1::4] = 0.0, 1.0  # greedy, and untouched
    return temp


@pytest.mark.parametrize("num_tokens,vocab,dtype", [
    (0, 100, torch.float32), (1, 50, torch.float32), (7, 9000, torch.float32),
    (5, 300, torch.bfloat16)])
def test_temperature(num_tokens: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10 + num_tokens)
    max_reqs = 8
    big = randn_logits(gen, num_tokens, vocab, pad=5, dtype=dtype)
    mapping = rand(gen, 0, max_reqs, num_tokens)
    # bf16: Triton's interpreter truncates the quotient where compiled Triton (and this
    # version) rounds to nearest.
    run_both(f"{gumbel.__name__}._temperature_kernel", gumbel.apply_temperature, big,
             mapping, temperatures(gen, max_reqs), exact=dtype == torch.float32, rtol=1e-2)


def gumbel_locals(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature,
                  is_drafting, use_fp64=False, bias=None):
    """The first launch of gumbel_sample alone: its per-block maxima and argmaxes."""
    num_tokens, vocab_size = logits.shape
    num_blocks = triton.cdiv(vocab_size, 1024)
    local_argmax = torch.full((num_tokens, num_blocks), -7, dtype=torch.int64)
    local_max = torch.full((num_tokens, num_blocks), -7.0,
                           dtype=torch.float64 if use_fp64 else torch.float32)
    gumbel._gumbel_sample_kernel[(num_tokens, num_blocks)](
        local_argmax, local_argmax.stride(0), local_max, local_max.stride(0),
        None, 0, 0, None, None, 0, None,
        logits, logits.stride(0), bias, bias.stride(0) if bias is not None else 0,
        expanded_idx_mapping, seed, pos, temperature, vocab_size, BLOCK_SIZE=1024,
        IS_DRAFTING=is_drafting, APPLY_TEMPERATURE=apply_temperature, USE_FP64=use_fp64,
        PER_TOKEN_COL=False, HAS_BIAS=bias is not None)
    return local_argmax, local_max


def sampling_inputs(seed: int, num_tokens: int, vocab: int, dtype: torch.dtype = torch.float32,
                    ties: bool = False, nans: bool = False):
    gen = torch.Generator().manual_seed(seed)
    max_reqs = 6
    logits = randn_logits(gen, num_tokens, vocab, pad=3, dtype=dtype)
    if ties:  # few distinct values: greedy rows tie across blocks, the first one wins
        logits = logits.round().clamp(-2, 2)
    if nans and num_tokens:
        logits[0, 5] = float("nan")
        logits[-1, vocab - 1] = float("nan")
        logits[-1, 1100:1200] = float("-inf")
    mapping = rand(gen, 0, max_reqs, num_tokens)
    if num_tokens > 2:
        mapping[2] = -1  # a row without a request: greedy, seed 0
    temp = temperatures(gen, max_reqs)
    temp[1::4] = 0.5  # (1.0 would be "no temperature" only for _temperature_kernel)
    temp[5] = 1.0
    seeds = torch.randint(-2**63, 2**63 - 1, (max_reqs,), generator=gen, dtype=torch.int64)
    pos = rand(gen, 0, 5000, num_tokens, dtype=torch.int64)
    return logits, mapping, temp, seeds, pos


@pytest.mark.parametrize("kernel", ["_gumbel_sample_kernel", "_gumbel_combine_kernel"])
@pytest.mark.parametrize("num_tokens,vocab,apply_temperature,is_drafting,use_fp64,extra", [
    (0, 2500, False, False, False, None),
    (1, 100, False, False, False, None),
    (9, 2500, False, False, False, None),
    (9, 2500, True, True, False, None),
    (6, 3000, True, False, True, None),
    (8, 2100, False, False, False, "ties"),
    (5, 2100, True, False, False, "nans"),
    (7, 1500, True, False, False, "bias"),
    (7, 1500, False, False, False, "bias_bf16"),
    (6, 1500, False, True, False, "bf16"),
])
def test_gumbel_sample(kernel: str, num_tokens: int, vocab: int, apply_temperature: bool,
                       is_drafting: bool, use_fp64: bool, extra: str | None) -> None:
    logits, mapping, temp, seeds, pos = sampling_inputs(
        num_tokens + vocab, num_tokens, vocab,
        dtype=torch.bfloat16 if extra in ("bf16", "bias_bf16") else torch.float32,
        ties=extra == "ties", nans=extra == "nans")
    bias = None
    if extra and extra.startswith("bias"):
        gen = torch.Generator().manual_seed(5)
        bias = torch.randn(num_tokens, vocab, generator=gen).to(logits.dtype)
        if logits.dtype == torch.bfloat16:
            # Sums exact in bf16 (eighths below 16): the interpreter truncates the sum to
            # bf16 where compiled Triton and the PyTorch version round to nearest.
            logits = logits.float().mul(8).round().clamp(-120, 120).div(8).to(logits.dtype)
            bias = bias.float().mul(8).round().clamp(-120, 120).div(8).to(logits.dtype)
    kwargs = dict(apply_temperature=apply_temperature, is_drafting=is_drafting,
                  use_fp64=use_fp64, bias=bias)
    name = f"{gumbel.__name__}.{kernel}"
    # (NaN logits: torch.equal fails on NaN; assert_close without tolerance is exact.)
    exact = dict(exact=False, atol=0, rtol=0) if extra == "nans" else {}
    run_both(name, gumbel.gumbel_sample, logits, mapping, temp, seeds, pos, **kwargs, **exact)
    if kernel == "_gumbel_sample_kernel":
        run_both(name, gumbel_locals, logits, mapping, temp, seeds, pos, **kwargs, **exact)


def combine(local_argmax, local_max) -> torch.Tensor:
    sampled = torch.full((local_max.shape[0],), -5, dtype=torch.int64)
    num_blocks = local_max.shape[1]
    gumbel._gumbel_combine_kernel[(local_max.shape[0],)](
        local_argmax, local_argmax.stride(0), local_max, local_max.stride(0), sampled,
        num_blocks, PADDED_NUM_BLOCKS=triton.next_power_of_2(num_blocks))
    return sampled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gumbel_combine(dtype: torch.dtype) -> None:
    # Maxima as the first launch leaves them, and NaNs (the first NaN block wins).
    gen = torch.Generator().manual_seed(8)
    local_max = torch.randn(6, 5, generator=gen).round().to(dtype)  # ties
    local_max[1] = float("-inf")
    local_max[2, 3], local_max[3, 1:3] = float("nan"), float("nan")
    local_argmax = rand(gen, 0, 5000, 6, 5, dtype=torch.int64)
    run_both(f"{gumbel.__name__}._gumbel_combine_kernel", combine, local_argmax, local_max,
             exact=False, atol=0, rtol=0)


def test_gumbel_sample_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    # The noise does its job: sampled tokens follow softmax(logits / temperature) (with
    # the PyTorch versions alone: the interpreter would take a minute).
    for kernel in ("_gumbel_sample_kernel", "_gumbel_combine_kernel"):
        monkeypatch.setattr(gumbel, kernel, kernels.load()[f"{gumbel.__name__}.{kernel}"])
    vocab, num_tokens = 4, 4000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(num_tokens, vocab).contiguous()
    mapping = torch.zeros(num_tokens, dtype=torch.int32)
    sampled = gumbel.gumbel_sample(logits, mapping, torch.tensor([2.0]),
                                   torch.tensor([77]), torch.arange(num_tokens),
                                   apply_temperature=True, is_drafting=False)
    freq = torch.bincount(sampled, minlength=vocab).double() / num_tokens
    torch.testing.assert_close(freq, torch.softmax(logits[0].double() / 2, 0), atol=0.03,
                               rtol=0)


@pytest.mark.parametrize("per_token_col,row_mapping,source", [
    (False, False, False), (True, True, False), (True, False, True)])
def test_gumbel_sample_logits_cache(per_token_col: bool, row_mapping: bool,
                                    source: bool) -> None:
    num_tokens, vocab, max_reqs, num_cols = 6, 1300, 6, 3
    logits, mapping, temp, seeds, pos = sampling_inputs(40, num_tokens, vocab)
    gen = torch.Generator().manual_seed(41)
    cache = torch.full((max_reqs, num_cols, vocab + 4), 9.0)
    col = rand(gen, 0, num_cols, num_tokens) if per_token_col else torch.tensor(2)
    rows = None
    if row_mapping:
        rows = torch.tensor([3, -1, 0, 5, 1, 2], dtype=torch.int32)
    # Distinct requests: each (row, column) of the cache is written once.
    mapping = torch.tensor([4, 0, -1, 1, 5, 2], dtype=torch.int32)
    src = randn_logits(gen, num_tokens, vocab) if source else None
    for kernel in ("_gumbel_sample_kernel", "_gumbel_combine_kernel"):
        run_both(f"{gumbel.__name__}.{kernel}", gumbel.gumbel_sample, logits, mapping, temp,
                 seeds, pos, apply_temperature=True, is_drafting=True, logits_cache=cache,
                 logits_cache_col=col, logits_cache_source=src,
                 logits_cache_row_mapping=rows)


# --------------------------------------------------------------------- logit_bias.py


def table(rows: list[list], width: int, dtype: torch.dtype = torch.int32):
    """A [len(rows), width] table holding ``rows`` left-aligned (rest: junk), and the
    number of entries of each row."""
    out = torch.full((len(rows), width), 77, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out, torch.tensor([len(r) for r in rows], dtype=torch.int32)


@pytest.mark.parametrize("vocab,check_all_masked", [(300, False), (300, True), (9000, True)])
def test_logit_bias(vocab: int, check_all_masked: bool) -> None:
    gen = torch.Generator().manual_seed(vocab)
    v = vocab
    # Per request: allowed token IDs, logit bias, stop tokens (min tokens), restore flag.
    allowed, num_allowed = table([[3, 17, v - 1, 40, 41], [], [], [5, 6], [], []], 16)
    bias_ids, num_bias = table([[17, 3, 200], [], list(range(16)), [5], [9, v - 1], []], 16)
    bias_values = torch.randn(6, 16, generator=gen) * 4
    stop, num_stop = table([[40, 2], [], [], [5, 6], [7, 8, 9], [v - 2]], 8)
    restore = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)
    min_lens = torch.tensor([100, 0, 0, 50, 50, 20], dtype=torch.int32)
    # Token rows: request 3 has only stop tokens left (restored when the flag is checked);
    # request 5 reached its minimum length on its second row.
    mapping = torch.tensor([0, 1, 2, 3, 3, 4, 5, 5], dtype=torch.int32)
    pos = torch.tensor([10, 3, 4, 30, 31, 10, 18, 19], dtype=torch.int64)
    logits = randn_logits(gen, mapping.numel(), vocab, pad=2)
    logits[4, 6] = float("-inf")  # a stop token already -inf: stays -inf
    run_both(f"{logit_bias.__name__}._bias_kernel", logit_bias.apply_logit_bias, logits,
             mapping, pos, num_allowed, allowed, num_bias, bias_ids, bias_values, min_lens,
             num_stop, restore, stop, check_all_masked)


def test_logit_bias_no_tokens() -> None:
    allowed, num = table([[1]], 4)
    run_both(f"{logit_bias.__name__}._bias_kernel", logit_bias.apply_logit_bias,
             torch.zeros(0, 50), torch.zeros(0, dtype=torch.int32),
             torch.zeros(0, dtype=torch.int64), num, allowed, num, allowed,
             torch.zeros(1, 4), num, num, num, allowed, True)


# ---------------------------------------------------------------------- penalties.py


@pytest.mark.parametrize("block_size,vocab", [(1024, 2500), (8192, 9000), (1024, 700)])
def test_penalties(monkeypatch: pytest.MonkeyPatch, block_size: int, vocab: int) -> None:
    monkeypatch.setattr(penalties, "PENALTIES_BLOCK_SIZE", block_size)
    gen = torch.Generator().manual_seed(block_size + vocab)
    max_reqs = 6
    rep = torch.tensor([1.3, 1.0, 1.0, 0.8, 1.0, 1.0])
    freq = torch.tensor([0.0, 0.5, 0.0, -0.3, 0.0, 0.0])
    pres = torch.tensor([0.0, 0.0, -0.7, 1.1, 0.0, 0.0])
    prompt_bin_mask = rand(gen, -2**31, 2**31 - 1, max_reqs, -(-vocab // 32))
    output_bin_counts = rand(gen, 0, 3, max_reqs, vocab) * rand(gen, 0, 2, max_reqs, vocab)
    # Rows of a request with drafts: local positions 0, 1, 2 (earlier drafts counted).
    mapping = torch.tensor([3, 3, 3, 0, 0, 1, 2, 4], dtype=torch.int32)
    local_pos = torch.tensor([0, 1, 2, 0, 1, 0, 0, 0], dtype=torch.int32)
    token_ids = rand(gen, 0, vocab, mapping.numel())
    token_ids[2] = -1  # a placeholder draft: counts nothing
    token_ids[4] = token_ids[1]
    logits = randn_logits(gen, mapping.numel(), vocab, pad=1)
    logits[:, :8] = 0.0  # neither positive nor negative
    run_both(f"{penalties.__name__}._penalties_kernel", penalties.apply_penalties, logits,
             mapping, token_ids, local_pos, rep, freq, pres, prompt_bin_mask,
             output_bin_counts)


def test_penalties_none() -> None:
    logits = torch.randn(3, 40)
    run_both(f"{penalties.__name__}._penalties_kernel", penalties.apply_penalties, logits,
             torch.tensor([0, 1, 1], dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
             torch.zeros(3, dtype=torch.int32), torch.ones(2), torch.zeros(2),
             torch.zeros(2), torch.zeros(2, 2, dtype=torch.int32),
             torch.zeros(2, 40, dtype=torch.int32))


@pytest.mark.parametrize("lens", [
    [(5, 5), (1, 3)],
    [(1000, 2500), (2048, 2048), (0, 1030), (3, 1025)],
    [(7, 7)],
])
def test_bincount(lens: list[tuple[int, int]]) -> None:
    gen = torch.Generator().manual_seed(len(lens))
    max_reqs, vocab, max_len = 8, 700, 2600
    all_token_ids = rand(gen, 0, vocab, max_reqs, max_len)
    all_token_ids[:, 0], all_token_ids[:, 1] = 31, vocab - 1  # bit 31: the sign bit
    reqs = torch.randperm(max_reqs, generator=gen)[:len(lens)]
    prompt_len = rand(gen, 0, 50, max_reqs)
    prefill_len = prompt_len + rand(gen, 0, 50, max_reqs)
    for r, (p, f) in zip(reqs.tolist(), lens):
        prompt_len[r], prefill_len[r] = p, f
    prompt_bin_mask = rand(gen, -2**31, 2**31 - 1, max_reqs, -(-vocab // 32))
    output_bin_counts = rand(gen, 0, 5, max_reqs, vocab)
    run_both(f"{penalties.__name__}._bincount_kernel", penalties.bincount, reqs,
             all_token_ids, prompt_len, prefill_len, prompt_bin_mask, output_bin_counts,
             max(f for _, f in lens))


# ------------------------------------------------------------------------ logprob.py


@pytest.mark.parametrize("kernel", ["_topk_log_softmax_kernel", "_ranks_kernel"])
@pytest.mark.parametrize("num_rows,vocab,num_logprobs,dtype", [
    (0, 100, 3, torch.float32), (1, 50, 0, torch.float32), (5, 2500, 4, torch.float32),
    (4, 9000, 2, torch.float32), (3, 1500, 5, torch.bfloat16)])
def test_logprobs(kernel: str, num_rows: int, vocab: int, num_logprobs: int,
                  dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_rows + vocab)
    logits = randn_logits(gen, num_rows, vocab, pad=4, dtype=dtype)
    sampled = rand(gen, 0, vocab, num_rows, dtype=torch.int64)
    if num_rows > 2:
        logits[1, 1000:] = float("-inf")
        sampled[1] = vocab - 1  # ranked among the padding as well
        logits[2, sampled[2]] = logits[2].max()  # ties
        logits[2, 0] = logits[2].max()
    name = f"{logprob.__name__}.{kernel}"
    if kernel == "_ranks_kernel" and dtype != torch.float32:
        # Triton's interpreter compares bf16 values by their bits (it holds them as
        # uint16): ranks of bf16 logits are checked against those of the same values in
        # fp32 (the PyTorch version's, checked against the interpreter's below).
        run_both(name, logprob.compute_topk_scores, logits.float(), num_logprobs, sampled)
        ranks = [torch.empty(num_rows, dtype=torch.int64) for _ in range(2)]
        for out, x in zip(ranks, (logits, logits.float())):
            kernels.load()[name][(num_rows,)](out, x, x.stride(0), sampled, vocab,
                                              BLOCK_SIZE=8192)
        assert torch.equal(ranks[0], ranks[1])
        return
    run_both(name, logprob.compute_topk_scores, logits, num_logprobs, sampled)


def test_token_logprobs_wide() -> None:
    # More token IDs than the kernel gathers at once (1024).
    gen = torch.Generator().manual_seed(2)
    logits = randn_logits(gen, 2, 1500)
    token_ids = rand(gen, 0, 1500, 2, 1100, dtype=torch.int64)
    run_both(f"{logprob.__name__}._topk_log_softmax_kernel", logprob.compute_token_logprobs,
             logits, token_ids)


# ------------------------------------------------------------------ structured outputs


@pytest.mark.parametrize("vocab", [1000, 4096])
def test_grammar_bitmask(vocab: int) -> None:
    """Bitmask rows keyed (request, position) onto each request's logits rows; positions
    past a request's rows skipped (adaptive verification trims them)."""
    from vllm.v1.worker.gpu import structured_outputs as so

    gen = torch.Generator().manual_seed(vocab)
    stride, reqs = 5, 3
    cu = torch.tensor([0, 5, 7, 12], dtype=torch.int32)  # request 1: 2 rows of 5
    logits = torch.randn(12, vocab + 3, generator=gen)[:, :vocab]
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (reqs * stride, words), generator=gen,
                            dtype=torch.int32)
    mapping = torch.tensor([r * stride + p for r in range(reqs) for p in range(stride)],
                           dtype=torch.int32)
    block = so.GRAMMAR_BITMASK_BLOCK_SIZE

    def call(logits, mapping, cu, bitmask):  # noqa: ANN001, ANN202
        so._apply_grammar_bitmask_kernel[(mapping.numel(), triton.cdiv(vocab, block))](
            logits, logits.stride(0), mapping, cu, bitmask, bitmask.stride(0), vocab,
            MASK_STRIDE=stride, BLOCK_SIZE=block)

    _, (got, _) = run_both(f"{so.__name__}._apply_grammar_bitmask_kernel", call, logits,
                           mapping, cu, bitmask)
    masked = torch.isinf(got[0])
    assert masked.any() and not masked.all()
