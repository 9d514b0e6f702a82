#!/usr/bin/env python3
"""Throughput at Qwen3-8B shapes with no checkpoint: no speculation, the DFlash chain and
DDTree, each at synthetic acceptance (vLLM's rejection_sample_method "synthetic": random
weights, drafts accepted at calibrated rates), at several concurrencies.

The script writes the models itself: a Qwen3-8B-shaped target (config only, loaded with
load_format "dummy"), a z-lab/Qwen3-8B-DFlash-b16-shaped drafter (config and random
safetensors, made on the GPU where there is one: vLLM's dummy loader leaves the drafter's
fused context-KV weight empty on CPU) and a byte-level BPE tokenizer trained here and padded
to the model's vocabulary, so that every sampled id decodes.

One engine per mode (start-ups dominate: one engine serves every concurrency, with
max_num_seqs the largest), modes in order of importance; a mode that is not expected to fit
in --time-budget-s is skipped and named in the output, a mode that fails is recorded with
its error. Writes OUT/throughput.md, .json and .png.

  scripts/bench_gpu_throughput.py --out bench-gpu --time-budget-s 390     # an H200
  scripts/bench_gpu_throughput.py --shape tiny --concurrency 1 2 --output-len 32 \
      --tree 8:4.0 --dynamic 8:16                                         # CPU
  scripts/bench_gpu_throughput.py --shape tiny-hybrid --chain-acceptance 4 \
      --tree 8:4.0 16:4.5 64:5.0 --dynamic                   # a hybrid target (Qwen3-Next)

With VLLM_DDTREE_STANDIN_OPS=1 every engine gets gpu_machine.standin_ops's
environment and engine arguments (a stand-in for vLLM's compiled ops), and every row says so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # metrics and clean-up in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, on the CPU platform only

import torch  # noqa: E402

if not torch.cuda.is_available():
    # DDTree's Triton kernels run on CPU tensors through Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_acceptance import counters, step_token_schedule  # noqa: E402
from make_tiny_models import (  # noqa: E402
    BLOCK_SIZE,
    layer_weights,
    make_hybrid,
    qwen3_config,
    train_tokenizer,
)

SYNTHETIC = "synthetic acceptance"
STANDIN = "compiled-op stand-in"


@dataclass(frozen=True)
class Shape:
    target: dict
    drafter: dict
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int = 16
    mask_token_id: int | None = None  # None: the tokenizer's <|mask|>
    hybrid: str | None = None  # make_tiny_models' hybrid pair of this architecture instead


QWEN3_8B_LAYER = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128)
TINY_LAYER = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
SHAPES = {
    # Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16, from their published configs.
    "8b": Shape(target=dict(QWEN3_8B_LAYER, num_hidden_layers=36),
                drafter=dict(QWEN3_8B_LAYER, num_hidden_layers=5), vocab_size=151936,
                target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669),
    # make_tiny_models' sizes, but the real block size, so the synthetic lengths fit.
    "tiny": Shape(target=dict(TINY_LAYER, num_hidden_layers=4),
                  drafter=dict(TINY_LAYER, num_hidden_layers=1), vocab_size=1024,
                  target_layer_ids=[0, 2]),
    # make_tiny_models' hand-built Qwen3-Next (Gated DeltaNet + attention) and its DFlash
    # drafter: the hybrid verify step (the GDN tree path, in CUDA graphs on a GPU).
    "tiny-hybrid": Shape(target={}, drafter={}, vocab_size=0, target_layer_ids=[],
                         block_size=BLOCK_SIZE, hybrid="qwen3_next"),
}


@dataclass
class Mode:
    name: str
    spec: dict | None
    requested_acceptance: float | None = None
    concurrencies: list[int] = field(default_factory=list)  # empty: all
    env: dict[str, str] = field(default_factory=dict)  # set while its engine runs


def modes(drafter: str, depth: int, chain: float, trees: Sequence[tuple[int, float]],
          dynamic: Sequence[tuple[int, int]], max_concurrency: int
          ) -> list[Mode]:
    """Most important first: the time budget cuts from the end."""
    synthetic = {"model": drafter, "rejection_sample_method": "synthetic"}
    chain_spec = {"method": "dflash", "num_speculative_tokens": depth,
                  "synthetic_acceptance_length": chain, **synthetic}
    out = [Mode("no speculation", None), Mode(f"dflash chain k={depth}", chain_spec, chain)]
    accept = dict(trees)
    for budget, length in trees:
        out.append(Mode(f"ddtree B={budget}", {"method": "ddtree", "tree_budget": budget,
                                                "synthetic_acceptance_length": length,
                                                **synthetic}, length))
    for budget, tokens in dynamic:
        # Acceptance as the full tree's: the schedule cuts trees, the rates stay per depth.
        length = accept.get(budget, chain)
        schedule = step_token_schedule(tokens, budget, max_concurrency)
        out.append(Mode(f"ddtree B={budget} dynamic <={tokens} tokens/step", {
            "method": "ddtree", "tree_budget": budget, "synthetic_acceptance_length": length,
            "num_speculative_tokens_per_batch_size": schedule, **synthetic}, length,
            [max_concurrency]))
    return out


# --- models -------------------------------------------------------------------------------

def write_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """make_tiny_models' BPE, padded with placeholder tokens to ``vocab_size`` ids (random
    weights sample any id, and each must decode); returns the special tokens' ids."""
    train_tokenizer(out, vocab_size=min(vocab_size, 1000))
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab.values())
    vocab.update({f"<|x{i}|>": i for i in range(vocab_size) if i not in taken})
    path.write_text(json.dumps(data))
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def write_models(out: Path, shape: Shape, seed: int = 0, weights: bool = True
                 ) -> tuple[Path, Path]:
    """OUT/target (config and tokenizer: dummy weights) and OUT/drafter (config and random
    bf16 safetensors, unless ``weights`` is false: configs only, for config checks); an
    existing drafter with the same config is kept."""
    from safetensors.torch import save_file

    target, drafter = out / "target", out / "drafter"
    if shape.hybrid is not None:
        make_hybrid(out, seed, arch=shape.hybrid)
        return target, drafter
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(target, shape.vocab_size)
    eos = ids["<|im_end|>"]
    mask = shape.mask_token_id if shape.mask_token_id is not None else ids["<|mask|>"]
    common = dict(max_position_embeddings=40960, torch_dtype="bfloat16",
                  use_sliding_window=False, sliding_window=None)
    (target / "config.json").write_text(json.dumps(
        qwen3_config(shape.target, shape.vocab_size, eos, **common), indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    config = json.dumps(qwen3_config(
        shape.drafter, shape.vocab_size, eos, **common, architectures=["DFlashDraftModel"],
        block_size=shape.block_size, num_target_layers=shape.target["num_hidden_layers"],
        dflash_config={"mask_token_id": mask, "target_layer_ids": shape.target_layer_ids}),
        indent=2)
    if not weights:
        (drafter / "config.json").write_text(config)
        return target, drafter
    weights_file = drafter / "model.safetensors"
    if weights_file.exists() and (drafter / "config.json").exists() \
            and (drafter / "config.json").read_text() == config:
        return target, drafter
    # About 2 GB at 8B shapes: drawn on the GPU (seconds), only the bf16 copy on the host.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    h, dh = shape.target["hidden_size"], shape.drafter["hidden_size"]
    tensors: dict[str, torch.Tensor] = {}
    with torch.device(device):
        parts = [{"fc.weight": torch.randn(dh, h * len(shape.target_layer_ids),
                                           generator=gen) * 0.02,
                  "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(dh)}]
        parts += [layer_weights(f"layers.{n}", shape.drafter, gen)
                  for n in range(shape.drafter["num_hidden_layers"])]
        for part in parts:
            tensors |= {k: v.to(torch.bfloat16).cpu() for k, v in part.items()}
            part.clear()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    (drafter / "config.json").write_text(config)
    return target, drafter


def prompts(target: Path, count: int, length: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids, cut from the tokenizer's corpus."""
    from make_tiny_models import corpus_files
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    ids = tok("".join(p.read_text() for p in corpus_files()))["input_ids"]
    step = max(1, (len(ids) - length) // max(1, count))
    return [ids[i * step:i * step + length] for i in range(count)]


# --- engines ------------------------------------------------------------------------------

def standin() -> tuple[dict, dict[str, str]] | None:
    """The compiled-op stand-in's engine arguments and environment, when asked for."""
    if os.environ.get("VLLM_DDTREE_STANDIN_OPS") != "1":
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # gpu_machine/
    from gpu_machine.standin_ops import STANDIN_ENV, standin_engine_kwargs

    return standin_engine_kwargs(), dict(STANDIN_ENV)


def engine_kwargs(*layers: dict) -> dict:
    """Later layers win; dict values (compilation_config, ...) are merged one level down."""
    out: dict = {}
    for layer in layers:
        for k, v in layer.items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) \
                else v
    return out


def iterations(llm) -> int:
    """Engine steps so far: the count of vLLM's per-step histogram (prefill steps too)."""
    return next((int(m.count) for m in llm.get_metrics()
                 if m.name == "vllm:iteration_tokens_total"), 0)


def step_tokens(mode: Mode) -> int:
    """Tokens one request puts in a verify step at most."""
    spec = mode.spec or {}
    return 1 + spec.get("tree_budget", spec.get("num_speculative_tokens", 0))


def runner_name(llm) -> str:
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
            .model_runner
    except AttributeError:
        return "?"
    return f"{type(runner).__module__}.{type(runner).__qualname__}".removeprefix("vllm.v1.")


def release() -> None:
    """Free what an engine of this process left (it must be unreachable by now): the next
    engine profiles free GPU memory. Harmless where none ran."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def run_mode(args, mode: Mode, target: Path, extra: dict, all_prompts: list[list[int]]
             ) -> dict:
    """One engine; per concurrency a warm-up and --repeats timed passes. Times in seconds:
    startup, teardown, and per concurrency the whole (warm-up + passes)."""
    from vllm import LLM, SamplingParams

    release()  # also after a mode that failed half-way
    cuda = torch.cuda.is_available()
    concs = mode.concurrencies or args.concurrency
    spec = mode.spec
    if spec is not None:  # the drafter's random weights are real files: see write_models
        spec = dict(spec, draft_load_config={"load_format": "auto"})
    kwargs = engine_kwargs(
        {"model": str(target), "load_format": "dummy", "dtype": "bfloat16", "seed": 0,
         "speculative_config": spec, "max_num_seqs": max(concs),
         "max_num_batched_tokens": args.max_num_batched_tokens,
         "max_model_len": args.prompt_len + args.output_len + step_tokens(mode) + 64,
         "enforce_eager": not cuda, "disable_log_stats": False},
        {"gpu_memory_utilization": args.gpu_memory_utilization} if cuda else {},
        extra)
    saved = {k: os.environ.get(k) for k in mode.env}
    os.environ.update(mode.env)
    try:
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    out: dict = {"startup_s": time.perf_counter() - t0, "rows": [], "run_s": {},
                 "runner": runner_name(llm)}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=min(64, args.output_len),
                              ignore_eos=True)
        for conc in concs:
            t1 = time.perf_counter()
            requests = [{"prompt_token_ids": p} for p in all_prompts[:conc]]
            llm.generate(requests, warm, use_tqdm=False)
            before, steps0 = counters(llm), iterations(llm)
            rates, walls = [], []
            for _ in range(args.repeats):
                t2 = time.perf_counter()
                res = llm.generate(requests, params, use_tqdm=False)
                walls.append(time.perf_counter() - t2)
                rates.append(sum(len(r.outputs[0].token_ids) for r in res) / walls[-1])
            after, steps = counters(llm), iterations(llm) - steps0
            drafts = after.get("spec_decode_num_drafts", 0) - before.get(
                "spec_decode_num_drafts", 0)
            accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get(
                "spec_decode_num_accepted_tokens", 0)
            out["rows"].append({
                "concurrency": conc, "tokens_per_s": statistics.median(rates),
                "tokens_per_s_runs": rates, "engine_steps": steps,
                "ms_per_step": 1e3 * sum(walls) / max(1, steps),
                "verify_steps_per_request": drafts / (conc * args.repeats),
                "acceptance_length": 1 + accepted / drafts if drafts else 1.0})
            out["run_s"][conc] = time.perf_counter() - t1
    finally:
        t3 = time.perf_counter()
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        release()
        out["teardown_s"] = time.perf_counter() - t3
    return out


# --- the time budget ----------------------------------------------------------------------

def estimate_s(concurrencies: Sequence[int], done: Sequence[dict]) -> float | None:
    """Seconds a mode should take, from the modes done so far: the longest start-up plus
    teardown seen, plus per concurrency the longest run there (warm-up and timed passes; the
    longest at any concurrency where none ran there). None before any mode ran."""
    if not done:
        return None
    total = max(d["startup_s"] + d.get("teardown_s", 0.0) for d in done)
    longest = max(s for d in done for s in d["run_s"].values())
    for c in concurrencies:
        total += max((d["run_s"][c] for d in done if c in d["run_s"]), default=longest)
    return total


def skip_reason(estimate: float | None, elapsed_s: float, budget_s: float) -> str | None:
    """Why a mode is skipped, or None to run it. The first mode always runs."""
    if estimate is None or elapsed_s + estimate <= budget_s:
        return None
    return (f"time budget: needs about {estimate:.0f} s, {max(0.0, budget_s - elapsed_s):.0f} "
            f"s of {budget_s:.0f} s left")


# --- output -------------------------------------------------------------------------------

def add_speedups(rows: list[dict], chain_mode: str) -> None:
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == "no speculation"}
    chain = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == chain_mode}
    for r in rows:
        c = r["concurrency"]
        r["speedup_vs_none"] = r["tokens_per_s"] / base[c] if c in base else None
        r["speedup_vs_chain"] = r["tokens_per_s"] / chain[c] if c in chain else None


def markdown(report: dict) -> str:
    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v is not None else "-"

    lines = [f"# {report['title']}", "",
             f"- date: {report['date']}", f"- machine: {report['machine']}",
             f"- command: `{report['command']}`",
             f"- {report['note']}", "",
             "| mode | conc. | tok/s | ms/step | accept. length requested / measured | "
             "x none | x chain | start-up s | model runner |", "|" + "---|" * 9]
    for r in report["results"]:
        req = f"{r['requested_acceptance']:.2f}" if r["requested_acceptance"] else "-"
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
            f"{r['ms_per_step']:.2f} | {req} / {r['acceptance_length']:.2f} | "
            f"{x(r['speedup_vs_none'])} | {x(r['speedup_vs_chain'])} | {r['startup_s']:.1f} | "
            f"{r['runner']} |")
    lines += ["", "ms/step: wall time of the timed passes over the engine steps in them "
                  "(vLLM's iteration_tokens_total count, prefill steps included). Measured "
                  "acceptance: 1 + accepted / drafts from vLLM's spec-decode counters."]
    for key, title in (("skipped", "Skipped"), ("failed", "Failed"),
                       ("pending", "Not run (the run was cut short)")):
        if report[key]:
            lines += ["", f"{title}:", ""] + [f"- {m['mode']}: {m['reason']}"
                                              for m in report[key]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        got = {r["concurrency"]: r for r in rows if r["label"] == label}
        xs = [j + (i - (len(labels) - 1) / 2) * width for j, c in enumerate(concs) if c in got]
        cs = [c for c in concs if c in got]
        axes[0].bar(xs, [got[c]["tokens_per_s"] for c in cs], width, label=label)
        axes[1].bar(xs, [got[c]["speedup_vs_none"] or 0 for c in cs], width, label=label)
    for ax, ylabel in zip(axes, ("output tokens/s", "speedup over no speculation")):
        ax.set_xticks(range(len(concs)), [f"conc. {c}" for c in concs])
        ax.set_ylabel(ylabel)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(report["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    name = next((line.split(":", 1)[1].strip() for line in
                 Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor() or "?")
    return f"CPU ({name}, {os.cpu_count()} cores)"


def pair(kind: type, text: str) -> tuple[int, float | int]:
    a, b = text.split(":")
    return int(a), kind(b)


def main() -> int:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--out", type=Path, default=Path("bench-gpu-throughput"))
    parser.add_argument("--models-dir", type=Path, help="default: OUT/models")
    parser.add_argument("--time-budget-s", type=float, default=390.0,
                        help="for the whole run, model writing included")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chain-acceptance", type=float, default=6.9,
                        help="the dflash chain's synthetic acceptance length")
    parser.add_argument("--tree", nargs="*", default=["128:9.19", "64:7.16", "256:9.81"],
                        metavar="B:LENGTH", help="ddtree budgets and their synthetic "
                        "acceptance lengths (default: DDTree's Qwen3-8B MATH-500 numbers)")
    parser.add_argument("--dynamic", nargs="*", default=["64:512"], metavar="B:TOKENS",
                        help="ddtree at budget B with a dynamic schedule keeping verify steps "
                             "near TOKENS tokens, at the largest concurrency only")
    # Ample (the KV cache needed is a few GB), and low enough that an engine whose memory
    # this process failed to release still leaves room for the next one.
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--engine-kwargs", type=json.loads, default={},
                        help="JSON of extra vllm.LLM arguments for every engine")
    args = parser.parse_args()
    args.concurrency = sorted(set(args.concurrency))
    shape = SHAPES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)

    stand_in = standin()
    extra = engine_kwargs(stand_in[0] if stand_in else {}, args.engine_kwargs)
    if stand_in:
        os.environ.update(stand_in[1])
    target, drafter = write_models(args.models_dir or args.out / "models", shape)
    all_prompts = prompts(target, max(args.concurrency), args.prompt_len)
    plan = modes(str(drafter), shape.block_size - 1, args.chain_acceptance,
                 [pair(float, t) for t in args.tree], [pair(int, t) for t in args.dynamic],
                 max(args.concurrency))
    suffix = f", {SYNTHETIC}" + (f", {STANDIN}" if stand_in else "")
    # The same for every mode (vLLM's compile cache keys on it), and room for every step.
    args.max_num_batched_tokens = max(
        8192, *(max(m.concurrencies or args.concurrency) * step_tokens(m) for m in plan))

    title = f"Throughput at {args.shape} shapes, {SYNTHETIC} (random weights)" + (
        f", {STANDIN}" if stand_in else "")
    rows, done, skipped, failed = [], [], [], []

    def save(pending: list[str]) -> str:
        """Written after every mode too: a run killed from outside keeps what it measured."""
        add_speedups(rows, plan[1].name)
        report = {
            "title": title, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "command": shlex.join(sys.argv), "shape": args.shape,
            "standin": bool(stand_in),
            "note": f"{SYNTHETIC}: random weights, drafts accepted at calibrated rates "
                    f"(rejection_sample_method synthetic); greedy, ignore_eos, "
                    f"{args.output_len} output and {args.prompt_len} prompt tokens per "
                    f"request, median of {args.repeats} passes; one engine per mode",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "startup_s": {m["mode"]: m["startup_s"] for m in rows},
            "results": rows, "skipped": skipped, "failed": failed,
            "pending": [{"mode": m, "reason": "not run yet: the run stopped before it"}
                        for m in pending],
            "wall_s": time.perf_counter() - start,
        }
        (args.out / "throughput.json").write_text(json.dumps(report, indent=2))
        table = markdown(report)
        (args.out / "throughput.md").write_text(table)
        if rows and not pending:
            try:
                plot(report, args.out / "throughput.png")
            except ImportError as e:  # a bare GPU machine may lack matplotlib
                print(f"no PNG: {e}", file=sys.stderr)
        return table

    for i, mode in enumerate(plan):
        concs = mode.concurrencies or args.concurrency
        reason = skip_reason(estimate_s(concs, done), time.perf_counter() - start,
                             args.time_budget_s)
        if reason:
            skipped.append({"mode": mode.name, "reason": reason})
            print(f"--- skipped {mode.name}: {reason}", file=sys.stderr, flush=True)
            continue
        print(f"--- {mode.name}", file=sys.stderr, flush=True)
        try:
            got = run_mode(args, mode, target, extra, all_prompts)
        except Exception as e:  # recorded; the next mode gets a fresh engine
            traceback.print_exc()
            failed.append({"mode": mode.name, "reason": f"{type(e).__name__}: {e}"[:2000]})
        else:
            done.append(got)
            for r in got["rows"]:
                rows.append({"mode": mode.name, "label": mode.name + suffix, **r,
                             "requested_acceptance": mode.requested_acceptance,
                             "startup_s": got["startup_s"], "runner": got["runner"],
                             "spec": mode.spec})
                print(f"    conc. {r['concurrency']}: {r['tokens_per_s']:.1f} tok/s, "
                      f"acceptance {r['acceptance_length']:.2f}", file=sys.stderr, flush=True)
            print(f"    start-up {got['startup_s']:.1f} s, teardown {got['teardown_s']:.1f} "
                  f"s, {got['runner']}", file=sys.stderr, flush=True)
        save([m.name for m in plan[i + 1:]])
    print(save([]))
    # The first mode (the baseline every speedup needs) decides the exit status.
    return 0 if rows and rows[0]["mode"] == plan[0].name else 1

if __name__ == "__main__":
    sys.exit(main())
