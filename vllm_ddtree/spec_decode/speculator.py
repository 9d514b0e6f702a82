"""The ddtree speculator: DFlash's drafter, whose per-depth logits become a token tree.

V2's DFlash speculator drafts ``num_speculative_steps + 1`` queries per request (the bonus
token and mask tokens) in one forward and samples one token per mask position. Here the
drafter drafts ``tree_depth`` positions, and ``_generate_draft`` (inside DFlash's captured
FULL graph when graphs are on) turns their logits into a tree of ``tree_budget`` nodes per
request on the device: the nodes' tokens are the drafts V2 hands the scheduler
(``[num_reqs, tree_budget]``), and the trees' links stay in a ``TreeStore``, by request-state
slot, for the next step's verification.

Before drafting, the accepted path's hidden states are compacted to the first rows of each
request's verify span (``propose``), so that DFlash's context rows (a request's first
``query_len - num_rejected`` rows) are the accepted path, as for a chain.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree import ops
from vllm_ddtree.attention.features import refuse_quantized_kv_cache
from vllm_ddtree.spec_decode.adaptive.reorder import by_score, padded
from vllm_ddtree.spec_decode.model_state import install_model_state
from vllm_ddtree.spec_decode.options import tree_options, tree_widths
from vllm_ddtree.spec_decode.paused_context import PAUSED_CONTEXT_ROWS, PausedContext
from vllm_ddtree.spec_decode.tree_store import TreeStore
from vllm_ddtree.spec_decode.verifier import TreeVerifier


def _tree_attention_on_cpu() -> None:
    """The CPU platform answers CPU_ATTN whatever backend is selected: CPU_ATTN becomes
    TREE_ATTN's CPU implementation (CPU_ATTN itself for requests without a tree, and for
    engines without trees), before the target's layers pick their backend. A choice made
    earlier in this process (another engine's) is cached by the selector: forgotten."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    from vllm_ddtree.attention import CPU_BACKEND_PATH

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND_PATH)
    _cached_get_attn_backend.cache_clear()


def _reasons(vllm_config: Any) -> bool:
    """A reasoning parser: the grammar starts past the reasoning, a per-path bound the
    scheduler's tree walk does not follow (structured requests then draft chains)."""
    config = getattr(vllm_config, "structured_outputs_config", None)
    return bool(getattr(config, "reasoning_parser", ""))


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any = None) -> None:
        self.req_states = req_states  # the runner's (keep_drafts; tests' oracle drafters)
        self.sizing: Any = None  # adaptive trees (make_adaptive_verification)
        self.paused_context: PausedContext | None = None  # adaptive trees, paused
        options = tree_options(vllm_config.speculative_config)
        # The base class sizes its buffers by num_speculative_tokens (tree_budget) drafter
        # steps; the drafter drafts tree_depth. Read before: _num_graph_context_tokens.
        self.budget, self.depth = options.tree_budget, options.tree_depth
        self.spine, self.widths = options.tree_spine, tree_widths(options)
        refuse_quantized_kv_cache(vllm_config.cache_config.cache_dtype)
        super().__init__(vllm_config, device)
        self.num_speculative_steps = self.depth
        self.num_query_per_req = self.depth + 1
        rows = self.max_num_reqs * self.depth
        self.sample_indices = self.sample_indices[:rows]
        self.sample_pos = self.sample_pos[:rows]
        self.sample_idx_mapping = self.sample_idx_mapping[:rows]
        self.sample_col = self.sample_col.view(self.max_num_reqs, -1)[:, :self.depth].flatten()
        # draft_tokens stays [max_num_reqs, tree_budget]: the trees' nodes below the root.
        # Adaptive trees verify prefixes: their nodes are renumbered most probable first.
        self.trees = TreeStore(self.max_num_reqs, self.budget, self.depth, device,
                               scored=options.adaptive)
        self.verifier = TreeVerifier(self.trees, self.budget, self.depth,
                                     vllm_config.speculative_config,
                                     grammar_trees=not _reasons(vllm_config))
        if device.type == "cpu":
            _tree_attention_on_cpu()

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        # Context rows of a captured draft step: one verify step (tree_budget + 1) each.
        return min(num_reqs * (self.budget + 1), self.max_num_tokens)

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        # Runs before the runner makes its ModelState: the target's becomes ddtree's.
        install_model_state(self.vllm_config, target_model, self.verifier)

    def set_attn(self, model_state: Any, kv_cache_config: Any, block_tables: Any,
                 target_input_buffers: Any, target_attn_groups: Any) -> None:
        super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers,
                         target_attn_groups)
        self.verifier.bind(self.vllm_config, kv_cache_config, block_tables,
                           self.draft_attn_layer_names, target_attn_groups)

    def _generate_draft(self, num_reqs: int, num_tokens_padded: int,
                        attn_metadata: dict[str, Any] | None,
                        slot_mappings: dict[str, torch.Tensor] | None,
                        num_tokens_across_dp: torch.Tensor | None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE) -> None:
        hidden_states = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                        num_tokens_across_dp, cudagraph_runtime_mode)
        rows = self.sample_indices[:num_reqs * self.depth]
        logits = self.draft_logits_at(hidden_states[rows])
        step = self.num_query_per_req
        roots = self.input_buffers.input_ids[:num_reqs * step:step].to(torch.int64)
        logits = logits.view(num_reqs, self.depth, -1)
        # Adaptive trees, eager: trees as wide as the scheduler schedules next, to a power of
        # two (the rest of the cap is never verified; a captured draft step keeps its shapes).
        budget = self.budget
        if self.sizing is not None and cudagraph_runtime_mode == CUDAGraphMode.NONE:
            need = self.sizing.drafts_to_schedule(self.budget)
            budget = min(self.budget, max(8, 1 << (need - 1).bit_length()))
        trees = ops.build_tree_from_logits(roots, logits, budget, self.spine, self.widths)
        if self.trees.scores is not None:  # adaptive trees verify prefixes: reorder.py
            trees = padded(by_score(trees), self.budget)
        slots = self.sample_idx_mapping[:num_reqs * self.depth:self.depth]
        self.draft_tokens[:num_reqs] = self.trees.write(slots, trees, logits.argmax(dim=-1))

    def draft_parents(self, draft: Any) -> list[list[int] | None] | None:
        """Each request's drafts' parents (0: the root), None for a request drafting a chain:
        the scheduler fills structured output's mask rows along the trees (patch 0014,
        grammar_tree.py). Read after the step (take_draft_token_ids), and only when the
        drafts themselves go to the scheduler (a batch with structured output; otherwise
        they are placeholders, -1)."""
        if all(not ids or ids[0] < 0 for ids in draft.draft_token_ids):
            return None
        slots = [self.req_states.req_id_to_index.get(r, self.trees.padding_slot)
                 for r in draft.req_ids]
        rows = torch.tensor(slots, device=self.trees.parents.device)
        parents = self.trees.parents[rows].tolist()
        chain = self.trees.chain_only[rows].tolist()
        return [None if c else p[1:1 + len(ids)]
                for p, c, ids in zip(parents, chain, draft.draft_token_ids)]

    def keep_drafts(self, tree_nodes: dict[str, list[int]] | None) -> None:
        """Before a step's inputs: the tree nodes the scheduler kept of each structured
        request's drafts (its grammar allows them: grammar_tree.py; patch 0014), by their
        draft-time numbers, go first, in that order, so that the step verifies them (the
        scheduled prefix) and nothing the grammar forbids. Host data copied to the device
        without waiting (pinned where it can be)."""
        if not tree_nodes:
            return
        from vllm.utils.torch_utils import async_tensor_h2d

        slots = [self.req_states.req_id_to_index[req_id] for req_id in tree_nodes]
        orders = [[0, *kept, *sorted(set(range(1, self.budget + 1)).difference(kept))]
                  for kept in tree_nodes.values()]
        device = self.trees.parents.device
        self.trees.renumber(async_tensor_h2d(slots, device, torch.int64),
                            async_tensor_h2d(orders, device, torch.int64),
                            self.req_states.draft_tokens)

    def draft_logits_at(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The drafter's logits, ``[num_reqs * tree_depth, vocab]``, request-major."""
        return self.model.compute_logits(hidden_states)

    def make_adaptive_verification(self, runner: Any) -> Any:
        """The runner's adaptive verification manager (patch 0013): adaptive trees when
        the config asks for them (enable_adaptive_verification), else none."""
        if not tree_options(self.vllm_config.speculative_config).adaptive:
            return None
        from vllm_ddtree.spec_decode.adaptive.sizing import AdaptiveTreeSizing, use_varlen_graphs

        use_varlen_graphs(runner, self.draft_attn_layer_names)
        self.sizing = self.verifier.sizing = AdaptiveTreeSizing(runner, self.trees,
                                                                self.budget)
        return self.sizing

    def propose(self, input_batch: Any, attn_metadata: dict[str, Any],
                slot_mappings: dict[str, torch.Tensor], last_hidden_states: torch.Tensor,
                aux_hidden_states: list[torch.Tensor] | None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        self.verifier.commit_hidden_states([last_hidden_states, *(aux_hidden_states or [])])
        if self.sizing is not None and not self.sizing.drafting(input_batch):
            self._store_context(input_batch, last_hidden_states, aux_hidden_states,
                                dummy_run=kwargs.get("dummy_run", False))
            return self.draft_tokens[:input_batch.num_reqs]
        if self.paused_context is not None:  # drafting again: the context complete first
            self.paused_context.flush(self._store_context_kv)
        return super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                               aux_hidden_states, *args, **kwargs)

    def _store_context(self, input_batch: Any, last_hidden_states: torch.Tensor,
                       aux_hidden_states: list[torch.Tensor] | None,
                       dummy_run: bool = False) -> None:
        """A paused drafter (adaptive trees) keeps its context: every row of a step without
        drafts is committed, so the rows' context K/V go where the target's step put the
        drafter's KV (the runner's slot mappings of its groups, at the step's positions),
        as DFlash's input preparation would (the drafter's query pass skipped, as DFlash
        does with num_speculative_tokens=0); queued and stored in batches
        (paused_context.py)."""
        n = input_batch.num_tokens
        if dummy_run:  # a start-up profile's run: combined as DFlash does, not queued
            self._store_hidden_states(n, last_hidden_states, aux_hidden_states)
            return
        parts = [h[:n] for h in aux_hidden_states or [last_hidden_states]]
        groups = self.draft_kv_cache_group_ids
        if self.paused_context is None:
            combine = self.model.combine_hidden_states if aux_hidden_states else None
            self.paused_context = PausedContext(
                min(self.max_num_tokens, PAUSED_CONTEXT_ROWS), sum(p.shape[-1] for p in parts),
                len(groups), parts[0].dtype, self.device, combine)
        slots = [self.block_tables.slot_mappings[gid, :n] for gid in groups]
        self.paused_context.add(parts, input_batch.positions[:n], slots, input_batch.req_ids,
                                self._store_context_kv)

    def _store_context_kv(self, states: torch.Tensor, positions: torch.Tensor,
                          slots: list[torch.Tensor]) -> None:
        groups = self._layer_group_idx
        self.model.precompute_and_store_context_kv(
            states, positions, slots[0] if groups is None else [slots[g] for g in groups])
