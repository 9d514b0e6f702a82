"""vLLM's own method "dflash" loads and runs the tiny pair on CPU, in-process, and its greedy
output equals the target's own (the baseline that ddtree must match too)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
