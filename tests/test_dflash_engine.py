"""vLLM's own method "dflash" loads and runs the tiny pair on CPU, in-process, and its greedy
output equals the target's own (the baseline that ddtree must match too)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,"]


def generate(tiny_models: Path, speculative_config: dict | None) -> tuple[list, object]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
              seed=0, disable_log_stats=False, speculative_config=speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.slow
def test_dflash_tiny_pair_is_lossless_on_cpu(tiny_models: Path) -> None:
    plain, _ = generate(tiny_models, None)
    spec, llm = generate(tiny_models, {"method": "dflash", "model": str(tiny_models / "drafter"),
                                       "num_speculative_tokens": 7})
    assert all(len(t) == 40 for t in spec)
    assert spec == plain
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_draft_tokens"].value
    assert drafts > 0, "the drafter never ran"


def repeat_the_last_token(monkeypatch) -> None:
    """Method dflash's drafter still runs, but its drafts become the last sampled token
    repeated: drafts a near-uniform target seldom agrees with, so accepting them too often
    shows as repeats that sampling without speculation almost never makes."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    propose = DFlashProposer.propose

    def repeated(self, *args, next_token_ids, **kwargs):
        drafts = propose(self, *args, next_token_ids=next_token_ids, **kwargs)
        return next_token_ids.view(-1, 1).expand_as(drafts).to(drafts.dtype).contiguous()

    monkeypatch.setattr(DFlashProposer, "propose", repeated)


@pytest.mark.slow
def test_dflash_sampling_matches_the_target_distribution(tiny_models: Path,
                                                         monkeypatch) -> None:
    """Temperature 1 over the whole vocabulary (issue 30): the 2nd and 3rd generated tokens,
    the ones the chain speculates, are distributed as without speculation, and the 2nd
    repeats the 1st as rarely. Threshold: the test fails when a chi-square p-value is below
    0.001 (fixed seeds: deterministic). With vLLM's CPU stand-in for the Triton expand
    kernel unfixed (patch 0010), every p-value is 0 and most 2nd tokens repeat the 1st."""
    from engine_helpers import chi_square_p_value
    from vllm import LLM, SamplingParams

    repeat_the_last_token(monkeypatch)
    n, samples = 3000, {}
    for name, spec in (("plain", None), ("dflash", {"method": "dflash", "num_speculative_tokens": 2,
                                                    "model": str(tiny_models / "drafter")})):
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=128,
                  seed=0, dtype="float32", max_num_seqs=64, speculative_config=spec)
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1000 + i)
                  for i in range(n)]
        outputs = llm.generate(["def main():"] * n, params, use_tqdm=False)
        samples[name] = [o.outputs[0].token_ids for o in outputs]
        del llm
    plain, spec = samples["plain"], samples["dflash"]
    assert all(len(t) == 3 for t in spec)
    for position in (1, 2):
        p = chi_square_p_value([t[position] for t in plain], [t[position] for t in spec])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"
    p = chi_square_p_value([t[1] == t[0] for t in plain], [t[1] == t[0] for t in spec])
    repeats = sum(t[1] == t[0] for t in spec), sum(t[1] == t[0] for t in plain)
    assert p > 1e-3, f"2nd token repeats the 1st {repeats[0]} times, {repeats[1]} without"


def cpu_sampler_kernels() -> None:
    """vLLM installs its CPU stand-ins for the sampler's Triton kernels when a worker starts;
    a test calling the sampler directly installs them itself (once; nothing where Triton
    runs, e.g. on a GPU)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import _registry

    if "vllm.v1.sample.rejection_sampler.expand_kernel" not in _registry:
        current_platform.register_triton_kernel_overrides()


def test_expand_batch_to_tokens_keeps_every_dtype() -> None:
    """The sampler expands per-request float32 temperatures and top-p and int32 top-k to
    per-draft values; on CPU vLLM's stand-in dropped all but int64 (issue 30)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    cpu_sampler_kernels()
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2, 0 and 3 drafts
    for values in ([2.5, 1.5, 0.0], [20, 3, 0]):
        for dtype in (torch.float32, torch.int32, torch.int64):
            x = torch.tensor(values).to(dtype)
            got = expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1)
            want = torch.cat([x[:1].repeat(2), torch.ones(3, dtype=dtype)])
            assert got.dtype == dtype and torch.equal(got, want), (dtype, got)


def test_top_k_top_p_of_drafts_at_qwen3_vocab() -> None:
    """Issue 30's crash: top-k and top-p of 24 requests' 7 drafts each over Qwen3's 151,936
    tokens. Per request temperature, k and p, checked against torch.topk per draft."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    cpu_sampler_kernels()
    reqs, drafts, vocab = 24, 7, 151936
    logits = torch.randn(reqs * drafts, vocab, generator=torch.Generator().manual_seed(0))
    temperature = torch.linspace(0.5, 1.5, reqs)
    top_k = torch.arange(5, 5 + reqs, dtype=torch.int32)
    top_p = torch.linspace(0.8, 0.99, reqs)
    metadata = SimpleNamespace(all_greedy=False, temperature=temperature, top_k=top_k,
                               top_p=top_p)
    cu = torch.arange(1, reqs + 1, dtype=torch.int32) * drafts
    out = apply_sampling_constraints(logits.clone(), cu, metadata)
    for row in range(reqs * drafts):
        r = row // drafts
        scaled = logits[row] / temperature[r]
        top = scaled.topk(int(top_k[r]))
        kept = out[row].isfinite().nonzero().view(-1)
        assert set(kept.tolist()) <= set(top.indices.tolist()) and len(kept) > 0, row
        assert torch.allclose(out[row, kept], scaled[kept])
        # Top-p keeps the most likely of the top k: at least p of their mass, and no
        # token more than that needs.
        mass = top.values.softmax(-1)[:len(kept)].sum()
        assert set(kept.tolist()) == set(top.indices[:len(kept)].tolist())
        assert mass >= top_p[r] - 1e-5 or len(kept) == 1, (row, mass)
        assert mass - top.values.softmax(-1)[len(kept) - 1] < top_p[r] + 1e-5, (row, mass)


@pytest.fixture(scope="session")
def qwen3_vocab_models(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pair with Qwen3's 151,936-token vocabulary: the target's embedding and LM
    head get random rows for the ids past the tokenizer's."""
    from safetensors.torch import load_file, save_file

    out, vocab = tmp_path_factory.mktemp("qwen3_vocab"), 151936
    shutil.copytree(tiny_models, out, dirs_exist_ok=True)
    weights = load_file(tiny_models / "target" / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        weights[name] = torch.cat([w, torch.randn(vocab - len(w), w.shape[1], generator=gen)
                                   * w.std()])
    save_file(weights, out / "target" / "model.safetensors", metadata={"format": "pt"})
    for model in ("target", "drafter"):
        config = json.loads((out / model / "config.json").read_text())
        (out / model / "config.json").write_text(json.dumps(config | {"vocab_size": vocab}))
    return out


@pytest.mark.slow
def test_dflash_top_k_top_p_at_qwen3_vocab(qwen3_vocab_models: Path) -> None:
    """Issue 30's crash, in the engine: method dflash, top-k 20 and top-p 0.95, 24 concurrent
    requests, Qwen3's vocabulary. Every token is among the target's 20 most likely: its
    position's 20 logprobs (the target's) include it."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(qwen3_vocab_models / "target"), enforce_eager=True, max_model_len=128,
              seed=0, dtype="float32", disable_log_stats=False,
              speculative_config={"method": "dflash", "num_speculative_tokens": 7,
                                  "model": str(qwen3_vocab_models / "drafter")})
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_tokens=8,
                            ignore_eos=True, logprobs=20, detokenize=False)
    outputs = llm.generate(["def main():"] * 24, params, use_tqdm=False)
    for o in outputs:
        assert len(o.outputs[0].token_ids) == 8
        assert all(len(lp) == 20 for lp in o.outputs[0].logprobs)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_draft_tokens"].value > 0, "the drafter never ran"
