"""Sampling on the tree path: the target's choice at every node, and which request
parameters the tree path honours.

Lossless sampling needs no draft probabilities (the drafts are deterministic top-k): the
target samples independently at every node with the request's own temperature / top-k /
top-p (and seed), and the walk follows the sample; the first sample with no matching child
is the bonus token. Each emitted token is thus a sample of the target given the accepted
prefix, exactly as without speculation. Before choosing, the logits get what vLLM's sampler
applies (allowed_token_ids; penalties, counting each node's path as output), and logprobs
come from the target's logits at the node where each token was chosen (both in
DDTreeState.verify); n > 1 reaches the engine as n separate requests. Parameters applied
by logits processors the tree path does not run, or that force or score other tokens, are
refused per request with an error naming the parameter (an HTTP 400), while the server keeps
serving.
"""

from __future__ import annotations

from typing import Any

import torch

# (parameter, value that means "unused"): anything else is refused on the tree path.
UNSUPPORTED = (
    ("min_p", 0.0), ("min_tokens", 0), ("logit_bias", None), ("bad_words", None),
    ("structured_outputs", None), ("thinking_token_budget", None),
    ("logprob_token_ids", None), ("trace_decode_token_ids", None),
)


def validate_request(params: Any) -> None:
    """Refuse, naming it, a sampling parameter the tree path does not honour."""
    from vllm.exceptions import VLLMValidationError

    for name, unused in UNSUPPORTED:
        value = getattr(params, name, unused)
        if value != unused and not (value == [] or value == {}):
            raise VLLMValidationError(
                f"{name}={value!r} is not supported with speculative method 'ddtree' (tree "
                f"verification does not apply it); leave {name} unset", parameter=name,
                value=value)


def node_choices(logits: torch.Tensor, num_sampled: list[int], cu_num_sampled: torch.Tensor,
                 sampling_metadata: Any) -> torch.Tensor:
    """The target's token at every logits row (one row per tree node): argmax for greedy
    requests, an independent sample from the processed distribution otherwise. Request r
    owns ``num_sampled[r]`` rows; ``cu_num_sampled`` is their cumulative sum on the device."""
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    # Each row's request, computed on the device (no host data, so no sync).
    rows = torch.arange(logits.shape[0], device=logits.device)
    request = torch.searchsorted(cu_num_sampled.to(rows.dtype), rows, right=True)
    sm = sampling_metadata
    temperature = sm.temperature[request]
    processed = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    processed = apply_top_k_top_p(
        processed, None if sm.top_k is None else sm.top_k[request],
        None if sm.top_p is None else sm.top_p[request])
    probs = processed.softmax(dim=-1, dtype=torch.float32)
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a sample from p. Seeded requests
    # draw their rows from their own generator.
    noise = torch.empty_like(probs).exponential_()
    starts = [0]
    for n in num_sampled:
        starts.append(starts[-1] + n)
    for r, generator in sm.generators.items():
        noise[starts[r]:starts[r + 1]].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)
