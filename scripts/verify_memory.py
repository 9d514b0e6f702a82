"""Peak extra memory of a verify step's node sampling and logprobs, on CPU.

A synthetic step of ``--rows`` logits rows (requests of ``--nodes`` rows each, the last one
shorter) over a vocabulary of ``--vocab``, every request sampled at Qwen3's defaults
(temperature 0.6, top-k 20, top-p 0.95; one request seeded), optionally with presence /
frequency / repetition penalties, then the emitted tokens' logprobs (``--depth`` + 1 per
request). Prints one JSON line: ``peak_extra_bytes`` is the process's peak resident memory
during the call minus its resident memory just before (the logits already resident), read
from Linux's VmHWM after resetting it through /proc/self/clear_refs (tracemalloc would not
see torch's allocations). torch's CPU allocator has no cache: glibc serves large blocks by
mmap and returns them on free, so resident memory follows what torch holds. Blocks under
glibc's mmap threshold (up to 32 MiB, dynamic) stay in its heap, where freed space may stay
resident: with a small vocabulary, set MALLOC_MMAP_THRESHOLD_ (bytes) lower.

    python scripts/verify_memory.py --rows 8190 --vocab 151936 --penalties
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from types import SimpleNamespace

import torch


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(rows: int, vocab: int, nodes: int = 91, depth: int = 15, penalties: bool = False,
            chunk_rows: int | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Peak extra memory (bytes) of node_targets and the logprobs of one synthetic step."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree import ops, sampling
    from vllm_ddtree.runner import DDTreeState

    if chunk_rows is not None:
        sampling.CHUNK_ROWS = chunk_rows
    num_sampled = [nodes] * (rows // nodes) + ([rows % nodes] if rows % nodes else [])
    R = len(num_sampled)
    request = torch.repeat_interleave(torch.arange(R), torch.tensor(num_sampled))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)

    def per_request(value, dt=torch.float32):
        return torch.full((R,), value, dtype=dt)

    sm = SimpleNamespace(
        all_greedy=False, temperature=per_request(0.6), top_k=per_request(20, torch.int32),
        top_p=per_request(0.95), generators={min(1, R - 1): torch.Generator().manual_seed(5)},
        no_penalties=not penalties, allowed_token_ids_mask=None, bad_words_token_ids={},
        output_token_ids=[torch.randint(0, vocab, (300,), generator=gen).tolist()
                          for _ in range(R)],
        prompt_token_ids=torch.randint(0, vocab, (R, 500), generator=gen),
        presence_penalties=per_request(0.5), frequency_penalties=per_request(0.3),
        repetition_penalties=per_request(1.2))
    node_depth = torch.randint(0, depth + 1, (rows,), generator=gen)
    path = torch.randint(0, vocab, (rows, depth), generator=gen)
    # Each request accepts its first min(depth, nodes - 1) nodes: logprobs at every position.
    first_row = torch.tensor([0, *num_sampled[:-1]]).cumsum(0)
    reach = torch.arange(1, depth + 1)
    accepted = torch.where(reach < torch.tensor(num_sampled)[:, None], reach, -1).int()
    verdict = ops.Verdict(accepted, (accepted > 0).sum(1).int(),
                          torch.randint(0, vocab, (R, depth + 1), generator=gen))
    state = SimpleNamespace(runner=SimpleNamespace(sampler=Sampler("raw_logprobs")))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before, start = _status("VmRSS:"), time.time()
    choices = sampling.node_targets(logits, request, num_sampled, lambda: node_depth,
                                    lambda: path, sm, None)
    logprobs = DDTreeState._logprobs(state, logits, first_row, verdict, 5)
    peak = _status("VmHWM:") - before
    del choices, logprobs
    return dict(rows=rows, vocab=vocab, nodes=nodes, depth=depth, penalties=penalties,
                chunk_rows=sampling.CHUNK_ROWS, dtype=str(dtype).removeprefix("torch."),
                seconds=round(time.time() - start, 1), peak_extra_bytes=peak,
                logits_bytes=logits.nbytes, chunk_buffer_bytes=sampling.CHUNK_ROWS * vocab * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8190)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--nodes", type=int, default=91, help="rows per request (budget + 1)")
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--penalties", action="store_true")
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="override sampling.CHUNK_ROWS (e.g. --rows: one chunk, as before)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    print(json.dumps(measure(args.rows, args.vocab, args.nodes, args.depth, args.penalties,
                             args.chunk_rows, getattr(torch, args.dtype))))


if __name__ == "__main__":
    main()
