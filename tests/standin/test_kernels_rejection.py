"""The PyTorch versions of DFlash's drafter-input kernel and of the rejection sampler's
kernels (cpu_standin.kernels.rejection) against the Triton originals run in
Triton's interpreter.

The rejection sampler's kernels are tested on the launches vLLM's own ``rejection_sample``
makes: a pass of it with the PyTorch versions records every launch (its arguments as they
were just before it), and each recorded launch is then run both ways by ``run_both``."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import vllm.v1.worker.cpu.shm  # noqa: F401  (as the CPU worker: UVA buffers in plain memory)
from kernel_harness import run_both, triton_kernel
from triton.runtime.errors import InterpreterError
from vllm.triton_utils import dispatcher, tl, triton
from vllm.v1.worker.gpu.spec_decode import rejection_sampler, rejection_sampler_utils
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

from cpu_standin import kernels
from cpu_standin.kernels import FALLBACK, LAUNCH_OPTIONS, rejection

DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
UTILS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
STATS = f"{UTILS}._compute_local_logits_stats_kernel"
REJECTION = f"{UTILS}._rejection_kernel"
RESAMPLE = f"{UTILS}._resample_kernel"
INSERT = f"{UTILS}._insert_resampled_kernel"
RECORDED = (STATS, REJECTION, RESAMPLE, INSERT)


def rand(gen: torch.Generator, low: int, high: int, *shape: int,
         dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen).to(dtype)


def cumsum0(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.long().cumsum(0)]).to(
        torch.int32)


# ------------------------------------------------------------- dflash/speculator.py


def dflash_case(seed: int, query_lens: list[int], num_rejected: list[int],
                num_sampled: list[int], steps: int = 3, anchor: bool = False,
                cp: tuple[int, int, int] = (1, 0, 1), max_model_len: int = 4096,
                override: int | None = None) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    max_reqs, block_size = 8, 4
    nq = steps if anchor else steps + 1
    num_reqs = len(query_lens)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    num_tokens = int(lens.sum())
    max_tokens = max(num_tokens, max_reqs * nq) + 24
    computed = rand(gen, 0, 300, num_reqs, dtype=torch.int64)
    positions = torch.cat([torch.arange(c, c + n) for c, n in
                           zip(computed.tolist(), query_lens)] + [torch.zeros(0)]).long()
    max_blocks = 1 + (400 + num_tokens + nq) // block_size
    block_table = rand(gen, 1, 10_000, max_reqs, max_blocks)
    block_table[torch.rand(block_table.shape, generator=gen) < 0.15] = 0  # null blocks
    input_batch = SimpleNamespace(
        num_reqs=num_reqs, num_scheduled_tokens=np.array(query_lens, dtype=np.int32),
        positions=torch.cat([positions, rand(gen, 0, 99, 5, dtype=torch.int64)]),
        query_start_loc=cumsum0(lens), idx_mapping=torch.randperm(max_reqs, generator=gen)[
            :num_reqs].to(torch.int32))
    buffers = SimpleNamespace(
        input_ids=rand(gen, -9, 0, max_tokens), positions=rand(gen, -9, 0, max_tokens,
                                                               dtype=torch.int64),
        is_padding=torch.rand(max_tokens, generator=gen) < 0.5,
        query_start_loc=rand(gen, -9, 0, max_reqs + 1), seq_lens=rand(gen, -9, 0, max_reqs))
    args = (
        buffers,
        rand(gen, -9, 0, max_tokens, dtype=torch.int64),  # query slot mapping
        rand(gen, -9, 0, max_tokens, dtype=torch.int64),  # context positions
        rand(gen, -9, 0, max_tokens, dtype=torch.int64),  # context slot mapping
        rand(gen, -9, 0, max_reqs * steps, dtype=torch.int64),  # sample indices
        rand(gen, -9, 0, max_reqs * steps, dtype=torch.int64),  # sample positions
        rand(gen, -9, 0, max_reqs * steps, dtype=torch.int64),  # sample idx mapping
        torch.full((max_reqs,), -1.0),  # temperature
        rand(gen, -9, 0, max_reqs, dtype=torch.int64),  # seeds
        input_batch,
        torch.tensor(num_sampled, dtype=torch.int32),
        torch.tensor(num_rejected, dtype=torch.int32),
        rand(gen, 0, 1000, max_reqs, 1, dtype=torch.int64),  # last sampled
        rand(gen, 0, 1000, max_reqs),  # next prefill tokens
        torch.rand(max_reqs, generator=gen),
        rand(gen, -(2**62), 2**62, max_reqs, dtype=torch.int64),
        block_table, block_size, cp[1], cp[0], cp[2],
        151_000,  # parallel drafting token
        nq, steps, max_reqs, max_tokens, max_model_len, anchor, override)
    return args


@pytest.mark.parametrize("case", [
    dict(query_lens=[4], num_rejected=[0], num_sampled=[4]),  # all accepted
    dict(query_lens=[4, 4, 1, 4], num_rejected=[3, 0, 0, 2], num_sampled=[1, 4, 1, 2]),
    # a chunked prefill (nothing sampled: the next prompt token goes first), over blocks
    dict(query_lens=[300, 4, 150], num_rejected=[0, 1, 0], num_sampled=[0, 3, 1], steps=8),
    dict(query_lens=[4, 4, 4], num_rejected=[1, 0, 3], num_sampled=[3, 4, 1],
         max_model_len=290),  # positions and seq_lens clamped
    dict(query_lens=[4, 2, 4], num_rejected=[2, 0, 1], num_sampled=[2, 2, 3],
         override=2),  # fewer requests than the batch
    dict(query_lens=[4, 4], num_rejected=[0, 2], num_sampled=[4, 2], anchor=True),
    dict(query_lens=[5, 3, 40], num_rejected=[2, 1, 0], num_sampled=[3, 2, 1],
         cp=(2, 1, 1), steps=4),
    dict(query_lens=[5, 3, 40], num_rejected=[2, 1, 0], num_sampled=[3, 2, 1],
         cp=(4, 2, 2), steps=4),
    dict(query_lens=[2] * 8, num_rejected=[1, 0] * 4, num_sampled=[1, 2] * 4,
         steps=1),  # a full batch: no padding rows
])
def test_prepare_dflash_inputs(case: dict) -> None:
    args = dflash_case(300 + len(case["query_lens"]) + case.get("steps", 3), **case)
    run_both(f"{DFLASH}._prepare_dflash_inputs_kernel", dflash.prepare_dflash_inputs, *args)


# ---------------------------------------------------------------- rejection_sampler.py


@pytest.mark.parametrize("num_logits", [0, 1, 9, 1500])
def test_gather_draft_sampled(num_logits: int) -> None:
    gen = torch.Generator().manual_seed(400 + num_logits)
    num_tokens, max_reqs = num_logits + 7, 8
    logits_indices = torch.randperm(num_tokens, generator=gen)[:num_logits].to(torch.int64)
    local_pos = rand(gen, 0, 4, num_logits)
    if num_logits:
        local_pos[0] = 0
    prefill_len = rand(gen, 0, 300, max_reqs)
    positions = rand(gen, 0, 400, num_tokens, dtype=torch.int64)
    run_both(f"{SAMPLER}._gather_draft_sampled_kernel", rejection_sampler.gather_draft_sampled,
             rand(gen, 0, 5000, num_tokens), positions, logits_indices,
             rand(gen, 0, max_reqs, num_logits), local_pos, prefill_len)


# ---------------------------------------------------------- rejection_sampler_utils.py


class Recorder:
    """Stands for a kernel in vLLM's module during a recording pass: keeps a copy of
    every launch's arguments (as they are before it), then runs the PyTorch version (the
    Triton kernel where it hands the launch back)."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches
        self.impl = kernels.load()[name]
        self.triton = triton_kernel(name)

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append((self.name, tuple(grid), *copy.deepcopy((args, kwargs))))
            result = self.impl.fn(tuple(grid), *args, **{
                k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
            if result is FALLBACK:
                return self.triton[grid](*args, **kwargs)
            return result
        return launch


def record(call, *args: Any, into: list | None = None, **kwargs: Any) -> tuple[list, Any]:
    """``call(*args, **kwargs)`` with the rejection sampler's kernels recorded (in
    ``into`` if given)."""
    launches: list = [] if into is None else into
    originals = {}
    for name in RECORDED:
        host, attr = dispatcher._resolve_kernel(name)
        originals[name] = (host, attr, getattr(host, attr))
        setattr(host, attr, Recorder(name, launches))
    try:
        result = call(*args, **kwargs)
    finally:
        for host, attr, original in originals.values():
            setattr(host, attr, original)
    return launches, result


def replay(name: str, grid: tuple, args: tuple, kwargs: dict) -> None:
    host, attr = dispatcher._resolve_kernel(name)
    getattr(host, attr)[grid](*args, **kwargs)


def check_launches(launches: list, fallbacks: tuple[str, ...] = ()) -> None:
    # Bit for bit, NaN for NaN: the outputs vLLM allocates empty keep their garbage where
    # the kernels write nothing (the same in both runs, NaNs included).
    for name, grid, args, kwargs in launches:
        run_both(name, replay, name, grid, args, kwargs, fallback=name in fallbacks,
                 exact=False, atol=0.0, rtol=0.0)


def batch(seed: int, plans: list[str], temps: list[float], vocab: int,
          steps: int | None = None) -> dict:
    """A verification batch: request i has one draft per letter of ``plans[i]``, drawn
    so that the target accepts it ('a'), rejects it ('r'), may do either ('?'), or a -1
    placeholder ('-'); temperature ``temps[i]`` (0: greedy)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, max_reqs = len(plans), 8
    steps = steps if steps is not None else max([len(p) for p in plans] + [1])
    lens = torch.tensor([len(p) + 1 for p in plans], dtype=torch.int64)
    cu = cumsum0(lens)
    num_logits = int(lens.sum())
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_reqs].to(torch.int32)
    expanded_idx = torch.repeat_interleave(idx_mapping, lens, output_size=num_logits)
    local_pos = torch.cat([torch.arange(n) for n in lens.tolist()] + [torch.zeros(0)]).to(
        torch.int32)
    pos = (rand(gen, 0, 2000, num_reqs, dtype=torch.int64).repeat_interleave(lens)
           + local_pos)
    logits = torch.randn(num_logits, vocab, generator=gen) * 3
    draft = rand(gen, 0, vocab, num_logits, dtype=torch.int64)  # (first of a request: input)
    temperature = torch.rand(max_reqs, generator=gen) + 0.5
    temperature[idx_mapping.long()] = torch.tensor(temps, dtype=torch.float32)
    for r, plan in enumerate(plans):
        greedy = temps[r] == 0.0
        for i, kind in enumerate(plan):
            row, token = int(cu[r]) + i, int(draft[int(cu[r]) + i + 1])
            if kind == "a":
                logits[row, token] = 40.0
            elif kind == "r":
                if greedy:
                    logits[row, token] = -40.0
                else:
                    logits[row, token] = -40.0
                    logits[row, (token + 1) % vocab] = 40.0
            elif kind == "?":
                logits[row, token] = 9.0 if greedy else 6.0
                logits[row, (token + 3) % vocab] = 9.0 if greedy else 6.0
            else:
                draft[row + 1] = -1
    return dict(target_logits=logits, draft_logits_cache=None, draft_sampled=draft,
                cu_num_logits=cu, pos=pos, idx_mapping=idx_mapping,
                expanded_idx_mapping=expanded_idx, expanded_local_pos=local_pos,
                temperature=temperature,
                seed=rand(gen, -(2**63), 2**63 - 1, max_reqs, dtype=torch.int64),
                num_speculative_steps=steps)


def sample(inputs: dict, **kwargs: Any) -> tuple[list, torch.Tensor, torch.Tensor]:
    launches, (sampled, num_sampled) = record(rejection_sampler_utils.rejection_sample,
                                              **inputs, **kwargs)
    return launches, sampled, num_sampled


GREEDY, HOT = 0.0, 0.8
CASES = [
    # (plans, temperatures, vocabulary)
    (["aaa", "aar", "raa", "r?a"], [GREEDY, GREEDY, HOT, HOT], 9000),
    (["aaaa", "aaaa"], [HOT, GREEDY], 9000),  # all accepted: bonus tokens
    (["", "a", ""], [HOT, GREEDY, 1.0], 9000),  # requests without drafts
    (["a-a", "-aa", "aa-", "-aa"], [GREEDY, HOT, HOT, GREEDY], 9000),  # placeholders
    (["????????", "????????", "????????", "????????"], [HOT, 1.3, GREEDY, 0.4], 3000),
    # 9 statistics blocks (padded to 16: np.sum's order), 65 resampling blocks
    (["ra", "a?", "?"], [1.0, GREEDY, HOT], 66000),
    (["r", "aar", "?"], [HOT, 2.0, GREEDY], 1024),  # one resample block exactly
    ([], [], 2000),  # no requests
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rejection_sample(case: int) -> None:
    plans, temps, vocab = CASES[case]
    inputs = batch(500 + case, plans, temps, vocab)
    launches, sampled, num_sampled = sample(inputs)
    assert [name for name, *_ in launches] == list(RECORDED)
    # The plans' certain outcomes.
    for r, plan in enumerate(plans):
        n = int(num_sampled[r])
        if set(plan) <= {"a"}:
            assert n == len(plan) + 1
        elif plan[0] in "r-":
            assert n == 1
    check_launches(launches)


@triton.jit
def _logsumexp_kernel(out_ptr, max_ptr, sumexp_ptr, num_blocks, PADDED: tl.constexpr):
    row = tl.program_id(0)
    lse = rejection_sampler_utils._compute_global_logsumexp(
        max_ptr, num_blocks, sumexp_ptr, num_blocks, row, num_blocks, PADDED)
    tl.store(out_ptr + row, lse)


@pytest.mark.parametrize("num_blocks", [1, 3, 9, 19])
def test_global_logsumexp(num_blocks: int) -> None:
    # The blocks' statistics combined over the padded block count, in np.sum's order.
    gen = torch.Generator().manual_seed(450 + num_blocks)
    rows = 64
    maxes = torch.randn(rows, num_blocks, generator=gen) * 4
    sums = torch.rand(rows, num_blocks, generator=gen) * 900 + 1
    maxes[0, 0], sums[0, 0] = float("-inf"), 0.0  # a block without a finite logit
    maxes[1], sums[1] = float("-inf"), 0.0  # a row without one: NaN
    padded = triton.next_power_of_2(num_blocks)
    want = torch.empty(rows)
    _logsumexp_kernel[(rows,)](want, maxes, sums, num_blocks, PADDED=padded)
    got = rejection._global_logsumexp(maxes.numpy(), sums.numpy(), padded)
    torch.testing.assert_close(torch.from_numpy(got), want, atol=0.0, rtol=0.0,
                               equal_nan=True)


@pytest.mark.parametrize("options", [dict(use_fp64=True),
                                     dict(skip_masked_vocab_blocks=True)])
def test_rejection_sample_options(options: dict) -> None:
    inputs = batch(600, ["r?", "aa", "-a", "?r"], [HOT, HOT, GREEDY, 1.0], 5000)
    # Top-k-like masking: most of the vocabulary -inf in some rows (whole blocks of it).
    logits = inputs["target_logits"]
    logits[1::2, 1500:] = float("-inf")
    logits[0, :1024] = float("-inf")
    launches, _, _ = sample(inputs, **options)
    check_launches(launches)


@pytest.mark.parametrize("plans", [["????", "??-?", "????", ""], ["", ""]])
def test_rejection_sample_synthetic(plans: list[str]) -> None:
    inputs = batch(650, plans, [HOT, GREEDY, GREEDY, HOT][:len(plans)], 2000, steps=4)
    rates = torch.tensor([0.9, 0.5, 0.7, 0.3])
    launches, _, _ = sample(inputs, synthetic_conditional_rates=rates)
    check_launches(launches)


def test_rejection_sample_duplicate_seeds_and_edges() -> None:
    # Equal seeds and positions in two requests, the largest seeds, a NaN-free tie.
    inputs = batch(700, ["?a", "?a", "a"], [HOT, HOT, GREEDY], 4000)
    inputs["seed"][:] = 2**63 - 1
    inputs["pos"][:] = 5
    logits = inputs["target_logits"]
    logits[5, :] = 0.0  # a flat greedy bonus row: the first token wins
    launches, _, _ = sample(inputs)
    check_launches(launches)


def test_rejection_sample_nan_logits() -> None:
    # NaN logits: maxima and argmaxes ignore them (as the interpreter's nanmax), sums and
    # logsumexps turn NaN.
    inputs = batch(750, ["a?", "?a", "aa"], [GREEDY, HOT, 1.0], 3000)
    logits = inputs["target_logits"]
    logits[0, [5, 2000, 2999]] = float("nan")
    logits[3, 17] = float("nan")
    logits[8, :100] = float("nan")  # a bonus row, resampled
    launches, _, _ = sample(inputs)
    check_launches(launches)


def test_rejection_sample_draft_logits() -> None:
    # Probabilistic drafting: the drafter's logits (before temperature) are cached.
    plans, temps = ["aa", "a-", "ar", "aa"], [HOT, 1.2, GREEDY, 1.0]
    inputs = batch(800, plans, temps, 9000)
    gen = torch.Generator().manual_seed(801)
    values = torch.randn(8, 2, 9500, generator=gen)  # (wider than the target vocabulary)
    cu, draft = inputs["cu_num_logits"], inputs["draft_sampled"]
    for r in range(len(plans)):
        req = int(inputs["idx_mapping"][r])
        for i in range(2):
            token = int(draft[int(cu[r]) + i + 1])
            if token >= 0:
                values[req, i, token] = 4.0
    inputs["draft_logits_cache"] = SimpleNamespace(values=values, row_mapping=None)
    launches, _, _ = sample(inputs)
    check_launches(launches)

    # Rows mapped, one sampled request rejecting: its residual needs libdevice's log1p,
    # handed to Triton, whose interpreter does not run it either.
    inputs = batch(810, ["ra", "aa"], [HOT, GREEDY], 3000)
    inputs["draft_logits_cache"] = SimpleNamespace(
        values=torch.randn(4, 2, 3000, generator=gen),
        row_mapping=torch.tensor([3, 2, 1, 0, -1, 1, 2, 3], dtype=torch.int32))
    launches = record_until_failure(inputs)
    assert [name for name, *_ in launches] == [STATS, REJECTION, RESAMPLE]
    check_launches(launches[:2])
    name, grid, args, kwargs = launches[2]
    assert kernels.load()[RESAMPLE].fn(grid, *args, **kwargs) is FALLBACK


def record_until_failure(inputs: dict) -> list:
    """The launches of a pass that Triton's interpreter fails, recorded up to there."""
    launches: list = []
    with pytest.raises(InterpreterError):
        record(rejection_sampler_utils.rejection_sample, into=launches, **inputs)
    return launches


@pytest.mark.parametrize("method", ["block", "fly", "watermark"])
def test_rejection_sample_fallbacks(method: str) -> None:
    inputs = batch(900, ["a?", "ra"], [HOT, GREEDY], 2000)
    num_logits = inputs["target_logits"].shape[0]
    if method == "block":
        options: dict = dict(use_block_verification=True)
        fallbacks: tuple[str, ...] = (REJECTION, RESAMPLE)
    elif method == "fly":
        options, fallbacks = dict(fly_window_size=1), (REJECTION,)
    else:
        gen = torch.Generator().manual_seed(901)
        options = dict(contexts=rand(gen, -1, 2000, num_logits, 2),
                       watermarking=torch.tensor([True, False] * 4), watermark_key=2**40 + 7)
        fallbacks = (RESAMPLE,)
    launches, _, _ = sample(inputs, **options)
    check_launches(launches, fallbacks)
