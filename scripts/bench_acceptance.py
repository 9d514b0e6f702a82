#!/usr/bin/env python3
"""Acceptance benchmark: no speculation vs the DFlash chain vs DDTree (and, with
--jetspec-drafter, a JetSpec head with JetSpec's and DDTree's builds), in one run, on the
same held-out prompts (the trained tiny pair by default: scripts/train_tiny_pair.py).

For each mode and concurrency: mean acceptance length (tokens committed per verify step),
per-depth acceptance (share of verify steps accepting at least d draft tokens), target
forwards per generated token, tokens/s (median over --repeats passes) and a step-time
breakdown (draft, tree build, verify forward, walk + compaction). Greedy outputs must be
identical across modes (exit status 1 otherwise). Writes OUT/acceptance.md, .json and two
PNG plots (acceptance length vs budget; histogram of accepted lengths).

  scripts/bench_acceptance.py                          # CPU, the trained tiny pair
  scripts/bench_acceptance.py --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 \
      --prompts prompts.json --cuda-graphs --concurrency 1 8 32 --dtype bfloat16

The breakdown wraps the runner's calls with timers (synchronizing on CUDA), so it is taken
on an extra pass, apart from the passes that give tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # timers reach the runner
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU only (the tiny pair: 0.2)


# A second no-speculation engine: how far two identical engines' tokens/s differ in a run
# (its resolution), not a mode compared with.
CONTROL = "none (control)"


def modes(drafter: str, budgets: list[int], depth: int, dynamic: Sequence[str] = (),
          max_reqs: int = 256, jetspec: str | None = None,
          adaptive: Sequence[int] = (), control: bool = False) -> list[tuple[str, dict | None]]:
    """The modes of a run; with ``jetspec`` (a JetSpec head) also that head with JetSpec's
    build and with DDTree's best-first build, at every budget (spine on, as DDTree's); with
    ``adaptive`` (caps) ddtree's adaptive trees, and the JetSpec head's, at each cap; with
    ``control`` a second no-speculation engine (CONTROL), identical to the first."""
    out: list[tuple[str, dict | None]] = [("none", None)] + [(CONTROL, None)] * control + [(
        "dflash", {"method": "dflash", "model": drafter, "num_speculative_tokens": depth})]
    for spine in (True, False):
        for b in budgets:
            out.append((f"ddtree B={b}{' spine' if spine else ''}", {
                "method": "ddtree", "model": drafter, "tree_budget": b, "tree_spine": spine}))
    for b in budgets if jetspec else ():
        for build in ("jetspec", "best_first"):
            out.append((f"jetspec head, {build} B={b} spine", {
                "method": "ddtree", "model": jetspec, "tree_budget": b, "tree_build": build}))
    for cap in adaptive:
        out.append((f"ddtree adaptive, cap {cap}", {
            "method": "ddtree", "model": drafter, "tree_budget": cap,
            "enable_adaptive_verification": True}))
        if jetspec:
            out.append((f"jetspec head adaptive, cap {cap}", {
                "method": "ddtree", "model": jetspec, "tree_budget": cap,
                "tree_build": "jetspec", "enable_adaptive_verification": True}))
    for pair in dynamic:
        b, tokens = (int(x) for x in pair.split(":"))
        out.append((f"ddtree B={b} spine, {tokens} tokens/step", {
            "method": "ddtree", "model": drafter, "tree_budget": b,
            "num_speculative_tokens_per_batch_size": step_token_schedule(tokens, b, max_reqs)}))
    return out


def step_token_schedule(tokens: int, budget: int, max_reqs: int) -> list[tuple[int, int, int]]:
    """vLLM's num_speculative_tokens_per_batch_size for trees that keep a verify step within
    ``tokens`` tokens: R requests get the budget where it fits, else 2**k - 1 nodes for the
    largest 2**k <= tokens // R (at least 1). Steps of 2**k tokens per request keep the
    tiers few: vLLM captures CUDA graphs for each."""
    ranges: list[tuple[int, int, int]] = []
    for reqs in range(1, max_reqs + 1):
        per_request = tokens // reqs
        nodes = budget if per_request > budget else (1 << per_request.bit_length() >> 1) - 1
        nodes = max(1, nodes)
        if ranges and ranges[-1][2] == nodes:
            ranges[-1] = (ranges[-1][0], reqs, nodes)
        else:
            ranges.append((reqs, reqs, nodes))
    return ranges


class StepTimers:
    """Wall time per named runner call, summed; on CUDA each call is synchronized."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.enabled = cuda, False
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        if owner is None or not hasattr(owner, attr):
            return
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.enabled:
                return inner(*args, **kwargs)
            self._sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._sync()
                self.total[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, inner))

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def remove(self) -> None:
        for owner, attr, inner in reversed(self.undo):
            setattr(owner, attr, inner)


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner


def native_cpu_attention() -> None:
    """vLLM's own CPU_ATTN for the engines started from now on: a ddtree engine's start in
    this process (an earlier concurrency's) made CPU_ATTN TREE_ATTN's CPU implementation
    (which runs CPU_ATTN for engines without trees, through one more dispatch)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    AttentionBackendEnum.CPU_ATTN.clear_override()
    _cached_get_attn_backend.cache_clear()


def install_timers(llm, timers: StepTimers) -> None:
    import vllm_ddtree.ops
    from vllm_ddtree.spec_decode.verifier import TreeVerifier

    runner = runner_of(llm)
    # The target model's forward (eager: no graph to time at its call site), the
    # speculator's drafting and the verifier in the rejection sampler's place.
    timers.wrap(runner.model, "forward", "verify forward")
    timers.wrap(getattr(runner, "speculator", None), "propose", "draft (incl. tree build)")
    timers.wrap(vllm_ddtree.ops, "build_tree_from_logits", "tree build")
    rejection = getattr(runner, "rejection_sampler", None)
    if rejection is not None:
        name = ("walk + compaction" if isinstance(rejection, TreeVerifier)
                else "chain rejection")
        timers.wrap(runner, "rejection_sampler", name)


def counters(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:")
        if hasattr(m, "values"):
            out[name] = list(m.values)
        elif hasattr(m, "value"):
            out[name] = m.value
    return out


# The suffix of a mode run under a constraint: the option giving it.
CONSTRAINTS = {" + regex": "regex", " + json": "json_schema"}


EVERY_NODE = ", every node"  # a tree mode whose scheduler keeps nodes the grammar forbids


def constraint_of(mode: str) -> str:
    """A mode's constraint suffix, "" for none."""
    return next((c for c in CONSTRAINTS if mode.endswith(c)), "")


def chains(results: list[dict]) -> dict[tuple[str, int], float]:
    """The chains' acceptance lengths by (chain mode, concurrency): 1 where none ran."""
    out = {(r["mode"], r["concurrency"]): r["acceptance_length"] for r in results
           if r["mode"] == chain_of(r["mode"])}
    for r in results:
        out.setdefault((chain_of(r["mode"]), r["concurrency"]), 1.0)
    return out


def chain_of(mode: str) -> str:
    """The chain a mode's acceptance and speed are compared with: the one under the same
    constraint."""
    return "dflash" + constraint_of(mode)


class ModeRun:
    """One mode's engine at one concurrency: a warm-up pass, then ``timed_pass`` (the
    tokens/s of one pass over the prompts) as many times as asked, then ``finish`` (the
    counters over the timed passes, a breakdown pass, the engine shut down)."""

    def __init__(self, args, name: str, spec: dict | None, prompts: list,
                 concurrency: int, engines: int = 1) -> None:
        import torch
        from vllm import LLM, SamplingParams

        device = {"gpu_memory_utilization": args.gpu_memory_utilization / engines} \
            if torch.cuda.is_available() else {}
        self.args, self.name, self.spec, self.concurrency = args, name, spec, concurrency
        self.llm = LLM(model=args.target, speculative_config=spec, dtype=args.dtype,
                       seed=0,
                       max_model_len=args.max_model_len, max_num_seqs=concurrency,
                       enforce_eager=not args.cuda_graphs, disable_log_stats=False, **device)
        from vllm.sampling_params import StructuredOutputsParams

        option = CONSTRAINTS.get(constraint_of(name))
        structured = None
        if option == "regex":
            structured = StructuredOutputsParams(regex=args.regex)
        elif option == "json_schema":
            structured = StructuredOutputsParams(json=json.loads(args.json_schema))
        self.params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                     ignore_eos=True, structured_outputs=structured)
        self.requests = [{"prompt_token_ids": p} for p in prompts]
        self.generate(self.requests[:2])  # warm-up
        self.before = counters(self.llm)
        self.rates: list[float] = []
        self.outputs: list | None = None

    def generate(self, requests: list) -> list:
        """The engine's generate; a mode with EVERY_NODE keeps every tree node the grammar
        forbids for it (as async scheduling does: the engines share this process's
        scheduler code, switched per pass)."""
        from vllm_ddtree.spec_decode import grammar_tree

        tree_grammar = grammar_tree._tree_grammar  # None: no grammar to keep nodes by
        if EVERY_NODE in self.name:
            grammar_tree._tree_grammar = lambda manager, request: None
        try:
            return self.llm.generate(requests, self.params, use_tqdm=False)
        finally:
            grammar_tree._tree_grammar = tree_grammar

    def timed_pass(self) -> None:
        t0 = time.perf_counter()
        res = self.generate(self.requests)
        dt = time.perf_counter() - t0
        self.rates.append(sum(len(r.outputs[0].token_ids) for r in res) / dt)
        self.outputs = [list(r.outputs[0].token_ids) for r in res]

    def finish(self) -> dict:
        """The breakdown pass (timers on) and the counters over it (greedy: every pass
        generates the same tokens; one engine runs at a time, as the counters are the
        process's); the engine stays up (``close``)."""
        import torch

        llm, outputs = self.llm, self.outputs
        before = counters(llm)
        timers = StepTimers(cuda=torch.cuda.is_available())
        install_timers(llm, timers)
        timers.enabled = True
        t0 = time.perf_counter()
        self.generate(self.requests)
        wall = time.perf_counter() - t0
        timers.remove()
        after = counters(llm)

        tokens = sum(len(o) for o in outputs)
        # Adaptive trees: what the sizing chose over every pass (steps, pauses, probes,
        # nodes, expected and realized accepted drafts) and the costs it chose by.
        sizing = getattr(runner_of(llm), "adaptive_verification", None)
        adaptive = sizing.stats() if hasattr(sizing, "stats") else None
        d = {k: _minus(after.get(k, 0), before.get(k, 0)) for k in after}
        drafts = d.get("spec_decode_num_drafts", 0)
        per_pos = d.get("spec_decode_num_accepted_tokens_per_pos", [])
        accepted = d.get("spec_decode_num_accepted_tokens", 0)
        forwards = timers.calls["verify forward"]  # target forwards in the breakdown pass
        hist = [drafts - (per_pos[0] if per_pos else 0)] + [
            per_pos[i] - (per_pos[i + 1] if i + 1 < len(per_pos) else 0)
            for i in range(len(per_pos))]
        return {
            "mode": self.name, "concurrency": self.concurrency, "spec": self.spec,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "per_depth_acceptance": [p / drafts for p in per_pos] if drafts else [],
            "accepted_length_histogram": _trim(hist) if drafts else [],
            "verify_steps": drafts,
            # Drafts verified a request's step (structured output: those its grammar allows).
            "drafts_per_verify_step": d.get("spec_decode_num_draft_tokens", 0) / drafts
            if drafts else 0.0,
            "generated_tokens": tokens * len(self.rates),
            "target_forwards_per_token": forwards / tokens,
            "tokens_per_s": statistics.median(self.rates), "tokens_per_s_runs": self.rates,
            "breakdown_ms_per_forward": {k: 1e3 * v / max(1, forwards)
                                         for k, v in timers.total.items()},
            "breakdown_pass_wall_s": wall, "outputs": outputs,
            **({"adaptive": adaptive} if adaptive is not None else {}),
        }

    def close(self) -> None:
        del self.llm
        gc.collect()


def run_modes(args, runs: list[tuple[str, dict | None]], prompts: list,
              concurrency: int) -> list[dict]:
    """The modes one after another, or with ``--interleave`` every mode's engine at once
    and their timed passes in turn (round-robin, every other round backwards), so that a
    machine whose speed drifts (a shared CPU) slows every mode alike and the k-th passes of
    two modes can be compared as a pair (``adaptive_vs_best``). Engines without trees start
    first: a tree engine's start on the CPU makes later engines' attention TREE_ATTN's
    (undone here for each concurrency's)."""
    native_cpu_attention()
    if not args.interleave:
        out = []
        for name, spec in runs:
            print(f"--- {name}, concurrency {concurrency}", file=sys.stderr, flush=True)
            run = ModeRun(args, name, spec, prompts, concurrency)
            for _ in range(args.repeats):
                run.timed_pass()
            out.append(_report(run.finish()))
            run.close()
        return out
    print(f"--- {len(runs)} modes interleaved, concurrency {concurrency}", file=sys.stderr,
          flush=True)
    engines = [ModeRun(args, name, spec, prompts, concurrency, len(runs))
               for name, spec in sorted(runs, key=lambda r: _has_trees(r[1]))]
    for k in range(args.repeats):  # every other round backwards: no mode always goes first
        for run in engines if k % 2 == 0 else engines[::-1]:
            run.timed_pass()
    timed = {run.name: (run.rates, run.outputs) for run in engines}
    for run in engines:  # together: shutting one down ends the process's parallel groups
        run.close()
    # The counters are the process's last engine's: each mode's breakdown pass and counters
    # on an engine of its own, alone.
    out = []
    for name, spec in runs:
        run = ModeRun(args, name, spec, prompts, concurrency)
        run.rates, run.outputs = timed[name]
        out.append(_report({**run.finish(), "interleaved": True}))
        run.close()
    return out


def _has_trees(spec: dict | None) -> bool:
    return spec is not None and spec.get("method") != "dflash"


def _report(r: dict) -> dict:
    print(f"    {r['mode']}: acceptance length {r['acceptance_length']:.2f}, "
          f"{r['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return r


def _minus(a, b):
    if isinstance(a, list):
        b = b if isinstance(b, list) else []
        return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return a - b


def _trim(hist: list) -> list:
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    return hist


def markdown(results: list[dict], identical: bool, chain: dict[tuple[str, int], float]
             ) -> str:
    cols = ["verify forward", "draft (incl. tree build)", "tree build", "walk + compaction",
            "chain rejection"]
    lines = ["| mode | conc. | accept. length | x chain | drafts/step | fwd/token | tok/s | "
             + " | ".join(f"{c} ms" for c in cols) + " |",
             "|" + "---|" * (7 + len(cols))]
    for r in results:
        ratio = r["acceptance_length"] / chain[(chain_of(r["mode"]), r["concurrency"])] \
            if r["verify_steps"] else None
        b = r["breakdown_ms_per_forward"]
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['acceptance_length']:.2f} | "
            + (f"{ratio:.2f}x" if ratio else "-")
            + f" | {r.get('drafts_per_verify_step', 0.0):.1f}"
            + f" | {r['target_forwards_per_token']:.3f} | {r['tokens_per_s']:.1f} | "
            + " | ".join(f"{b[c]:.2f}" if c in b else "-" for c in cols) + " |")
    lines += ["", "Per-depth acceptance (share of verify steps accepting >= d drafts):", "",
              "| mode | conc. | " + " | ".join(f"d={d}" for d in range(1, 9)) + " |",
              "|" + "---|" * 10]
    for r in results:
        if r["per_depth_acceptance"]:
            cells = [f"{x:.2f}" for x in r["per_depth_acceptance"][:8]]
            cells += [""] * (8 - len(cells))
            lines.append(f"| {r['mode']} | {r['concurrency']} | " + " | ".join(cells) + " |")
    lines += ["", f"Greedy outputs identical across modes: {'yes' if identical else 'NO'}"]
    return "\n".join(lines + speed_vs_chain(results) + adaptive_vs_best(results)) + "\n"


def median_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``xs``: the order
    statistics the binomial distribution puts around it (at least ``level``; with fewer
    than 6 values no pair reaches 95%, and the interval is their range)."""
    s, n = sorted(xs), len(xs)
    j, below = 1, (1 + n) / 2 ** n  # P(fewer than j + 1 of n values below the median)
    while j < n // 2 and below <= (1 - level) / 2:
        j += 1
        below += math.comb(n, j) / 2 ** n
    return s[j - 1], s[n - j]


def _paired(results: dict, mode: tuple, other: tuple) -> list[float] | None:
    """The k-th pass of ``mode`` over the k-th of ``other``, where both ran interleaved."""
    a, b = results.get(mode), results.get(other)
    if not (a and b and a.get("interleaved") and b.get("interleaved")):
        return None
    return [x / y for x, y in zip(a["tokens_per_s_runs"], b["tokens_per_s_runs"])]


def _ratio_cell(ratio: float, paired: list[float] | None) -> str:
    if not paired:
        return f"{ratio:.2f}x"
    lo, hi = median_interval(paired)
    return f"{ratio:.2f}x ({statistics.median(paired):.3f}x, {lo:.3f}-{hi:.3f})"


def _verdict(checks: list[tuple[float, list[float] | None, float]]) -> str:
    """Each check is (ratio of medians, paired ratios or None, goal). Paired: met where
    every interval's low end reaches its goal, not met where one's high end falls short,
    else unresolved (the run cannot tell). Unpaired: the ratios of medians decide."""
    if all(paired for _, paired, _ in checks):
        intervals = [(median_interval(paired), goal) for _, paired, goal in checks]
        if all(lo >= goal for (lo, _), goal in intervals):
            return "met"
        return "not met" if any(hi < goal for (_, hi), goal in intervals) else "unresolved"
    return "met" if all(ratio >= goal for ratio, _, goal in checks) else "not met"


def adaptive_vs_best(results: list[dict]) -> list[str]:
    """Each adaptive mode's tokens/s over the fastest other mode and over no speculation,
    per concurrency, and issue 53's goals: at least 0.97x the fastest other mode at every
    concurrency; the JetSpec head's at least 1.15x no speculation at concurrency 1. Where the
    modes ran interleaved, also the median of their pass-by-pass ratios and its 95%
    interval, by which the goal is met, not met or unresolved."""
    by = {(r["mode"], r["concurrency"]): r for r in results}
    rate = {key: r["tokens_per_s"] for key, r in by.items()}
    concs = sorted({c for _, c in rate})
    adaptive = list(dict.fromkeys(m for m, _ in rate if "adaptive" in m))
    if not adaptive:
        return []
    lines = ["", "Adaptive trees' tokens/s over the fastest other mode (named) and over no "
                 "speculation: the ratio of the medians, and where the modes ran interleaved "
                 "(median of the pass-by-pass ratios, its 95% interval):", "",
             "| mode | conc. | fastest other | x fastest | x none | goal | control x none |",
             "|---|---|---|---|---|---|---|"]
    for mode in adaptive:
        for c in concs:
            others = {m: v for (m, cc), v in rate.items()
                      if cc == c and "adaptive" not in m and m != CONTROL}
            if (mode, c) not in rate or not others:
                continue
            best = max(others, key=others.get)
            x_best = rate[(mode, c)] / others[best]
            p_best = _paired(by, (mode, c), (best, c))
            checks = [(x_best, p_best, 0.97)]
            x_none = p_none = None
            if "none" in others:
                x_none = rate[(mode, c)] / others["none"]
                p_none = _paired(by, (mode, c), ("none", c))
                if mode.startswith("jetspec") and c == 1:
                    checks.append((x_none, p_none, 1.15))
            control = rate[(CONTROL, c)] / others["none"] \
                if (CONTROL, c) in rate and "none" in others else None
            lines.append(f"| {mode} | {c} | {best} | {_ratio_cell(x_best, p_best)} | "
                         + (_ratio_cell(x_none, p_none) if x_none else "-")
                         + f" | {_verdict(checks)} | "
                         + (_ratio_cell(control, _paired(by, (CONTROL, c), ("none", c)))
                            if control else "-") + " |")
    return lines + ["", "Goals: >= 0.97x the fastest other mode at every concurrency; the "
                        "JetSpec head's >= 1.15x no speculation at concurrency 1. "
                        "Interleaved, a goal is met where its interval's low end reaches "
                        "it, not met where the high end falls short, else unresolved. "
                        f"Control: {CONTROL}, a second engine identical to none's (where "
                        "run): two identical engines differ by this much in the run."]


def speed_vs_chain(results: list[dict]) -> list[str]:
    """Each ddtree mode's tokens/s over the chain's, per concurrency, and the throughput
    goal: at least 1.35x the chain at the lowest concurrency, and not below it at the
    highest."""
    rate = {(r["mode"], r["concurrency"]): r["tokens_per_s"] for r in results}
    concs = sorted({c for _, c in rate})
    trees = list(dict.fromkeys(m for m, _ in rate if m.startswith("ddtree")))
    if not trees or any((chain_of(m), c) not in rate for m in trees for c in concs):
        return []
    lines = ["", "Tokens/s over the dflash chain's:", "",
             "| mode | " + " | ".join(f"conc. {c}" for c in concs) + " | goal |",
             "|" + "---|" * (len(concs) + 2)]
    for mode in trees:
        ratios = [rate.get((mode, c), 0) / rate[(chain_of(mode), c)] for c in concs]
        met = ratios[0] >= 1.35 and ratios[-1] >= 1.0
        lines.append(f"| {mode} | " + " | ".join(f"{x:.2f}x" for x in ratios)
                     + f" | {'met' if met else 'not met'} |")
    return lines + ["", f"Goal: >= 1.35x at concurrency {concs[0]} and >= 1.00x at "
                        f"concurrency {concs[-1]}."]


def plots(results: list[dict], budgets: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for conc in sorted({r["concurrency"] for r in results}):
        rs = {r["mode"]: r for r in results if r["concurrency"] == conc}
        fig, ax = plt.subplots(figsize=(6, 4))
        for spine in (" spine", ""):
            xs = [b for b in budgets if f"ddtree B={b}{spine}" in rs]
            ys = [rs[f"ddtree B={b}{spine}"]["acceptance_length"] for b in xs]
            ax.plot(xs, ys, marker="o", label=f"ddtree{spine or ' (no spine)'}")
        if "dflash" in rs:
            ax.axhline(rs["dflash"]["acceptance_length"], color="gray", ls="--",
                       label="dflash chain")
        ax.set(xscale="log", xlabel="tree budget B (nodes)", ylabel="mean acceptance length",
               title=f"Acceptance length vs budget (concurrency {conc})")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"acceptance_vs_budget_c{conc}.png", dpi=120)
        plt.close(fig)

        shown = [m for m in ["dflash"] + [f"ddtree B={b} spine" for b in budgets] if m in rs]
        if not shown:  # no chain or fixed tree ran (adaptive modes alone): no histogram
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(shown)
        for i, mode in enumerate(shown):
            h = rs[mode]["accepted_length_histogram"]
            total = sum(h) or 1
            offset = (i - (len(shown) - 1) / 2) * width  # the group centred on its tick
            ax.bar([k + offset for k in range(len(h))], [x / total for x in h], width,
                   label=mode)
        ax.set(xlabel="draft tokens accepted in a verify step", ylabel="share of steps",
               title=f"Accepted lengths (concurrency {conc})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"accepted_length_histogram_c{conc}.png", dpi=120)
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from train_tiny_pair import DEFAULT_OUT

    parser.add_argument("--pair", type=Path, default=DEFAULT_OUT,
                        help="a train_tiny_pair.py output (target/, drafter/, prompts)")
    parser.add_argument("--target", help="target model (default: PAIR/target)")
    parser.add_argument("--drafter", help="DFlash drafter (default: PAIR/drafter)")
    parser.add_argument("--prompts", type=Path,
                        help="JSON list of prompts (token id lists or strings); "
                             "default PAIR/heldout_prompts.json")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cuda-graphs", action="store_true", help="default: eager")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--dynamic", nargs="*", default=[], metavar="B:TOKENS",
                        help="also ddtree at budget B with vLLM's dynamic speculative "
                             "decoding, trees cut to keep a verify step near TOKENS tokens")
    parser.add_argument("--jetspec-drafter", help="also a JetSpec head (causal_head) with both "
                        "builds, e.g. a train_tiny_pair.py --jetspec output's drafter/")
    parser.add_argument("--adaptive", type=int, nargs="*", default=[], metavar="CAP",
                        help="also adaptive trees (enable_adaptive_verification) under each "
                             "cap (tree_budget)")
    parser.add_argument("--control", action="store_true",
                        help=f"also a second no-speculation engine ('{CONTROL}'), identical "
                             "to the first: how far identical engines differ in the run")
    parser.add_argument("--modes", nargs="*", help="run only these modes (names as printed)")
    parser.add_argument("--regex", help="also run every mode with this regex as every "
                        "request's structured output (mode name + ' + regex'); chains are "
                        "compared with the chain under the same constraint")
    parser.add_argument("--json-schema", help="also run every mode with this JSON schema "
                        "(JSON text) as every request's structured output (mode name + "
                        "' + json')")
    parser.add_argument("--every-node", action="store_true",
                        help="also each tree mode under each constraint with the nodes the "
                             "grammar forbids verified too (mode + ', every node'), as under "
                             "async scheduling: what keeping only allowed nodes saves")
    parser.add_argument("--interleave", action="store_true",
                        help="hold every mode's engine at once and time their passes in "
                             "turn (a machine whose speed drifts slows all alike; small "
                             "models: each engine gets 1/modes of the GPU memory)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="write OUT/acceptance.md and the plots again from a run's "
                             "acceptance.json (no run)")
    args = parser.parse_args()
    if args.render:
        run = json.loads(args.render.read_text())
        results, identical = run["results"], run["identical_greedy_outputs"]
        chain = chains(results)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "acceptance.md").write_text(markdown(results, identical, chain))
        plots(results, run["args"]["budgets"], args.out)
        return 0
    args.target = args.target or str(args.pair / "target")
    args.drafter = args.drafter or str(args.pair / "drafter")
    prompts = json.loads((args.prompts or args.pair / "heldout_prompts.json").read_text())
    if prompts and isinstance(prompts[0], str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.target)
        prompts = [tok(p)["input_ids"] for p in prompts]
    prompts = prompts[:args.num_prompts]
    block = json.loads((Path(args.drafter) / "config.json").read_text())["block_size"] \
        if Path(args.drafter, "config.json").exists() else 16
    args.out.mkdir(parents=True, exist_ok=True)

    results = []
    runs = [(name, spec) for name, spec in modes(
        args.drafter, args.budgets, block - 1, args.dynamic, max(args.concurrency),
        args.jetspec_drafter, args.adaptive, args.control) if not args.modes or name in args.modes]
    plain = list(runs)
    for suffix, option in CONSTRAINTS.items():  # each mode again under each constraint
        if getattr(args, option, None):
            runs += [(name + suffix, spec) for name, spec in plain]
            if args.every_node:
                runs += [(name + EVERY_NODE + suffix, spec) for name, spec in plain
                         if spec is not None and spec["method"] != "dflash"]
    for conc in args.concurrency:
        results += run_modes(args, runs, prompts, conc)

    reference = {(r["mode"], r["concurrency"]): r["outputs"] for r in results
                 if r["mode"] == chain_of(r["mode"]).replace("dflash", "none")}
    # Each mode's greedy outputs against no speculation's under the same constraint.
    identical = all(reference.get((chain_of(r["mode"]).replace("dflash", "none"),
                                   r["concurrency"]), r["outputs"]) == r["outputs"]
                    for r in results)
    chain = chains(results)
    table = markdown(results, identical, chain)
    print(table)
    (args.out / "acceptance.md").write_text(table)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "acceptance.json").write_text(json.dumps(
        {"args": meta, "identical_greedy_outputs": identical,
         "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results]},
        indent=2))
    plots(results, args.budgets, args.out)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
