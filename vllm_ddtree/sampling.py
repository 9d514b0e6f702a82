"""Sampling on the tree path: the target's choice at every node, and which request
parameters the tree path honours.

Lossless sampling needs no draft probabilities (the drafts are deterministic top-k): the
target samples independently at every node with the request's own temperature / top-k /
top-p (and seed), and the walk follows the sample; the first sample with no matching child
is the bonus token. Each emitted token is thus a sample of the target given the accepted
prefix, exactly as without speculation. Before choosing, each node's logits get what vLLM's
sampler applies, in its order (allowed_token_ids, bad_words, min_tokens, penalties; then,
for sampling, temperature and top-k / top-p), with the node's path below the root counted
as output, as a chain position counts the drafts before it. Logprobs come from the
target's raw logits at the node that chose each token (DDTreeState.verify); n > 1 reaches
the engine as n separate requests; structured-output requests are verified as chains
(DDTreeProposer._greedy_chains), with vLLM's grammar masks. Parameters the tree path does
not apply (thinking budget; min_p and logit_bias, which vLLM refuses for every speculative
method) or that force or score other tokens are refused per
request with an error naming the parameter (an HTTP 400), while the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch

# (parameter, value that means "unused"): anything else is refused on the tree path.
UNSUPPORTED = (
    ("min_p", 0.0), ("logit_bias", None),  # vLLM refuses these for all speculative methods
    ("thinking_token_budget", None),
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


class MinTokens(NamedTuple):
    """Requests with min_tokens this step: ``rows`` (batch row, stop token ids) and ``left``
    (on the device, per request: tokens still to emit before a stop token may end the
    output; <= 0 once min_tokens is reached)."""

    rows: list[tuple[int, Collection[int]]]
    left: torch.Tensor


def process_node_logits(logits: torch.Tensor, request: torch.Tensor,
                        node_depth: Callable[[], torch.Tensor],
                        path_tokens: Callable[[], torch.Tensor], num_reqs: int,
                        sampling_metadata: Any, min_tokens: MinTokens | None) -> torch.Tensor:
    """What vLLM's sampler applies to logits before choosing, for one row per tree node:
    ``request`` is each row's request (batch row); ``node_depth()`` each row's node depth and
    ``path_tokens()`` its tokens below the root, the node's own first, then its parent's, ...
    (-1 where none), both asked for only when needed. Returns ``logits`` itself when nothing
    applies, else a float32 copy."""
    sm = sampling_metadata
    if (sm.no_penalties and sm.allowed_token_ids_mask is None and min_tokens is None
            and not sm.bad_words_token_ids):
        return logits
    processed = logits.to(torch.float32, copy=True)
    depth = node_depth() if sm.bad_words_token_ids or min_tokens is not None else None
    path = path_tokens() if sm.bad_words_token_ids or not sm.no_penalties else None
    if sm.allowed_token_ids_mask is not None:
        processed.masked_fill_(sm.allowed_token_ids_mask[request], float("-inf"))
    if sm.bad_words_token_ids:
        _mask_bad_words(processed, request, depth, path, num_reqs, sm)
    if min_tokens is not None:
        _mask_stop_tokens(processed, request, depth, min_tokens)
    if not sm.no_penalties:
        _apply_penalties(processed, request, path, num_reqs, sm)
    return processed


def _mask_bad_words(logits: torch.Tensor, request: torch.Tensor, depth: torch.Tensor,
                    path: torch.Tensor, num_reqs: int, sm: Any) -> None:
    """A bad word's last token is banned at a node whose history (output, then path) ends
    with the word's other tokens, as vLLM bans it after the output and drafts so far."""
    from vllm.utils.torch_utils import async_tensor_h2d

    dev = logits.device
    words = [(r, w) for r, ws in sm.bad_words_token_ids.items() if r < num_reqs for w in ws]
    longest = max(len(w) for _, w in words) - 1  # prefix tokens to compare, at most
    # The last `longest` output tokens of each request, newest first (-1: none).
    tails = [[-1] * longest for _ in range(num_reqs)]
    for r, _ in words:
        recent = sm.output_token_ids[r][::-1][:longest]
        tails[r][:len(recent)] = recent
    # History newest first: k-th token back is on the path while k < depth, else output.
    back = torch.arange(longest, device=dev)
    from_path = torch.nn.functional.pad(path[:, :longest], (0, longest - path[:, :longest]
                                                           .shape[1]), value=-1)
    out_at = (back - depth[:, None]).clamp(min=0, max=max(longest - 1, 0))
    output = async_tensor_h2d(tails, dev, torch.int64)[request]
    history = torch.where(back < depth[:, None], from_path, output.gather(1, out_at))
    # Each word: its request, its prefix newest first (-2: matches anything), last token.
    owner = async_tensor_h2d([r for r, _ in words], dev, torch.int64)
    prefix = async_tensor_h2d([w[-2::-1] + [-2] * (longest + 1 - len(w)) for _, w in words],
                              dev, torch.int64)
    last = async_tensor_h2d([w[-1] for _, w in words], dev, torch.int64)
    hit = (request[:, None] == owner) & ((prefix == -2) | (history[:, None, :] == prefix)
                                         ).all(dim=-1)
    _ban(logits, hit, last)


def _ban(logits: torch.Tensor, hit: torch.Tensor, tokens: torch.Tensor) -> None:
    """Token ``tokens[j]`` to -inf at the rows where ``hit[:, j]``: [rows, entries], never a
    [rows, vocab] mask."""
    banned = torch.where(hit, float("-inf"), float("inf"))
    logits.scatter_reduce_(1, tokens.expand_as(hit), banned, reduce="amin")


def _mask_stop_tokens(logits: torch.Tensor, request: torch.Tensor, depth: torch.Tensor,
                      min_tokens: MinTokens) -> None:
    """Stop tokens out while the output plus the node's depth is under min_tokens."""
    from vllm.utils.torch_utils import async_tensor_h2d

    dev = logits.device
    owner = async_tensor_h2d([r for r, stop_ids in min_tokens.rows for _ in stop_ids], dev,
                             torch.int64)
    stops = async_tensor_h2d([t for _, stop_ids in min_tokens.rows for t in stop_ids], dev,
                             torch.int64)
    short = depth < min_tokens.left[request]
    _ban(logits, (request[:, None] == owner) & short[:, None], stops)


def _apply_penalties(logits: torch.Tensor, request: torch.Tensor, path: torch.Tensor,
                     num_reqs: int, sm: Any) -> None:
    """Presence / frequency / repetition penalties, the path counted as output."""
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.utils.torch_utils import PIN_MEMORY, make_tensor_with_pad

    vocab = logits.shape[-1]
    output = make_tensor_with_pad(sm.output_token_ids[:num_reqs], pad=vocab, device="cpu",
                                  dtype=torch.int64, pin_memory=PIN_MEMORY)
    output = output.to(logits.device, non_blocking=True)
    history = torch.cat([output[request], path.to(torch.int64)], dim=1)
    history.masked_fill_(history < 0, vocab)  # padding, and async scheduling's placeholders
    apply_penalties(logits, sm.prompt_token_ids[request], history,
                    sm.presence_penalties[request], sm.frequency_penalties[request],
                    sm.repetition_penalties[request])


def node_choices(logits: torch.Tensor, request: torch.Tensor, num_sampled: list[int],
                 sampling_metadata: Any) -> torch.Tensor:
    """The target's token at every logits row (one row per tree node): argmax for greedy
    requests, an independent sample from the processed distribution otherwise. ``request``
    is each row's request (on the device); request r owns ``num_sampled[r]`` rows."""
    greedy = logits.argmax(dim=-1)
    if sampling_metadata.all_greedy:
        return greedy
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    sm = sampling_metadata
    temperature = sm.temperature[request]
    # One float32 copy of the logits, then in place: a verify step samples at up to
    # max_num_batched_tokens rows, each as wide as the vocabulary.
    scores = logits.to(torch.float32, copy=True)
    scores.div_(torch.where(temperature > 0, temperature, 1.0)[:, None])
    scores = apply_top_k_top_p(
        scores, None if sm.top_k is None else sm.top_k[request],
        None if sm.top_p is None else sm.top_p[request])
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a sample from p; p need not be
    # normalized (a row's constant factor does not move its argmax). Seeded requests draw
    # their rows from their own generator.
    weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    noise = torch.empty_like(weights).exponential_()
    if sm.generators:
        starts = [0]
        for n in num_sampled:
            starts.append(starts[-1] + n)
        for r, generator in sm.generators.items():
            noise[starts[r]:starts[r + 1]].exponential_(generator=generator)
    sampled = weights.div_(noise).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)
