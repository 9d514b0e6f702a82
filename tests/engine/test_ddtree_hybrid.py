"""Method "ddtree" on V2 with hybrid targets (Gated DeltaNet + full attention): a tiny
Qwen3-Next (scripts/make_tiny_models.py --hybrid), the same model as a Qwen3.5 (M-RoPE) and
as a text-only Qwen3.5. Every tree node's recurrent layers run over its own path
(patch 0005's hook, vllm_ddtree/recurrent/), the accepted path is committed into the
state slot the next step reads, and greedy output is the target's own, token for token,
with trees accepted deep and off the chain (an oracle drafter: test_ddtree_targets.py). The
CPU GDN path runs in bf16 only; the tiny target's greedy margins are far above bf16 noise
(tests/tools/test_tiny_hybrid.py measures them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import known_continuation, language_model_only, oracle_tree_logits
from engine_runs import run_with_aborts, tree_stats

PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(8)]
MAX_TOKENS = 20


def tree_spec(pair: Path, budget: int, **options: object) -> dict:
    return {"method": "ddtree", "model": str(pair / "drafter"), "tree_budget": budget,
            **options}


def generate(pair: Path, spec: dict | None, max_num_seqs: int = 8,
             max_tokens: int = MAX_TOKENS, prompts: list[str] = PROMPTS,
             params: list | None = None, **engine):
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # Qwen3-Next's experts need their own parallel group, which an engine of another model
    # started earlier in this process did not make.
    cleanup_dist_env_and_memory()
    settings = dict(enforce_eager=True, max_model_len=512, seed=0, dtype="bfloat16",
                    max_num_seqs=max_num_seqs, disable_log_stats=False,
                    enable_prefix_caching=False, speculative_config=spec,
                    **language_model_only(pair))
    llm = LLM(model=str(pair / "target"), **(settings | engine))
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {o.prompt: list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, params, use_tqdm=False)}, llm


@pytest.fixture(scope="module")
def hybrid_baselines(tiny_hybrid: Path, tiny_qwen3_5: Path, tiny_qwen3_5_text: Path):
    """By architecture: the pair, the target alone's greedy output (16 tokens of look-ahead
    for the oracle drafter) by prompt, and by prompt token ids."""
    pairs = {"qwen3_next": tiny_hybrid, "qwen3_5": tiny_qwen3_5,
             "qwen3_5_text": tiny_qwen3_5_text}
    cache = {}

    def baseline(arch: str) -> tuple[Path, dict[str, list], dict[tuple, list]]:
        if arch not in cache:
            alone, llm = generate(pairs[arch], None, max_tokens=MAX_TOKENS + 16)
            tokenizer = llm.get_tokenizer()
            cache[arch] = alone, {tuple(tokenizer.encode(p)): alone[p] for p in PROMPTS}
        return pairs[arch], *cache[arch]
    return baseline


def with_oracle(monkeypatch: pytest.MonkeyPatch, truth: dict[tuple, list], seed: int) -> None:
    from vllm_ddtree.spec_decode.speculator import DDTreeSpeculator

    monkeypatch.setattr(DDTreeSpeculator, "draft_logits_at", oracle_tree_logits(truth, seed))


def verifier(llm):
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    return runner.speculator.verifier


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "budget", "spine", "max_num_seqs"), [
    ("qwen3_next", 16, True, 8), ("qwen3_next", 4, True, 1), ("qwen3_next", 64, False, 8),
    ("qwen3_5", 16, True, 8), ("qwen3_5_text", 16, True, 8)])
def test_greedy_is_lossless_with_deep_trees(hybrid_baselines, monkeypatch, arch: str,
                                            budget: int, spine: bool, max_num_seqs: int
                                            ) -> None:
    """Qwen3-Next, Qwen3.5 (M-RoPE: tree positions on every axis) and text-only Qwen3.5."""
    pair, baseline, truth = hybrid_baselines(arch)
    with_oracle(monkeypatch, truth, seed=budget)
    got, llm = generate(pair, tree_spec(pair, budget, tree_spine=spine),
                        max_num_seqs=max_num_seqs)
    assert got == {p: t[:MAX_TOKENS] for p, t in baseline.items()}
    gdn = verifier(llm).gdn
    assert gdn is not None and gdn.commits > 0 and not gdn.verifying  # verified, committed
    stats = tree_stats(llm)
    assert stats["longest_accepted"] >= 3, stats
    if spine and budget > 4:
        assert stats["paths_off_the_index_line"] > 0, stats


@pytest.mark.slow
def test_structured_output_verifies_trees_on_a_hybrid(tiny_hybrid: Path, monkeypatch) -> None:
    """Qwen3-Next under a regex and a JSON schema beside plain requests: the scheduler
    keeps the nodes the grammar allows and the worker renumbers the tree (the GDN layers
    verify it along the renumbered parents); greedy output is the target alone's under the
    same constraints, ending where it ends."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.spec_decode import grammar_tree

    schema = {"type": "object", "properties": {"op": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer"}},
              "required": ["op", "n"], "additionalProperties": False}
    constraints = [StructuredOutputsParams(regex=r"\n    return [a-z0-9 +*-]+"),
                   StructuredOutputsParams(json=schema), None]

    def params(max_tokens: int) -> list:
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                               structured_outputs=constraints[i % 3])
                for i in range(len(PROMPTS))]

    alone, llm = generate(tiny_hybrid, None, params=params(MAX_TOKENS + 16))
    tokenizer = llm.get_tokenizer()
    del llm
    with_oracle(monkeypatch, {tuple(tokenizer.encode(p)): alone[p] for p in PROMPTS}, 16)
    kept, nodes_of = [], grammar_tree.scheduled_tree_nodes

    def recorded(requests, scheduled):  # noqa: ANN001, ANN202
        nodes = nodes_of(requests, scheduled)
        kept.extend((nodes or {}).values())
        return nodes

    monkeypatch.setattr(grammar_tree, "scheduled_tree_nodes", recorded)
    got, llm = generate(tiny_hybrid, tree_spec(tiny_hybrid, 16), params=params(MAX_TOKENS))
    assert got == {p: t[:MAX_TOKENS] for p, t in alone.items()}
    assert any(n != list(range(1, len(n) + 1)) for n in kept)  # renumbered trees
    assert verifier(llm).gdn.commits > 0
    assert tree_stats(llm)["longest_accepted"] >= 3


def assert_mostly_wrong(pair: Path, baseline: dict[str, list]) -> None:
    """A control's check: ddtree at budget 16 misses the target's output for at least half
    the prompts."""
    got, _ = generate(pair, tree_spec(pair, 16))
    wrong = [p for p in PROMPTS if got[p] != baseline[p][:MAX_TOKENS]]
    assert len(wrong) >= len(PROMPTS) // 2, wrong


@pytest.mark.slow
def test_the_tree_path_is_what_keeps_it_lossless(hybrid_baselines, monkeypatch) -> None:
    """The control: with the GDN layers verifying each request's rows as one chain (in node
    order, as vLLM's spec path would), the same trees give another output: the tiny
    target's choices depend on its recurrent state."""
    from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify

    pair, baseline, truth = hybrid_baselines("qwen3_next")
    with_oracle(monkeypatch, truth, seed=16)
    begin_step = GDNTreeVerify.begin_step

    def as_chains(self, parents):
        if parents is not None:
            node = torch.arange(parents.shape[1], device=parents.device)
            parents = (node - 1).expand_as(parents).to(parents.dtype)
        begin_step(self, parents)

    monkeypatch.setattr(GDNTreeVerify, "begin_step", as_chains)
    assert_mostly_wrong(pair, baseline)


@pytest.mark.slow
def test_m_rope_tree_positions_are_what_keep_qwen3_5_lossless(hybrid_baselines,
                                                              monkeypatch) -> None:
    """The control: without tree positions on the M-RoPE axes (the 1-D positions, which the
    Qwen3.5 forward does not read, still get them), attention sees chain positions at tree
    nodes and the output is not the target's."""
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    pair, baseline, truth = hybrid_baselines("qwen3_5")
    with_oracle(monkeypatch, truth, seed=16)
    monkeypatch.setattr(TreeVerifier, "shift_rope_positions", lambda self, positions: None)
    assert_mostly_wrong(pair, baseline)


def test_a_verify_step_longer_than_a_state_block_is_refused(tiny_hybrid: Path) -> None:
    """Prefix caching on a hybrid (align mode) checkpoints one block boundary a step: a tree
    (tree_budget + 1 rows) longer than a block of recurrent states is refused at start-up,
    naming the budget and the block size (final only once the executor aligned it to the
    state page: 640 tokens here); caching is on by default, with ddtree as with the chain."""
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(tiny_hybrid / "target"), max_model_len=2048,
                        dtype="bfloat16", speculative_config=tree_spec(tiny_hybrid, 4)
                        ).create_engine_config().cache_config
    assert config.enable_prefix_caching and config.mamba_cache_mode == "align"
    with pytest.raises(ValueError, match=r"tree_budget is 640: with prefix caching on a hybrid "
                       r"target, a verify step \(tree_budget \+ 1 rows\) must fit in one "
                       r"block of recurrent states \(640 tokens"):
        hybrid_engine(tiny_hybrid, tree_spec(tiny_hybrid, 640), caching=True, max_num_seqs=2)


def chain_oracle(monkeypatch: pytest.MonkeyPatch, truth: dict[tuple, list[int]],
                 perfect: set[tuple] = frozenset()) -> None:
    """V2's DFlash chain drafting each request's greedy continuation right for a random
    number of tokens (0 to all), then wrong: drafts accepted at every depth (all right for
    the prompts in ``perfect``). Reads the requests' tokens from the runner's states
    (``oracle_states``, set once the engine is up; the start-up's dummy drafts stay the
    drafter's)."""
    import numpy as np
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    generate_draft = DFlashSpeculator._generate_draft

    def oracle(self, num_reqs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        generate_draft(self, num_reqs, *args, **kwargs)
        states, steps = getattr(self, "oracle_states", None), self.num_speculative_steps
        if states is None:
            return
        for r, slot in enumerate(self.sample_idx_mapping[:num_reqs * steps:steps].tolist()):
            seq, right = known_continuation(states, slot, truth, steps)
            prompt = tuple(seq[:int(states.prompt_len.np[slot])])
            good = steps if prompt in perfect else int(
                np.random.default_rng([len(seq), *seq[-3:]]).integers(0, steps + 1))
            drafts = [t if i < good else t + 1 for i, t in enumerate(right)]
            drafts += [0] * (steps - len(drafts))
            self.draft_tokens[r] = torch.tensor(drafts)

    monkeypatch.setattr(DFlashSpeculator, "_generate_draft", oracle)


def one_by_one(llm, params, requests: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    """Each request after the one before (so that it may hit what they cached)."""
    return [list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                 .outputs[0].token_ids) for ids in requests]


# Prefix caching on the tiny Qwen3-Next ("align" mode: blocks of 640 tokens, the GDN state
# page). Decode positions' states are retained with prefix_cache_retention_interval (vLLM's
# default keeps prompt boundaries only: a next turn would hit nothing of the reply).
SHARED = "def g(x):\n" + " ".join(f"w{i % 97}" for i in range(400))  # ~1150 tokens
TURN_TOKENS = 40


def caching_phases(tokenizer, replies: dict[tuple, list[int]] | None = None
                   ) -> list[list[list[int]]]:
    """Three batches of token prompts: a first request; then two sharing its first block,
    one parting inside it, and four turns of 610-619 of its tokens (each reply crosses 640
    in a verify step, at a different depth); then each turn again with its reply and two
    more tokens (``replies``, the target's), whose block state at 640 a verify step took."""
    first = tokenizer.encode(SHARED + " alpha beta")
    turns = [first[:610 + 3 * i] for i in range(4)]
    second = [tokenizer.encode(SHARED + s) for s in (" gamma", " delta eps")]
    second += [tokenizer.encode(SHARED[:len(SHARED) // 2] + " zeta"), *turns]
    phases = [[first], second]
    if replies is not None:
        phases.append([t + replies[tuple(t)][:TURN_TOKENS] + [5, 6] for t in turns])
    return phases


def hybrid_engine(pair: Path, spec: dict | None, caching: bool, **engine):
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    settings = dict(speculative_config=spec, enable_prefix_caching=caching,
                    max_model_len=2048, dtype="bfloat16", enforce_eager=True, max_num_seqs=8,
                    seed=0, disable_log_stats=False)
    if caching:
        settings["prefix_cache_retention_interval"] = 640
    return LLM(model=str(pair / "target"), **(settings | engine))


def run_phases(llm, phases: list[list[list[int]]], max_tokens: int) -> dict[tuple, list[int]]:
    """Each phase's prompts in one call (after the phase before: it may hit their blocks)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for prompts in phases:
        for ids, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                params, use_tqdm=False)):
            out[tuple(ids)] = list(o.outputs[0].token_ids)
    return out


@pytest.fixture(scope="module")
def caching_baselines(tiny_hybrid: Path, tiny_qwen3_5: Path, tiny_qwen3_5_text: Path):
    """By architecture: the pair, the phases' prompts and the target alone's replies with
    caching off (16 tokens more: the oracles' look-ahead)."""
    pairs = {"qwen3_next": tiny_hybrid, "qwen3_5": tiny_qwen3_5,
             "qwen3_5_text": tiny_qwen3_5_text}
    cache = {}

    def baseline(arch: str):
        if arch not in cache:
            llm = hybrid_engine(pairs[arch], None, caching=False,
                                **language_model_only(pairs[arch]))
            tokenizer = llm.get_tokenizer()
            replies = run_phases(llm, caching_phases(tokenizer), TURN_TOKENS + 16)
            phases = caching_phases(tokenizer, replies)
            replies |= run_phases(llm, phases[2:], TURN_TOKENS + 16)
            del llm
            cache[arch] = pairs[arch], phases, replies
        return cache[arch]
    return baseline


def boundary_paths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Records, for every tree verified, a 640-token block boundary that its accepted path
    crosses before its last node (the state align mode checkpoints there is that of a row
    inside the path, the root's at depth 0): (drafts accepted, the boundary's depth in the
    path, off the spine)."""
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    seen, call = [], TreeVerifier.__call__

    def recording(self, logits, input_batch, draft_logits=None):  # noqa: ANN001, ANN202
        roots = input_batch.num_computed_tokens_np[:input_batch.num_reqs].tolist()
        out = call(self, logits, input_batch, draft_logits)
        verdict = self._path.verdict
        for r, (root, n) in enumerate(zip(roots, verdict.num_accepted.tolist())):
            depth = 640 - 1 - root % 640  # the boundary token's depth below this root
            if depth < n:
                nodes = verdict.accepted[r, :n].tolist()
                seen.append((n, depth, nodes != list(range(1, n + 1))))
        return out

    monkeypatch.setattr(TreeVerifier, "__call__", recording)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "budget", "max_num_seqs", "spine", "chunk"), [
    ("qwen3_next", None, 8, True, None), ("qwen3_next", 4, 1, True, None),
    ("qwen3_next", 16, 8, True, 1024), ("qwen3_next", 64, 8, False, None),
    ("qwen3_5", 16, 8, True, None), ("qwen3_5_text", 16, 1, True, None)])
def test_prefix_caching_is_the_target_without(caching_baselines, monkeypatch, arch: str,
                                              budget: int | None, max_num_seqs: int,
                                              spine: bool, chunk: int | None) -> None:
    """Issue 54: with prefix caching on (align mode), vLLM's DFlash chain (budget None: 7
    drafts, an oracle drafting each reply right for a random number of tokens) and ddtree
    (oracle trees accepted deep and off the spine) generate what the target alone does with
    caching off, token for token, at concurrency 1 and 8, with prompts prefilled in chunks
    beside verify steps, on Qwen3-Next and Qwen3.5 (M-RoPE and text-only); vLLM's own
    prefix-cache hits count the shared block and every next turn's block, whose state a
    verify step took inside an accepted path (the GDN commit's per-row states:
    gdn_verify.commit; with the last state alone committed, two of the three Qwen3-Next tree
    cases fail). Blind spot: the tiny target's GDN layers are exact stores (beta 1, no
    decay), so a state taken a few rows late would go unseen here;
    tests/recurrent/test_gdn_verify.py checks each row's state against vLLM's chain."""
    pair, phases, replies = caching_baselines(arch)
    if budget is None:
        spec = {"method": "dflash", "model": str(pair / "drafter"),
                "num_speculative_tokens": 7}
        chain_oracle(monkeypatch, replies)
    else:
        spec = tree_spec(pair, budget, tree_spine=spine)
        with_oracle(monkeypatch, replies, seed=budget)
        crossings = boundary_paths(monkeypatch)
    llm = hybrid_engine(pair, spec, caching=True, max_num_seqs=max_num_seqs,
                        **({"max_num_batched_tokens": chunk} if chunk else {}),
                        **language_model_only(pair))
    if budget is None:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
            .model_runner
        runner.speculator.oracle_states = runner.req_states

    def hits() -> float:
        return {m.name: getattr(m, "value", None)
                for m in llm.get_metrics()}["vllm:prefix_cache_hits"]

    got = run_phases(llm, phases[:2], TURN_TOKENS)
    before = hits()
    got |= run_phases(llm, phases[2:], TURN_TOKENS)
    assert got == {p: replies[p][:TURN_TOKENS] for p in got}
    assert before >= 2 * 640  # the shared block, for the two requests past it
    assert hits() - before >= 4 * 640  # each next turn: the block a verify step stored
    if budget is not None:
        assert verifier(llm).gdn.commits > 0
        assert any(n >= 3 for n, _, _ in crossings), crossings  # deep, across a boundary
        if not spine or budget > 4:
            assert any(off for _, _, off in crossings), crossings


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True])
def test_full_graph_metadata_stays_lossless(hybrid_baselines, monkeypatch,
                                            adaptive: bool) -> None:
    """The GDN metadata FULL CUDA graphs read: with the GDN builders staging every verify
    step's metadata into their persistent graph buffers (as under FULL graphs on a GPU; the
    CPU runs eagerly, so the buffers are read directly), output stays the target's with
    trees accepted deep, fixed or adaptive (each request's own prefix: a varlen graph's
    batch). The state-slot buffer is as wide as the tree's columns (patch 0006: a
    budget-wide buffer failed to take them)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    pair, baseline, truth = hybrid_baselines("qwen3_next")
    with_oracle(monkeypatch, truth, seed=16)
    spec = tree_spec(pair, 16, enable_adaptive_verification=adaptive)
    _, llm = generate(pair, spec, prompts=PROMPTS[:1], max_tokens=1)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    if adaptive:
        from engine_helpers import fixed_step_costs, use_step_costs

        sizing = use_step_costs(runner, fixed_step_costs(per_token_ms=0.05, draft_ms=0.05))
    builders = [b for groups in runner.attn_groups for g in groups
                for b in g.metadata_builders if isinstance(b, GDNAttentionMetadataBuilder)]
    staged = []
    stage = GDNAttentionMetadataBuilder._stage_spec_decode

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        staged.append(stage(self, *args))
        return staged[-1]

    monkeypatch.setattr(GDNAttentionMetadataBuilder, "_stage_spec_decode", counted)
    for builder in builders:
        builder.use_full_cuda_graph = True
        assert builder.spec_state_indices_tensor.shape[1] == runner.speculator.depth + 1
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = {o.prompt: list(o.outputs[0].token_ids)
           for o in llm.generate(PROMPTS, params, use_tqdm=False)}
    assert builders and any(staged)
    assert got == {p: t[:MAX_TOKENS] for p, t in baseline.items()}
    assert tree_stats(llm)["longest_accepted"] >= 3
    if adaptive:
        chosen = sizing.stats()
        assert 0 < chosen["min_nodes"] < chosen["max_nodes"], chosen


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True])
def test_adaptive_trees_stay_lossless_on_a_hybrid(hybrid_baselines, monkeypatch,
                                                  caching: bool) -> None:
    """Qwen3-Next with adaptive trees (cap 16): every step verifies a prefix of each
    request's tree, of varying length (none for some), through the GDN tree path; then the
    drafter pauses (its context kept while the recurrent state advances a token a step)
    and resumes. Greedy output is the target's, with paths accepted deep and off the
    greedy chain, prefix caching on (align mode) and off."""
    from engine_helpers import fixed_step_costs, pause_and_resume, use_step_costs
    from vllm import SamplingParams

    pair, baseline, truth = hybrid_baselines("qwen3_next")
    with_oracle(monkeypatch, truth, seed=16)
    llm = hybrid_engine(pair, tree_spec(pair, 16, enable_adaptive_verification=True),
                        caching, **language_model_only(pair))
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    paying = fixed_step_costs(per_token_ms=0.05, draft_ms=0.05)
    sizing = use_step_costs(runner, paying)
    tokens = MAX_TOKENS + 16  # all the baseline has
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    done, _, paused = pause_and_resume(llm, sizing, PROMPTS, params, 3, 8, paying,
                                       fixed_step_costs(per_token_ms=0.05, draft_ms=100.0))
    assert done == {p: t[:tokens] for p, t in baseline.items()}
    chosen = sizing.stats()
    assert paused["paused_steps"] >= 3, paused
    assert chosen["steps"] > paused["steps"] and chosen["realized"] > paused["realized"]
    assert 0 < chosen["min_nodes"] < chosen["max_nodes"], chosen
    assert chosen["paths_off_the_greedy_chain"] > 0, chosen
    assert tree_stats(llm)["longest_accepted"] >= 3
    gdn = verifier(llm).gdn
    assert gdn is not None and gdn.commits > 0


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True])
def test_chunked_prefill_preemption_and_aborts_stay_lossless(hybrid_baselines, monkeypatch,
                                                             caching: bool) -> None:
    """Prompts prefilled in chunks beside verify steps (max_num_batched_tokens 40), requests
    aborted between verify steps (their state slots freed and reused by a later batch): the
    others stay the target's own, with prefix caching (align mode) and without."""
    from vllm import SamplingParams

    pair, baseline, truth = hybrid_baselines("qwen3_next")
    with_oracle(monkeypatch, truth, seed=4)
    _, llm = generate(pair, tree_spec(pair, 12), prompts=PROMPTS[:1], max_tokens=1,
                      max_num_batched_tokens=40, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kept = run_with_aborts(llm, PROMPTS[:6], params, ["r1", "r4"])
    assert len(kept) == 4
    assert all(tokens == baseline[prompt][:MAX_TOKENS] for prompt, tokens in kept.values())
    outputs = llm.generate(PROMPTS[6:], params, use_tqdm=False)
    assert {o.prompt: list(o.outputs[0].token_ids) for o in outputs} == {
        p: baseline[p][:MAX_TOKENS] for p in PROMPTS[6:]}
    assert tree_stats(llm)["longest_accepted"] >= 3


@pytest.mark.slow
def test_the_stash_is_what_stash_bytes_counts(tiny_hybrid: Path) -> None:
    """The start-up check's size of the stash (config.stash_bytes) is what the engine keeps:
    each GDN layer's stash buffers (allocated at its first verify step, rewritten by every
    later one, a captured graph's too) hold stash_bytes_per_row bytes per row for the
    largest step, max_num_seqs x (tree_budget + 1) rows."""
    from vllm_ddtree.recurrent.gdn_verify import stash_bytes_per_row
    from vllm_ddtree.recurrent.limits import stash_bytes

    _, llm = generate(tiny_hybrid, tree_spec(tiny_hybrid, 8), max_num_seqs=4,
                      prompts=PROMPTS[:4], max_tokens=8)
    config = llm.llm_engine.vllm_config
    row = stash_bytes_per_row(config.model_config.hf_text_config, torch.bfloat16)
    need, per_request = stash_bytes(config)
    gdn = verifier(llm).gdn
    assert len(gdn.stash) == 3  # 3 GDN layers
    for st in gdn.stash.values():
        tensors = (st.x, st.conv_out, st.g, st.beta)
        assert all(t.shape[0] == 4 * 9 for t in tensors)  # four requests' whole trees
        assert sum(t.numel() * t.element_size() for t in tensors) == 4 * 9 * row
    assert per_request == 3 * 9 * row and need == 4 * per_request


def test_a_stash_that_does_not_fit_is_refused_at_startup(tiny_hybrid: Path,
                                                         monkeypatch) -> None:
    """A budget whose per-step stash exceeds the memory left beside the KV cache (here 1 GiB
    free of the node's 2 beside VLLM_CPU_KVCACHE_SPACE=1) is refused at start-up with the
    number needed and the settings to change; a smaller batch of the same budget fits."""
    from collections import namedtuple

    import psutil
    from vllm.engine.arg_utils import EngineArgs

    memory = namedtuple("memory", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(24 * 2**30, 2 * 2**30))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")

    def config(max_num_seqs: int):
        return EngineArgs(model=str(tiny_hybrid / "target"), max_model_len=512,
                          dtype="bfloat16", enable_prefix_caching=False,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=300_000,
                          speculative_config=tree_spec(tiny_hybrid, 1024),
                          ).create_engine_config()

    # 256 requests x 1025 rows x 3 layers x 2,064 bytes: 1.51 GiB.
    with pytest.raises(ValueError, match=r"tree_budget is 1024: a verify step's Gated DeltaNet "
                       r"stash .* needs 1\.51 GiB \(6\.1 MiB per request, up to 256 requests "
                       r"a step\), but 1\.00 GiB is left beside the KV cache sized by "
                       r"VLLM_CPU_KVCACHE_SPACE \(1 GiB\); lower tree_budget, max_num_seqs"):
        config(256)
    assert config(8).speculative_config.num_speculative_tokens == 1024


@pytest.mark.parametrize("caching", [False, True])
def test_state_pages_that_do_not_fit_are_refused_at_startup(tiny_hybrid: Path,
                                                            caching: bool) -> None:
    """A request holds 1 + tree_depth recurrent-state pages in each GDN layer (one more with
    prefix caching, align mode), whatever the budget (patch 0006); a KV cache smaller than
    one request's pages is refused at start-up naming the depth, before vLLM's own check
    (which names max_model_len only); a cache that holds them passes."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.recurrent.limits import state_bytes_per_request

    def config(kv_bytes: int, depth: int = 7):
        return EngineArgs(model=str(tiny_hybrid / "target"), max_model_len=512,
                          dtype="bfloat16", enable_prefix_caching=caching,
                          kv_cache_memory_bytes=kv_bytes,
                          speculative_config=tree_spec(tiny_hybrid, 64,
                                                       num_speculative_tokens=depth),
                          ).create_engine_config()

    pages, need = state_bytes_per_request(config(2**30))
    assert pages == (2 if caching else 1) + 7
    shallow = state_bytes_per_request(config(2**30, depth=3))
    assert shallow[0] == pages - 4 and shallow[1] < need * (pages - 4) / pages  # and narrower
    with pytest.raises(ValueError, match=rf"num_speculative_tokens \(the tree's depth\) is 7: "
                       rf"a request holds {pages} recurrent-state pages in each Gated DeltaNet "
                       rf"layer .*more than the whole KV cache .*kv_cache_memory_bytes\); "
                       rf"lower num_speculative_tokens"):
        config(need // 2)
    config(need)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True])
def test_preemption_under_a_small_kv_cache_and_cut_trees_stay_lossless(tiny_hybrid: Path,
                                                                        monkeypatch,
                                                                        caching: bool) -> None:
    """Three requests of about 600 prompt tokens, prefilled in chunks beside verify steps,
    under a KV cache of 82 blocks: vLLM sizes a hybrid's attention blocks to the recurrent
    state's page (640 tokens here), and a request holds 8 blocks (1 + tree_depth state
    slots) in each of the 3 GDN layers' groups and one attention block per 640 tokens in
    each of the 2 attention groups: the three fit until two pass 640 tokens, and one is then
    preempted (its recurrent state recomputed from its tokens when it is resumed). The last
    one runs into max_model_len (660), its last trees cut short. Output stays the target's
    own, with trees accepted deep, with prefix caching on (align mode, every block's state
    retained; under this cache the preempted request's blocks are reused before it resumes:
    no hits) and off."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    lengths, max_tokens, max_len = (600, 610, 620), 50, 660
    prompts = [[3 + (7 * i + j * j) % 200 for j in range(n)] for i, n in enumerate(lengths)]
    truth = {}
    _, llm = generate(tiny_hybrid, None, prompts=PROMPTS[:1], max_tokens=1, max_model_len=1024)
    for prompt, out in zip(prompts, llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens + 16, ignore_eos=True),
            use_tqdm=False)):
        truth[tuple(prompt)] = list(out.outputs[0].token_ids)
    del llm
    with_oracle(monkeypatch, truth, seed=3)
    _, llm = generate(tiny_hybrid, tree_spec(tiny_hybrid, 12), prompts=PROMPTS[:1],
                      max_tokens=1, max_num_seqs=3, max_model_len=max_len,
                      max_num_batched_tokens=128, num_gpu_blocks_override=82,
                      enable_prefix_caching=caching,
                      **({"prefix_cache_retention_interval": None} if caching else {}))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        room = min(max_tokens, max_len - len(prompt))
        assert list(out.outputs[0].token_ids) == truth[tuple(prompt)][:room]
    assert len(outputs[-1].outputs[0].token_ids) == max_len - lengths[-1]  # at the limit
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["vllm:num_preemptions"] > 0, "the KV cache was not small enough to preempt"
    assert tree_stats(llm)["longest_accepted"] >= 3


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True])
def test_sampling_matches_the_target_distribution(tiny_hybrid: Path, monkeypatch,
                                                  caching: bool) -> None:
    """Temperature 2 (the tiny target's margins make it nearly deterministic at 1), top-k
    3: the 2nd and 3rd tokens, the first ones speculation produces, are distributed as
    without speculation, with trees (budget 8) of the oracle drafter shown the greedy
    continuation, so that sampled nodes are accepted too. Fails below a chi-square p-value
    of 0.001 (fixed seeds: deterministic). With prefix caching on (align mode) and off."""
    from engine_helpers import chi_square_p_value
    from vllm import SamplingParams

    n, prompt = 600, "def main():"

    def sampled(llm) -> list[list[int]]:
        params = [SamplingParams(temperature=2.0, top_k=3, max_tokens=3, seed=1000 + i)
                  for i in range(n)]
        return [list(o.outputs[0].token_ids)
                for o in llm.generate([prompt] * n, params, use_tqdm=False)]

    greedy, llm = generate(tiny_hybrid, None, prompts=[prompt], max_tokens=19,
                           max_num_seqs=64, max_model_len=128)
    plain = sampled(llm)
    del llm
    with_oracle(monkeypatch, {tuple(tiny_tokenizer(tiny_hybrid).encode(prompt)):
                              greedy[prompt]}, seed=8)
    _, llm = generate(tiny_hybrid, tree_spec(tiny_hybrid, 8), prompts=[prompt], max_tokens=1,
                      max_num_seqs=64, max_model_len=128, enable_prefix_caching=caching)
    speculated = sampled(llm)
    # Three tokens: one verify step a request, a node accepted (off the spine too) and a
    # bonus token.
    stats = tree_stats(llm)
    assert stats["longest_accepted"] == 1 and stats["paths_off_the_index_line"] > 0, stats
    assert all(len(t) == 3 for t in speculated)
    for position in (1, 2):
        assert len({t[position] for t in plain}) >= 3  # a real distribution, not one token
        p = chi_square_p_value([t[position] for t in plain],
                               [t[position] for t in speculated])
        assert p > 1e-3, f"token {position + 1}: p = {p:.2g}"


def tiny_tokenizer(pair: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pair / "target"))
