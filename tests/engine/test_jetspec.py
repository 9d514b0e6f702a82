"""JetSpec on vLLM 0.34's Model Runner V2, in the CPU stand-in with the trained tiny pair's
JetSpec-format head (models/tiny-pair/jetspec-drafter: DFlash's checkpoint format with
dflash_config.causal_head, causal in-block attention): the head's attention is causal under
methods ddtree, jetspec and vLLM's own dflash (patch 0009; a DFlash head is not), method
"jetspec" and the head pick JetSpec's tree build in either form of the speculative config
(top-level fields, patch 0001; speculator_options), bad heads and widths are refused naming
the field, and with JetSpec's trees greedy output stays the target's under preemption,
chunked prefill and aborts, and sampling keeps the target's distribution. Greedy output with
JetSpec's trees at budget 64 and concurrency 8 is tested in test_ddtree.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_runs import REPO, generate, preempt_and_abort, preemption_prompts, tree_stats

PAIR = REPO / "models" / "tiny-pair"
JETSPEC = PAIR / "jetspec-drafter"
DFLASH = PAIR / "drafter"
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,"]


def runner_of(llm):  # noqa: ANN001, ANN201
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner


def record_drafter_causality(llm) -> set:  # noqa: ANN001
    """The ``causal`` of every attention metadata the drafter's layers are handed while
    drafting (what the attention kernel is told), filled in as the engine runs."""
    from vllm.forward_context import get_forward_context

    speculator = runner_of(llm).speculator
    model, names, seen = speculator.model, speculator.draft_attn_layer_names, set()
    forward = model.forward

    def record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        metadata = get_forward_context().attn_metadata or {}
        seen.update(getattr(metadata[name], "causal", None) for name in names
                    if name in metadata)
        return forward(*args, **kwargs)

    model.forward = record
    return seen


def head(out: Path, drafter: Path = JETSPEC, top: dict | None = None,
         **dflash_config: object) -> Path:
    """A copy of a drafter's config with dflash_config fields changed (None: removed) and
    top-level fields set; the weights are linked."""
    out.mkdir(parents=True)
    (out / "model.safetensors").symlink_to(drafter / "model.safetensors")
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"] = {k: v for k, v in {**config["dflash_config"],
                                                 **dflash_config}.items() if v is not None}
    config.update(top or {})
    (out / "config.json").write_text(json.dumps(config))
    return out


def engine_config(spec: dict):  # noqa: ANN201
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                      speculative_config=spec).create_engine_config()


@pytest.mark.slow
@pytest.mark.parametrize(("method", "drafter", "causal"), [
    ("ddtree", JETSPEC, True), ("dflash", JETSPEC, True), ("ddtree", DFLASH, False)],
    ids=["ddtree-jetspec-head", "dflash-jetspec-head", "ddtree-dflash-head"])
def test_a_jetspec_head_drafts_causally(method: str, drafter: Path, causal: bool) -> None:
    """The drafter's layers and the attention metadata they are handed while drafting: a
    JetSpec head attends causally under ddtree and under vLLM's own dflash (patch 0009;
    without it vLLM reads only is_causal and dflash_config.causal, and the head loads
    non-causal), a DFlash head (the control) does not. Method jetspec: in the preemption
    test below."""
    from vllm import LLM, SamplingParams

    extra = {"num_speculative_tokens": 7} if method == "dflash" else {"tree_budget": 16}
    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=8,
              speculative_config={"method": method, "model": str(drafter), **extra})
    speculator = runner_of(llm).speculator
    assert speculator.model.get_draft_attn_causal() == [causal, causal]
    assert speculator.requires_non_causal is not causal
    seen = record_drafter_causality(llm)
    outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert seen == {causal}, seen
    if method == "ddtree":  # the head picks the build
        assert speculator.widths == ((7,) if causal else ())
        assert tree_stats(llm)["verified_rows"] > 0


def test_vllms_dflash_loader_reads_causal_head(tmp_path: Path) -> None:
    """Patch 0009 in vLLM's own resolution (which picks the drafter's attention backend and
    each layer's causality): causal_head counts when neither is_causal nor
    dflash_config.causal is given, and a head contradicting it is refused by name."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

    def hf(drafter: Path):  # noqa: ANN202
        return engine_config({"method": "dflash", "model": str(drafter),
                              "num_speculative_tokens": 7}).speculative_config \
            .draft_model_config.hf_config

    assert not dflash_has_any_non_causal(hf(JETSPEC))
    assert dflash_has_any_non_causal(hf(DFLASH))
    assert not dflash_has_any_non_causal(hf(head(tmp_path / "plain", DFLASH, causal=True)))
    for name, drafter in (
            ("dflash_config.causal", head(tmp_path / "a", causal=False)),
            ("is_causal", head(tmp_path / "b", top={"is_causal": False}))):
        with pytest.raises(ValueError, match=f"{name} is False but dflash_config.causal_head"):
            dflash_has_any_non_causal(hf(drafter))


@pytest.mark.parametrize(("spec", "build", "width"), [
    ({"method": "ddtree", "model": str(JETSPEC)}, "jetspec", 7),
    ({"method": "ddtree", "model": str(DFLASH)}, "best_first", None),
    ({"method": "ddtree", "model": str(JETSPEC), "tree_build": "best_first"},
     "best_first", None),
    ({"method": "jetspec", "model": str(DFLASH)}, "jetspec", 7),
    ({"method": "jetspec", "model": str(DFLASH), "tree_budget": 16, "tree_width": [4, 2]},
     "jetspec", [4, 2]),
    ({"method": "jetspec", "model": str(JETSPEC),
      "speculator_options": {"tree_budget": 16, "tree_width": 3}}, "jetspec", 3),
])
def test_method_jetspec_and_the_head_pick_the_build(spec: dict, build: str,
                                                    width: int | list | None) -> None:
    """tree_build by the method ("jetspec"), else by the head (a JetSpec head: "jetspec"
    with width 7, a DFlash head: "best_first"), else as given; the documented top-level
    fields and speculator_options alike."""
    config = engine_config(spec).speculative_config
    assert (config.method, config.custom_method) == ("dflash", spec["method"])
    options = config.speculator_options
    assert (options["tree_build"], options["tree_width"]) == (build, width)
    budget = spec.get("tree_budget", (spec.get("speculator_options") or {}).get(
        "tree_budget", 64))
    assert (options["tree_budget"], config.num_speculative_tokens) == (budget, budget)


@pytest.mark.parametrize(("changes", "spec", "message"), [
    ({"causal": False}, {},
     "dflash_config.causal is False but dflash_config.causal_head is true"),
    ({"top": {"is_causal": False}}, {}, "is_causal is False but dflash_config.causal_head"),
    ({"causal_head": "yes"}, {}, "dflash_config.causal_head must be true or false"),
    ({"mask_token_id": None}, {}, "dflash_config has no mask_token_id, which a causal"),
    ({"target_layer_ids": None}, {}, "dflash_config has no target_layer_ids"),
    ({}, {"tree_width": 0}, r"tree_width must be an integer in \[1, 2048\]"),
    ({}, {"tree_width": 3000}, r"tree_width must be an integer in \[1, 2048\]"),
    ({}, {"tree_width": True}, r"tree_width must be an integer in \[1, 2048\]"),
    ({}, {"tree_width": []}, "tree_width must be an integer .* list of 1 to 32"),
    ({}, {"tree_width": [2] * 33}, "tree_width must be an integer .* list of 1 to 32"),
    ({}, {"tree_width": 1, "tree_budget": 8},
     "tree_budget is 8, but tree_width 1 over the drafter's 7 positions places at most 7"),
    ({}, {"speculator_options": {"tree_width": [1, 1, 1], "tree_budget": 8}},
     r"tree_budget is 8, but tree_width \[1, 1, 1\] over"),
    ({}, {"tree_build": "widest"},
     r"speculative_config\.tree_build must be one of \('best_first', 'jetspec'\)"),
    ({"causal_head": None}, {"tree_width": 3},
     "tree_width applies to tree_build 'jetspec', not 'best_first'"),
])
def test_bad_heads_and_widths_are_refused_by_name(tmp_path: Path, changes: dict, spec: dict,
                                                  message: str) -> None:
    drafter = head(tmp_path / "drafter", **changes)
    with pytest.raises(Exception, match=message):
        engine_config({"method": "ddtree", "model": str(drafter)} | spec)


@pytest.mark.slow
def test_preemption_chunked_prefill_and_aborts_stay_lossless() -> None:
    """Method jetspec in the documented top-level form: JetSpec's trees under a tiny KV
    cache (preemption), long prompts prefilled in chunks next to verify steps, requests
    aborted mid-stream; then a batch in the freed request slots. Output is the target
    alone's, the trees accept 3+ deep, and the head drafts causally throughout."""
    llm, causal = preempt_and_abort(
        str(PAIR / "target"), {"method": "jetspec", "model": str(JETSPEC), "tree_budget": 12},
        preemption_prompts(10), later=2, started=record_drafter_causality)
    spec = llm.llm_engine.vllm_config.speculative_config
    assert (spec.custom_method, spec.speculator_options["tree_budget"]) == ("jetspec", 12)
    assert runner_of(llm).speculator.widths == (7,)
    assert tree_stats(llm)["longest_accepted"] >= 3, tree_stats(llm)
    assert causal == {True}, causal


@pytest.mark.slow
def test_sampling_matches_the_target_distribution() -> None:
    """Temperature 1, JetSpec's trees (budget 8, width 3, no spine): the 2nd and 3rd
    generated tokens (the first drafted ones) are distributed as without speculation
    (chi-square p > 0.001, fixed seeds), with paths accepted off the drafter's chain."""
    from engine_helpers import chi_square_p_value

    n, model = 1500, str(PAIR / "target")
    common = dict(prompts=["The quick brown fox"] * n, max_tokens=3, max_num_seqs=64,
                  temperature=1.0, seeds=[2000 + i for i in range(n)])
    plain = generate(model, **common)["tokens"]
    spec = {"method": "jetspec", "model": str(JETSPEC), "tree_budget": 8, "tree_width": 3,
            "tree_spine": False}
    run = generate(model, spec=spec, **common)
    assert run["trees"]["verified_rows"] > 0 and all(len(t) == 3 for t in run["tokens"])
    assert run["trees"]["paths_off_the_index_line"] > 0, run["trees"]
    assert run["accepted"] > 0, run
    for position in (1, 2):
        p = chi_square_p_value([t[position] for t in plain],
                               [t[position] for t in run["tokens"]])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"
