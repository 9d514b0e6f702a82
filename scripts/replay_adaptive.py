#!/usr/bin/env python3
"""Adaptive trees on a device's cost curves, replayed from recorded trees and verdicts.

A trace holds, for every request at every verify step of a real run, its tree's path
log-probabilities under the drafter (most probable first, as adaptive trees number them)
and which nodes the target accepted, with every drafted node verified. Replaying it, a
mode verifies a prefix of each tree: a fixed budget B its first B nodes, adaptive trees
what their sizing (``choose_nodes``, ``after_choice``: the engine's own functions, with
its online calibration) picks from the cost curves, pausing and probing as the engine
does. A prefix's accepted drafts are the trace's accepted nodes inside it (a prefix holds
every ancestor). Tokens per second = committed tokens / the curves' step times: a model of
the device, not a timing, and every row says which curves it used.

  scripts/replay_adaptive.py record --out docs/adaptive-replay/trace-tiny-pair.npz
      # the trained tiny pair on this CPU: greedy, concurrency 8, every node verified
      # (--drafter jetspec-drafter: its JetSpec head, trace-tiny-pair-jetspec.npz)
  scripts/replay_adaptive.py measure --out curves.json [--shape 8b]
      # an engine's start-up profile of its step costs (on a GPU: the device's own curves)
  scripts/replay_adaptive.py replay --trace docs/adaptive-replay/trace-tiny-pair.npz \\
      [--curves curves.json] --out docs/adaptive-replay
      # H200 model curves by default (h200_costs: published specs and measured kernels)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # vllm_ddtree from the checkout, as the tests import it
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the runner in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from bench_acceptance import runner_of  # noqa: E402

from vllm_ddtree.spec_decode.adaptive.calibration import AcceptanceCalibration  # noqa: E402
from vllm_ddtree.spec_decode.adaptive.costs import StepCosts  # noqa: E402
from vllm_ddtree.spec_decode.adaptive.sizing import (  # noqa: E402
    after_choice,
    choose_nodes,
    drafter_state,
    drafts_width,
    fix_costs,
    node_acceptance,
    probe_wait,
    probes_now,
)

FIXED_BUDGETS = (4, 16, 64, 256)
# A load is phases of (concurrency, tokens to generate): a phase lasts until its requests
# have their tokens, so every mode does the same work (a mode that commits more tokens a
# step leaves a busy phase sooner). The mixed load comes and goes as a server's does.
TOKENS_PER_REQUEST = 400
MAX_NUM_BATCHED_TOKENS = 8192  # the recorded engine's (a request's drafts fit half a step)
ROW_STRIDE = 64  # a step's rows start this far past the last step's: the trace's spread
MIXED = ((1, 400), (32, 6400), (8, 1600), (1, 400), (32, 6400))

# H200, Qwen3-8B target (bf16) with z-lab/Qwen3-8B-DFlash-b16, a model of the step from
# published specs and the kernels measured on a lent H200 (docs/benchmarks.md):
# - verify: max(floor, tokens x per-token). Floor: the 16.4 GB of weights at 4.8 TB/s
#   (3.4 ms) plus 36 layers of tree attention at one request (measured 0.08 ms a layer at
#   16-64 nodes, 1024 context: 2.9 ms): 6.3 ms. Per token: 16.4 GFLOP at 70% of the
#   989 dense bf16 TFLOP/s, 0.0237 ms. The knee, ~265 tokens, is where the DDTree paper
#   finds speed peaking at batch 1 on an H200 (budgets 256-512).
# - draft: the drafter's 1.0 GB and the target's 1.24 GB LM head read (0.47 ms) plus the
#   tree build measured per request (0.51 ms for one at B=256; 0.046 ms a request at 32).
# - paused: the context K/V of the step's tokens alone (5 small layers): 0.1 ms.
# - rest of the step (scheduler, inputs, outputs; async scheduling hides most): 0.3 ms.
H200_VERIFY = (6.3, 0.0237)
H200_DRAFT = (0.95, 0.046)
H200_PAUSED_MS, H200_REST_MS = 0.1, 0.3


def h200_costs() -> StepCosts:
    """The H200 model's curves as the engine keeps them (a point per size bucket)."""
    costs = StepCosts()
    for n in sorted({2 ** (i / 4) for i in range(0, 4 * 16)}):
        tokens = max(1, round(n))
        costs.verify.add(tokens, max(H200_VERIFY[0], tokens * H200_VERIFY[1]), trusted=True)
    for reqs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        costs.draft.add(reqs, H200_DRAFT[0] + H200_DRAFT[1] * (reqs - 1), trusted=True)
        costs.paused_draft.add(reqs, H200_PAUSED_MS, trusted=True)
    costs.rest_ms = {True: H200_REST_MS, False: H200_REST_MS}
    return costs


def costs_from_json(summary: dict) -> StepCosts:
    """Curves from ``StepCosts.summary()`` (what ``measure`` writes)."""
    costs = StepCosts()
    for curve, key in ((costs.verify, "verify_ms_by_tokens"),
                       (costs.draft, "draft_ms_by_requests"),
                       (costs.paused_draft, "paused_draft_ms_by_requests")):
        for size, ms in summary[key]:
            curve.add(int(size), float(ms), trusted=True)
    rest = summary["rest_ms"]
    costs.rest_ms = {True: rest.get("drafting") or 0.0, False: rest.get("paused") or 0.0}
    return costs


@dataclass(frozen=True)
class Trace:
    scores: np.ndarray  # float32 [rows, N]: path log-probs, most probable first (-inf: none)
    accepted: np.ndarray  # bool [rows, N]: the target's path went through the node

    @classmethod
    def load(cls, path: Path) -> Trace:
        data = np.load(path)
        scores = data["scores"].astype(np.float32)
        accepted = np.zeros(scores.shape, dtype=bool)
        rows, cols = np.nonzero(data["paths"] > 0)
        accepted[rows, data["paths"][rows, cols] - 1] = True
        return cls(scores, accepted)

    def rows(self, step: int, count: int) -> np.ndarray:
        """The rows a step of ``count`` requests verifies (the same for every mode)."""
        return (step * ROW_STRIDE + np.arange(count)) % len(self.scores)


@dataclass
class Replayed:
    tokens: float = 0.0
    ms: float = 0.0
    steps: int = 0
    nodes: int = 0
    paused: int = 0
    predicted: float = 0.0  # adaptive: accepted drafts the calibration expected
    realized: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.tokens / self.ms


Step = Callable[[int, int, Replayed], None]


def run_load(phases: tuple[tuple[int, int], ...], step: Step) -> Replayed:
    """Steps (``step(n, concurrency, out)``, which adds its tokens and time to ``out``)
    until each phase has its tokens."""
    out, n = Replayed(), 0
    for concurrency, tokens in phases:
        goal = out.tokens + tokens
        while out.tokens < goal:
            step(n, concurrency, out)
            out.steps, n = out.steps + 1, n + 1
    return out


def replay_fixed(trace: Trace, costs: StepCosts, phases: tuple[tuple[int, int], ...],
                 budget: int | None) -> Replayed:
    """A fixed budget (None: no speculation, no drafter)."""
    kept = np.cumsum(trace.accepted, axis=1)

    def step(n: int, c: int, out: Replayed) -> None:
        if budget is None:
            out.tokens += c
            out.ms += float(costs.verify.at(np.array([c]))[0]) + (costs.rest_ms[False] or 0)
            return
        b = min(budget, trace.scores.shape[1])
        accepted = float(kept[trace.rows(n, c), b - 1].sum())
        out.tokens += c + accepted
        out.realized += accepted
        out.nodes += c * b
        out.ms += float(costs.step_ms(np.array([c + c * b]), c, drafting=True)[0])

    return run_load(phases, step)


def replay_adaptive(trace: Trace, costs: StepCosts, phases: tuple[tuple[int, int], ...],
                    cap: int, sizes: list[int] | None = None) -> Replayed:
    """Adaptive trees as the engine sizes them (sizing.py's functions): calibrated online
    from the verified nodes' verdicts, scheduled as drafts_width allows, paused when not
    drafting pays more, probing as probes_now says (a probe verifies at most a node a
    request; drafting resumes by RESUME_MARGIN); each step's node count goes to
    ``sizes``."""
    import torch

    calibration = AcceptanceCalibration(torch.device("cpu"))
    state = drafter_state(cap)
    kept = np.cumsum(trace.accepted, axis=1)

    def step(n: int, c: int, out: Replayed) -> None:
        total = 0
        if not state["drafting"]:  # no trees this step: the drafter paused at the last end
            state["probe"] = False
            probes_now(state, c, lambda: probe_wait(costs, c, c))
            out.paused += 1
            out.tokens += c
            out.ms += float(costs.step_ms(np.array([c]), c, drafting=state["drafting"])[0])
        else:
            rows = trace.rows(n, c)
            scores = trace.scores[rows, :cap]
            width = drafts_width(state["widest"], cap, MAX_NUM_BATCHED_TOKENS // (2 * c))
            acceptance = node_acceptance(calibration, scores, np.full(c, width))
            choice = choose_nodes(acceptance, c, c, costs, explore=state["probe"])
            after_choice(state, choice)
            state["probe"] = False
            total = int(choice.nodes.sum())
            accepted = float(sum(kept[r, k - 1] for r, k in zip(rows, choice.nodes) if k))
            verified = np.arange(cap)[None, :] < choice.nodes[:, None]
            calibration.observe(torch.from_numpy(scores), torch.from_numpy(verified),
                                torch.from_numpy(trace.accepted[rows, :cap]))
            out.tokens += c + accepted
            out.nodes += total
            out.predicted += choice.predicted
            out.realized += accepted
            out.ms += float(costs.step_ms(np.array([c + total]), c,
                                          drafting=choice.drafting)[0])
        if sizes is not None:
            sizes.append(total)

    return run_load(phases, step)


def compare(trace: Trace, costs: StepCosts, phases: tuple[tuple[int, int], ...],
            cap: int = 256) -> dict[str, Replayed]:
    """Every mode on one load: none, each fixed budget up to the cap, adaptive."""
    out = {"none": replay_fixed(trace, costs, phases, None)}
    for b in FIXED_BUDGETS:
        if b <= cap:
            out[f"B={b}"] = replay_fixed(trace, costs, phases, b)
    out[f"adaptive, cap {cap}"] = replay_adaptive(trace, costs, phases, cap)
    return out


def markdown(tables: dict[str, dict[str, Replayed]], curves: str, trace_path: Path) -> str:
    lines = [f"Replayed on {curves} (a model of the step, not a timing), trees and verdicts "
             f"from `{trace_path.name}`: `scripts/replay_adaptive.py replay`.", ""]
    for load, modes in tables.items():
        best = max((r.tokens_per_s for m, r in modes.items()
                    if m.startswith("B=")), default=float("nan"))
        none = modes["none"].tokens_per_s
        lines += [f"### {load}", "",
                  "| mode | tokens/s (modeled) | vs best fixed | vs none | nodes/step | "
                  "accepted drafts/step | paused steps | expected drafts/step |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, r in modes.items():
            expected = f"{r.predicted / r.steps:.2f}" if mode.startswith("adaptive") else ""
            lines.append(f"| {mode} | {r.tokens_per_s:,.1f} | {r.tokens_per_s / best:.3f}x | "
                         f"{r.tokens_per_s / none:.3f}x | "
                         f"{r.nodes / r.steps:.1f} | {r.realized / r.steps:.2f} | "
                         f"{r.paused} | {expected} |")
        lines.append("")
    return "\n".join(lines)


def replay_main(args: argparse.Namespace) -> int:
    trace = Trace.load(args.trace)
    if args.curves:
        costs, curves = costs_from_json(json.loads(args.curves.read_text())), \
            f"the curves measured in `{args.curves.name}`"
    else:
        costs, curves = h200_costs(), "the H200 model (`h200_costs`)"
    loads = {f"concurrency {c}": ((c, c * TOKENS_PER_REQUEST),) for c in args.concurrency}
    loads["mixed (" + ", ".join(f"{t} tokens at {c}" for c, t in MIXED) + ")"] = MIXED
    tables = {name: compare(trace, costs, conc, args.cap) for name, conc in loads.items()}
    text = markdown(tables, curves, args.trace)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"replay-{args.trace.stem}" + (f"-{args.curves.stem}" if args.curves else "")
        name += ".md"
        (args.out / name).write_text(f"# Adaptive trees, replayed\n\n{text}")
    return 0


def tiny_engine(pair: Path, spec: dict, concurrency: int):
    from vllm import LLM

    return LLM(model=str(pair / "target"), dtype="float32", enforce_eager=True, seed=0,
               max_model_len=1024, max_num_seqs=concurrency,
               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
               speculative_config=spec)


def record_main(args: argparse.Namespace) -> int:
    """Every drafted node verified (flat verify costs: each node pays), so each row
    holds the target's verdict on the whole tree."""
    import torch
    from vllm import SamplingParams

    spec = {"method": "ddtree", "model": str(args.pair / args.drafter),
            "tree_budget": args.cap, "enable_adaptive_verification": True}
    if args.drafter == "jetspec-drafter":
        spec["tree_build"] = "jetspec"
    llm = tiny_engine(args.pair, spec, args.concurrency)
    sizing = runner_of(llm).adaptive_verification
    fix_costs(sizing, StepCosts.flat(5.0, 0.01))  # a node costs nothing: all verified
    scores_rows, path_rows = [], []
    observe = sizing.observe

    def recording(verdict, input_batch) -> None:  # noqa: ANN001
        observe(verdict, input_batch)
        cu = input_batch.cu_num_logits
        verified = (cu[1:] - cu[:-1] - 1).tolist()
        scores = sizing.trees.scores[input_batch.idx_mapping].float()
        paths = verdict.accepted.long()
        for r, n in enumerate(verified):
            if n == int(torch.isfinite(scores[r]).sum()):
                scores_rows.append(scores[r].numpy().astype(np.float16))
                path_rows.append(paths[r, 1:].numpy().astype(np.int16))

    sizing.observe = recording
    prompts = json.loads((args.pair / "heldout_prompts.json").read_text())[:args.num_prompts]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                 use_tqdm=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, scores=np.stack(scores_rows), paths=np.stack(path_rows))
    print(f"{len(scores_rows)} rows (request-steps) to {args.out}")
    return 0


def measure_main(args: argparse.Namespace) -> int:
    """An adaptive engine's step costs after its start-up profile (and a short greedy
    run, which keeps them current): on a GPU, the device's own curves."""
    from vllm import SamplingParams

    if args.shape:
        import bench_gpu_throughput as gpu
        from vllm import LLM

        target, drafter = gpu.write_models(args.out.parent / "models", gpu.SHAPES[args.shape])
        stand_in = gpu.standin()
        if stand_in:
            os.environ.update(stand_in[1])
        spec = {"method": "ddtree", "model": str(drafter), "tree_budget": args.cap,
                "enable_adaptive_verification": True,
                "draft_load_config": {"load_format": "auto"}}
        llm = LLM(**gpu.engine_kwargs(
            {"model": str(target), "load_format": "dummy", "dtype": "bfloat16", "seed": 0,
             "speculative_config": spec, "max_num_seqs": args.concurrency,
             "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_model_len": 2048,
             "gpu_memory_utilization": 0.6}, stand_in[0] if stand_in else {}))
        prompts = gpu.prompts(target, args.concurrency, 128)
    else:
        spec = {"method": "ddtree", "model": str(args.pair / "drafter"),
                "tree_budget": args.cap, "enable_adaptive_verification": True}
        llm = tiny_engine(args.pair, spec, args.concurrency)
        prompts = json.loads((args.pair / "heldout_prompts.json").read_text())
    prompts = prompts[:args.concurrency]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                 use_tqdm=False)
    summary = runner_of(llm).adaptive_verification.timer.costs.summary()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="a trace from the tiny pair on this machine")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--concurrency", type=int, default=8)
    rec.add_argument("--num-prompts", type=int, default=32)
    rec.add_argument("--max-tokens", type=int, default=96)
    rec.add_argument("--drafter", choices=["drafter", "jetspec-drafter"], default="drafter",
                     help="the pair's DFlash drafter, or its JetSpec head (JetSpec's build)")
    mea = sub.add_parser("measure", help="an engine's start-up cost curves, as JSON")
    mea.add_argument("--out", type=Path, required=True)
    mea.add_argument("--shape", choices=["8b", "tiny"], help="bench_gpu_throughput's shapes "
                     "(dummy weights): on a GPU; default the tiny pair")
    mea.add_argument("--concurrency", type=int, default=8)
    rep = sub.add_parser("replay", help="every mode on a trace and cost curves")
    rep.add_argument("--trace", type=Path, required=True)
    rep.add_argument("--curves", type=Path, help="measure's JSON (default: the H200 model)")
    rep.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    rep.add_argument("--out", type=Path)
    for p in (rec, mea, rep):
        p.add_argument("--pair", type=Path, default=REPO / "models" / "tiny-pair")
        p.add_argument("--cap", type=int, default=256)
    args = parser.parse_args()
    return {"record": record_main, "measure": measure_main,
            "replay": replay_main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
