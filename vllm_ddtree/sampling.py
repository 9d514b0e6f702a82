"""Sampling on the tree path: the target's choice at every node, and which request
parameters the tree path honours.

Lossless sampling needs no draft probabilities (the drafts are deterministic top-k): the
target samples independently at every node with the request's own temperature / top-k /
top-p (and seed), and the walk follows the sample; the first sample with no matching child
is the bonus token. Each emitted token is thus a sample of the target given the accepted
prefix, exactly as without speculation. Before choosing, each node's logits get what vLLM's
sampler applies, in its order (allowed_token_ids, bad_words, min_tokens, penalties; then,
for sampling, temperature and top-k / top-p), with the node's path below the root counted
as output, as a chain position counts the drafts before it. Rows go CHUNK_ROWS at a time
(a step's extra memory is bounded by the chunk, not by its up to max_num_batched_tokens
rows); a seeded request draws the same noise as in one piece. Logprobs come from the
target's raw logits at the node that chose each token (DDTreeState.verify); n > 1 reaches
the engine as n separate requests; structured-output requests are verified as chains
(DDTreeProposer._greedy_chains), with vLLM's grammar masks. Parameters the tree path does
not apply (thinking budget; min_p and logit_bias, which vLLM refuses for every speculative
method) or that force or score other tokens are refused per
request with an error naming the parameter (an HTTP 400), while the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from itertools import accumulate
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


# Node rows are processed and sampled this many at a time. A verify step has up to
# max_num_batched_tokens of them (8,192 for `vllm serve` on a GPU, 16,384 for `LLM`), and
# each full-vocabulary temporary (the float32 copy, vLLM's int64 [rows, V + 1] penalty bin
# counts, the race's noise) would be that tall: 8 to 12 [rows, V] float32 buffers in all,
# 37-55 GiB at 8,190 x 151,936. vLLM sizes the KV cache from a profile run whose sampler
# sees max_num_seqs rows (256 on most GPUs, 1,024 on H100/H200-class ones) and holds bf16
# logits, a float32 copy, probabilities and noise: about 3.5 [max_num_seqs, V] float32
# buffers. On a GPU (top-k / top-p and repetition penalties work in place there) a chunk
# holds about 2 [CHUNK_ROWS, V] float32 buffers sampling, about 6.5 with penalties: at
# V = 151,936 and 256 rows 0.3 / 1.0 GB, against the profile's 0.5 GB at 256 sequences and
# 2.2 GB at 1,024. Smaller chunks mean more kernel launches (about 30 per chunk) for less
# work each.
CHUNK_ROWS = 256


class MinTokens(NamedTuple):
    """Requests with min_tokens this step: ``rows`` (batch row, stop token ids) and ``left``
    (on the device, per request: tokens still to emit before a stop token may end the
    output; <= 0 once min_tokens is reached)."""

    rows: list[tuple[int, Collection[int]]]
    left: torch.Tensor


def node_targets(logits: torch.Tensor, request: torch.Tensor, num_sampled: list[int],
                 node_depth: Callable[[], torch.Tensor],
                 path_tokens: Callable[[], torch.Tensor], sampling_metadata: Any,
                 min_tokens: MinTokens | None) -> torch.Tensor:
    """The target's token at every logits row (one row per tree node): vLLM's logits
    processing (``process_node_logits``), then argmax or a sample (``node_choices``),
    ``CHUNK_ROWS`` rows at a time, so that the step's extra memory is O(CHUNK_ROWS x V).
    ``request`` is each row's request (on the device); request r owns ``num_sampled[r]``
    consecutive rows (host data: the chunks need no device read). ``node_depth()`` gives
    each row's node depth and ``path_tokens()`` its tokens below the root, the node's own
    first, then its parent's, ... (-1 where none), both asked for only when needed."""
    sm = sampling_metadata
    starts = list(accumulate(num_sampled, initial=0))
    rules = _Processing.make(logits, node_depth, path_tokens, len(num_sampled), sm,
                             min_tokens)
    if rules is None and sm.all_greedy:  # an argmax copies nothing: no chunks needed
        return logits.argmax(dim=-1)
    seeded = {} if sm.all_greedy else {r: g for r, g in sm.generators.items()
                                       if r < len(num_sampled)}
    noise = _Noise(starts, seeded, logits.shape[-1], logits.device)
    choices = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for s, e in chunk_ranges(starts, seeded, CHUNK_ROWS):
        chunk = logits[s:e]
        processed = process_node_logits(chunk, request[s:e], slice(s, e), rules, sm)
        choices[s:e] = node_choices(processed, request[s:e], sm, partial(noise, s, e),
                                    owned=processed is not chunk)
    return choices


def chunk_ranges(starts: list[int], seeded: Collection[int], size: int
                 ) -> list[tuple[int, int]]:
    """Row ranges [s, e) of at most ``size`` rows covering ``starts[-1]`` rows, request r
    owning rows starts[r]..starts[r + 1] - 1. A chunk never ends inside a seeded request
    unless that request alone fills it: a seeded request's noise is drawn in one call of
    its generator (``_Noise``), held only while the chunks of one such request run."""
    spans = sorted((starts[r], starts[r + 1]) for r in seeded)
    ranges, s, i = [], 0, 0
    while s < starts[-1]:
        e = min(s + size, starts[-1])
        while i < len(spans) and spans[i][1] <= s:  # seeded requests done
            i += 1
        if i < len(spans) and spans[i][0] <= s:  # inside a seeded request: stay within it
            e = min(e, spans[i][1])
        else:
            j = i
            while j < len(spans) and spans[j][1] <= e:  # seeded requests within the chunk
                j += 1
            if j < len(spans) and spans[j][0] < e:  # would end inside one: stop before it
                e = spans[j][0]
        ranges.append((s, e))
        s = e
    return ranges


class _Noise:
    """Exponential noise for the race, chunk by chunk (float32 [rows, V]; chunks asked in
    row order). Unseeded rows: a fresh draw per chunk, so every node's noise is
    independent. A seeded request's rows: its generator draws all of them in one call, the
    same numbers in the same order as a step in one chunk; where its rows span chunks, that
    block is kept until its last chunk."""

    def __init__(self, starts: list[int], generators: dict[int, torch.Generator], vocab: int,
                 device: torch.device) -> None:
        self.spans = sorted(((starts[r], starts[r + 1], g) for r, g in generators.items()),
                            key=lambda span: span[0])
        self.vocab, self.device = vocab, device
        self.next, self.block = 0, None  # the first span not done, and its block if drawn

    def __call__(self, s: int, e: int) -> torch.Tensor:
        noise = torch.empty(e - s, self.vocab, device=self.device).exponential_()
        while self.next < len(self.spans) and self.spans[self.next][0] < e:
            a, b, generator = self.spans[self.next]
            if s <= a and b <= e:  # within the chunk
                noise[a - s:b - s].exponential_(generator=generator)
            elif b > s:  # rows in several chunks (chunk_ranges: one request at a time)
                if self.block is None:
                    self.block = torch.empty(b - a, self.vocab, device=self.device
                                             ).exponential_(generator=generator)
                lo, hi = max(a, s), min(b, e)
                noise[lo - s:hi - s] = self.block[lo - a:hi - a]
            if b > e:
                break
            self.next, self.block = self.next + 1, None
        return noise


class _Processing(NamedTuple):
    """What a step's node rows get before choosing, its host data moved to the device
    once per step (not once per chunk); per logits row where a field is per row."""

    depth: torch.Tensor | None
    path: torch.Tensor | None
    bad_words: tuple | None
    stops: tuple | None
    penalty_output: torch.Tensor | None

    @classmethod
    def make(cls, logits: torch.Tensor, node_depth: Callable[[], torch.Tensor],
             path_tokens: Callable[[], torch.Tensor], num_reqs: int, sm: Any,
             min_tokens: MinTokens | None) -> _Processing | None:
        if (sm.no_penalties and sm.allowed_token_ids_mask is None and min_tokens is None
                and not sm.bad_words_token_ids):
            return None
        dev = logits.device
        return cls(
            node_depth() if sm.bad_words_token_ids or min_tokens is not None else None,
            path_tokens() if sm.bad_words_token_ids or not sm.no_penalties else None,
            _bad_words_table(sm, num_reqs, dev) if sm.bad_words_token_ids else None,
            None if min_tokens is None else _stops_table(min_tokens, dev),
            None if sm.no_penalties else _penalty_output(sm, num_reqs, logits.shape[-1], dev))


def process_node_logits(logits: torch.Tensor, request: torch.Tensor, rows: slice,
                        rules: _Processing | None, sampling_metadata: Any) -> torch.Tensor:
    """What vLLM's sampler applies to logits before choosing, for rows ``rows`` of a step
    (``logits`` and ``request``, each row's request, are those rows), with each node's
    path below the root counted as output. Returns ``logits`` itself when nothing
    applies, else a float32 copy."""
    sm = sampling_metadata
    if rules is None:
        return logits
    processed = logits.to(torch.float32, copy=True)
    depth = None if rules.depth is None else rules.depth[rows]
    path = None if rules.path is None else rules.path[rows]
    if sm.allowed_token_ids_mask is not None:
        processed.masked_fill_(sm.allowed_token_ids_mask[request], float("-inf"))
    if rules.bad_words is not None:
        _mask_bad_words(processed, request, depth, path, rules.bad_words)
    if rules.stops is not None:
        _mask_stop_tokens(processed, request, depth, rules.stops)
    if rules.penalty_output is not None:
        _apply_penalties(processed, request, path, rules.penalty_output, sm)
    return processed


def _bad_words_table(sm: Any, num_reqs: int, dev: torch.device) -> tuple:
    """The bad words of a step, on the device: (the last ``longest`` output tokens per
    request, newest first, -1: none; each word's request; its prefix newest first, -2:
    matches anything; its last token)."""
    from vllm.utils.torch_utils import async_tensor_h2d

    words = [(r, w) for r, ws in sm.bad_words_token_ids.items() if r < num_reqs for w in ws]
    longest = max(len(w) for _, w in words) - 1  # prefix tokens to compare, at most
    tails = [[-1] * longest for _ in range(num_reqs)]
    for r, _ in words:
        recent = sm.output_token_ids[r][::-1][:longest]
        tails[r][:len(recent)] = recent
    return (async_tensor_h2d(tails, dev, torch.int64),
            async_tensor_h2d([r for r, _ in words], dev, torch.int64),
            async_tensor_h2d([w[-2::-1] + [-2] * (longest + 1 - len(w)) for _, w in words],
                             dev, torch.int64),
            async_tensor_h2d([w[-1] for _, w in words], dev, torch.int64))


def _mask_bad_words(logits: torch.Tensor, request: torch.Tensor, depth: torch.Tensor,
                    path: torch.Tensor, table: tuple) -> None:
    """A bad word's last token is banned at a node whose history (output, then path) ends
    with the word's other tokens, as vLLM bans it after the output and drafts so far."""
    tails, owner, prefix, last = table
    longest = tails.shape[1]
    # History newest first: k-th token back is on the path while k < depth, else output.
    back = torch.arange(longest, device=logits.device)
    from_path = torch.nn.functional.pad(path[:, :longest], (0, longest - path[:, :longest]
                                                           .shape[1]), value=-1)
    out_at = (back - depth[:, None]).clamp(min=0, max=max(longest - 1, 0))
    history = torch.where(back < depth[:, None], from_path, tails[request].gather(1, out_at))
    hit = (request[:, None] == owner) & ((prefix == -2) | (history[:, None, :] == prefix)
                                         ).all(dim=-1)
    _ban(logits, hit, last)


def _ban(logits: torch.Tensor, hit: torch.Tensor, tokens: torch.Tensor) -> None:
    """Token ``tokens[j]`` to -inf at the rows where ``hit[:, j]``: [rows, entries], never a
    [rows, vocab] mask."""
    banned = torch.where(hit, float("-inf"), float("inf"))
    logits.scatter_reduce_(1, tokens.expand_as(hit), banned, reduce="amin")


def _stops_table(min_tokens: MinTokens, dev: torch.device) -> tuple:
    """(each stop token's request, the stop token, tokens left per request) on the device."""
    from vllm.utils.torch_utils import async_tensor_h2d

    rows = min_tokens.rows
    return (async_tensor_h2d([r for r, stop_ids in rows for _ in stop_ids], dev, torch.int64),
            async_tensor_h2d([t for _, stop_ids in rows for t in stop_ids], dev, torch.int64),
            min_tokens.left)


def _mask_stop_tokens(logits: torch.Tensor, request: torch.Tensor, depth: torch.Tensor,
                      table: tuple) -> None:
    """Stop tokens out while the output plus the node's depth is under min_tokens."""
    owner, stops, left = table
    short = depth < left[request]
    _ban(logits, (request[:, None] == owner) & short[:, None], stops)


def _penalty_output(sm: Any, num_reqs: int, vocab: int, dev: torch.device) -> torch.Tensor:
    """Each request's output so far, padded with ``vocab`` (vLLM's padding id), on the
    device."""
    from vllm.utils.torch_utils import PIN_MEMORY, make_tensor_with_pad

    output = make_tensor_with_pad(sm.output_token_ids[:num_reqs], pad=vocab, device="cpu",
                                  dtype=torch.int64, pin_memory=PIN_MEMORY)
    return output.to(dev, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, request: torch.Tensor, path: torch.Tensor,
                     output: torch.Tensor, sm: Any) -> None:
    """Presence / frequency / repetition penalties, the path counted as output."""
    from vllm.model_executor.layers.utils import apply_penalties

    history = torch.cat([output[request], path.to(torch.int64)], dim=1)
    history.masked_fill_(history < 0, logits.shape[-1])  # padding, async's placeholders
    apply_penalties(logits, sm.prompt_token_ids[request], history,
                    sm.presence_penalties[request], sm.frequency_penalties[request],
                    sm.repetition_penalties[request])


def node_choices(logits: torch.Tensor, request: torch.Tensor, sampling_metadata: Any,
                 noise: Callable[[], torch.Tensor], owned: bool = False) -> torch.Tensor:
    """The target's token at each of these logits rows: argmax for greedy requests, an
    independent sample from the processed distribution otherwise. ``request`` is each
    row's request (on the device), ``noise()`` the rows' Exp(1) noise (float32 [rows, V]),
    asked for only when sampling; ``owned``: ``logits`` is a float32 copy that may be
    overwritten."""
    greedy = logits.argmax(dim=-1)
    sm = sampling_metadata
    if sm.all_greedy:
        return greedy
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    temperature = sm.temperature[request]
    # At most one float32 copy of the logits, then in place.
    scores = logits if owned else logits.to(torch.float32, copy=True)
    scores.div_(torch.where(temperature > 0, temperature, 1.0)[:, None])
    scores = apply_top_k_top_p(
        scores, None if sm.top_k is None else sm.top_k[request],
        None if sm.top_p is None else sm.top_p[request])
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a sample from p; p need not be
    # normalized (a row's constant factor does not move its argmax).
    weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    sampled = weights.div_(noise()).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)
