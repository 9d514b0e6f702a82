"""Tree verification in a V2 step, in step order:

1. ``begin_step`` (the ModelState's ``preprocess_state``: after the runner wrote chain
   positions and computed slot mappings from them, before attention metadata): each node
   of a request's tree gets position context + depth (siblings share one), in place, and
   TREE_ATTN learns which rows are trees. Slots stay per node, as the chain gave them.
2. ``__call__`` in place of V2's rejection sampler: the target's choice at every node (its
   sampler, greedy or a sample keyed by the node's position: nodes of one depth share a
   draw, and a path visits one node per depth, so the emitted tokens are the target's own
   samples), the walk (``verify_tree``), logprobs of the emitted tokens, and the accepted
   path's KV entries moved to the slots right after the root; chain positions restored.
3. ``compact_hidden_states`` (the speculator's ``propose``): the accepted path's hidden
   states moved likewise, so DFlash's context rows are the accepted path.

Requests whose processing reads the drafts before a row as its history draft chains and
are verified as chains (TreeStore). Trace replay (``--enable-trace-replay``) makes a node's
choice the request's trace token for its depth. Synthetic acceptance (benchmarking only)
overrides the target's choices along a drawn path (vllm_ddtree/synthetic.py). Recurrent
(Gated DeltaNet) layers verify the step's trees through the hooks of patches 0005 / 0008
(vllm_ddtree/recurrent/gdn_verify.py), told the trees in ``begin_step``; the accepted path's
state is committed after the walk, with the KV compaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_ddtree import ops
from vllm_ddtree.attention.tree_batch import hand_to_builders
from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify, gdn_layers
from vllm_ddtree.spec_decode import node_sampling
from vllm_ddtree.spec_decode.compaction import target_kv_compactions
from vllm_ddtree.synthetic import SyntheticAcceptance


@dataclass
class TreeStep:
    """One verify step's tree data, from ``begin_step`` to drafting."""

    rows: torch.Tensor  # [num_logits] the logits rows' token rows
    delta: torch.Tensor  # [num_logits] tree position - chain position of each of them
    chain_rows: torch.Tensor  # [num_logits] whether a row's request drafted a chain
    verdict: ops.Verdict | None = None
    roots: torch.Tensor | None = None  # [R + 1] each request's root row, then num_tokens


class TreeVerifier:
    # Read by V2's start-up warm-up as of any rejection sampler; trees are sized by
    # tree_budget, never adaptively (refused at start-up).
    enable_adaptive_verification = False

    def __init__(self, trees: Any, budget: int, depth: int) -> None:
        self.trees, self.budget, self.max_depth = trees, budget, min(depth, budget)
        self.sampler: Any = None
        self.synthetic: SyntheticAcceptance | None = None
        self.step: TreeStep | None = None
        self._compactions: list | None = None
        self.gdn: GDNTreeVerify | None = None
        # Set for the forward of the first step with trees (V2's start-up warm-up step,
        # when it runs): tree attention then compiles every split variant a later step
        # may pick, so that none compiles while serving (attention/backend.py).
        self._warm_up: tuple[int, int] | None = None
        dev = trees.first_child.device
        self._node = torch.arange(budget + 1, device=dev)
        # Counters (stats() reads them): verify steps of requests, the longest accepted
        # path, and paths that left the node-index == depth line (off the spine; a node's
        # index is at least its depth, so a path leaves the line where an index exceeds it).
        self.verified_rows = 0
        self._longest = torch.zeros((), dtype=torch.int32, device=dev)
        self._off_line = torch.zeros((), dtype=torch.int64, device=dev)
        self._index_line = torch.arange(1, self.max_depth + 1, dtype=torch.int32, device=dev)

    def bind(self, vllm_config: Any, kv_cache_config: Any, block_tables: Any,
             draft_layers: set[str], target_attn_groups: list) -> None:
        """Once the KV cache exists (the speculator's set_attn): the target's TREE_ATTN
        builders get the trees (the drafter's builders are others: never)."""
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.block_tables, self.draft_layers = block_tables, set(draft_layers)
        hand_to_builders(target_attn_groups, self.trees.attention)
        layers = gdn_layers(vllm_config)
        if layers:
            self.gdn = GDNTreeVerify(self.max_depth)
            for layer in layers:
                layer.ddtree_verify = self.gdn  # read by the hooks of patches 0005, 0008
        if self._node.device.type == "cuda":  # the CUDA backend's Triton split variants
            sched = vllm_config.scheduler_config
            self._warm_up = (sched.max_num_batched_tokens, sched.max_num_seqs)
        spec = vllm_config.speculative_config
        if spec.rejection_sample_method == "synthetic":  # benchmarking only
            self.synthetic = SyntheticAcceptance(
                spec.synthetic_acceptance_rates[:self.max_depth], self.trees.parents.device)

    def with_sampler(self, sampler: Any) -> TreeVerifier:
        self.sampler = sampler
        return self

    def add_request(self, req_index: int, params: Any) -> None:
        """A new request in slot ``req_index``: whether it drafts trees or the chain
        (TreeStore)."""
        if params is None:
            return
        from vllm.v1.worker.gpu.sample.penalties import use_penalty

        self.trees.chain_only[req_index] = bool(
            use_penalty(params) or params.bad_words_token_ids
            or params.structured_outputs is not None
            or params.thinking_token_budget is not None)

    def begin_step(self, input_batch: Any) -> None:
        self.step = None
        if not input_batch.num_draft_tokens:
            self.trees.attention.clear()
            if self.gdn is not None:
                self.gdn.begin_step(None)
            return
        rows = input_batch.logits_indices
        slots = input_batch.expanded_idx_mapping.long()
        local = input_batch.expanded_local_pos.long()
        delta = self.trees.depths[slots, local].long() - local
        positions = input_batch.positions
        positions[rows] += delta
        # A request's rows are a tree when it has drafts and they were not a chain.
        cu = input_batch.cu_num_logits
        is_tree = (cu[1:] - cu[:-1] > 1) & ~self.trees.chain[input_batch.idx_mapping]
        self.trees.attention.point(torch.where(is_tree, input_batch.idx_mapping, -1))
        self.step = TreeStep(rows, delta, chain_rows=self.trees.chain[slots])
        if self._warm_up is not None:
            self.trees.attention.set_warm_up(self._warm_up)
        if self.gdn is not None:  # chains' parents are chains (TreeStore.write)
            self.gdn.begin_step(self.trees.parents[input_batch.idx_mapping])

    def shift_rope_positions(self, positions: torch.Tensor | None) -> None:
        """Tree positions on every M-RoPE axis (Qwen3.5; the model state's own positions,
        [3, tokens]): a generated token advances each axis by one, so a node's offset from
        its chain position is the same on all three."""
        if positions is not None and positions.dim() == 2 and self.step is not None:
            positions[:, self.step.rows] += self.step.delta

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, input_batch: Any,
                 draft_logits: Any = None) -> Any:
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        step, sampler = self.step, self.sampler
        assert step is not None, "a verify step without begin_step"
        num_nans = None
        if sampler.compute_nans:
            from vllm.v1.worker.gpu.metrics.logits import get_num_nans

            num_nans = get_num_nans(logits)
        ids = input_batch.input_ids[step.rows]
        # vLLM's processing counts the drafts before a row as its history: right for a
        # chain; a tree's node is processed on the committed history alone, which is
        # exact for the processing a tree request may have (TreeStore.chain_only). A
        # chain's rows past its depth are never accepted: no history, so that chunks of
        # rows (node_sampling) keep only a chain's first depth + 1 together.
        local = input_batch.expanded_local_pos
        choice = node_sampling.sample_nodes(
            sampler, logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
            input_batch.idx_mapping_np, input_batch.cu_num_logits_np,
            input_batch.positions[step.rows], ids,
            torch.where(step.chain_rows & (local <= self.max_depth), local, 0),
            _host_seq_lens(input_batch), head=self.max_depth + 1)
        # Per request, its nodes in order (root first); -1 past a request's nodes.
        cu = input_batch.cu_num_logits.long()
        at = cu[:-1, None] + self._node
        valid = self._node < (cu[1:] - cu[:-1])[:, None]
        at = at.clamp(max=logits.shape[0] - 1)
        token_ids = torch.where(valid, ids[at].long(), -1)
        choices = torch.where(valid, choice[at].long(), -1)
        slots = input_batch.idx_mapping
        if sampler.trace_replay_state is not None:
            choices = self._replayed(choices, slots)
        first_child = self.trees.first_child[slots]
        if self.synthetic is not None:  # a drawn path is accepted, not the target's
            choices, first_child = self.synthetic.override(
                choices, token_ids, self.trees.parents[slots], self.trees.depths[slots],
                first_child, valid)
        verdict = ops.Verdict(*torch.ops.vllm_ddtree.verify_tree(
            token_ids, first_child, self.trees.next_sibling[slots], choices, self.max_depth))
        logprobs = self._logprobs(logits, input_batch, verdict, cu)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (verdict.num_accepted + 1).to(torch.int32), input_batch.seq_lens,
            input_batch.cu_num_logits, input_batch.idx_mapping,
            sampler.req_states.prefill_len.gpu)
        step.verdict = verdict
        step.roots = torch.cat([step.rows[cu[:-1]],
                                step.rows.new_full((1,), input_batch.num_tokens)])
        self._compact_kv(step)
        if self.gdn is not None:
            self.gdn.commit(verdict)  # the accepted path's recurrent state
        input_batch.positions[step.rows] -= step.delta  # chain positions, for the drafter
        self._count(verdict)
        if self._warm_up is not None:  # after the first tree step's forward: done
            self.trees.attention.set_warm_up(None)
            self._warm_up = None
        return SamplerOutput(sampled_token_ids=verdict.output_tokens, logprobs_tensors=logprobs,
                             num_nans=num_nans, num_sampled=num_sampled,
                             num_rejected=num_rejected)

    def _replayed(self, choices: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Trace replay (--enable-trace-replay; a request's ``trace_decode_token_ids``):
        a node at depth d chooses the trace's token for output position step + d, where
        ``step`` tokens are committed so far, so the walk accepts the nodes that match the
        trace and emits the trace; logprobs stay the target's own. Past the trace, the
        target's choice."""
        state = self.sampler.trace_replay_state
        slots = slots.long()
        req = state.req_states
        step = (req.total_len.gpu[slots] - req.prompt_len.gpu[slots]).long()
        out = step[:, None] + self.trees.depths[slots].long()  # [R, N] output positions
        trace = state.trace_token_ids.gpu
        replayed = (choices >= 0) & (out < state.trace_len.gpu[slots].long()[:, None])
        forced = trace[slots[:, None], out.clamp(0, trace.shape[1] - 1)].long()
        return torch.where(replayed, forced, choices)

    def _logprobs(self, logits: torch.Tensor, input_batch: Any, verdict: ops.Verdict,
                  cu: torch.Tensor) -> Any:
        """Logprobs of the emitted tokens, laid out as V2's rejection sampler lays them
        (row cu[r] + j: request r's token j): token j was chosen at its path's node j - 1
        (the root for j = 0), so its row is that node's logits row."""
        sampler = self.sampler
        dims = sampler.get_logprobs_dims(input_batch.idx_mapping_np)
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
            logits, order, flat, num_logprobs, input_batch.cu_num_logits_np.tolist(),
            input_batch.expanded_idx_mapping, sampler, max_token_ids,
            logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"))

    def _compact_kv(self, step: TreeStep) -> None:
        if self._compactions is None:  # bound once the caches are bound to the layers
            self._compactions = target_kv_compactions(
                self.vllm_config, self.kv_cache_config, self.draft_layers)
        for gid, compact in self._compactions:
            compact(self.block_tables.slot_mappings[gid], step.roots, step.verdict)

    def compact_hidden_states(self, hidden_states: list[torch.Tensor]) -> None:
        """Before drafting: the accepted path's rows of the target's hidden states."""
        step, self.step = self.step, None
        if step is None or step.verdict is None:
            return
        for h in hidden_states:
            ops.compact_tree([], h, step.roots.new_zeros(1), step.roots, step.verdict)

    def _count(self, verdict: ops.Verdict) -> None:
        self.verified_rows += verdict.num_accepted.shape[0]
        torch.maximum(self._longest, verdict.num_accepted.max(), out=self._longest)
        self._off_line += (verdict.accepted > self._index_line).any(dim=1).sum()

    def stats(self) -> dict[str, int]:
        """Verify steps of requests, the longest accepted path, paths off the spine."""
        return {"verified_rows": self.verified_rows, "longest_accepted": int(self._longest),
                "paths_off_the_index_line": int(self._off_line)}


def _host_seq_lens(input_batch: Any) -> Any:
    """The batch's sequence-length upper bounds as numpy: a tensor vLLM keeps on the host
    (its own rejection sampler reads it the same way), so no device sync."""
    return input_batch.seq_lens_cpu_upper_bound.numpy()
