"""Adaptive trees' choice (vllm_ddtree/spec_decode/adaptive/): the node count that maximizes
expected accepted tokens per millisecond, ranked across requests as prefixes of each tree;
no drafts, and a paused drafter, when none pays; the cost curves and the calibration they
read. The engine runs are tests/engine/test_adaptive_trees.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ddtree.spec_decode.adaptive.calibration import (
    BIN_NATS,
    AcceptanceCalibration,
)
from vllm_ddtree.spec_decode.adaptive.costs import CostCurve, StepCosts, StepTimer
from vllm_ddtree.spec_decode.adaptive.sizing import (
    MAX_PROBE_WAIT,
    PROBE_SHARE,
    Choice,
    after_choice,
    choose_nodes,
    drafter_state,
    probe_wait,
    probes_now,
)


def costs_of(verify: dict[int, float], draft: dict[int, float],
             paused: dict[int, float] | None = None, rest: float = 0.0) -> StepCosts:
    costs = StepCosts()
    for curve, points in ((costs.verify, verify), (costs.draft, draft),
                          (costs.paused_draft, paused or {})):
        for size, ms in points.items():
            curve.add(size, ms, trusted=True)
    costs.rest_ms = {True: rest, False: rest}
    return costs


def linear(per_token: float, base: float = 1.0) -> dict[int, float]:
    return {n: base + per_token * n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)}


def ranked(rng: np.random.Generator, reqs: int, nodes: int) -> np.ndarray:
    """Calibrated acceptances, non-increasing along each request's tree."""
    return -np.sort(-rng.uniform(0, 1, (reqs, nodes)) ** rng.uniform(1, 6, (reqs, 1)), axis=1)


def test_the_choice_maximizes_accepted_tokens_per_millisecond() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        reqs, nodes = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        acceptance = ranked(rng, reqs, nodes)
        costs = costs_of(linear(float(rng.uniform(0.001, 0.2))), {1: 1.0, 8: 2.0},
                         {1: 0.2, 8: 0.3}, rest=float(rng.uniform(0, 2)))
        choice = choose_nodes(acceptance, reqs, reqs, costs)
        flat = np.sort(acceptance.ravel())[::-1]
        k = np.arange(flat.size + 1)
        rate = (reqs + np.concatenate(([0], np.cumsum(flat)))) / costs.step_ms(
            reqs + k, reqs, drafting=True)
        paused = reqs / costs.step_ms(np.array([reqs]), reqs, drafting=False)[0]
        if choice.drafting:
            chosen = int(choice.nodes.sum())
            assert rate[chosen] == pytest.approx(rate.max()) and rate.max() > paused
            assert choice.predicted == pytest.approx(flat[:chosen].sum())
        else:
            assert paused >= rate.max() and not choice.nodes.any()


def test_a_confident_request_gets_a_bigger_tree_than_an_unsure_one() -> None:
    sure = 0.95 ** np.arange(1, 65)
    unsure = 0.4 ** np.arange(1, 65)
    acceptance = np.stack([unsure, sure, np.zeros(64)])  # the third verifies nothing
    choice = choose_nodes(acceptance, 3, 3, costs_of(linear(0.02), {1: 1.0, 4: 1.0}))
    assert choice.drafting
    assert choice.nodes[1] > choice.nodes[0] >= 1 and choice.nodes[2] == 0
    # Each request's admitted nodes are the best of its tree: the first nodes[r].
    threshold = min(acceptance[r, n - 1] for r, n in enumerate(choice.nodes) if n)
    for r, n in enumerate(choice.nodes):
        assert (acceptance[r, n:] <= threshold + 1e-12).all()


def test_a_flat_verify_cost_verifies_every_node_that_may_be_accepted() -> None:
    acceptance = np.full((2, 16), 0.01)
    acceptance[:, 8:] = 0.0
    choice = choose_nodes(acceptance, 2, 2, costs_of({1: 5.0, 1024: 5.0}, {1: 1.0}))
    assert choice.nodes.tolist() == [8, 8]


def test_no_drafts_and_a_paused_drafter_when_no_draft_pays() -> None:
    acceptance = np.full((4, 16), 0.3)
    dear = costs_of(linear(0.01), {1: 50.0, 8: 50.0}, {1: 0.1, 8: 0.1})
    choice = choose_nodes(acceptance, 4, 4, dear)
    assert not choice.drafting and not choice.nodes.any()
    cheap = costs_of(linear(0.01), {1: 0.5, 8: 0.5}, {1: 0.1, 8: 0.1})
    assert choose_nodes(acceptance, 4, 4, cheap).drafting
    # A probe's drafts are verified (the calibration must hear the target) though the
    # drafter stays paused.
    # At about a chain step's cost: at most one node a request.
    probe = choose_nodes(acceptance, 4, 4, dear, explore=True)
    assert not probe.drafting and 0 < probe.nodes.sum() <= 4
    assert not choose_nodes(np.zeros((4, 0)), 4, 4, dear, explore=True).nodes.any()


def test_a_probe_resumes_drafting_only_by_a_margin() -> None:
    """Drafting 7% faster than pausing (by the estimates) keeps a drafting drafter
    drafting, but a probe does not resume it (RESUME_MARGIN: noisy estimates)."""
    flat = costs_of({1: 1.0, 1024: 1.0}, {1: 0.4}, {1: 0.0})
    acceptance = np.array([[0.5]])
    assert choose_nodes(acceptance, 1, 1, flat).drafting
    probe = choose_nodes(acceptance, 1, 1, flat, explore=True)
    assert not probe.drafting and probe.nodes.tolist() == [1]
    assert choose_nodes(np.array([[0.9]]), 1, 1, flat, explore=True).drafting


def test_pauses_back_off_until_drafting_lasts() -> None:
    """Each pause waits twice as long as the one before, to 64 steps; a resumption that
    pauses within 8 drafting steps keeps the back-off, 8 in a row restart it."""
    state = {"drafting": True, "wait": 4, "run": 0, "probe_in": 0, "widest": 8}
    drafting = Choice(np.array([3, 1]), True, 1.0)
    paused = Choice(np.array([0, 0]), False, 0.0)
    waits = []
    for choice in [paused, drafting, paused, drafting, drafting, paused] + [paused] * 4:
        after_choice(state, choice)
        if not choice.drafting:
            waits.append(state["probe_in"])
    assert waits == [4, 8, 16, 32, 64, 64, 64]
    assert state["widest"] == 3
    for _ in range(8):
        after_choice(state, drafting)
    after_choice(state, paused)
    assert state["probe_in"] == 4


def test_probes_take_at_most_their_share_of_a_pause() -> None:
    """probe_wait: the paused steps that keep a probe (a drafting step verifying a node a
    request) within PROBE_SHARE of the pause's time: 150 when a probe step costs 2.5 paused
    ones, as a CPU's at 32 requests; about none where probes are cheap; never past
    MAX_PROBE_WAIT. Only a pause where drafting lost clearly waits for it (a close call,
    within RESUME_MARGIN, keeps the back-off alone)."""
    # Paused: verify(32) 2 ms; probing: verify(64) 2 ms + the drafter's 3 ms.
    dear = costs_of({32: 2.0, 64: 2.0}, {32: 3.0}, {32: 0.0})
    assert probe_wait(dear, 32, 32) == pytest.approx(1.5 / PROBE_SHARE, abs=1)
    cheap = costs_of({32: 2.0, 64: 2.0}, {32: 0.01}, {32: 0.0})
    assert probe_wait(cheap, 32, 32) <= 1
    assert probe_wait(costs_of({32: 2.0}, {32: 1e6}, {32: 0.0}), 32, 32) == MAX_PROBE_WAIT
    lost = choose_nodes(np.full((32, 8), 0.01), 32, 32, dear)
    assert not lost.drafting and lost.lost_clearly
    close = choose_nodes(np.full((32, 8), 0.17), 32, 32, dear)  # 15.1 tokens/ms vs 16
    assert not close.drafting and not close.lost_clearly
    assert not choose_nodes(np.full((32, 8), 0.9), 32, 32, dear).lost_clearly  # drafting


def test_a_clearly_lost_pause_probes_once_the_curves_allow_it() -> None:
    """Paused where drafting lost clearly: the back-off ends at 4 steps, but the probe waits
    for probe_wait (read then, and again at most the back-off's wait later); when the
    curves turn cheap (drafting pays again) it probes at the next look. A close call
    probes when its back-off ends."""
    state = drafter_state(64)
    after_choice(state, Choice(np.zeros(8, dtype=np.int32), False, 0.0, True))
    waits = iter([150] * 3 + [0])
    looks = []

    def wait() -> int:
        looks.append(state["paused_for"])
        return next(waits)

    steps = 1
    while not probes_now(state, 8, wait):
        steps += 1
    assert steps == 28 and looks == [4, 12, 20, 28]  # back-off 4, then 8 each
    state = drafter_state(64)
    after_choice(state, Choice(np.zeros(8, dtype=np.int32), False, 0.0, False))
    assert [probes_now(state, 8, lambda: 150) for _ in range(4)] == [False] * 3 + [True]


def test_a_paused_drafter_probes_when_its_wait_ends_or_the_batch_halves() -> None:
    """Paused with 32 requests: it probes after its wait at 20 requests, at once (the
    back-off restarted) when the batch falls to 16 or fewer."""
    state = {"drafting": True, "wait": 16, "run": 0, "probe_in": 0, "widest": 8,
             "paused_reqs": 0}
    after_choice(state, Choice(np.zeros(32, dtype=np.int32), False, 0.0))
    assert (state["paused_reqs"], state["probe_in"]) == (32, 16)
    probed = [probes_now(state, 20, lambda: 0) for _ in range(16)]
    assert probed == [False] * 15 + [True] and state["probe"] and state["drafting"]
    assert state["wait"] == 32
    after_choice(state, Choice(np.zeros(32, dtype=np.int32), False, 0.0))
    assert [probes_now(state, n, lambda: 0) for n in (30, 17, 16)] == [False, False, True]
    assert state["wait"] == 4 and state["widest"] == 8


def test_served_periods_over_predicted_ones_scale_the_estimates() -> None:
    """Drafting steps' served periods over the curves' prediction (a step's timer hears
    both) scale drafting estimates: drafting 7% ahead by the curves, but served twice as
    slow as predicted, pauses; an idle gap (over OUTLIER times) is not a step's cost."""
    import time

    flat = costs_of({1: 1.0, 1024: 1.0}, {1: 0.4}, {1: 0.0})
    acceptance = np.array([[0.5]])
    assert choose_nodes(acceptance, 1, 1, flat).drafting
    flat.add_bias(100.0, 1.0)
    assert flat.drafting_bias == 1.0
    for _ in range(20):
        flat.add_bias(2.0, 1.0)
    assert 1.8 < flat.drafting_bias < 2.0
    assert not choose_nodes(acceptance, 1, 1, flat).drafting
    assert flat.step_ms(np.array([2]), 1, True)[0] == pytest.approx(
        flat.step_ms(np.array([2]), 1, True, raw=True)[0] * flat.drafting_bias)
    assert flat.step_ms(np.array([1]), 1, False)[0] == pytest.approx(1.0)
    timer = StepTimer(torch.device("cpu"), learn=True)  # the timer hands both over
    for predicted in (5.0, 5.0, None, 5.0):
        timer.step_start()
        time.sleep(0.01)
        timer.drafter_start(2, 1, True, predicted_ms=predicted)  # served: 10 ms or more
        timer.step_end()
    assert timer.costs.drafting_bias > 1.1


def test_cost_curves_interpolate_rise_and_skip_outliers() -> None:
    curve = CostCurve()
    for size, ms in ((1, 2.0), (16, 3.0), (256, 11.0)):
        curve.add(size, ms, trusted=True)
    assert curve.at(np.array([16]))[0] == pytest.approx(3.0)
    middle = curve.at(np.array([100]))[0]
    assert 3.0 < middle < 11.0
    assert curve.at(np.array([512]))[0] > 11.0  # extended by the last slope
    # Served samples: the first moves a profiled bucket halfway, the next by a third, ...;
    # one far above its bucket (an idle gap) is dropped once the bucket has served three.
    curve.add(16, 5.0)
    assert curve.at(np.array([16]))[0] == pytest.approx(4.0)
    for _ in range(2):
        curve.add(16, 4.0)
    curve.add(16, 100.0)
    assert curve.at(np.array([16]))[0] == pytest.approx(4.0)
    for _ in range(20):
        curve.add(16, 4.0)
    curve.add(16, 5.0)  # by the smoothing weight, 0.1, at last
    assert curve.at(np.array([16]))[0] == pytest.approx(4.1)
    dipping = CostCurve()
    for size, ms in ((1, 4.0), (64, 2.0)):
        dipping.add(size, ms, trusted=True)
    # Never cheaper for more tokens: the two pooled.
    assert dipping.at(np.array([1, 64])).tolist() == pytest.approx([3.0, 3.0])


def test_a_slow_step_in_one_bucket_does_not_raise_the_whole_curve() -> None:
    """Measured on this CPU: one slow served step at 11 tokens (12 ms, a bucket no profile
    run timed) made every size up to 1024 cost 12 ms under a running maximum, so that a
    step with drafts looked far dearer than it was. A new bucket's sample over OUTLIER
    times the curve there is dropped; one that is kept is pooled by weight."""
    profile = {1: 1.6, 2: 1.4, 4: 1.4, 8: 2.3, 16: 3.9, 32: 3.1, 64: 3.8, 128: 4.9,
               256: 7.7, 512: 12.1, 1024: 23.3}
    curve = CostCurve()
    for size, ms in profile.items():
        curve.add(size, ms, trusted=True)
    curve.add(11, 12.3)  # a new bucket, far above the curve there: dropped
    assert curve.at(np.array([11]))[0] < 4.0
    for size in (32, 64, 128, 256):
        for _ in range(5):  # served steps confirm the profile
            curve.add(size, profile[size])
    curve.add(13, 7.0)  # new, under 4x the curve: kept, then pooled by weight
    fitted = curve.at(np.array([13, 32, 64, 128, 256, 512]))
    assert (np.diff(fitted) >= 0).all()
    assert fitted[2:].tolist() == pytest.approx([3.8, 4.9, 7.7, 12.1], rel=0.05)
    assert fitted[0] < 4.5


class FakeClock:
    cuda = False

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


def test_the_start_up_profile_takes_the_median_of_the_timed_repeats() -> None:
    timer = StepTimer(torch.device("cpu"), learn=True)
    timer.clock = clock = FakeClock()
    times = iter([9.0, 1.0, 3.0, 2.0])  # the first run is a warm-up, dropped

    def run(tokens: int, drafting: bool) -> None:
        clock.now += tokens * 1e-3 * next(times)
        timer.drafter_start(tokens, 1, drafting)
        clock.now += 0.5e-3

    timer.profile(run, [(4, True)], repeats=3)
    assert timer.costs.verify.at(np.array([4]))[0] == pytest.approx(8.0)
    assert timer.costs.draft.at(np.array([1]))[0] == pytest.approx(0.5)
    assert timer.learn and not timer.costs.paused_draft
    # Served steps: the rest of a step's period (here 1 ms before each step) is learned
    # per mode, from the second step on; curves move by the smoothing weight.
    for _ in range(3):
        clock.now += 1e-3
        timer.step_start()
        clock.now += 8e-3
        timer.drafter_start(4, 1, drafting=True)
        clock.now += 0.5e-3
        timer.step_end()
    assert timer.costs.rest_ms == {True: pytest.approx(1.0), False: None}


def test_calibration_follows_the_targets_verdicts_and_never_rises() -> None:
    calibration = AcceptanceCalibration(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    # Nodes the drafter gives ~0.9 are accepted 30% of the time; ~0.05, 20%.
    logprobs = torch.tensor([[-0.1] * 32 + [-3.0] * 32])
    truth = torch.tensor([0.3] * 32 + [0.2] * 32)
    for _ in range(300):
        accepted = (torch.rand(64, generator=gen) < truth)[None]
        calibration.observe(logprobs, torch.ones(1, 64, dtype=torch.bool), accepted)
    calibration.host.publish()
    rates = calibration.rates()
    assert rates[int(0.1 / BIN_NATS)] == pytest.approx(0.3, abs=0.05)
    assert rates[int(3.0 / BIN_NATS)] == pytest.approx(0.2, abs=0.05)
    assert (np.diff(rates) <= 0).all()
    # Unverified nodes teach nothing; a bin never seen keeps the drafter's own claim
    # (capped by the bins above it).
    assert calibration.probabilities(np.array([-np.inf]))[0] <= np.exp(-15)


def test_the_non_increasing_fit_pools_violators_by_weight() -> None:
    from vllm_ddtree.spec_decode.adaptive.calibration import non_increasing

    fit = non_increasing(np.array([0.9, 0.1, 0.5, 0.2]), np.array([1.0, 1.0, 3.0, 1.0]))
    assert fit.tolist() == pytest.approx([0.9, 0.4, 0.4, 0.2])


@pytest.mark.parametrize(("spine", "widths"), [(True, ()), (False, ()), (True, (3, 2))])
def test_reordered_trees_are_the_same_trees_most_probable_first(spine: bool,
                                                                widths: tuple) -> None:
    """Adaptive trees verify prefixes: renumbered by path probability (reorder.py), a tree
    keeps its nodes, tokens, depths and ancestry; prefixes are valid trees; and the walk
    accepts the same tokens for any target choices."""
    from vllm_ddtree import ops
    from vllm_ddtree.spec_decode.adaptive.reorder import by_score
    from vllm_ddtree.tree import mask_words

    gen = torch.Generator().manual_seed(0)
    R, L, V, B = 4, 6, 40, 24
    logits = torch.randn(R, L, V, generator=gen) * 3
    roots = torch.randint(0, V, (R,), generator=gen)
    built = ops.build_tree_from_logits(roots, logits, B, spine, widths)
    tree = by_score(built)
    assert (torch.diff(tree.scores[:, 1:], dim=1) <= 0).all()
    for r in range(R):
        old = {(int(built.depths[r, i]), int(built.token_ids[r, i]),
                float(built.scores[r, i])) for i in range(B + 1)}
        assert old == {(int(tree.depths[r, i]), int(tree.token_ids[r, i]),
                        float(tree.scores[r, i])) for i in range(B + 1)}
        for i in range(1, B + 1):
            p = int(tree.parents[r, i])
            assert 0 <= p < i and tree.depths[r, i] == tree.depths[r, p] + 1
            # Ancestor-or-self bits: the parent's plus its own.
            want = [j for j in range(B + 1) if j == i or _bit(tree, r, p, j)]
            assert [j for j in range(B + 1) if _bit(tree, r, i, j)] == want
        children = [i for i in range(1, B + 1)]
        for i in range(B + 1):  # links: children in index order
            kids = [c for c in children if int(tree.parents[r, c]) == i]
            walk, c = [], int(tree.first_child[r, i])
            while c >= 0:
                walk.append(c)
                c = int(tree.next_sibling[r, c])
            assert walk == kids
    assert tree.ancestor_mask.shape[-1] == mask_words(B + 1)
    for _ in range(20):  # the same accepted tokens, whatever the target chooses
        choice = torch.randint(0, V, (R, B + 1), generator=gen)
        choice_of = {}
        for r in range(R):  # a choice per (request, path): keyed by the node's tokens
            for i in range(B + 1):
                choice_of[(r, _path(built, r, i))] = int(choice[r, i])
        new_choice = torch.tensor([[choice_of[(r, _path(tree, r, i))] for i in range(B + 1)]
                                   for r in range(R)])
        a = ops.verify_tree(built, choice, L)
        b = ops.verify_tree(tree, new_choice, L)
        assert torch.equal(a.output_tokens, b.output_tokens)


@pytest.mark.parametrize("spine", [False, True])
def test_a_narrower_build_is_the_wide_trees_best_nodes_padded(spine: bool) -> None:
    """Adaptive trees build (eager) only as many nodes as the scheduler schedules next:
    DDTree's best-first build at 8 nodes is the 24-node build's 8 most probable (without
    the spine, which may force less probable nodes in), and padded to 24 its extra nodes
    are unlinked, never verified (-inf), and the walk accepts what it did."""
    from vllm_ddtree import ops
    from vllm_ddtree.spec_decode.adaptive.reorder import by_score, padded
    from vllm_ddtree.tree import mask_words

    gen = torch.Generator().manual_seed(1)
    R, L, V, B, b = 4, 6, 40, 24, 8
    logits = torch.randn(R, L, V, generator=gen) * 3
    roots = torch.randint(0, V, (R,), generator=gen)
    wide = by_score(ops.build_tree_from_logits(roots, logits, B, spine))
    narrow = by_score(ops.build_tree_from_logits(roots, logits, b, spine))
    tree = padded(narrow, B)
    assert tree.token_ids.shape == (R, B + 1) and tree.ancestor_mask.shape == (
        R, B + 1, mask_words(B + 1))
    assert torch.equal(tree.ancestor_mask[:, :b + 1, :narrow.ancestor_mask.shape[-1]],
                       narrow.ancestor_mask)
    assert not tree.ancestor_mask[:, b + 1:].any()
    assert (tree.scores[:, b + 1:] == float("-inf")).all()
    assert (tree.parents[:, b + 1:] == -1).all() and (tree.first_child[:, b + 1:] == -1).all()
    assert (tree.first_child[:, :b + 1] <= b).all() and (tree.next_sibling <= b).all()
    if not spine:
        for r in range(R):
            assert {_path(tree, r, i) for i in range(b + 1)} == {
                _path(wide, r, i) for i in range(b + 1)}
    for _ in range(10):
        choice = torch.randint(0, V, (R, B + 1), generator=gen)
        assert torch.equal(ops.verify_tree(tree, choice, L).output_tokens,
                           ops.verify_tree(narrow, choice[:, :b + 1], L).output_tokens)


def _bit(tree, r: int, i: int, j: int) -> bool:  # noqa: ANN001
    return bool((int(tree.ancestor_mask[r, i, j // 32]) >> (j % 32)) & 1)


def _path(tree, r: int, i: int) -> tuple:  # noqa: ANN001
    out = []
    while i >= 0:
        out.append(int(tree.token_ids[r, i]))
        i = int(tree.parents[r, i])
    return tuple(out)
