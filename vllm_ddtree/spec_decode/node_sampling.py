"""A verify step's node sampling and logprobs, in chunks of rows.

V2's sampler processes every row it is given at once: an fp32 copy of the logits, then
penalties, temperature, top-k / top-p (a sort on CPU: values, indices, probabilities) and
the Gumbel draw each add [rows, vocab] tensors. A verify step has budget + 1 rows a request
(780 at 12 requests and budget 64; up to max_num_batched_tokens), so its peak grew
with the tree, to about 3.8 MB a row at Qwen3's vocabulary on CPU. Here the rows go through
the sampler a chunk at a time, so that only the logits grow with the step.

Chunking leaves every row's draw as it was: each of V2's processing stages and the Gumbel
draw (keyed by the request's seed and the row's position) work row by row, given the row's
request. The one reach across rows is the processing of a request that counts the drafts
before a row as its history (penalties, bad words, a thinking budget: such a request drafts
a chain, TreeStore.chain_only): those kernels read the request's earlier rows by offset,
so a request's first ``head`` rows (its chain, depth + 1) always share a chunk. Its later
rows are never on an accepted path: the caller gives them no history. (Where V2's fused
FlashInfer sampler is on, it is chosen per call: a chunk without greedy or seeded rows may
use it where one call for all rows would not; it draws for unseeded requests only.)

``profile_verify_step`` runs a step of the engine's most verify rows through the same
path, from the ModelState's hook into V2's start-up memory profile (model_state.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Logits elements a chunk processes (rows = this // vocab): 2**24 is 64 MiB of fp32, about
# 110 rows at Qwen3's vocabulary of 151,936 (docs/benchmarks.md). On CPU a chunk's fp32
# tensors stay above glibc's largest mmap threshold (32 MiB), so each is unmapped when
# freed: at 2**23 the engine's peak was higher (measured once: 1,061 MB against 858).
CHUNK_ELEMENTS = 1 << 24


def rows_a_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def chunk_bounds(cu_num_logits: np.ndarray, chunk_rows: int, head: int
                 ) -> list[tuple[int, int]]:
    """The chunks' row ranges [start, end): consecutive, of at most max(chunk_rows, head)
    rows; a request's first ``head`` rows are never split."""
    size, total = max(chunk_rows, head), int(cu_num_logits[-1])
    if total <= size:  # one chunk: no walk over the requests
        return [(0, total)]
    bounds = [0]
    for start, end in zip(cu_num_logits[:-1].tolist(), cu_num_logits[1:].tolist()):
        if min(end, start + head) - bounds[-1] > size:
            bounds.append(start)  # the head would straddle: the chunk ends before it
        while end - bounds[-1] > size:
            bounds.append(bounds[-1] + size)
    if bounds[-1] != total:
        bounds.append(total)
    return list(zip(bounds[:-1], bounds[1:]))


def sample_nodes(sampler: Any, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor,
                 idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray,
                 cu_num_logits_np: np.ndarray, pos: torch.Tensor, input_ids: torch.Tensor,
                 local_pos: torch.Tensor, seq_lens_np: np.ndarray, head: int,
                 chunk_rows: int | None = None) -> torch.Tensor:
    """``sampler.sample`` of every row (V2's Sampler; per-row arguments as it takes them),
    a chunk of rows at a time: the sampled token of each row, [rows]."""
    chunk_rows = chunk_rows or rows_a_chunk(logits.shape[1])
    cu = cu_num_logits_np
    out = []
    for start, end in chunk_bounds(cu, chunk_rows, head):
        # The requests with rows in the chunk (a long request's later rows span chunks).
        first = int(np.searchsorted(cu, start, side="right")) - 1
        last = int(np.searchsorted(cu, end, side="left"))
        # [0] alone: the chunk's processed logits are freed before the next chunk.
        out.append(sampler.sample(
            logits[start:end], expanded_idx_mapping[start:end], idx_mapping[first:last],
            idx_mapping_np[first:last], pos[start:end], input_ids[start:end],
            local_pos[start:end], seq_lens_np[first:last])[0])
    return out[0] if len(out) == 1 else torch.cat(out)


def topk_scores(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                num_logprobs: int, cu_num_logits: list[int], expanded_idx_mapping: torch.Tensor,
                sampler: Any, max_per_req_token_ids: int, logits_mode: bool,
                chunk_rows: int | None = None) -> Any:
    """V2's ``compute_topk_scores`` of ``logits[rows]`` (logprobs of ``token_ids`` and the
    top ``num_logprobs``, row by row), gathering a chunk of rows at a time instead of a
    copy of them all."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    chunk_rows = chunk_rows or rows_a_chunk(logits.shape[1])
    parts = []
    for start in range(0, rows.shape[0], chunk_rows):
        end = min(start + chunk_rows, rows.shape[0])
        parts.append(compute_topk_scores(
            logits[rows[start:end]], num_logprobs, token_ids[start:end],
            logprob_token_ids_state=sampler.logprob_token_ids_state,
            expanded_idx_mapping=expanded_idx_mapping[start:end],
            max_per_req_token_ids=max_per_req_token_ids, logits_mode=logits_mode))
    if len(parts) == 1:
        return parts[0]._replace(cu_num_generated_tokens=cu_num_logits)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([p.logprob_token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        selected_token_ranks=torch.cat([p.selected_token_ranks for p in parts]),
        cu_num_generated_tokens=cu_num_logits)


def max_verify_rows(vllm_config: Any, budget: int) -> int:
    """Logits rows of the engine's largest verify step: every scheduled token is at most a
    row, and a request has at most budget + 1."""
    sched = vllm_config.scheduler_config
    return min(sched.max_num_batched_tokens, sched.max_num_seqs * (budget + 1))


@torch.inference_mode()
def profile_verify_step(sampler: Any, model: Any, hidden_states: torch.Tensor, rows: int,
                        budget: int, head: int, processing: bool) -> None:
    """A verify step's sampling at ``rows`` logits rows (requests of budget + 1 rows, the
    last one shorter), for V2's start-up memory profile: the logits, then the node
    sampling and logprobs, chunk by chunk, as a step computes them. ``processing``: with
    sampling parameters that use every stage (vLLM's own warm-up parameters: penalties,
    top-k and top-p, logprobs), set on the dummy requests' slots and reset after."""
    from vllm.sampling_params import SamplingParams

    dev = hidden_states.device
    nodes = budget + 1
    num_reqs = -(-rows // nodes)
    cu = np.minimum(np.arange(num_reqs + 1, dtype=np.int32) * nodes, rows).astype(np.int32)
    idx_mapping_np = np.arange(num_reqs, dtype=np.int32)
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32, device=dev)
    expanded = torch.arange(rows, device=dev).div(nodes, rounding_mode="floor").int()
    local = torch.arange(rows, device=dev).remainder(nodes).int()
    seq_lens_np = np.full(num_reqs, nodes, dtype=np.int32)
    if processing:
        for slot in range(num_reqs):
            sampler.add_request(slot, SamplingParams.for_sampler_warmup())
        sampler.apply_staged_writes()
    try:
        # The step's hidden states of its logits rows; any values will do.
        which = torch.arange(rows, device=dev).remainder(hidden_states.shape[0])
        logits = model.compute_logits(hidden_states[which])
        sampled = sample_nodes(sampler, logits, expanded, idx_mapping, idx_mapping_np, cu,
                               local.long(), torch.zeros_like(local), torch.zeros_like(local),
                               seq_lens_np, head)
        dims = sampler.get_logprobs_dims(idx_mapping_np)
        if dims is not None:
            topk_scores(logits, torch.arange(rows, device=dev), sampled, dims[0], cu.tolist(),
                        expanded, sampler, dims[1], logits_mode=False)
    finally:
        if processing:  # the slots as fresh: the profile's own passes expect them so
            for slot in range(num_reqs):
                sampler.add_request(slot, SamplingParams(temperature=0.0))
            sampler.apply_staged_writes()
