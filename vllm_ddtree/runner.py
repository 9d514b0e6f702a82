"""DDTree inside vLLM's V1 model runner: the proposer and the per-step tree bookkeeping.

The runner patch (patches/0005) calls in at five points; everything else is here:

1. construction: ``DDTreeProposer`` replaces ``DFlashProposer``, and ``DDTreeState``
   holds the trees between steps and the step's ``TreeBatch`` for TREE_ATTN;
2. ``DDTreeState.prepare_step`` after the runner wrote chain positions and slot mappings:
   gather each request's tree (by request id: rows move between steps), write depth-aware
   positions in place, hand the trees to the attention backend;
3. ``DDTreeState.verify`` instead of the rejection sampler: the target's choice at every
   node (after allowed_token_ids and penalties; in vLLM's synthetic mode, a benchmarking
   mode, overridden along a drawn path: vllm_ddtree/synthetic.py), the walk
   (``verify_tree``), the emitted tokens' logprobs, and the compaction of the accepted
   path's KV entries and hidden states to the first slots/rows, so the scheduler's
   rollback (drafts - accepted) and DFlash's context handling work as for a chain; chain
   positions are restored;
4. ``DDTreeProposer._sample_draft_tokens``: the drafter's logits become trees (``build_tree``),
   or, where a step asks no more drafts than the spine holds, the greedy chain.
5. ``DDTreeState.input_fits_in_drafter``: whether the drafter's queries stay within
   max_model_len, reserving its block past the accepted path (not a verify step).

The proposer also gives the drafter CUDA graph sizes of its own (config.drafter_graph_sizes).

Rows with drafts but no stored tree (placeholders, and structured-output requests, which
draft the greedy chain) are verified as chains, at most the drafter's depth deep, and so are
spine trees of which a step verifies no more than the spine; rows without drafts just take
the target's token.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree import ops, sampling
from vllm_ddtree.attention import tree_batch
from vllm_ddtree.config import (
    deriving_drafter_config,
    drafter_graph_sizes,
    synthetic_rates_per_depth,
    tree_widths,
)
from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify, gdn_layers
from vllm_ddtree.sampling import MinTokens, node_targets
from vllm_ddtree.spec_decode.compaction import kv_compaction
from vllm_ddtree.synthetic import SyntheticAcceptance
from vllm_ddtree.tree import DraftTrees


class DDTreeProposer(DFlashProposer):
    """DFlash's drafter, drafting per-depth logits that become a tree of ``tree_budget``
    nodes; returns the nodes' tokens (what the scheduler schedules) and keeps the trees."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any) -> None:
        spec = vllm_config.speculative_config
        super().__init__(vllm_config, device, runner)
        self.budget, self.depth, self.spine = spec.tree_budget, spec.tree_depth, spec.tree_spine
        self.widths = tree_widths(spec)  # JetSpec's build; empty: best-first
        self.ddtree_state = DDTreeState(runner, self.budget, self.depth, self.spine)
        self._roots: torch.Tensor | None = None
        self._num_drafts, self._drafts = self.budget, None  # this step's, set by propose
        self._own_graph_sizes = False  # set with the graph keys

    def _create_draft_vllm_config(self) -> Any:
        # Without this the copy would inherit TREE_ATTN, and the target's trees with it.
        with deriving_drafter_config():
            return super()._create_draft_vllm_config()

    def initialize_cudagraph_keys(self, cudagraph_mode: Any) -> None:
        # The drafter's own sizes (config.drafter_graph_sizes), in a copy of the
        # compilation config that only its dispatcher reads.
        cc = self.compilation_config
        sizes = drafter_graph_sizes(cc.cudagraph_capture_sizes or [], self.budget + 1,
                                    self.depth + 1)
        self._own_graph_sizes = sizes is not None
        if sizes is not None:
            view = copy.copy(cc)
            view.cudagraph_capture_sizes, view.max_cudagraph_capture_size = sizes, sizes[-1]
            self.cudagraph_dispatcher.compilation_config = view
        super().initialize_cudagraph_keys(cudagraph_mode)

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings: Any = None) -> None:
        # vLLM captures the drafter's graphs at the target's sizes: a target size of n
        # verify steps captures the drafter's graph for n requests.
        step = self.budget + 1
        if is_graph_capturing and self._own_graph_sizes and num_tokens % step == 0:
            num_tokens = num_tokens // step * (self.depth + 1)
        super().dummy_run(num_tokens, use_cudagraphs=use_cudagraphs,
                          is_graph_capturing=is_graph_capturing, slot_mappings=slot_mappings)

    def propose(self, num_speculative_tokens: int, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, *args, **kwargs) -> torch.Tensor:
        """The first ``num_speculative_tokens`` nodes of each tree: ``tree_budget``, or
        fewer where vLLM's dynamic speculative decoding (``num_speculative_tokens_per_batch_
        size``) picks fewer for this batch size; a best-first tree's first b nodes are the
        best tree of b nodes. The drafter always drafts the whole depth."""
        self._roots, self._num_drafts = next_token_ids, num_speculative_tokens
        if num_speculative_tokens == 0:  # its forward still runs: the drafter's context
            self.ddtree_state.store(None, [])
            return super().propose(0, target_token_ids, target_positions,
                                   target_hidden_states, next_token_ids, *args, **kwargs)
        super().propose(self.depth, target_token_ids, target_positions, target_hidden_states,
                        next_token_ids, *args, **kwargs)
        return self._drafts

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any
                             ) -> tuple[torch.Tensor, None]:
        logits = self.draft_logits(hidden_states)  # [R * depth, V], request-major
        R = logits.shape[0] // self.depth
        logits = logits.view(R, self.depth, -1)
        state = self.ddtree_state
        if self._num_drafts <= state.chain_drafts:
            # Nodes of the spine only: the drafter's greedy chain, verified as a chain.
            state.store(None, [])
            self._drafts = logits[:, :self._num_drafts].argmax(dim=-1)
        else:
            trees = ops.build_tree_from_logits(self._roots[:R].to(torch.int64), logits,
                                               self.budget, self.spine, self.widths)
            req_ids = list(state.runner.input_batch.req_ids[:R])
            chains = [i for i, rid in enumerate(req_ids) if _structured(state.runner, rid)]
            if chains and not self.spine:  # with the spine, nodes 1..depth are that chain
                trees = self._greedy_chains(trees, logits, chains)
            for i in chains:
                req_ids[i] = None
            state.store(trees, req_ids)
            self._drafts = trees.token_ids[:, 1:self._num_drafts + 1]
        # The base class views this as [R, depth]; propose returns the drafts.
        return logits.new_zeros(R * self.depth, dtype=torch.int64), None

    def _greedy_chains(self, trees: DraftTrees, logits: torch.Tensor, rows: list[int]
                       ) -> DraftTrees:
        """Structured-output requests draft the drafter's greedy chain in their first nodes
        and are verified as chains (no stored tree): vLLM's scheduler checks their drafts
        against the grammar, and builds their grammar masks, as a chain in node order."""
        from vllm.utils.torch_utils import async_tensor_h2d

        rows_t = async_tensor_h2d(rows, logits.device, torch.int64)
        depth = min(self.depth, self.budget)
        token_ids = trees.token_ids.clone()
        token_ids[rows_t, 1:depth + 1] = logits[rows_t, :depth].argmax(dim=-1)
        return trees._replace(token_ids=token_ids)

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """At start-up (vllm_ddtree/warmup.py): one tree built from logits as the drafter
        makes them (its compute_logits: their dtype and layout), so that what the build
        launches (ranked_topk on CUDA) compiles now. Not through draft_logits, which
        tests replace by drafters that read the batch's requests."""
        hidden = torch.zeros(self.depth, self.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        roots = torch.zeros(1, dtype=torch.int64, device=self.device)
        ops.build_tree_from_logits(roots, logits.view(1, self.depth, -1), self.budget,
                                   self.spine, self.widths)


class DDTreeState:
    def __init__(self, runner: Any, budget: int, depth: int, spine: bool) -> None:
        self.runner, self.budget, self.depth = runner, budget, depth
        # With the spine, a tree's first `depth` nodes are the drafter's greedy chain: a
        # step that verifies no more of them (a small budget, or a tree cut by dynamic
        # speculative decoding) is verified as that chain, with causal attention.
        self.chain_drafts = depth if spine else 0
        self.num_nodes = budget + 1
        self.trees = tree_batch.TreeBatch(runner.max_num_reqs, budget, runner.device)
        tree_batch.install(runner.vllm_config, self.trees)
        # The target's Gated DeltaNet layers verify trees through this (bound to them at
        # the first step, once the model is loaded; None: not bound yet; False: none).
        self._gdn: GDNTreeVerify | None | bool = None
        self.proposed: DraftTrees | None = None
        self.proposed_rows: dict[str, int] = {}
        self.step: dict[str, torch.Tensor] | None = None
        self.step_drafts: list[int] | None = None  # this step's drafts per request
        dev, max_reqs, N = runner.device, runner.max_num_reqs, self.num_nodes
        self.node = torch.arange(N, device=dev)
        # The links of the trees drafted last step, field-major so that one index_select
        # gathers a step's rows: depths, first_child, next_sibling, parents (int32
        # [4, max_reqs + 1, N]). Its last row is a chain, for rows drafted without a stored
        # tree (placeholders, structured output); no deeper than a tree (accepting fewer
        # drafts is still lossless): every path has at most `depth` nodes below the root.
        self._links = torch.empty(4, max_reqs + 1, N, dtype=torch.int32, device=dev)
        self._chain_row = max_reqs
        chain_child = torch.where(self.node + 1 <= min(depth, budget), self.node + 1, -1)
        self._links[:, max_reqs] = torch.stack([self.node, chain_child,
                                                torch.full_like(self.node, -1), self.node - 1])
        # Per row, to the device in one copy through vLLM's pinned buffer (a tensor made
        # from a list on a CUDA device would synchronize the stream): its links row, its
        # tree's row in the drafted batch (-1: none) and its number of drafts.
        self._row_info = runner._make_buffer(3 * max_reqs, dtype=torch.int32)
        # Counters (read them with stats(), which syncs): verify steps of requests, the
        # longest accepted path, and paths that left the node-index == depth line (with the
        # spine: paths off the drafter's greedy chain). A node's index is at least its depth
        # (parents precede children), so a path leaves the line where an index exceeds it.
        self._verified_rows = 0
        self._longest = torch.zeros((), dtype=torch.int32, device=dev)
        self._off_line = torch.zeros((), dtype=torch.int64, device=dev)
        # No path is deeper than the drafter's depth: the verdict (and vLLM's host-side
        # copy and parse of it) is max_depth + 1 wide, not budget + 1.
        self.max_depth = min(depth, budget)
        self._index_line = torch.arange(1, self.max_depth + 1, dtype=torch.int32, device=dev)
        self.last_verdict: ops.Verdict | None = None
        self._kv_groups: list | None = None
        # rejection_sample_method "synthetic" (benchmarking only): drawn paths, not the
        # target's, are accepted.
        rates = synthetic_rates_per_depth(runner.vllm_config.speculative_config)
        self.synthetic = None if rates is None else SyntheticAcceptance(rates, dev)

    def store(self, trees: DraftTrees | None, req_ids: list[str | None]) -> None:
        """Keep this step's trees (None: none drafted); a row whose id is None is not a
        tree (a chain)."""
        self.proposed = trees
        self.proposed_rows = {rid: i for i, rid in enumerate(req_ids) if rid is not None}
        if trees is not None:
            self._links[:, :len(req_ids)].copy_(torch.stack(
                [trees.depths, trees.first_child, trees.next_sibling, trees.parents]))

    def prepare_step(self, spec_decode_metadata: Any, num_tokens: int) -> None:
        """After the runner's _prepare_inputs: this step's trees, positions and masks."""
        self.last_verdict = None
        self.step_drafts = (None if spec_decode_metadata is None
                            else spec_decode_metadata.num_draft_tokens)
        gdn = self._gdn_verify()
        if spec_decode_metadata is None:
            self.trees.clear()
            self.step = None
            if gdn:
                gdn.begin_step(None)
            return
        runner, N = self.runner, self.num_nodes
        drafts = spec_decode_metadata.num_draft_tokens
        R = len(drafts)
        info = self._row_info.np
        for i, (rid, n) in enumerate(zip(runner.input_batch.req_ids[:R], drafts)):
            tree = self.proposed_rows.get(rid, -1) if n > self.chain_drafts else -1
            info[i], info[R + i], info[2 * R + i] = (
                tree if tree >= 0 else self._chain_row, tree, n)
        row_info = self._row_info.copy_to_gpu(3 * R)
        n = row_info[2 * R:]
        depths, first_child, next_sibling, parents = self._links.index_select(1, row_info[:R])
        if self.proposed is not None:
            self.trees.set_trees(row_info[R:2 * R], self.proposed.ancestor_mask,
                                 self.proposed.depths)
        else:
            self.trees.clear()
        # A scheduled prefix of a tree's nodes is a tree (parents precede children). Links
        # to nodes beyond it stay: those nodes' tokens are -1, which no choice equals.
        qsl = runner.query_start_loc.gpu[:R + 1].to(torch.int64)
        rows = (qsl[:-1, None] + self.node).clamp(max=num_tokens - 1)
        valid = self.node <= n[:, None]
        token_ids = torch.where(valid, runner.input_ids.gpu[rows].to(torch.int64), -1)
        # Depth-aware positions, in place: node i of a tree sits at root position + depth.
        # Other rows are chains (depth == node), prefill chunks included, so they keep theirs.
        offset = depths - self.node
        qpos = runner.query_pos.gpu[:num_tokens].clamp(max=N - 1)
        delta = offset[runner.req_indices.gpu[:num_tokens], qpos]
        self._shift_positions(num_tokens, delta)
        self.step = dict(token_ids=token_ids, first_child=first_child,
                         next_sibling=next_sibling, valid=valid, qsl=qsl, delta=delta,
                         num_tokens=num_tokens, num_drafts=n, parents=parents, depths=depths)
        if gdn:
            gdn.begin_step(parents)

    def _shift_positions(self, num_tokens: int, delta: torch.Tensor) -> None:
        """Moves the step's positions by ``delta`` per token, in both of vLLM's position
        buffers. Under M-RoPE (Qwen3.5) a generated token's position advances by one on
        every axis (vLLM's get_next_input_positions_tensor: context length + delta on all
        rows), and drafts are generated tokens, so the tree offset applies to each axis."""
        runner = self.runner
        runner.positions[:num_tokens] += delta
        if runner.uses_mrope:
            runner.mrope_positions.gpu[:, :num_tokens] += delta

    def _gdn_verify(self) -> GDNTreeVerify | None:
        if self._gdn is None:
            layers = gdn_layers(self.runner)
            self._gdn = GDNTreeVerify(self.max_depth) if layers else False
            for layer in layers:
                layer.ddtree_verify = self._gdn  # read by the hook of patch 0011
        return self._gdn or None

    def input_fits_in_drafter(self, common_attn_metadata: Any, max_model_len: int) -> bool:
        """In place of the runner's _input_fits_in_drafter: whether the drafter's queries
        (the bonus token and tree_depth mask tokens, at the positions after each request's
        accepted path) stay within max_model_len for the whole batch. vLLM reserves
        num_speculative_tokens + 1 past every request's scheduled tokens, which for ddtree
        is tree_budget + 1 past a verify step (which the scheduler already ends before
        max_model_len): one request within 2 x (tree_budget + 1) tokens of its limit
        stopped drafting for all. A request's accepted path holds at most tree_depth of its
        d drafts, so its committed tokens are at most its scheduled ones less
        max(0, d - tree_depth); which path was accepted is not known on the host yet."""
        cad, runner = common_attn_metadata, self.runner
        committed = cad.max_seq_len
        n = cad.num_reqs
        if self.step_drafts and n:
            # Host numpy only (the optimistic seq_lens vLLM builds its metadata from): this
            # runs inside the step, where a tensor read would be a sync.
            scheduled = np.diff(runner.query_start_loc.np[:n + 1])
            seq_lens = runner.input_batch.num_computed_tokens_cpu[:n] + scheduled
            drafts = np.asarray(self.step_drafts[:n], dtype=np.int64)
            committed = int((seq_lens - np.maximum(drafts - self.depth, 0)).max())
        return committed + self.depth + 1 <= max_model_len

    def verify(self, logits: torch.Tensor, spec_decode_metadata: Any, hidden_states: Any,
               aux_hidden_states: Any) -> SamplerOutput:
        """Tree verification in place of the rejection sampler, then compaction."""
        runner, step = self.runner, self.step
        runner.input_batch.update_async_output_token_ids()
        drafts = spec_decode_metadata.num_draft_tokens
        cu_sampled = spec_decode_metadata.cu_num_sampled_tokens.to(logits.device)
        sampling_metadata = runner.input_batch.sampling_metadata
        first_row = cu_sampled - (1 + step["num_drafts"])  # each request's root row
        # Each logits row's request and node, on the device (no host data, so no sync).
        all_rows = torch.arange(logits.shape[0], device=logits.device)
        req = torch.searchsorted(cu_sampled.to(all_rows.dtype), all_rows, right=True)
        node = (all_rows - first_row[req]).clamp(max=self.num_nodes - 1)
        per_row = node_targets(
            logits, req, [1 + n for n in drafts], lambda: step["depths"][req, node],
            lambda: self._path_tokens()[req, node], sampling_metadata,
            self._min_tokens(len(first_row)))
        rows = first_row[:, None] + self.node
        choice = torch.where(step["valid"], per_row[rows.clamp(max=logits.shape[0] - 1)], -1)
        first_child = step["first_child"]
        if self.synthetic is not None:
            choice, first_child = self.synthetic.override(
                choice, step["token_ids"], step["parents"], step["depths"], first_child,
                step["valid"])
        verdict = ops.Verdict(*torch.ops.vllm_ddtree.verify_tree(
            step["token_ids"], first_child, step["next_sibling"], choice, self.max_depth))
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(logits, first_row, verdict,
                                      sampling_metadata.max_num_logprobs)
        self._compact(verdict, hidden_states, aux_hidden_states)
        self._count(verdict)
        num_tokens = step["num_tokens"]
        self._shift_positions(num_tokens, -step["delta"])  # chain positions for the drafter
        self.step = None
        return SamplerOutput(sampled_token_ids=verdict.output_tokens.to(torch.int32),
                             logprobs_tensors=logprobs)

    def _min_tokens(self, num_reqs: int) -> MinTokens | None:
        """min_tokens from the requests' own parameters, against their output so far as the
        device counts it (the root's position). Not vLLM's MinTokens processor: under async
        scheduling with speculative decoding it counts the drafts' optimistic placeholders
        (-1) as output and lets stop tokens through too early (vLLM's dflash loses min_tokens
        that way)."""
        from vllm.utils.torch_utils import async_tensor_h2d

        runner, rows, least = self.runner, [], [0] * num_reqs
        for r, rid in enumerate(runner.input_batch.req_ids[:num_reqs]):
            state = runner.requests[rid]
            params = state.sampling_params
            if params is None or not params.min_tokens:
                continue
            # Real tokens (placeholders trail them): a lower bound of the output so far.
            output = state.output_token_ids
            real = len(output)
            while real > 0 and output[real - 1] == -1:
                real -= 1
            if real < params.min_tokens:
                rows.append((r, params.all_stop_token_ids))
                least[r] = params.min_tokens
        if not rows:
            return None
        dev, step = runner.device, self.step
        root = step["qsl"][1:] - 1 - step["num_drafts"]  # each request's root token
        prompt = runner.input_batch.num_prompt_tokens[:num_reqs].tolist()
        output = runner.positions[root] + 1 - async_tensor_h2d(prompt, dev, torch.int64)
        return MinTokens(rows, async_tensor_h2d(least, dev, torch.int64) - output)

    def _path_tokens(self) -> torch.Tensor:
        """[R, N, depth]: each node's path tokens below the root (itself first), -1 padded;
        found by following parents, at most ``depth`` hops."""
        token_ids, parents = self.step["token_ids"], self.step["parents"].long()
        cur = self.node.expand_as(parents)
        columns = []
        for _ in range(self.depth):
            on_path = cur > 0
            at = cur.clamp(min=0)
            columns.append(torch.where(on_path, token_ids.gather(1, at), -1))
            cur = torch.where(on_path, parents.gather(1, at), 0)
        return torch.stack(columns, dim=-1)

    def _logprobs(self, logits: torch.Tensor, first_row: torch.Tensor, verdict: ops.Verdict,
                  num_logprobs: int) -> Any:
        """Logprobs of the emitted tokens, laid out like the tokens ([R, D + 1] flattened;
        vLLM drops the -1 padding's rows): token j of a request was chosen at its accepted
        path's node j - 1 (the root for j = 0), so its logits row is that node's. Raw
        logprobs or logits, as the sampler's logprobs_mode says (ddtree's config refuses
        the processed modes). Up to max_num_batched_tokens rows (R x (max_depth + 1)):
        gathered and scored sampling.CHUNK_ROWS at a time."""
        from vllm.v1.outputs import LogprobsTensors

        sampler = self.runner.sampler
        path = torch.cat([verdict.accepted.new_zeros(len(first_row), 1),
                          verdict.accepted], dim=1).clamp(min=0)
        rows = (first_row[:, None] + path).flatten().clamp(max=logits.shape[0] - 1)
        tokens = verdict.output_tokens.flatten().clamp(min=0)
        parts = []
        for s in range(0, len(rows), sampling.CHUNK_ROWS):
            chunk = slice(s, s + sampling.CHUNK_ROWS)
            scores = logits[rows[chunk]].float()
            if sampler.logprobs_mode == "raw_logprobs":
                scores = sampler.compute_logprobs(scores)
            parts.append(sampler.gather_logprobs(scores, num_logprobs, tokens[chunk]))
        return LogprobsTensors(*(torch.cat([getattr(part, field) for part in parts])
                                 for field in ("logprob_token_ids", "logprobs",
                                               "selected_token_ranks")))

    def _count(self, verdict: ops.Verdict) -> None:
        self.last_verdict = verdict
        self._verified_rows += verdict.num_accepted.shape[0]
        torch.maximum(self._longest, verdict.num_accepted.max(), out=self._longest)
        self._off_line += (verdict.accepted > self._index_line).any(dim=1).sum()

    def stats(self) -> dict[str, int]:
        longest, off_line = torch.stack([self._longest.long(), self._off_line]).tolist()
        return {"verified_rows": self._verified_rows, "longest_accepted": longest,
                "paths_off_the_index_line": off_line}

    def _compact(self, verdict: ops.Verdict, hidden_states: Any, aux_hidden_states: Any
                 ) -> None:
        qsl = self.step["qsl"]
        for h in [hidden_states, *(aux_hidden_states or [])]:
            if isinstance(h, torch.Tensor) and h.dim() == 2:
                ops.compact_tree([], h, qsl.new_zeros(1), qsl, verdict)
        if self._kv_groups is None:  # bound once, after the KV caches are allocated
            self._kv_groups = [(kv_compaction(caches), slot_mapping)
                               for caches, slot_mapping in self._target_kv_caches()]
        for compact, slot_mapping in self._kv_groups:
            compact(slot_mapping, qsl, verdict)
        if self._gdn:
            self._gdn.commit(verdict)  # recurrent layers: the accepted path's state

    def _target_kv_caches(self):
        """Per KV-cache group: the target's attention layers' caches and the slot mapping."""
        runner = self.runner
        draft = getattr(runner.drafter, "_draft_attn_layer_names", set())
        context = runner.compilation_config.static_forward_context
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            # Layers sharing another's cache (cross-layer KV sharing) list the same tensor
            # again; compact_tree compacts a repeated cache once.
            layers = [(context[name], context[name].kv_cache) for name in group.layer_names
                      if name not in draft and name in context]
            layers = [(layer, c) for layer, c in layers
                      if isinstance(c, torch.Tensor) and c.dim() == 4]
            if layers:
                yield layers, runner.input_batch.block_table[gid].slot_mapping.gpu


def _structured(runner: Any, req_id: str) -> bool:
    state = runner.requests.get(req_id)
    return state is not None and getattr(state.sampling_params, "structured_outputs",
                                         None) is not None
