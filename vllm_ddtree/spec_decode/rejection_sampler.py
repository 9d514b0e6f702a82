"""The tree rejection sampler: one frozen record in (``TreeVerifyInput``), one out
(``TreeVerifyOutput``), as V2 keeps its rejection sampler apart and SGLang hands
``EagleVerifyInput`` / ``EagleVerifyOutput`` between stages.

The target's choice at every node comes from V2's own sampler (greedy, or a sample keyed by
the node's position: nodes of one depth share a draw, and a path visits one node per depth,
so the emitted tokens are the target's own samples), a chunk of rows at a time
(node_sampling.py). The walk (``verify_tree``) follows the choices down each tree; the
emitted tokens' logprobs are laid out as V2's rejection sampler lays them. Trace replay
(``--enable-trace-replay``) makes a node's choice the request's trace token for its depth;
synthetic acceptance (benchmarking only) overrides the choices along a drawn path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_ddtree import ops
from vllm_ddtree.spec_decode import node_sampling
from vllm_ddtree.spec_decode.tree_store import TreeStore
from vllm_ddtree.synthetic import SyntheticAcceptance


@dataclass(frozen=True)
class TreeStep:
    """A verify step's rows, as ``begin_step`` finds them (before the forward)."""

    rows: torch.Tensor  # [num_logits] the logits rows' token rows
    delta: torch.Tensor  # [num_logits] tree position - chain position of each of them
    chain_rows: torch.Tensor  # [num_logits] whether a row's request drafted a chain


@dataclass(frozen=True)
class TreeVerifyInput:
    step: TreeStep
    logits: torch.Tensor  # [num_logits, vocab]
    batch: Any  # V2's InputBatch of the step
    trees: TreeStore  # the step's trees, by request-state slot (batch.idx_mapping)


@dataclass(frozen=True)
class TreeVerifyOutput:
    verdict: ops.Verdict
    roots: torch.Tensor  # [R + 1] each request's root row, then num_tokens
    logprobs: Any  # V2's LogprobsTensors, or None
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor
    num_nans: torch.Tensor | None

    def sampler_output(self) -> Any:
        """What V2's runner takes from a rejection sampler."""
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        return SamplerOutput(sampled_token_ids=self.verdict.output_tokens,
                             logprobs_tensors=self.logprobs, num_nans=self.num_nans,
                             num_sampled=self.num_sampled, num_rejected=self.num_rejected)


class TreeRejectionSampler:
    def __init__(self, sampler: Any, budget: int, max_depth: int,
                 synthetic: SyntheticAcceptance | None, device: torch.device) -> None:
        self.sampler, self.max_depth, self.synthetic = sampler, max_depth, synthetic
        self._node = torch.arange(budget + 1, device=device)

    def __call__(self, inp: TreeVerifyInput) -> TreeVerifyOutput:
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

        step, logits, batch, sampler = inp.step, inp.logits, inp.batch, self.sampler
        num_nans = None
        if sampler.compute_nans:
            from vllm.v1.worker.gpu.metrics.logits import get_num_nans

            num_nans = get_num_nans(logits)
        ids = batch.input_ids[step.rows]
        # vLLM's processing counts the drafts before a row as its history: right for a
        # chain; a tree's node is processed on the committed history alone, which is
        # exact for the processing a tree request may have (TreeStore.chain_only). A
        # chain's rows past its depth are never accepted: no history, so that chunks of
        # rows (node_sampling) keep only a chain's first depth + 1 together.
        local = batch.expanded_local_pos
        choice = node_sampling.sample_nodes(
            sampler, logits, batch.expanded_idx_mapping, batch.idx_mapping,
            batch.idx_mapping_np, batch.cu_num_logits_np, batch.positions[step.rows], ids,
            torch.where(step.chain_rows & (local <= self.max_depth), local, 0),
            _host_seq_lens(batch), head=self.max_depth + 1)
        # Per request, its nodes in order (root first); -1 past a request's nodes.
        cu = batch.cu_num_logits.long()
        at = cu[:-1, None] + self._node
        valid = self._node < (cu[1:] - cu[:-1])[:, None]
        at = at.clamp(max=logits.shape[0] - 1)
        token_ids = torch.where(valid, ids[at].long(), -1)
        choices = torch.where(valid, choice[at].long(), -1)
        slots, trees = batch.idx_mapping, inp.trees
        if sampler.trace_replay_state is not None:
            choices = self._replayed(choices, slots, trees.depths[slots])
        first_child = trees.first_child[slots]
        if self.synthetic is not None:  # a drawn path is accepted, not the target's
            choices, first_child = self.synthetic.override(
                choices, token_ids, trees.parents[slots], trees.depths[slots], first_child,
                valid)
        verdict = ops.Verdict(*torch.ops.vllm_ddtree.verify_tree(
            token_ids, first_child, trees.next_sibling[slots], choices, self.max_depth))
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (verdict.num_accepted + 1).to(torch.int32), batch.seq_lens,
            batch.cu_num_logits, batch.idx_mapping, sampler.req_states.prefill_len.gpu)
        roots = torch.cat([step.rows[cu[:-1]], step.rows.new_full((1,), batch.num_tokens)])
        return TreeVerifyOutput(verdict, roots, self._logprobs(logits, batch, verdict, cu),
                                num_sampled, num_rejected, num_nans)

    def _replayed(self, choices: torch.Tensor, slots: torch.Tensor,
                  depths: torch.Tensor) -> torch.Tensor:
        """Trace replay (--enable-trace-replay; a request's ``trace_decode_token_ids``):
        a node at depth d chooses the trace's token for output position step + d, where
        ``step`` tokens are committed so far, so the walk accepts the nodes that match the
        trace and emits the trace; logprobs stay the target's own. Past the trace, the
        target's choice."""
        state = self.sampler.trace_replay_state
        slots = slots.long()
        req = state.req_states
        step = (req.total_len.gpu[slots] - req.prompt_len.gpu[slots]).long()
        out = step[:, None] + depths.long()  # [R, N] output positions
        trace = state.trace_token_ids.gpu
        replayed = (choices >= 0) & (out < state.trace_len.gpu[slots].long()[:, None])
        forced = trace[slots[:, None], out.clamp(0, trace.shape[1] - 1)].long()
        return torch.where(replayed, forced, choices)

    def _logprobs(self, logits: torch.Tensor, batch: Any, verdict: ops.Verdict,
                  cu: torch.Tensor) -> Any:
        """Logprobs of the emitted tokens, laid out as V2's rejection sampler lays them
        (row cu[r] + j: request r's token j): token j was chosen at its path's node j - 1
        (the root for j = 0), so its row is that node's logits row."""
        sampler = self.sampler
        dims = sampler.get_logprobs_dims(batch.idx_mapping_np)
        if dims is None:
            return None
        num_logprobs, max_token_ids = dims
        R, width = verdict.output_tokens.shape
        L, dev = logits.shape[0], logits.device
        path = torch.cat([verdict.accepted.new_zeros(R, 1), verdict.accepted], dim=1)
        j = torch.arange(width, device=dev)
        emitted = j < (verdict.num_accepted + 1)[:, None]
        # Scattered with the rest sent to a spare row L: fixed shapes, no host sync.
        dst = torch.where(emitted, cu[:-1, None] + j, L).flatten()
        src = torch.where(emitted, cu[:-1, None] + path.long(), L).flatten()
        order = torch.arange(L + 1, device=dev).scatter_(0, dst, src)[:L]
        flat = torch.zeros(L + 1, dtype=torch.int64, device=dev).scatter_(
            0, dst, verdict.output_tokens.flatten().clamp(min=0))[:L]
        return node_sampling.topk_scores(
            logits, order, flat, num_logprobs, batch.cu_num_logits_np.tolist(),
            batch.expanded_idx_mapping, sampler, max_token_ids,
            logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"))


def _host_seq_lens(batch: Any) -> Any:
    """The batch's sequence-length upper bounds as numpy: a tensor vLLM keeps on the host
    (its own rejection sampler reads it the same way), so no device sync."""
    return batch.seq_lens_cpu_upper_bound.numpy()
