"""Helpers of the engine tests (both vLLM environments): the oracle drafter's logits, the
tiny targets of other families, a random LoRA adapter, the chi-square test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def imperfect_logits(truth: list[int], depth: int, vocab: int,
                     rng: np.random.Generator) -> torch.Tensor:
    """Per depth [depth, vocab] random logits showing the true next token (``truth``, up to
    ``depth`` of them) first (55%), second or third (30%), or not at all (15%)."""
    logits = torch.from_numpy(rng.normal(size=(depth, vocab)))
    for d, true in enumerate(truth):
        u = rng.random()
        if u < 0.55:
            logits[d, true] = 12.0
        elif u < 0.85:
            others = rng.choice(vocab, size=2, replace=False)
            logits[d, others[0]] = 13.0
            if u > 0.7:
                logits[d, others[1]] = 12.5
            logits[d, true] = 12.0
    return logits


def known_continuation(states, slot: int, continuations: dict[tuple, list[int]],  # noqa: ANN001
                       count: int) -> tuple[list[int], list[int]]:
    """A request's tokens so far (the runner's request states, read on the host: a test's
    drafter may sync) and the next ``count`` (or fewer) of its prompt's continuation."""
    n, prompt_len = int(states.total_len.gpu[slot]), int(states.prompt_len.np[slot])
    seq = states.all_token_ids.gpu[slot, :n].tolist()
    return seq, continuations[tuple(seq[:prompt_len])][n - prompt_len:][:count]


def oracle_tree_logits(continuations: dict[tuple, list[int]], seed: int):
    """``DDTreeSpeculator.draft_logits_at`` for a drafter that knows each prompt's greedy
    continuation (by prompt token ids) and shows it imperfectly (imperfect_logits). It reads
    each request's tokens so far from the runner's request states (on the host: a test's
    drafter may sync)."""

    def draft_logits_at(self, hidden_states: torch.Tensor) -> torch.Tensor:
        depth, states = self.depth, self.req_states
        rows = hidden_states.shape[0] // depth
        vocab = self.model.compute_logits(hidden_states[:1]).shape[-1]
        logits = torch.zeros(rows, depth, vocab)
        slots = self.sample_idx_mapping[:rows * depth:depth].tolist()
        for r, slot in enumerate(slots):
            if slot < 0:
                continue
            seq, truth = known_continuation(states, slot, continuations, depth)
            rng = np.random.default_rng([seed, len(seq), *seq[-3:]])
            logits[r] = imperfect_logits(truth, depth, vocab, rng)
        return logits.flatten(0, 1).to(hidden_states.device)

    return draft_logits_at


def fixed_step_costs(per_token_ms: float, draft_ms: float, base_ms: float = 5.0):
    """Adaptive trees' step costs for a test (vllm_ddtree/spec_decode/adaptive/costs.py):
    verify steps of base_ms + per_token_ms a token (a step's fixed cost dominating, as on a
    GPU at low concurrency), the drafter draft_ms (0.01 ms paused), nothing else."""
    from vllm_ddtree.spec_decode.adaptive.costs import StepCosts

    out = StepCosts()
    for n in (1, 4, 16, 64, 256, 1024):
        out.verify.add(n, base_ms + per_token_ms * n, trusted=True)
    for n in (1, 64):
        out.draft.add(n, draft_ms, trusted=True)
        out.paused_draft.add(n, 0.01, trusted=True)
    out.rest_ms = {True: 0.0, False: 0.0}
    return out


def pause_and_resume(llm, sizing, prompts: list[str], params, pause_at: int,  # noqa: ANN001
                     resume_at: int, paying, costly) -> tuple[dict, dict, dict]:
    """Runs ``prompts`` step by step with adaptive trees whose costs are ``paying`` until
    step ``pause_at``, ``costly`` (drafting does not pay: the drafter pauses) until
    ``resume_at``, then ``paying`` again: the outputs by prompt, and the sizing's stats at
    the two steps."""
    engine, done, marks = llm.llm_engine, {}, {}
    sizing.timer.costs = paying
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        if step in (pause_at, resume_at):
            marks[step] = sizing.stats()
            sizing.timer.costs = costly if step == pause_at else paying
        for out in engine.step():
            if out.finished:
                done[out.prompt] = list(out.outputs[0].token_ids)
    return done, marks[pause_at], marks[resume_at]


def use_step_costs(runner, step_costs) -> object:  # noqa: ANN001
    """The runner's adaptive trees read ``step_costs``, not measured ones, from now on."""
    from vllm_ddtree.spec_decode.adaptive.sizing import fix_costs

    sizing = runner.adaptive_verification
    fix_costs(sizing, step_costs)
    return sizing


def windowed_pair(tiny_models: Path, out: Path, window: int) -> Path:
    """The tiny pair with every target layer attending through a sliding window (Qwen3's
    own config fields), as Mistral-style and gpt-oss's windowed layers do."""
    import shutil

    shutil.copytree(tiny_models / "target", out / "target")
    (out / "drafter").symlink_to(tiny_models / "drafter")
    config = json.loads((out / "target" / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=window, max_window_layers=0)
    (out / "target" / "config.json").write_text(json.dumps(config))
    return out


def other_target_pair(tiny_models: Path, out: Path, family: str) -> Path:
    """A random tiny target of another family DFlash drafts for, with the tiny pair's
    tokenizer, and the tiny DFlash drafter (the same hidden size and vocabulary): "llama"
    (Llama 3.1's rope scaling) or "gpt-oss" (attention sinks in every layer, a sliding window
    of 4 positions in every other one, mixture-of-experts MLPs)."""
    import shutil

    from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

    config = json.loads((tiny_models / "target" / "config.json").read_text())
    common = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=config["vocab_size"],
                  max_position_embeddings=4096, eos_token_id=config["eos_token_id"],
                  bos_token_id=config["bos_token_id"])
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            **common, intermediate_size=256, head_dim=32, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 512}))
    else:
        model = GptOssForCausalLM(GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
            head_dim=64, sliding_window=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 1.0 if "sinks" in name else 0.05 if p.dim() > 1 else 0.02)
    model.save_pretrained(out / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_models / "target" / name, out / "target" / name)
    (out / "drafter").symlink_to(tiny_models / "drafter")
    return out


def random_lora(target: Path, out: Path, rank: int = 8) -> Path:
    """A random PEFT LoRA adapter on the tiny target's q / v / o projections."""
    import json

    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    h, d = config["hidden_size"], config["head_dim"]
    shapes = {"q_proj": (h, config["num_attention_heads"] * d),
              "v_proj": (h, config["num_key_value_heads"] * d),
              "o_proj": (config["num_attention_heads"] * d, h)}
    gen = torch.Generator().manual_seed(1)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.3
            weights[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.3
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(shapes), "bias": "none", "lora_dropout": 0.0,
        "fan_in_fan_out": False, "base_model_name_or_path": str(target)}))
    return out


def chi_square_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity; bins with an expected count below 5 in
    either sample are pooled."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    bins, rest = [], [0, 0]
    for token in set(ca) | set(cb):
        pooled = ca[token] + cb[token]
        if pooled * min(na, nb) / (na + nb) < 5:
            rest[0] += ca[token]
            rest[1] += cb[token]
        else:
            bins.append((ca[token], cb[token]))
    if rest[0] + rest[1]:
        bins.append(tuple(rest))
    stat = 0.0
    for x, y in bins:
        pooled = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = pooled * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(bins) - 1
    return float(1 - torch.special.gammainc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


def language_model_only(pair: Path) -> dict:
    """Engine settings for a tiny Qwen3.5, whose checkpoint holds no vision tower."""
    config = json.loads((pair / "target/config.json").read_text())
    return {"limit_mm_per_prompt": {"image": 0, "video": 0}} if "vision_config" in config else {}
