"""Synthetic acceptance for method "ddtree" (a benchmarking mode): vLLM's
rejection_sample_method "synthetic", with its rates per tree depth.

In the engine (tiny random pair, greedy) the mean acceptance length and the per-position
rates, read from vLLM's spec-decode stats, are the requested ones; drawn paths leave the
greedy spine and are compacted like real ones; bad settings fail at startup naming the
field. On hand-made trees the path choice is a real root-to-node path of the drawn length
(capped at the tree's height) and the walk accepts exactly it.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

PROMPTS = [f"def f{i}(x):\n    return x {'+-*'[i % 3]} {i * 7}" for i in range(16)]


def run_engine(tiny_models: Path, spec: dict, max_tokens: int, prompts: list[str] = PROMPTS):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512, seed=0,
              dtype="float32", max_num_seqs=16, disable_log_stats=False,
              speculative_config={"method": "ddtree", "model": str(tiny_models / "drafter"),
                                  "rejection_sample_method": "synthetic"} | spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm


def spec_stats(llm) -> tuple[int, list[int]]:
    """vLLM's spec-decode stats: verify steps of requests with drafts, and per draft
    position the steps that accepted it (for a tree: paths at least that deep)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    return (metrics["vllm:spec_decode_num_drafts"].value,
            metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values)


def ddtree_state(llm):
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    return runner.drafter.ddtree_state


def within(measured: float, expected: float, variance: float, n: int) -> bool:
    """Within 4.5 standard errors (of a mean of n independent draws of that variance):
    a chance of about 7e-6 per check to fail by bad luck; runs are seeded anyway."""
    return abs(measured - expected) <= 4.5 * math.sqrt(variance / n) + 1e-9


@pytest.mark.slow
def test_mean_length_is_the_requested_one_and_paths_are_compacted(tiny_models: Path,
                                                                  monkeypatch) -> None:
    """Length 3.5 at depth 7 is vLLM's rates [1, 1, 0.5, 0, ...]: every verify step accepts
    2 or 3 drafts, a fair coin between them, so the mean length's standard error over n
    steps is 0.5 / sqrt(n). The drafter favours two tokens per depth, so that the tree
    branches below depth 1 (the random drafter's is flat: the spine, then siblings at
    depth 1): drawn paths go off the greedy spine, and compaction moves their KV entries
    and hidden rows. That it moves them right shows in every bonus token: the target's own
    greedy choice after the emitted prefix, which it computes on the compacted cache from
    the next step on."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_ddtree.runner import DDTreeProposer, DDTreeState

    emitted: dict[str, list[list[int]]] = {}  # per request, each verify step's tokens
    moved = Counter()  # per kind (KV caches / hidden rows), the deepest position moved
    verify, compact = DDTreeState.verify, torch.ops.vllm_ddtree.compact_tree

    def two_way_logits(self, hidden_states):
        logits = self.model.compute_logits(hidden_states)  # [R * depth, V], request-major
        depth = torch.arange(logits.shape[0])[:, None] % self.depth
        favoured = (depth * 7 + torch.arange(2)) % logits.shape[1]
        return logits.scatter_add(1, favoured, torch.full(favoured.shape, 10.0))

    def recording_verify(self, logits, spec_decode_metadata, *args):
        req_ids = list(self.runner.input_batch.req_ids)
        out = verify(self, logits, spec_decode_metadata, *args)
        v = self.last_verdict
        for rid, n, num, tokens in zip(req_ids, spec_decode_metadata.num_draft_tokens,
                                       v.num_accepted.tolist(), v.output_tokens.tolist()):
            if n > 0:
                emitted.setdefault(rid, []).append(tokens[:num + 1])
        return out

    def counting_compact(kv_caches, hidden, slot_mapping, qsl, accepted, num_accepted):
        position = torch.arange(1, accepted.shape[1] + 1)
        moves = (accepted > position) & (position <= num_accepted[:, None])
        if moves.any():
            kind = "kv" if len(kv_caches) else "hidden"
            moved[kind] = max(moved[kind], int(position[moves.any(dim=0)].max()))
        return compact(kv_caches, hidden, slot_mapping, qsl, accepted, num_accepted)

    monkeypatch.setattr(DDTreeProposer, "draft_logits", two_way_logits)
    monkeypatch.setattr(DDTreeState, "verify", recording_verify)
    monkeypatch.setattr(torch.ops.vllm_ddtree, "compact_tree", counting_compact)
    max_tokens = 64
    outputs, llm = run_engine(tiny_models, {"tree_budget": 16,
                                            "synthetic_acceptance_length": 3.5}, max_tokens)
    n, per_pos = spec_stats(llm)
    assert n >= 250, n
    assert per_pos[:2] == [n, n] and not any(per_pos[3:]), per_pos
    mean_length = 1 + sum(per_pos) / n
    assert within(mean_length, 3.5, 0.25, n), (mean_length, n)
    stats = ddtree_state(llm).stats()
    assert stats["paths_off_the_index_line"] > 0 and stats["longest_accepted"] == 3, stats
    assert moved["kv"] >= 2 and moved["hidden"] >= 2, moved  # deeper than the first slot
    tokenizer = llm.get_tokenizer()
    del llm

    # Each request's output: its prefill's token, then what its verify steps emitted.
    steps = {}
    for o in outputs:
        got = list(o.outputs[0].token_ids)
        rid = next(r for r, s in emitted.items()
                   if [got[0], *sum(s, [])][:max_tokens] == got)
        steps[o.prompt] = emitted.pop(rid)
    target = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=512,
                 seed=0, dtype="float32")
    ids = {o.prompt: tokenizer.encode(o.prompt) for o in outputs}
    seqs = [TokensPrompt(prompt_token_ids=ids[o.prompt] + list(o.outputs[0].token_ids))
            for o in outputs]
    scored = target.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)
    bonus_ranks, draft_ranks = [], []
    for o, s in zip(outputs, scored):
        seq, start = s.prompt_token_ids, len(ids[o.prompt])
        ranks = [s.prompt_logprobs[i][seq[i]].rank for i in range(start, len(seq))]
        bonus_ranks.append(ranks[0])  # the prefill's token
        pos = 1
        for tokens in steps[o.prompt]:
            draft_ranks += ranks[pos:pos + len(tokens) - 1]
            if pos + len(tokens) - 1 < len(ranks):
                bonus_ranks.append(ranks[pos + len(tokens) - 1])
            pos += len(tokens)
    assert len(bonus_ranks) > len(PROMPTS) * 10
    assert set(bonus_ranks) == {1}, Counter(bonus_ranks)
    # Accepted drafts are mostly not the target's: synthetic, not real, acceptance.
    assert sum(r != 1 for r in draft_ranks) > len(draft_ranks) / 2


@pytest.mark.slow
@pytest.mark.parametrize("spec, rates", [
    # A tree 5 deep (num_speculative_tokens: the depth) of 16 nodes.
    ({"tree_budget": 16, "num_speculative_tokens": 5}, [0.9, 0.7, 0.5, 0.3, 0.1]),
    # 4 nodes, all on the spine: every row is verified as a chain.
    ({"tree_budget": 4}, [0.8, 0.8, 0.4, 0.0]),
])
def test_per_depth_rates_are_the_requested_ones(tiny_models: Path, spec, rates) -> None:
    """Position i's share of verify steps that accepted it is rate i (a Bernoulli mean:
    variance r (1 - r)); deeper positions are never accepted. The mean length is
    1 + sum(rates), its variance that of the accepted count A: E[A^2] - E[A]^2 with
    E[A^2] = sum_i (2i + 1) rate_i."""
    _, llm = run_engine(tiny_models, spec | {"synthetic_acceptance_rates": rates}, 64)
    n, per_pos = spec_stats(llm)
    assert n >= 250, n
    for i, rate in enumerate(rates):
        assert within(per_pos[i] / n, rate, rate * (1 - rate), n), (i, per_pos, n)
    assert not any(per_pos[len(rates):]), per_pos
    mean = sum(rates)
    variance = sum((2 * i + 1) * r for i, r in enumerate(rates)) - mean ** 2
    assert within(sum(per_pos) / n, mean, variance, n), (per_pos, n)


def engine_config(tiny_models: Path, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_models / "target"), max_model_len=512,
                      speculative_config={"method": "ddtree",
                                          "model": str(tiny_models / "drafter")} | spec
                      ).create_engine_config()


def test_rates_are_per_depth_and_vllm_sees_them_padded(tiny_models: Path) -> None:
    from vllm_ddtree.config import synthetic_rates_per_depth

    spec = engine_config(tiny_models, {"tree_budget": 10, "rejection_sample_method":
                                       "synthetic", "synthetic_acceptance_length": 3.5}
                         ).speculative_config
    assert (spec.tree_depth, spec.num_speculative_tokens) == (7, 10)
    assert synthetic_rates_per_depth(spec) == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert spec.synthetic_acceptance_rates == [1.0, 1.0, 0.5] + [0.0] * 7
    assert spec.synthetic_acceptance_length is None
    rates = [0.9, 0.5, 0.5, 0.2]
    spec = engine_config(tiny_models, {"num_speculative_tokens": 4, "rejection_sample_method":
                                       "synthetic", "synthetic_acceptance_rates": rates}
                         ).speculative_config
    assert synthetic_rates_per_depth(spec) == rates
    standard = engine_config(tiny_models, {}).speculative_config
    assert synthetic_rates_per_depth(standard) is None


SYNTHETIC = {"rejection_sample_method": "synthetic"}


@pytest.mark.parametrize("spec, message", [
    (SYNTHETIC | {"synthetic_acceptance_length": 9.0},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 8\], got 9.0"),
    (SYNTHETIC | {"synthetic_acceptance_length": 0.5},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 8\]"),
    (SYNTHETIC | {"synthetic_acceptance_length": 5.5, "num_speculative_tokens": 4},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 5\]"),
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
    ({"rejection_sample_method": "block"},
     r"speculative_config.rejection_sample_method is 'block': method 'ddtree' verifies"),
])
def test_bad_synthetic_settings_fail_at_startup_naming_the_field(tiny_models: Path, spec,
                                                                  message) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_models, spec)


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
    target = torch.randint(0, 50, t["token_ids"].shape, generator=torch.Generator().manual_seed(0))
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
    """Leading successes of u_i < conditional rate i: P(L > i) is unconditional rate i."""
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


def test_the_override_never_syncs(monkeypatch) -> None:
    """No .item(), .tolist(), truth value or boolean-mask index in synthetic.py: on a GPU
    each would stall the step and break CUDA-graph capture."""
    import sys

    from vllm_ddtree.synthetic import SyntheticAcceptance

    t = hand_made_trees([7, 4, 7])
    synthetic = SyntheticAcceptance([0.9, 0.7, 0.5, 0.3, 0.1, 0.05, 0.0], torch.device("cpu"))
    calls = []

    def record(name, original, check=None):
        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith("vllm_ddtree/synthetic.py") and (
                    check is None or check(*args)):
                calls.append(name)
            return original(self, *args, **kwargs)
        return wrapper

    def bool_index(index, *_):
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__",
                 "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, record(name, getattr(torch.Tensor, name)))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, record(name, getattr(torch.Tensor, name),
                                                       bool_index))
    choice = torch.where(t["valid"], 7, -1)
    synthetic.override(choice, t["token_ids"], t["parents"], t["depths"], t["first_child"],
                       t["valid"])
    assert calls == []
