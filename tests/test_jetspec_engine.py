"""JetSpec heads (DFlash's checkpoint format with dflash_config.causal_head: causal in-block
attention) on CPU: they load causal under method ddtree and under vLLM's own dflash (patch
0016), method "jetspec" and the head pick JetSpec's tree build, bad heads and widths are
refused by name, and with JetSpec's trees greedy output is the target's own, token for token
(trees accepted deep and off the chain: the oracle drafter), at concurrency 1 and 8, under
preemption, chunked prefill and aborts; sampling keeps the target's distribution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_ddtree_engine import (
    MAX_TOKENS,
    PROMPTS,
    assert_same_distribution,
    ddtree_state,
    generate,
    oracle_for_target,
    sampled,
)


def with_head(tiny_models: Path, out: Path, **dflash_config) -> Path:
    """The tiny pair with its drafter's dflash_config changed (the target is linked)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "target").symlink_to(tiny_models / "target")
    shutil.copytree(tiny_models / "drafter", out / "drafter")
    config = json.loads((out / "drafter/config.json").read_text())
    config["dflash_config"] = {**config["dflash_config"], **dflash_config}
    config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if v is not None}
    (out / "drafter/config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def jetspec_pair(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pair with a JetSpec-format head (causal_head: true; random weights)."""
    return with_head(tiny_models, tmp_path_factory.mktemp("jetspec"), causal_head=True)


def drafter_causality(llm) -> set:
    """The ``causal`` of every attention metadata the drafter's layers saw while serving."""
    seen = set()
    model = runner_of(llm).drafter.model
    forward = model.forward

    def record(*args, **kwargs):
        from vllm.forward_context import get_forward_context

        seen.update(getattr(md, "causal", None)
                    for md in (get_forward_context().attn_metadata or {}).values())
        return forward(*args, **kwargs)

    model.forward = record
    return seen


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ddtree", "dflash", "jetspec"])
def test_a_jetspec_head_drafts_causally(tiny_models: Path, jetspec_pair: Path,
                                        method: str) -> None:
    """From the drafter's attention metadata: a JetSpec head attends causally under every
    method (vLLM's dflash included), a DFlash head (the control) does not."""
    extra = {"num_speculative_tokens": 7} if method == "dflash" else {"tree_budget": 8}
    for pair, want in ((jetspec_pair, True), (tiny_models, False)):
        if pair == tiny_models and method == "jetspec":
            continue  # (method jetspec with a DFlash head: JetSpec's build, same causality)
        spec = {"method": method, "model": str(pair / "drafter"), **extra}
        _, llm = generate(pair, spec, max_tokens=1, prompts=PROMPTS[:1])
        seen = drafter_causality(llm)
        llm.generate(PROMPTS[:2], use_tqdm=False)
        assert seen == {want}, (pair, seen)
        assert runner_of(llm).drafter.dflash_causal is want
        del llm


def test_method_jetspec_and_the_head_pick_the_build(tiny_models: Path, jetspec_pair: Path,
                                                    tmp_path: Path) -> None:
    from test_ddtree_config import engine_config

    def spec_of(pair: Path, **spec):
        return engine_config(pair, {"model": str(pair / "drafter"), **spec}).speculative_config

    s = spec_of(jetspec_pair, method="ddtree")
    assert (s.tree_build, s.tree_width) == ("jetspec", 7)
    s = spec_of(tiny_models, method="jetspec", tree_width=[4, 2])
    assert (s.tree_build, s.tree_width) == ("jetspec", [4, 2])
    s = spec_of(tiny_models, method="ddtree")
    assert (s.tree_build, s.tree_width) == ("best_first", None)
    s = spec_of(jetspec_pair, method="ddtree", tree_build="best_first")
    assert s.tree_build == "best_first"


@pytest.mark.parametrize("head, spec, message", [
    ({"causal": False}, {}, "dflash_config.causal is False but dflash_config.causal_head is "
                            "true"),
    ({"causal_head": "yes"}, {}, "dflash_config.causal_head must be true or false"),
    ({"mask_token_id": None}, {}, "dflash_config has no mask_token_id, which a causal"),
    ({"target_layer_ids": None}, {}, "dflash_config has no target_layer_ids"),
    ({}, {"tree_width": 0}, "tree_width must be an integer in \\[1, 1024\\]"),
    ({}, {"tree_width": 2000}, "tree_width must be an integer in \\[1, 1024\\]"),
    ({}, {"tree_width": [2] * 33}, "tree_width must be an integer .* list of 1 to 32"),
    ({}, {"tree_width": 1, "tree_budget": 8}, "tree_budget is 8, but tree_width 1 over the "
                                              "drafter's 7 positions places at most 7 nodes"),
    ({}, {"tree_build": "widest"}, "tree_build must be one of \\('best_first', 'jetspec'\\)"),
    ({"causal_head": None}, {"tree_width": 3}, "tree_width applies to tree_build 'jetspec', "
                                               "not 'best_first'"),
    ({}, {"method": "jetspec", "tree_build": "best_first"}, "method 'jetspec' builds "
                                                           "JetSpec's trees"),
])
def test_bad_heads_and_widths_are_refused_by_name(tiny_models: Path, tmp_path: Path, head,
                                                  spec, message) -> None:
    from test_ddtree_config import engine_config

    pair = with_head(tiny_models, tmp_path / "pair", **({"causal_head": True} | head))
    with pytest.raises(ValueError, match=message):
        engine_config(pair, {"method": "ddtree", "model": str(pair / "drafter")} | spec)


@pytest.mark.slow
@pytest.mark.parametrize("max_num_seqs", [1, 8])
@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("budget", [16, 64])
def test_greedy_is_lossless_with_jetspec_trees(jetspec_pair: Path, monkeypatch, budget,
                                               spine, max_num_seqs) -> None:
    target = oracle_for_target(jetspec_pair, monkeypatch, seed=budget)
    spec = {"method": "jetspec", "model": str(jetspec_pair / "drafter"),
            "tree_budget": budget, "tree_spine": spine}
    outputs, llm = generate(jetspec_pair, spec, max_num_seqs=max_num_seqs)
    assert llm.llm_engine.vllm_config.speculative_config.tree_build == "jetspec"
    got = {o.prompt: list(o.outputs[0].token_ids) for o in outputs}
    assert got == {p: list(o.token_ids)[:MAX_TOKENS] for p, o in target.items()}
    stats = ddtree_state(llm).stats()
    assert stats["longest_accepted"] >= 3, stats
    if spine:
        assert stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_preemption_chunked_prefill_and_aborts_stay_lossless(jetspec_pair: Path,
                                                             monkeypatch) -> None:
    """JetSpec's trees under a tiny KV cache (preemption), long prompts prefilled in chunks,
    requests aborted mid-stream; then a batch in the freed slots."""
    from vllm import LLM, SamplingParams

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompts = [" ".join(words[(i + j) % 10] for j in range(5 + 15 * (i % 4))) + f" #{i}"
               for i in range(10)]
    target = oracle_for_target(jetspec_pair, monkeypatch, seed=5, prompts=prompts,
                               max_tokens=40)
    llm = LLM(model=str(jetspec_pair / "target"), enforce_eager=True, max_model_len=256,
              seed=0, dtype="float32", block_size=32, max_num_seqs=6,
              max_num_batched_tokens=64, num_gpu_blocks_override=10, disable_log_stats=False,
              speculative_config={"method": "jetspec", "tree_budget": 12,
                                  "model": str(jetspec_pair / "drafter")})
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", prompt, params)
    done, aborted = {}, ["r1", "r4", "r6"]
    for step in range(1000):
        if step == 3:
            engine.abort_request(aborted)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.prompt, list(out.outputs[0].token_ids))
        if not engine.has_unfinished_requests():
            break
    kept = {rid: v for rid, v in done.items() if rid not in aborted}
    assert len(kept) == 5
    assert all(tokens == list(target[p].token_ids)[:40] for p, tokens in kept.values())
    outputs = llm.generate(prompts[8:], params, use_tqdm=False)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: list(target[p].token_ids)[:40] for p in prompts[8:]}
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:num_preemptions"] > 0, "the KV cache was not small enough to preempt"
    assert ddtree_state(llm).stats()["longest_accepted"] >= 3


@pytest.mark.slow
def test_sampling_matches_the_target_distribution(jetspec_pair: Path) -> None:
    """Temperature 1, top-k 3, JetSpec's trees (budget 8, width 3): the 2nd and 3rd tokens
    are distributed as without speculation (chi-square p > 0.001; fixed seeds)."""
    spec = {"method": "jetspec", "tree_budget": 8, "tree_width": 3, "tree_spine": False,
            "model": str(jetspec_pair / "drafter")}
    assert_same_distribution(*(sampled(jetspec_pair, s, 1.0) for s in (None, spec)))
