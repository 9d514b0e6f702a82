"""ddtree on V2 with other targets (random tiny ones: tests/conftest.py's ``tiny_models``):
a Qwen3 whose layers all attend through a sliding window, a Llama (Llama 3.1's rope
scaling) and a gpt-oss (attention sinks, a window in every other layer, mixture-of-experts
MLPs). Their random drafter rarely agrees with them, so an oracle drafter that knows the
target's greedy continuation shows it imperfectly, and trees are accepted deep and off the
spine; output must equal the target alone's."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import oracle_tree_logits
from engine_runs import generate

pytestmark = pytest.mark.slow
PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(8)]


def assert_lossless_with_the_oracle(pair: Path, monkeypatch: pytest.MonkeyPatch,
                                    seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    alone = generate(str(pair / "target"), prompts=PROMPTS, max_tokens=40)["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    truth = {tuple(tokenizer.encode(p)): t for p, t in zip(PROMPTS, alone)}
    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", oracle_tree_logits(truth, seed))
    spec = {"method": "ddtree", "model": str(pair / "drafter"),
            "speculator_options": {"tree_budget": 16}}
    run = generate(str(pair / "target"), spec=spec, prompts=PROMPTS, max_tokens=40)
    assert run["tokens"] == alone
    trees = run["trees"]
    assert trees["longest_accepted"] >= 4 and trees["paths_off_the_index_line"] > 0, trees
    return alone


def test_sliding_window_target_is_lossless(tiny_models: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer sees 4 positions back: tree nodes lose context and upper ancestors to
    the window by position (siblings share one), as the target alone does there."""
    from engine_helpers import windowed_pair

    windowed = assert_lossless_with_the_oracle(
        windowed_pair(tiny_models, tmp_path, window=4), monkeypatch, seed=8)
    full = generate(str(tiny_models / "target"), prompts=PROMPTS, max_tokens=40)["tokens"]
    assert windowed != full  # the window matters


@pytest.mark.parametrize("family", ["llama", "gpt-oss"])
def test_other_target_families_are_lossless(tiny_models: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            family: str) -> None:
    from engine_helpers import other_target_pair

    assert_lossless_with_the_oracle(other_target_pair(tiny_models, tmp_path, family),
                                    monkeypatch, seed=9)


def test_lora_requests_are_lossless(tiny_models: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the requests with a LoRA adapter (the target's output changes), trees accepted
    deep and off the spine (the oracle drafter, shown the adapted continuations): output
    equals the target alone's with the same adapter."""
    from engine_helpers import random_lora
    from engine_runs import tree_stats
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    adapter = random_lora(tiny_models / "target", tmp_path / "lora")
    loras = [LoRARequest("random", 1, str(adapter)) if i % 2 == 0 else None
             for i in range(len(PROMPTS))]

    def run(spec: dict | None) -> tuple[list, object]:
        llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                  seed=0, dtype="float32", max_num_seqs=8, speculative_config=spec,
                  enable_lora=True, max_lora_rank=8, max_loras=1)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], llm

    adapted, _ = run(None)
    base = generate(str(tiny_models / "target"), prompts=PROMPTS, max_tokens=40)["tokens"]
    assert all(a != b for a, b in zip(adapted[0::2], base[0::2]))  # the adapter acts
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "target")
    truth = {tuple(tokenizer.encode(p)): t for p, t in zip(PROMPTS, adapted)}
    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", oracle_tree_logits(truth, 6))
    trees, llm = run({"method": "ddtree", "model": str(tiny_models / "drafter"),
                      "speculator_options": {"tree_budget": 16}})
    assert trees == adapted
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
