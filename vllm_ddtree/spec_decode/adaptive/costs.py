"""What a step costs, measured on the device that runs it.

A step's time splits into the verify part (from the target's attention metadata to the
drafter's start: the target's forward, sampling, the walk and the commit), the drafter's
part (its forward and the tree build, or, paused, storing its context) and the rest of the
step's period (the scheduler, input and output processing, everything the curves miss),
one average per mode, drafting or paused: the residual of each served step's period. The
verify part is a curve over the step's token count, the drafter's over its request count;
both are seeded at start-up from timed dummy runs and kept current from every served step
(an exponential average per size bucket). A step that chose to draft also compares its
period with what the curves predicted for it: the ratio (averaged) scales later drafting
estimates, because choosing by noisy estimates picks the drafts they underestimate most (a
CPU's step times move by 10% and more). Paused steps need none: nothing is chosen among
them, and their residual (``rest_ms``) is learned from every one.

``StepClock`` reads host time on a CPU and CUDA events on a GPU; an event is read only once
it has completed (``query``), so timing never waits for the device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vllm_ddtree.spec_decode.adaptive.calibration import non_increasing

BUCKETS_PER_OCTAVE = 4  # sizes within ~19% share a point of a curve
SMOOTHING = 0.1  # weight of a new sample in its bucket's average
OUTLIER = 4.0  # a served sample over this many times its bucket's value is dropped
MAX_WEIGHT = 10  # a bucket's weight in the curve's fit, in samples


class CostCurve:
    """Milliseconds over a size: averaged points in log-spaced buckets, read by linear
    interpolation of their non-decreasing fit (past the last point, extended by the last
    slope). The fit is the weighted least-squares one (a bucket weighs by its samples): a
    noisy bucket is pooled with its neighbours, not carried up to every larger size as a
    running maximum would (one slow step at 11 tokens made every step of up to 1024 look
    as slow on a CPU)."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self._fit: tuple[np.ndarray, np.ndarray] | None = None

    @staticmethod
    def bucket(size: int) -> int:
        return round(BUCKETS_PER_OCTAVE * math.log2(max(size, 1)))

    def add(self, size: int, ms: float, trusted: bool = False) -> None:
        """A sample: ``trusted`` (the start-up profile's medians) sets a bucket; a served
        step moves it, its first ones most (a served step costs what no dummy run times:
        sampling every node, the walk), then by the smoothing weight; one over OUTLIER
        times the bucket (once it has served three) or, for a new bucket, the curve there
        is dropped."""
        key = self.bucket(size)
        old = self.points.get(key)
        if not trusted and self._outlier(key, size, ms):
            return  # an idle gap or a one-off (a compile): not the step's cost
        self._fit = None
        if old is None or trusted:
            self.points[key], self.counts[key] = ms, 0
            return
        served = self.counts[key]
        self.points[key] = old + max(SMOOTHING, 1 / (served + 2)) * (ms - old)
        self.counts[key] = served + 1

    def _outlier(self, key: int, size: int, ms: float) -> bool:
        old = self.points.get(key)
        if old is None:  # a new bucket's first sample: judged against the curve there
            return bool(self.points) and ms > OUTLIER * float(self.at(np.array([size]))[0])
        return self.counts[key] >= 3 and ms > OUTLIER * old

    def __bool__(self) -> bool:
        return bool(self.points)

    def _fitted(self) -> tuple[np.ndarray, np.ndarray]:
        if self._fit is None:
            keys = sorted(self.points)
            values = np.array([self.points[k] for k in keys])
            # A profiled bucket weighs one sample; served samples add up to MAX_WEIGHT
            # (the smoothing forgets older ones).
            weights = np.array([min(1 + self.counts[k], MAX_WEIGHT) for k in keys], float)
            self._fit = (np.array([2.0 ** (k / BUCKETS_PER_OCTAVE) for k in keys]),
                         -non_increasing(-values, weights))
        return self._fit

    def at(self, sizes: np.ndarray) -> np.ndarray:
        xs, ys = self._fitted()
        sizes = np.asarray(sizes, dtype=np.float64)
        out = np.interp(sizes, xs, ys)
        if len(xs) > 1:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            out = np.where(sizes > xs[-1], ys[-1] + slope * (sizes - xs[-1]), out)
        return out

    def table(self) -> list[tuple[int, float]]:
        return [(round(2.0 ** (k / BUCKETS_PER_OCTAVE)), round(v, 3))
                for k, v in sorted(self.points.items())]


class StepCosts:
    """The verify curve (over tokens), the drafter's (over requests), the drafter's cost
    while paused (it still stores its context, over requests) and the rest of a step's
    period, drafting and paused."""

    def __init__(self) -> None:
        self.verify, self.draft, self.paused_draft = CostCurve(), CostCurve(), CostCurve()
        self.rest_ms: dict[bool, float | None] = {True: None, False: None}
        self.drafting_bias = 1.0  # drafting steps' served periods over predicted ones

    def add_bias(self, period_ms: float, predicted_ms: float) -> None:
        ratio = period_ms / max(predicted_ms, 1e-3)
        if 1 / OUTLIER <= ratio <= OUTLIER:  # else an idle gap, a compile: no step's cost
            self.drafting_bias += SMOOTHING * (ratio - self.drafting_bias)

    def add_rest(self, drafting: bool, ms: float) -> None:
        old = self.rest_ms[drafting]
        if old is None:
            self.rest_ms[drafting] = max(ms, 0.0)
        elif ms <= OUTLIER * max(old, 0.25):  # an idle server is no step's cost
            self.rest_ms[drafting] = max(old + SMOOTHING * (ms - old), 0.0)

    @classmethod
    def flat(cls, verify_ms: float, draft_ms: float,
             paused_draft_ms: float = 0.01) -> StepCosts:
        """Costs set by hand, the same at every size, nothing else in a step (benchmarks
        that fix the choice's prices: ``sizing.fix_costs``)."""
        costs = cls()
        for n in (1, 1 << 16):
            costs.verify.add(n, verify_ms, trusted=True)
            costs.draft.add(n, draft_ms, trusted=True)
            costs.paused_draft.add(n, paused_draft_ms, trusted=True)
        costs.rest_ms = {True: 0.0, False: 0.0}
        return costs

    @property
    def ready(self) -> bool:
        return bool(self.verify) and bool(self.draft)

    def step_ms(self, tokens: np.ndarray, num_reqs: int, drafting: bool,
                raw: bool = False) -> np.ndarray:
        """A step's time at each token count in ``tokens``, drafting for the next step or
        not (``raw``: the curves' alone, without drafting steps' served/predicted ratio)."""
        drafter = self.draft if drafting or not self.paused_draft else self.paused_draft
        fixed = (self.rest_ms[drafting] or 0.0) + float(drafter.at(np.array([num_reqs]))[0])
        scale = self.drafting_bias if drafting and not raw else 1.0
        return np.maximum(self.verify.at(tokens) + fixed, 1e-3) * scale

    def summary(self) -> dict[str, Any]:
        return {"verify_ms_by_tokens": self.verify.table(),
                "draft_ms_by_requests": self.draft.table(),
                "paused_draft_ms_by_requests": self.paused_draft.table(),
                "rest_ms": {("drafting" if k else "paused"): None if v is None else round(v, 3)
                            for k, v in self.rest_ms.items()},
                "drafting_served_over_predicted": round(self.drafting_bias, 3)}


class StepClock:
    """Marks on the device's timeline: host time on a CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float | None:
        """Milliseconds from ``start`` to ``end``; None while ``end`` has not happened."""
        if not self.cuda:
            return (end - start) * 1e3
        return start.elapsed_time(end) if end.query() else None


class StepTimer:
    """Times steps into ``costs``: ``step_start`` (the step's trees are set up),
    ``drafter_start``, ``step_end`` (the drafter is done; a step's period runs from the
    previous one's end). While serving each step updates the costs once its marks can be
    read; ``profile`` seeds the curves at start-up."""

    def __init__(self, device: torch.device, learn: bool) -> None:
        self.costs, self.clock, self.learn = StepCosts(), StepClock(device), learn
        self._marks: dict[str, Any] = {}
        self._last_end: Any = None
        self._pending: list[tuple] = []

    def step_start(self) -> None:
        self._marks = {"start": self.clock.mark()}

    def drafter_start(self, tokens: int, reqs: int, drafting: bool,
                      predicted_ms: float | None = None) -> None:
        """``predicted_ms``: the step's period as the curves predicted it, where the step
        chose to draft and the drafter drafts."""
        if "start" in self._marks:
            self._marks.update(draft=self.clock.mark(), size=(tokens, reqs, drafting),
                               predicted=predicted_ms)

    def step_end(self) -> None:
        marks, self._marks = self._marks, {}
        if "draft" not in marks:
            self._last_end = None
            return
        end = self.clock.mark()
        self._pending.append((self._last_end, marks["start"], marks["draft"], end,
                              marks["size"], marks["predicted"]))
        self._last_end = end
        if self.learn:
            for step in self._resolved():
                tokens, reqs, drafting, verify_ms, draft_ms, period, predicted = step
                if period is not None and predicted is not None:
                    self.costs.add_bias(period, predicted)
                self._add(tokens, reqs, drafting, verify_ms, draft_ms, trusted=False)
                if period is not None:
                    self.costs.add_rest(drafting, period - verify_ms - draft_ms)

    def profile(self, run: Callable[[int, bool], None], plan: list[tuple[int, bool]],
                repeats: int) -> None:
        """Runs ``run(tokens, drafting)`` for every entry of ``plan``, a warm-up and
        ``repeats`` timed times each: the curves are their medians."""
        timed: dict[tuple, list[tuple[float, float]]] = {}
        learn, self.learn = self.learn, False
        for tokens, drafting in plan:
            for i in range(repeats + 1):
                self.step_start()
                run(tokens, drafting)
                self.step_end()
                if i == 0:
                    self._pending.clear()
            if self.clock.cuda:
                torch.cuda.synchronize()
            for t, r, d, verify_ms, draft_ms, _, _ in self._resolved():
                timed.setdefault((t, r, d), []).append((verify_ms, draft_ms))
        self.costs, self._last_end, self.learn = StepCosts(), None, learn
        for (tokens, reqs, drafting), times in timed.items():
            verify_ms, draft_ms = np.median(np.array(times), axis=0)
            self._add(tokens, reqs, drafting, float(verify_ms), float(draft_ms), trusted=True)

    def _resolved(self) -> list[tuple]:
        """The pending steps whose marks have happened (all, on a CPU), in order."""
        out = []
        while self._pending:
            last_end, start, draft, end, (tokens, reqs, drafting), predicted = \
                self._pending[0]
            draft_ms = self.clock.ms(draft, end)
            if draft_ms is None:
                break
            period = None if last_end is None else self.clock.ms(last_end, end)
            out.append((tokens, reqs, drafting, self.clock.ms(start, draft), draft_ms,
                        period, predicted))
            self._pending.pop(0)
        del self._pending[:-16]  # never a backlog
        return out

    def _add(self, tokens: int, reqs: int, drafting: bool, verify_ms: float,
             draft_ms: float, trusted: bool) -> None:
        self.costs.verify.add(tokens, verify_ms, trusted)
        (self.costs.draft if drafting else self.costs.paused_draft).add(reqs, draft_ms,
                                                                        trusted)
