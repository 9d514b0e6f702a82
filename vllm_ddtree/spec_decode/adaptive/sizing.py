"""Adaptive trees in V2's step: ``AdaptiveTreeSizing`` takes the place of vLLM's
``AdaptiveVerificationManager`` on the runner (patch 0013), with the same calls.

The scheduler schedules ``tree_budget`` drafts a request. Before the step's inputs are
made (``get_num_tokens``), the sizing ranks every drafted node of the step by its calibrated
acceptance (calibration.py; from the latest scores on the host: a CPU's own, a GPU's a
step old) across all requests, and takes the node count ``k`` that maximizes

    (sampling requests + the k best nodes' acceptances) / step time(non-draft tokens + k)

with the step time from the measured curves (costs.py). A request verifies the prefix of
its tree that holds its admitted nodes (its nodes are numbered most probable first:
reorder.py), so a confident request verifies a bigger tree than an unsure one, and any may
verify none. The
host and device layouts stay the same (``compact_batch`` gives the exact counts), so that
chunked node sampling and logprobs read the host's layout as they do for fixed trees.

When not drafting at all beats the best ``k`` (the drafter's cost saved too), the step
verifies nothing and the drafter pauses: it still stores the committed tokens' context
(``DDTreeSpeculator._store_context``), so its context is right when it drafts again; the
scheduler is told to schedule no drafts (``drafts_to_schedule``); and it probes (drafts one
tree, whose best nodes the next step verifies) after 4, 8, ... up to 64 paused steps, and,
where drafting lost clearly, not before probes would take at most PROBE_SHARE of the pause's
time by the curves as they are then; the back-off restarting only after 8 drafting steps in
a row, or at once when the batch has shrunk to half the requests it paused with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_ddtree.spec_decode.adaptive.calibration import AcceptanceCalibration
from vllm_ddtree.spec_decode.adaptive.costs import StepCosts, StepTimer
from vllm_ddtree.spec_decode.adaptive.host_copy import HostCopy

PROBE_AFTER = (4, 64)  # paused steps before the first probe, and at most
DRAFTED_TO_RESET = 8  # drafting steps in a row after which the probes' back-off restarts
# The most of a pause's time its probes take, by the curves: a probe step over a paused one
# sets the least wait (a CPU's probe at 32 requests costs about 2.5 paused steps: 150).
PROBE_SHARE = 0.01
MAX_PROBE_WAIT = 256  # paused steps: a drafting cost overestimated is corrected by probes
PROBE_WIDTH = 8  # the widest tree a probe verifies, as drafts_to_schedule reads it
# How much faster drafting must look than pausing for a probe to resume it: the estimates
# are noisy (a CPU's step times vary by 10% and more), and a resumption that does not pay
# costs its drafting steps and restarts the probes' back-off.
RESUME_MARGIN = 0.1
PROFILE_REPEATS = 3


@dataclass(frozen=True)
class Choice:
    nodes: np.ndarray  # [R] nodes each request verifies
    drafting: bool  # whether the drafter drafts trees for the next step
    predicted: float  # expected accepted drafts
    lost_clearly: bool = False  # paused, drafting lost by more than RESUME_MARGIN


def choose_nodes(acceptance: np.ndarray, num_sampling: int, num_non_draft: int,
                 costs: StepCosts, explore: bool = False) -> Choice:
    """The step's node counts from the calibrated acceptance of each request's drafted nodes
    ``[R, N]`` (non-increasing along a row; 0 where a node cannot be verified). With
    ``explore`` (a probe's drafts) the best count of 1 to R nodes is verified even when
    pausing wins, so that the calibration learns from the target what a paused drafter
    would never see, at about the cost of a chain step; drafting resumes only when it
    beats pausing by ``RESUME_MARGIN``; a pause says whether drafting lost by more than
    that (its probes then wait for ``probe_wait``)."""
    num_reqs, width = acceptance.shape
    flat = acceptance.ravel()
    order = np.argsort(-flat, kind="stable")  # ties keep node order: prefixes
    order = order[flat[order] > 0]
    gains = num_sampling + np.concatenate(([0.0], np.cumsum(flat[order])))
    counts = num_non_draft + np.arange(len(gains))
    rate = gains / costs.step_ms(counts, num_reqs, drafting=True)
    best = int(np.argmax(rate))
    paused = num_sampling / costs.step_ms(counts[:1], num_reqs, drafting=False)[0]
    drafting = best > 0 and rate[best] > paused * (1 + RESUME_MARGIN * explore)
    if not drafting:
        best = 1 + int(np.argmax(rate[1:num_reqs + 1])) if explore and len(rate) > 1 else 0
    nodes = np.bincount(order[:best] // width, minlength=num_reqs).astype(np.int32)
    lost = not drafting and rate.max() * (1 + RESUME_MARGIN) < paused
    return Choice(nodes, drafting, float(gains[best] - num_sampling), bool(lost))


def probe_wait(costs: StepCosts, num_tokens: int, num_reqs: int) -> int:
    """The fewest paused steps that keep a probe (a drafting step verifying a node a
    request) within PROBE_SHARE of a pause's time, by the curves (at most MAX_PROBE_WAIT)."""
    paused = costs.step_ms(np.array([num_tokens]), num_reqs, drafting=False)[0]
    probe = costs.step_ms(np.array([num_tokens + num_reqs]), num_reqs, drafting=True)[0]
    return min(math.ceil(max(probe / paused - 1, 0.0) / PROBE_SHARE), MAX_PROBE_WAIT)


def drafter_state(budget: int) -> dict[str, Any]:
    """The drafter's state that the choices move (after_choice, probes_now): drafting or
    paused, probing, the most nodes a request verified last, while paused the steps until a
    probe (or a look at probe_wait), the steps paused so far, whether drafting lost
    clearly, the next pause's wait and the requests it paused with; drafting, the steps it
    has drafted in a row."""
    return {"drafting": True, "probe": False, "widest": budget, "probe_in": 0,
            "paused_for": 0, "lost_clearly": False, "wait": PROBE_AFTER[0], "run": 0,
            "paused_reqs": 0}


def drafts_width(widest: int, width: int, share: int) -> int:
    """Drafts a request is scheduled while drafting: room to grow past the widest tree
    verified last (at least 8), within ``width`` and a request's ``share`` of the step."""
    return max(min(width, 2 * widest, share - 1), min(width, 8))


def node_acceptance(calibration: AcceptanceCalibration, logprobs: np.ndarray,
                    scheduled: np.ndarray) -> np.ndarray:
    """Each request's nodes' calibrated acceptance, 0 past the drafts it was scheduled."""
    eligible = np.arange(logprobs.shape[1])[None, :] < scheduled[:, None]
    return np.where(eligible, calibration.probabilities(logprobs), 0.0)


def after_choice(state: dict[str, Any], choice: Choice) -> None:
    """The drafter's state after a step's choice: drafting, or paused until a probe. Each
    pause waits twice as long as the one before (to PROBE_AFTER's cap); drafting
    DRAFTED_TO_RESET steps in a row restarts the back-off (a resumption that soon pauses
    again keeps it)."""
    if choice.drafting:
        run = state["run"] + 1
        state.update(drafting=True, run=run, widest=int(choice.nodes.max(initial=0)))
        if run >= DRAFTED_TO_RESET:
            state["wait"] = PROBE_AFTER[0]
    else:
        state.update(drafting=False, probe_in=state["wait"], run=0, paused_for=0,
                     lost_clearly=choice.lost_clearly,
                     wait=min(2 * state["wait"], PROBE_AFTER[1]),
                     paused_reqs=len(choice.nodes))


def probes_now(state: dict[str, Any], num_reqs: int, wait: Callable[[], int]) -> bool:
    """A paused step: whether the drafter drafts again (a probe) at its end: its back-off
    is over and, where drafting lost clearly, the pause has lasted ``wait()`` steps
    (probe_wait by the curves as they are now: read when the back-off ends, then at most
    its wait later, so that cheaper costs are seen); or the batch has shrunk to half the
    requests it paused with or fewer (a node costs a smaller batch less, so drafting may
    pay again; the back-off restarts)."""
    state["probe_in"] -= 1
    state["paused_for"] += 1
    shrunk = 2 * num_reqs <= state["paused_reqs"]
    if not shrunk:
        if state["probe_in"] > 0:
            return False
        need = wait() - state["paused_for"] if state["lost_clearly"] else 0
        if need > 0:
            state["probe_in"] = min(need, state["wait"])
            return False
    else:
        state["wait"] = PROBE_AFTER[0]
    state.update(drafting=True, probe=True, widest=PROBE_WIDTH)
    return True


def use_varlen_graphs(runner: Any, draft_layer_names: set[str]) -> None:
    """With FULL CUDA graphs, verify steps of varying tree sizes replay V2's varlen decode
    graphs, as vLLM's own adaptive verification does: every target attention backend must
    replay per-request lengths of 1 to tree_budget + 1 (else refused at start-up, naming
    both settings), and the graph mode is resolved the way vLLM resolves it for its own."""
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.attn_utils import get_varlen_cudagraph_unsupported_backend
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import (
        resolve_adaptive_cudagraph_mode,
    )

    compilation = runner.compilation_config
    if not compilation.cudagraph_mode.has_full_cudagraphs():
        return
    target_layers = {name for group in runner.kv_cache_config.kv_cache_groups
                     for name in group.layer_names} - set(draft_layer_names)
    unsupported = get_varlen_cudagraph_unsupported_backend(
        runner.attn_groups, runner.vllm_config, runner.decode_query_len,
        checked_layer_names=target_layers)
    if unsupported is not None:
        backend, bound = unsupported
        raise ValueError(
            f"speculative_config.enable_adaptive_verification: adaptive trees replay FULL "
            f"decode CUDA graphs of 1 to {runner.decode_query_len} tokens a request "
            f"(tree_budget + 1), which the {backend} attention backend does not "
            f"(it allows {'none' if bound is None else f'at most {bound}'}); leave it "
            f"false, or set compilation_config.cudagraph_mode to one without FULL graphs "
            f"(PIECEWISE or NONE)")
    piecewise = bool(model_runner.is_breakable_cudagraph_enabled(compilation)
                     or model_runner.has_compiled_submodule(runner.model))
    compilation.cudagraph_mode = resolve_adaptive_cudagraph_mode(
        compilation.cudagraph_mode, piecewise_capture_available=piecewise)


class AdaptiveTreeSizing:
    def __init__(self, runner: Any, trees: Any, budget: int) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        self.runner, self.trees, self.budget = runner, trees, budget
        device = trees.scores.device
        # Ranks must choose alike: with tensor parallelism the costs are rank 0's start-up
        # profile, not updated while serving.
        self._tp = get_tp_group()
        self.timer = StepTimer(device, learn=self._tp.world_size == 1)
        self.calibration = AcceptanceCalibration(device)
        self.scores = HostCopy(trees.scores)
        self._cu = torch.zeros(runner.max_num_reqs + 1, dtype=torch.int32, device=device)
        # Accepted drafts, and accepted paths that left the drafter's greedy chain.
        self._realized = torch.zeros(2, dtype=torch.float32, device=device)
        self.realized = HostCopy(self._realized)
        self._batch: tuple[list[str], np.ndarray] | None = None
        self._predicted: float | None = None  # a drafting step's predicted period, ms
        # The drafter (drafter_state), and whether the drafts it made last are fresh and
        # the start-up profile is done.
        self.state = drafter_state(budget) | {"drafted": True, "profiled": False}
        self.counters = {"steps": 0, "paused_steps": 0, "nodes": 0, "min_nodes": None,
                         "max_nodes": 0, "predicted": 0.0, "probes": 0}
        # vLLM's stats interval read when logging, not every step (its envs are re-read).
        self._log_due = time.monotonic() + _log_interval()

    def add_request(self, req_idx: int) -> None:
        self.scores.fill_row(req_idx, 0.0)  # untried: as sure as the drafter can be

    def warmup_budget_kernel(self) -> None:
        """After V2's start-up warm-up (the name is vLLM's; GPU workers run it): the step
        costs are profiled from timed dummy runs at 1, 2, 4, ... tokens, drafting and
        paused. Where no warm-up runs (vLLM's CPU worker), the first verify step does it
        before making its batch, the stored trees kept."""
        if self.state["profiled"] is not False:
            return
        self.state["profiled"] = None  # under way: the dummy runs' drafter never probes
        saved = self.trees.saved()
        runner = self.runner
        top = min(runner.max_num_tokens, runner.max_num_reqs * (self.budget + 1))
        sizes = sorted({min(2 ** i, top) for i in range(top.bit_length() + 1)})
        plan = [(n, True) for n in sizes]
        plan += [(n, False) for n in sizes if n <= runner.max_num_reqs]

        def run(tokens: int, drafting: bool) -> None:
            self.state["drafting"] = drafting
            runner._dummy_run(tokens, skip_eplb=True)

        self.timer.profile(run, plan, PROFILE_REPEATS)
        self.state.update(drafting=True, profiled=True)
        self.trees.restore(saved)
        self.timer.costs = self._tp.broadcast_object(self.timer.costs, src=0)

    def get_num_tokens(self, num_tokens_per_req: dict[str, int],
                       draft_tokens: dict[str, list[int]]) -> int:
        """The step's token count; the per-request node counts kept for compact_batch."""
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        self.warmup_budget_kernel()
        req_ids = sort_batch_req_ids(num_tokens_per_req, draft_tokens,
                                     self.runner.decode_query_len)
        scheduled = np.array([len(draft_tokens.get(r, ())) for r in req_ids], dtype=np.int32)
        non_draft = np.array([num_tokens_per_req[r] for r in req_ids], dtype=np.int32) - \
            scheduled
        req_states = self.runner.req_states
        slots = np.array([req_states.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        num_sampling = int(np.count_nonzero(
            req_states.num_computed_tokens_np[slots] + non_draft
            >= req_states.prefill_len.np[slots]))
        choice = self._choose(slots, scheduled, num_sampling, int(non_draft.sum()))
        self._batch = (req_ids, choice.nodes)
        return int(non_draft.sum() + choice.nodes.sum())

    def _choose(self, slots: np.ndarray, scheduled: np.ndarray, num_sampling: int,
                num_non_draft: int) -> Choice:
        costs, state, c = self.timer.costs, self.state, self.counters
        if not costs.ready:  # the profile timed nothing: fixed trees until steps are
            return Choice(scheduled.copy(), True, 0.0)
        if not state["drafted"]:  # drafts the drafter did not make this time: stale
            return Choice(np.zeros_like(scheduled), False, 0.0)
        acceptance = node_acceptance(self.calibration, self.scores.latest()[slots],
                                     scheduled)
        choice = choose_nodes(acceptance, num_sampling, num_non_draft, costs,
                              explore=state["probe"])
        after_choice(state, choice)
        total = int(choice.nodes.sum())
        # A drafting step's period as the curves predict it, compared with the served one.
        self._predicted = float(costs.step_ms(np.array([num_non_draft + total]), len(slots),
                                              True, raw=True)[0]) if choice.drafting else None
        c["steps"] += 1
        c["nodes"] += total
        c["predicted"] += choice.predicted
        c["max_nodes"] = max(c["max_nodes"], total)
        if total:  # the smallest step that verified drafts
            c["min_nodes"] = min(c["min_nodes"] or total, total)
        return choice

    def compact_batch(self, num_draft_tokens_per_req: np.ndarray,
                      num_scheduled_tokens: np.ndarray,
                      cu_num_logits_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The exact per-request token counts and cu_num_logits (in the runner's order,
        which get_num_tokens computed the same way)."""
        assert self._batch is not None and len(self._batch[1]) == len(num_scheduled_tokens)
        nodes = self._batch[1]
        cu = np.zeros_like(cu_num_logits_np)
        np.cumsum(nodes + 1, out=cu[1:])
        return num_scheduled_tokens - num_draft_tokens_per_req + nodes, cu

    def reallocate_drafts(self, req_ids: list[str], idx_mapping: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, int, None]:
        """The device's cu_num_logits from the host's (query_start_loc already is)."""
        batch, self._batch = self._batch, None
        assert batch is not None and batch[0] == req_ids, "the runner's request order changed"
        num_reqs, nodes = len(req_ids), batch[1]
        cu = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(nodes + 1, out=cu[1:])
        self._cu[:num_reqs + 1].copy_(torch.from_numpy(cu), non_blocking=True)
        return (self._cu[:num_reqs + 1], self.runner.input_buffers.query_start_loc,
                int(nodes.sum()), None)

    def drafting(self, input_batch: Any) -> bool:
        """At the drafter's start (the speculator's propose): whether it drafts trees; a
        paused drafter probes once its wait is over."""
        state = self.state
        state["probe"] = False
        if not state["drafting"] and state["profiled"]:
            self.counters["paused_steps"] += 1
            self.counters["probes"] += probes_now(
                state, input_batch.num_reqs,
                lambda: probe_wait(self.timer.costs, input_batch.num_tokens,
                                   input_batch.num_reqs))
        predicted, self._predicted = self._predicted, None
        self.timer.drafter_start(input_batch.num_tokens, input_batch.num_reqs,
                                 state["drafting"], predicted)
        state.update(drafted=state["drafting"], requests=input_batch.num_reqs)
        return state["drafting"]

    def drafts_to_schedule(self, width: int) -> int:
        """How many drafts a request is scheduled next (patch 0013): none while paused,
        else room to grow past the widest tree verified last, within half the step's token
        budget (the rest admits waiting requests' prompts)."""
        if not self.state["drafted"]:
            return 0
        share = self.runner.max_num_tokens // (2 * max(self.state.get("requests", 1), 1))
        return drafts_width(self.state["widest"], width, share)

    def record_confidences(self, confidence_probs: Any, input_batch: Any) -> None:
        """After the drafter (the name is vLLM's): its scores and the calibration go to the
        host; the step's times are taken."""
        self.scores.publish()
        self.calibration.host.publish()
        self.realized.publish()
        self.timer.step_end()
        now = time.monotonic()
        if now >= self._log_due:
            self._log_due = now + _log_interval()
            _log(self.counters, float(self.realized.latest()[0]), self.timer.costs)

    def observe(self, verdict: Any, input_batch: Any) -> None:
        """In the verify step, on the device: the verified nodes' verdicts."""
        cu = input_batch.cu_num_logits
        node = torch.arange(1, self.budget + 1, device=cu.device)
        verified = node[None, :] < (cu[1:] - cu[:-1])[:, None]
        path = verdict.accepted.long().clamp(min=0)
        accepted = torch.zeros(path.shape[0], self.budget + 1, dtype=torch.bool,
                               device=cu.device).scatter_(1, path, True)[:, 1:]
        scores = self.trees.scores[input_batch.idx_mapping]
        self.calibration.observe(scores, verified, accepted)
        # Off the greedy chain: an accepted node less probable than its depth's best.
        depths = self.trees.depths[input_batch.idx_mapping, 1:].long().clamp(min=0)
        best = torch.full((scores.shape[0], self.budget + 1), float("-inf"),
                          device=cu.device).scatter_reduce(1, depths, scores, "amax")
        off = accepted & (scores < best.gather(1, depths) - 1e-6)
        self._realized[0] += verdict.num_accepted.sum()
        self._realized[1] += off.any(dim=1).sum()

    def stats(self) -> dict[str, Any]:
        """Counters, the costs and the calibration (reads the device: not in a step)."""
        c = dict(self.counters)
        c["realized"] = float(self._realized[0])
        c["paths_off_the_greedy_chain"] = float(self._realized[1])
        c["costs"] = self.timer.costs.summary()
        c["calibration"] = [round(float(r), 4) for r in self.calibration.rates()[:16]]
        return c


def fix_costs(sizing: AdaptiveTreeSizing, costs: StepCosts) -> None:
    """The sizing's choices read ``costs`` from now on: no start-up profile, nothing
    learned (benchmarks and tests that set the step's prices)."""
    sizing.state["profiled"] = True
    sizing.timer.learn = False
    sizing.timer.costs = costs


def _log_interval() -> float:
    import vllm.envs as envs

    return envs.VLLM_LOG_STATS_INTERVAL


def _log(c: dict[str, Any], realized: float, costs: StepCosts) -> None:
    """At vLLM's stats interval: what was chosen and what it cost."""
    from vllm_ddtree import logger

    steps = max(c["steps"], 1)
    logger.info(
        "Adaptive trees: %d verify steps, %d paused (%d probes), nodes per step %.1f "
        "(min %s, max %d), accepted drafts per step %.2f expected, %.2f realized; costs %s",
        c["steps"], c["paused_steps"], c["probes"], c["nodes"] / steps, c["min_nodes"],
        c["max_nodes"], c["predicted"] / steps, realized / steps, costs.summary())
