#!/usr/bin/env python3
"""What a speculative engine costs when it drafts nothing: the floor under adaptive trees.

Where no draft pays (this CPU at concurrency 8 and 32), adaptive trees pause the drafter,
and their tokens/s can at best be that of a paused step. This measures it, beside no
speculation, in one run (engines held at once, passes interleaved, tokens/s the median):

- ``ddtree adaptive, held paused``: adaptive trees (cap 256) whose costs price the drafter
  out (1e5 ms a draft step, learning off), so every step after the first is paused and
  probes come at most every MAX_PROBE_WAIT steps: the paused step's own cost (storing the
  drafter's context, the sizing, TREE_ATTN's dispatch, vLLM's speculative bookkeeping);
- ``dflash, drafting nothing``: vLLM's own DFlash with ``num_speculative_tokens_per_batch_size``
  giving 0 drafts at every batch size: what vLLM's speculative path costs when idle.

The held-paused row also gives the time its passes spent keeping the drafter's context
(DFlash's fc over the target's aux hidden states and the context K/V projected from it, for
every committed token, prompts included: what keeps the context right across a pause) as a
share of no speculation's pass, and the ceiling that alone sets: no speculation's time over
the two summed, the best a paused engine could do were the rest of its step free.

A second table splits each engine's passes into the parts of their steps (scheduling,
inputs, the target's forward, sampling with the speculator's drafting, outputs, the
scheduler's update): where a paused pass's extra time over no speculation's goes.

Synthetic costs for the held-paused mode (said on its row); the outputs are real and must
equal no speculation's (greedy). Writes OUT/paused-floor.md and .json.

  scripts/bench_paused_floor.py --concurrency 1 8 32 --repeats 5 \\
      --out docs/bench-acceptance-cpu/paused-floor
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_acceptance import (  # noqa: E402  (also sets the CPU's environment)
    StepTimers,
    native_cpu_attention,
    runner_of,
)

HELD_PAUSED = "ddtree adaptive, held paused"
VLLM_IDLE = "dflash, drafting nothing"


def price_out_the_drafter(llm) -> None:  # noqa: ANN001
    """Adaptive trees whose drafter costs 1e5 ms a step: no draft ever pays."""
    from vllm_ddtree.spec_decode.adaptive.costs import StepCosts
    from vllm_ddtree.spec_decode.adaptive.sizing import fix_costs

    fix_costs(runner_of(llm).adaptive_verification, StepCosts.flat(1.0, 1e5))


class ContextTimer:
    """Seconds the held-paused engine's drafter spends keeping its context, per pass: its
    paused steps' ``_store_context`` (queueing, DFlash's fc over the aux layers, the K/V
    projection) and any other store of queued rows (a probe's flush)."""

    def __init__(self, llm) -> None:  # noqa: ANN001
        speculator = runner_of(llm).speculator
        self.seconds, self._depth = 0.0, 0
        self.device = speculator.device
        for name in ("_store_context", "_store_context_kv"):
            setattr(speculator, name, self._timed(getattr(speculator, name)))

    def _timed(self, fn):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
            self._depth += 1
            t0 = time.perf_counter()
            try:
                fn(*args, **kwargs)
                if self.device.type == "cuda":
                    import torch

                    torch.cuda.synchronize()
            finally:
                self._depth -= 1
            if not self._depth:  # the outermost call only
                self.seconds += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class StepParts:
    """Seconds each engine's passes spend in the parts of its steps (the runner's and the
    scheduler's calls, bench_acceptance's StepTimers), per pass: where a paused step's extra
    time goes."""

    PARTS = {"schedule": ("scheduler", "schedule"),
             "inputs": ("runner", "prepare_inputs"),
             "target forward": ("model", "forward"),
             "sampling (and drafting)": ("runner", "sample_tokens"),
             "drafting (the speculator's propose)": ("speculator", "propose"),
             "outputs": ("runner", "postprocess_sampled"),
             "scheduler update": ("scheduler", "update_from_output")}

    def __init__(self, llm) -> None:  # noqa: ANN001
        runner = runner_of(llm)
        owners = {"runner": runner, "model": runner.model,
                  "speculator": getattr(runner, "speculator", None),
                  "scheduler": llm.llm_engine.engine_core.engine_core.scheduler}
        self.timers = StepTimers(cuda=runner.device.type == "cuda")
        for part, (owner, attr) in self.PARTS.items():
            self.timers.wrap(owners[owner], attr, part)
        self.timers.enabled = True

    def take(self) -> dict[str, float]:
        seconds = dict(self.timers.total)
        self.timers.total.clear()
        return seconds


def engines(args: argparse.Namespace, concurrency: int) -> dict:
    from vllm import LLM, SamplingParams

    native_cpu_attention()

    drafter = str(args.pair / "drafter")
    specs = {"none": None,  # first: a tree engine's start makes later engines TREE_ATTN's
             VLLM_IDLE: {"method": "dflash", "model": drafter, "num_speculative_tokens": 15,
                         "num_speculative_tokens_per_batch_size": [[1, concurrency, 0]]},
             HELD_PAUSED: {"method": "ddtree", "model": drafter, "tree_budget": 256,
                           "enable_adaptive_verification": True}}
    out = {}
    for name, spec in specs.items():
        llm = LLM(model=str(args.pair / "target"), dtype="float32", enforce_eager=True,
                  seed=0, max_model_len=1024, max_num_seqs=concurrency,
                  speculative_config=spec)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(max_tokens=4),
                     use_tqdm=False)  # warm-up (and the sizing's first step)
        if name == HELD_PAUSED:
            price_out_the_drafter(llm)
        out[name] = llm
    return out


def run(args: argparse.Namespace, concurrency: int, prompts: list) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llms = engines(args, concurrency)
    context = ContextTimer(llms[HELD_PAUSED])
    parts = {name: StepParts(llm) for name, llm in llms.items()}
    rates: dict[str, list[float]] = {name: [] for name in llms}
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    part_seconds: dict[str, list[dict]] = {name: [] for name in llms}
    storing: list[float] = []
    outputs: dict[str, list] = {}
    for i in range(args.repeats + 1):  # a first untimed pass each
        # Every other round backwards: no engine always runs first.
        for name, llm in list(llms.items())[::1 if i % 2 else -1]:
            context.take()
            parts[name].take()
            t0 = time.perf_counter()
            res = llm.generate(requests, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            outputs[name] = [list(r.outputs[0].token_ids) for r in res]
            if i:
                rates[name].append(sum(len(o) for o in outputs[name]) / dt)
                seconds[name].append(dt)
                part_seconds[name].append(parts[name].take())
                if name == HELD_PAUSED:
                    storing.append(context.take())
    stats = runner_of(llms[HELD_PAUSED]).adaptive_verification.stats()
    none = statistics.median(rates["none"])
    rows = [{"mode": name, "concurrency": concurrency,
             "tokens_per_s": statistics.median(r), "tokens_per_s_runs": r,
             "seconds_runs": seconds[name], "x_none": statistics.median(r) / none,
             "same_output": outputs[name] == outputs["none"],
             # ms a pass in each part of its steps (median over the passes)
             "parts_ms": {part: 1e3 * statistics.median(p.get(part, 0.0)
                                                        for p in part_seconds[name])
                          for part in StepParts.PARTS
                          if any(part in p for p in part_seconds[name])}}
            for name, r in rates.items()]
    rows[-1]["adaptive"] = {k: stats[k] for k in ("steps", "paused_steps", "probes")}
    none_s, store_s = statistics.median(seconds["none"]), statistics.median(storing)
    rows[-1]["context_share"] = store_s / none_s
    rows[-1]["context_ceiling"] = none_s / (none_s + store_s)
    del llms
    gc.collect()
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| mode | conc. | tok/s | x none | paused steps (probes) | storing the context, "
             "x none's time | ceiling it sets, x none | greedy output |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r.get("adaptive")
        paused = f"{a['paused_steps']} ({a['probes']})" if a else "-"
        mode = r["mode"] + (" (synthetic costs: the drafter priced out)" if a else "")
        share, ceiling = (f"{r['context_share']:.3f}", f"{r['context_ceiling']:.3f}x") if a \
            else ("-", "-")
        lines.append(f"| {mode} | {r['concurrency']} | {r['tokens_per_s']:,.1f} | "
                     f"{r['x_none']:.3f}x | {paused} | {share} | {ceiling} | "
                     f"{'same as none' if r['same_output'] else 'DIFFERS'} |")
    lines += ["", "Where a pass's time goes: ms a pass in each part of the steps (median; "
              "sampling includes drafting), and the whole pass:", "",
              "| mode | conc. | " + " | ".join(StepParts.PARTS) + " | pass |",
              "|---|---|" + "---|" * (len(StepParts.PARTS) + 1)]
    for r in rows:
        cells = [f"{r['parts_ms'][p]:,.1f}" if p in r["parts_ms"] else "-"
                 for p in StepParts.PARTS]
        pass_ms = 1e3 * statistics.median(r["seconds_runs"])
        lines.append(f"| {r['mode']} | {r['concurrency']} | " + " | ".join(cells)
                     + f" | {pass_ms:,.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, default=REPO / "models" / "tiny-pair")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=Path, help="token-id lists; default "
                   "PAIR/heldout_prompts.json")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    source = args.prompts or args.pair / "heldout_prompts.json"
    prompts = json.loads(source.read_text())[:args.num_prompts]
    rows = [row for c in args.concurrency for row in run(args, c, prompts)]
    command = "scripts/bench_paused_floor.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    text = markdown(rows, command)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paused-floor.md").write_text(f"# The paused floor\n\n{text}")
        (args.out / "paused-floor.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
