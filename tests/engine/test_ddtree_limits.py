"""Method "ddtree" on Model Runner V2 at its limits, with the trained tiny pair
(models/tiny-pair), whose drafter the target often agrees with: the largest budget (1024
nodes), a request ending at max_model_len beside one that does not, several samples per
request (``n``), the compiled target; start-up refusals V2 shares with 0.32 and that
tests/engine/test_ddtree.py does not list; and synthetic acceptance's walk, drawn lengths and
freedom from host syncs (vllm_ddtree/synthetic.py), as in 0.32's tests."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_runs import REPO, tree_stats

PAIR = REPO / "models" / "tiny-pair"
PROMPTS = ["def fibonacci(n):", "import os\nclass Path", "The quick brown fox", "x = [1, 2,",
           "for i in range(10):", "The capital of France is"]
MAX_TOKENS = 24
# A request ending one token short of max_model_len (NEAR_LEN) beside a short one.
NEAR_LEN, LONG_PROMPT_TOKENS = 160, 125
# n > 1 (vLLM refuses it greedy): top-k 1 (every completion the target's greedy output)
# and seeded samples.
N_PARAMS = [dict(n=2, temperature=1.0, top_k=1, seed=3), dict(n=2, temperature=0.8, seed=7),
            dict(n=3, temperature=1.0, seed=11)]


def spec(budget: int, **options: object) -> dict:
    return {"method": "ddtree", "model": str(PAIR / "drafter"), "tree_budget": budget,
            **options}


def run(spec: dict | None, prompts: list, params: list, **engine: object):
    """Every completion of every prompt (token ids), and the engine."""
    from vllm import LLM

    settings = dict(enforce_eager=True, max_model_len=512, seed=0, dtype="float32",
                    max_num_seqs=8, disable_log_stats=False, speculative_config=spec)
    llm = LLM(model=str(PAIR / "target"), **(settings | engine))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs], llm


def metrics(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}


def near_limit_prompts() -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(PAIR / "target"))
    long = tokenizer.encode(" ".join(f"item{i}" for i in range(80)))[:LONG_PROMPT_TOKENS]
    assert len(long) == LONG_PROMPT_TOKENS
    return [{"prompt_token_ids": long}, {"prompt_token_ids": tokenizer.encode(PROMPTS[1])}]


def near_limit_params() -> list:
    from vllm import SamplingParams

    # The long request may end one token short of NEAR_LEN; the short one outlives it.
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in (NEAR_LEN - 1 - LONG_PROMPT_TOKENS, 80)]


def n_params() -> list:
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw) for kw in N_PARAMS]


@pytest.fixture(scope="module")
def alone() -> dict[str, list]:
    """The target alone, in one engine: the prompts greedy, the near-limit pair, and the
    n > 1 requests (greedy and seeded)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    near = near_limit_prompts()
    prompts = PROMPTS + near + PROMPTS[:len(N_PARAMS)]
    params = [greedy] * len(PROMPTS) + near_limit_params() + n_params()
    out, _ = run(None, prompts, params)
    k = len(PROMPTS)
    return {"greedy": [o[0] for o in out[:k]], "near": [o[0] for o in out[k:k + 2]],
            "n": out[k + 2:]}


def record_steps(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every verify step: per request its drafts (tree nodes), and the largest position
    of the step's rows (tree positions: context + depth)."""
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    steps, begin_step = [], TreeVerifier.begin_step

    def record(self, input_batch) -> None:
        begin_step(self, input_batch)
        if input_batch.num_draft_tokens:
            drafts = input_batch.num_draft_tokens_per_req[:input_batch.num_reqs].tolist()
            steps.append({"drafts": dict(zip(input_batch.req_ids, drafts)),
                          "max_position": int(input_batch.positions[
                              :input_batch.num_tokens].max())})

    monkeypatch.setattr(TreeVerifier, "begin_step", record)
    return steps


@pytest.mark.slow
def test_the_largest_budget_is_lossless(alone: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """tree_budget 1024, the most (the drafter's top 1024 tokens per depth): verify steps of
    1,025 tokens a request, four requests a step (4,100 tokens of max_num_batched_tokens
    4,128), whole trees verified, none cut; paths accepted deep and off the spine; output is
    the target's."""
    from vllm import SamplingParams

    steps = record_steps(monkeypatch)
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, llm = run(spec(1024), prompts, [params] * len(prompts), max_model_len=2048,
                   max_num_seqs=4, max_num_batched_tokens=4128)
    assert [o[0] for o in got] == alone["greedy"][:4]
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats
    m = metrics(llm)
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == 1024 * m["vllm:spec_decode_num_drafts"]
    trees_per_step = [sum(n == 1024 for n in step["drafts"].values()) for step in steps]
    assert max(trees_per_step) == 4, trees_per_step


@pytest.mark.slow
def test_drafting_goes_on_beside_a_request_near_max_model_len(
        alone: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request ends one token short of max_model_len (160), a short one does not, at
    budget 64 (0.32's V1 runner stopped drafting for both while the long one was within
    tree_budget + 1 of its limit; its series reserved the drafter's block instead). V2's
    scheduler cuts a request's drafts to what fits below max_model_len, per request: the
    long one's trees are cut to a prefix (a prefix of a tree in node order is a tree),
    while the short one beside it drafts whole trees at every step, and after the long one
    is done. No verify row's position reaches max_model_len; output
    is the target's."""
    steps = record_steps(monkeypatch)
    got, llm = run(spec(64), near_limit_prompts(), near_limit_params(),
                   max_model_len=NEAR_LEN, max_num_seqs=2)
    assert [o[0] for o in got] == alone["near"]
    assert len(got[0][0]) == NEAR_LEN - 1 - LONG_PROMPT_TOKENS
    both = [s["drafts"] for s in steps if len(s["drafts"]) == 2]
    long_id, short_id = sorted(both[0])  # request ids in submission order
    assert len(both) >= 3 and all(d[short_id] == 64 for d in both), both
    # 34 tokens from its limit at its first verify step, the long request is verified on
    # trees cut to what fits, fewer nodes as it nears the limit, never none.
    cut = [d[long_id] for d in both]
    assert 0 < cut[-1] and all(a >= b for a, b in zip(cut, cut[1:])) and cut[0] < 64, both
    alone_after = [s["drafts"] for s in steps if len(s["drafts"]) == 1]
    assert alone_after and all(d == {short_id: 64} for d in alone_after), alone_after
    assert max(s["max_position"] for s in steps) < NEAR_LEN
    assert tree_stats(llm)["longest_accepted"] >= 3


@pytest.mark.slow
@pytest.mark.parametrize("budget", [4, 64])
def test_every_draft_query_has_a_kv_slot(alone: dict, monkeypatch: pytest.MonkeyPatch,
                                         budget: int) -> None:
    """The KV reserved past a step's scheduled tokens (num_lookahead_tokens: tree_depth + 1,
    not DFlash's tree_budget + 1): every query the drafter runs gets a slot in its request's
    blocks, after a prefill and after a verify step whose path was accepted to full depth
    (budget 4: the tree is no wider than deep). DFlash's input kernel gives a query beyond the
    request's blocks no slot, silently (its KV is never written, the drafter attends without
    it), so it is counted here: queries without a slot short of max_model_len."""
    import inspect

    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

    prepare, counts = dflash.prepare_dflash_inputs, {"queries": 0, "without_slot": 0}

    def checked(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        prepare(*args, **kwargs)
        bound = inspect.signature(prepare).bind(*args, **kwargs).arguments
        rows = bound["input_batch"].num_reqs * bound["num_query_per_req"]
        positions = bound["input_buffers"].positions[:rows]
        short = positions < bound["max_model_len"] - 1  # the last position is clamped
        counts["queries"] += int(short.sum())
        counts["without_slot"] += int(((bound["query_slot_mapping"][:rows] == PAD_SLOT_ID)
                                       & short).sum())

    monkeypatch.setattr(dflash, "prepare_dflash_inputs", checked)
    llm = LLM(model=str(PAIR / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=8, block_size=32, speculative_config=spec(budget))
    depth = llm.llm_engine.vllm_config.speculative_config.speculator_options["tree_depth"]
    assert llm.llm_engine.vllm_config.num_lookahead_tokens == depth + 1
    params = SamplingParams(temperature=0.0, max_tokens=4 * MAX_TOKENS, ignore_eos=True)
    # Prompts of 24 to 28 tokens too: a prefill ending depth + 1 short of a block's end, so
    # the drafter's last query after it is the first of the next block.
    words = llm.get_tokenizer().encode(" ".join(PROMPTS) * 4)
    prompts = PROMPTS + [{"prompt_token_ids": words[:n]} for n in range(24, 29)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids[:MAX_TOKENS]) for o in outputs[:len(PROMPTS)]] == \
        alone["greedy"]
    if budget == 4:
        assert tree_stats(llm)["longest_accepted"] == depth  # paths to full depth
    assert counts["queries"] > 0 and counts["without_slot"] == 0, counts


@pytest.mark.slow
def test_several_samples_per_request_are_served(alone: dict) -> None:
    """n > 1 (vLLM fans a request out into n): at top-k 1 each of the n completions is the
    target's greedy output; seeded samples (n = 2 at temperature 0.8, n = 3 at 1) are the
    target alone's own samples with the same seed (V2 samples each tree node keyed by its
    position, so an accepted path's tokens are the target's own draws), and differ from
    one another."""
    got, llm = run(spec(16), PROMPTS[:len(N_PARAMS)], n_params())
    assert [len(o) for o in got] == [kw["n"] for kw in N_PARAMS]
    for i, kw in enumerate(N_PARAMS):
        if kw.get("top_k") == 1:
            assert got[i] == [alone["greedy"][i]] * kw["n"]
        else:
            assert len({tuple(c) for c in got[i]}) == kw["n"], got[i]  # n distinct draws
    assert got == alone["n"]
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_compiled_target_is_lossless(alone: dict) -> None:
    """Without enforce_eager, as vLLM runs by default on a GPU: the target compiled with
    torch.compile (V2's start-up JIT warm-up off: test_the_start_up_warm_up_runs_with_trees);
    trees accept deep and off the spine, and output is the target's."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, llm = run(spec(16), PROMPTS, [params] * len(PROMPTS), enforce_eager=False,
                   kernel_config={"enable_jit_warmup": False})
    assert llm.llm_engine.vllm_config.compilation_config.mode > 0  # compiled
    assert [o[0] for o in got] == alone["greedy"]
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3 and stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_the_start_up_warm_up_runs_with_trees(alone: dict,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without enforce_eager (here without compiling, to keep it short) V2 warms the step's
    kernels up at start-up (kernel_config.enable_jit_warmup, on by default, on a GPU too),
    driving dummy verify steps through the runner's rejection sampler, here the tree
    verifier: the engine starts and its output is the target's. On CUDA the verifier sets
    tree attention's warm-up bounds for that first tree step's forward (every Triton split
    variant compiles then, none while serving); forced here as on CUDA, they are set once,
    during start-up, and cleared after that step."""
    from vllm import LLM, SamplingParams

    from vllm_ddtree.attention.tree_batch import TreeBatch
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    calls: list = []
    monkeypatch.setattr(TreeBatch, "set_warm_up", lambda self, bounds: calls.append(bounds))
    bind = TreeVerifier.bind

    def bind_as_on_cuda(self, *args) -> None:
        bind(self, *args)
        self._warm_up = (4128, 8)

    monkeypatch.setattr(TreeVerifier, "bind", bind_as_on_cuda)
    llm = LLM(model=str(PAIR / "target"), max_model_len=512, seed=0, dtype="float32",
              max_num_seqs=8, speculative_config=spec(16),
              compilation_config={"mode": 0, "cudagraph_mode": "NONE"})
    assert llm.llm_engine.vllm_config.kernel_config.enable_jit_warmup
    assert calls == [(4128, 8), None]  # the start-up warm-up's tree step
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone["greedy"]
    assert calls == [(4128, 8), None]  # none while serving


def engine_config(spec: dict, model: str | Path = PAIR / "target", **engine: object):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=512, speculative_config=spec,
                      **engine).create_engine_config()


@pytest.mark.parametrize(("arch", "fields", "kind"), [
    ("Lfm2ForCausalLM", {"model_type": "lfm2", "layer_types": ["conv", "full_attention"],
                         "full_attn_idxs": [1], "conv_L_cache": 3, "conv_bias": False,
                         "block_dim": 256, "block_ff_dim": 768, "norm_eps": 1e-5},
     "of kind conv,"),
    ("JambaForCausalLM", {"model_type": "jamba", "attn_layer_period": 2,
                          "attn_layer_offset": 1, "expert_layer_period": 2,
                          "expert_layer_offset": 1, "num_experts": 1}, "of kind .*mamba,"),
])
def test_recurrent_targets_other_than_gdn_are_refused(tmp_path: Path, arch: str,
                                                      fields: dict, kind: str) -> None:
    """A target whose recurrent layers are not Gated DeltaNet (a config of the tiny
    target's size with the tokenizer: no weights are read) is refused at start-up naming
    the kind and the model."""
    target = tmp_path / arch
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PAIR / "target" / name, target)
    config = json.loads((PAIR / "target" / "config.json").read_text())
    config.update(architectures=[arch], num_hidden_layers=2, **fields)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"the target '{re.escape(str(target))}' has "
                                         f"recurrent layers {kind} which ddtree cannot verify"):
        engine_config(spec(16), model=target)


def test_recurrent_kinds_are_named_and_gated_deltanet_passes() -> None:
    """The check itself: the kind from the config's layer list, or the architecture where
    the config names none; Gated DeltaNet architectures (Qwen3-Next, Qwen3.5) pass."""
    from types import SimpleNamespace

    from vllm_ddtree.recurrent.limits import verify_recurrent_target

    def target(arch: str, **hf: object) -> SimpleNamespace:
        return SimpleNamespace(model="some/hybrid-model", architectures=[arch],
                               hf_text_config=SimpleNamespace(**hf))

    with pytest.raises(ValueError, match=r"has recurrent layers \(kind not named in its "
                                         r"config; NemotronHForCausalLM\), which"):
        verify_recurrent_target(target("NemotronHForCausalLM"))
    with pytest.raises(ValueError, match="has recurrent layers of kind mamba, which"):
        verify_recurrent_target(target("JambaForCausalLM",
                                        layers_block_type=["attention", "mamba"]))
    for gdn in ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                "Qwen3_5MoeForConditionalGeneration"):
        verify_recurrent_target(target(gdn, layer_types=["linear_attention",
                                                          "full_attention"]))


def test_watermarking_is_refused() -> None:
    """Watermarking needs probabilistic drafts (vLLM's rule), which trees are not
    (ddtree refuses draft_sample_method 'probabilistic' by name); and the method says it
    does not watermark."""
    from vllm_ddtree.spec_decode.config import DDTreeSpeculatorConfig, JetSpecSpeculatorConfig

    with pytest.raises(ValueError, match="watermarking requires draft_sample_method"):
        engine_config(spec(16), watermark_config={"key": 1})
    with pytest.raises(ValueError, match="draft_sample_method is 'probabilistic': method "
                                         "'ddtree' does not support it"):
        engine_config(spec(16, draft_sample_method="probabilistic"),
                      watermark_config={"key": 1})
    assert not DDTreeSpeculatorConfig.supports_watermarking
    assert not JetSpecSpeculatorConfig.supports_watermarking


SYNTHETIC = {"rejection_sample_method": "synthetic"}
PER_DEPTH = r" \(method 'ddtree': one rate per tree depth, tree_depth = "


@pytest.mark.parametrize(("options", "message"), [
    (SYNTHETIC | {"synthetic_acceptance_length": 9.0},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 8\], got 9.0." +
     PER_DEPTH + "7;"),
    (SYNTHETIC | {"synthetic_acceptance_length": 0.5},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 8\]"),
    # num_speculative_tokens is the depth: lengths up to depth + 1.
    (SYNTHETIC | {"synthetic_acceptance_length": 5.5, "num_speculative_tokens": 4},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 5\].*" + PER_DEPTH +
     "4;"),
    # One rate per tree node (tree_budget) is not one per depth.
    (SYNTHETIC | {"tree_budget": 16, "synthetic_acceptance_rates": [0.5] * 16},
     r"speculative_config.synthetic_acceptance_rates must have length 7.*tree_depth = 7"),
    (SYNTHETIC | {"synthetic_acceptance_rates": [0.5, 0.6, 0.4, 0.3, 0.2, 0.1, 0.0]},
     r"speculative_config.synthetic_acceptance_rates must be non-increasing"),
    (SYNTHETIC | {"synthetic_acceptance_rates": [1.5, 1, 1, 1, 1, 1, 1]},
     r"speculative_config.synthetic_acceptance_rates entries must be in \[0, 1\]"),
    (SYNTHETIC, r"speculative_config.rejection_sample_method='synthetic' requires exactly one"),
    (SYNTHETIC | {"synthetic_acceptance_length": 2.0, "synthetic_acceptance_rates": [0.5] * 7},
     r"speculative_config.rejection_sample_method='synthetic' requires exactly one"),
    # vLLM's own check: the settings without the synthetic method.
    ({"synthetic_acceptance_rates": [0.5] * 7}, r"synthetic_acceptance_rates / "
     r"synthetic_acceptance_length are only valid with rejection_sample_method='synthetic'"),
    ({"synthetic_acceptance_length": 2.0}, r"synthetic_acceptance_rates / "
     r"synthetic_acceptance_length are only valid with rejection_sample_method='synthetic'"),
])
def test_bad_synthetic_settings_fail_at_startup_naming_the_field(options: dict,
                                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(spec(16) | options)


def test_dynamic_schedule_is_taken_from_the_cli() -> None:
    """vLLM's num_speculative_tokens_per_batch_size (JSON lists on the command line) sets
    the tree nodes verified per batch size; the scheduler's lookup clamps them to
    tree_budget (vLLM's rule for any method), and the tree's depth stays the drafter's."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(PAIR / "target"), "--max-model-len", "512",
                              "--speculative-config", json.dumps(spec(16) | {
                                  "num_speculative_tokens_per_batch_size":
                                  [[1, 2, 32], [3, 8, 7], [9, 256, 0]]})])
    config = EngineArgs.from_cli_args(args).create_engine_config().speculative_config
    assert (config.custom_method, config.num_speculative_tokens) == ("ddtree", 16)
    assert config.speculator_options["tree_depth"] == 7
    lookup = build_dynamic_sd_schedule_lookup(config.num_speculative_tokens_per_batch_size,
                                              10, config.num_speculative_tokens)
    assert lookup[1:] == [16, 16, 7, 7, 7, 7, 7, 7, 0, 0]


# Synthetic acceptance (vllm_ddtree/synthetic.py) on hand-made trees: 0.32's unit tests.

def within(measured: float, expected: float, variance: float, n: int) -> bool:
    """Within 4.5 standard errors (of a mean of n independent draws of that variance):
    a chance of about 7e-6 per check to fail by bad luck; runs are seeded anyway."""
    return abs(measured - expected) <= 4.5 * math.sqrt(variance / n) + 1e-9


def hand_made_trees(n_scheduled: list[int]) -> dict[str, torch.Tensor]:
    """Three rows of 8 nodes: a tree of height 3, the same tree with only nodes 0..4
    scheduled (height 2), and a chain 7 deep; node i's valid when i <= n_scheduled[row]."""
    tree = [-1, 0, 0, 1, 1, 2, 3, 5]  # parents: depths 0, 1, 1, 2, 2, 2, 3, 3
    chain = [-1, 0, 1, 2, 3, 4, 5, 6]
    parents = torch.tensor([tree, tree, chain], dtype=torch.int32)
    tokens = torch.tensor([[100, 10, 11, 20, 21, 22, 30, 31]] * 2 + [[100, *range(40, 47)]])
    R, N = parents.shape
    depths = torch.zeros(R, N, dtype=torch.int32)
    first_child = torch.full((R, N), -1, dtype=torch.int32)
    next_sibling = torch.full((R, N), -1, dtype=torch.int32)
    for r in range(R):
        last_child = {}
        for i in range(1, N):
            p = int(parents[r, i])
            depths[r, i] = depths[r, p] + 1
            if p in last_child:
                next_sibling[r, last_child[p]] = i
            else:
                first_child[r, p] = i
            last_child[p] = i
    valid = torch.arange(N) <= torch.tensor(n_scheduled)[:, None]
    return dict(token_ids=torch.where(valid, tokens, -1), parents=parents, depths=depths,
                first_child=first_child, next_sibling=next_sibling, valid=valid)


def root_path(parents: torch.Tensor, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


@pytest.mark.parametrize("length", range(9))
def test_the_walk_accepts_exactly_a_drawn_path(length: int) -> None:
    """Per row the end node is valid, at depth min(length, height), picked uniformly among
    that depth's nodes; the walk accepts its root path, no more (the target's own choice at
    node 3 is its child 6's token: the cut stops the walk there), and the bonus is the
    target's own choice at the end."""
    from vllm_ddtree import ops
    from vllm_ddtree.synthetic import force_path, pick_path_ends

    reps = 1500
    t = {k: v.repeat(reps, 1) for k, v in hand_made_trees([7, 4, 7]).items()}
    heights = torch.tensor([3, 2, 7]).repeat(reps)
    target = torch.randint(0, 50, t["token_ids"].shape,
                           generator=torch.Generator().manual_seed(0))
    target[:, 3] = 30
    choice = torch.where(t["valid"], target, -1)
    end = pick_path_ends(t["depths"], t["valid"], torch.full((len(heights),), length))
    forced, cut = force_path(choice, t["token_ids"], t["parents"], t["first_child"], end, 7)
    accepted, num, output = ops.verify_tree(ops.DraftTrees(
        t["token_ids"], t["parents"], t["depths"], cut, t["next_sibling"], None, None), forced,
        8)
    want = torch.clamp(heights, max=length)
    assert torch.equal(t["depths"].gather(1, end[:, None]).squeeze(1).long(), want)
    assert bool(t["valid"].gather(1, end[:, None]).all())
    assert torch.equal(num.long(), want)
    for r in range(0, len(end), 97):  # a sample of rows, in Python
        path = root_path(t["parents"][r], int(end[r]))
        assert accepted[r, :num[r]].tolist() == path and not (accepted[r, num[r]:] + 1).any()
        assert output[r, :num[r] + 1].tolist() == [
            *t["token_ids"][r, path].tolist(), int(choice[r, end[r]])]
    # Uniform among the nodes at that depth: per row kind, each node's share of the draws.
    for kind in range(3):
        picks = Counter(end[kind::3].tolist())
        at_depth = [i for i in range(8) if t["valid"][kind, i]
                    and int(t["depths"][kind, i]) == want[kind]]
        assert sorted(picks) == at_depth
        share = 1 / len(at_depth)
        for node in at_depth:
            assert within(picks[node] / reps, share, share * (1 - share), reps), (kind, picks)


def test_drawn_lengths_follow_the_rates() -> None:
    """Leading successes of u_i < conditional rate i: P(L > i) is unconditional rate i
    (vLLM 0.34's conversion of the rates, from V2's rejection sampler)."""
    from vllm_ddtree.synthetic import SyntheticAcceptance, draw_lengths

    rates = [0.9, 0.6, 0.6, 0.2, 0.0]
    synthetic = SyntheticAcceptance(rates, torch.device("cpu"))
    torch.manual_seed(0)
    n = 20000
    lengths = draw_lengths(synthetic.conditional, n)
    for i, rate in enumerate(rates):
        assert within(float((lengths > i).float().mean()), rate, rate * (1 - rate), n), i
    exact = SyntheticAcceptance([1.0, 1.0, 0.5, 0.0], torch.device("cpu"))
    assert set(draw_lengths(exact.conditional, 1000).tolist()) == {2, 3}


def test_the_override_never_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """No .item(), .tolist(), truth value or boolean-mask index in synthetic.py: on a GPU
    each would stall the step and break CUDA-graph capture."""
    import sys

    from engine_helpers import _bool_index

    from vllm_ddtree.synthetic import SyntheticAcceptance

    t = hand_made_trees([7, 4, 7])
    synthetic = SyntheticAcceptance([0.9, 0.7, 0.5, 0.3, 0.1, 0.05, 0.0], torch.device("cpu"))
    calls = []

    def record(name, original, check=None):  # noqa: ANN001, ANN202
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if sys._getframe(1).f_code.co_filename.endswith("vllm_ddtree/synthetic.py") and (
                    check is None or check(*args)):
                calls.append(name)
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__",
                 "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, record(name, getattr(torch.Tensor, name)))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, record(
            name, getattr(torch.Tensor, name), lambda index, *_: _bool_index(index)))
    choice = torch.where(t["valid"], 7, -1)
    synthetic.override(choice, t["token_ids"], t["parents"], t["depths"], t["first_child"],
                       t["valid"])
    assert calls == []
