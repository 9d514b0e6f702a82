"""Tree verification in a V2 step, in step order, one seat each:

1. ``begin_step`` (the ModelState's ``preprocess_state``: after the runner wrote chain
   positions and computed slot mappings from them, before attention metadata): each node
   of a request's tree gets position context + depth (siblings share one), in place, and
   TREE_ATTN's batch is pointed at the step's trees. Slots stay per node, as the chain gave
   them. Its record: ``TreeStep``.
2. ``__call__`` in place of V2's rejection sampler: ``TreeRejectionSampler`` turns one
   ``TreeVerifyInput`` into one ``TreeVerifyOutput`` (rejection_sampler.py); the accepted
   path's KV entries and recurrent state are committed (accepted_path.py); chain positions
   restored for the drafter.
3. ``commit_hidden_states`` (the speculator's ``propose``): the accepted path's hidden
   states moved likewise, so DFlash's context rows are the accepted path.

Requests whose processing reads the drafts before a row as its history draft chains and
are verified as chains (tree_store.py). Recurrent (Gated DeltaNet) layers verify the step's
trees through the hooks of patches 0005 / 0008 (vllm_ddtree/recurrent/gdn_verify.py), told
the trees in ``begin_step``.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree import ops
from vllm_ddtree.attention.tree_batch import hand_to_builders
from vllm_ddtree.recurrent.gdn_verify import GDNTreeVerify, gdn_layers
from vllm_ddtree.recurrent.limits import verify_tree_fits_state_block
from vllm_ddtree.spec_decode import node_sampling
from vllm_ddtree.spec_decode.accepted_path import AcceptedPathCommit
from vllm_ddtree.spec_decode.rejection_sampler import (
    TreeRejectionSampler,
    TreeStep,
    TreeVerifyInput,
    TreeVerifyOutput,
)
from vllm_ddtree.spec_decode.tree_store import TreeStore
from vllm_ddtree.synthetic import SyntheticAcceptance


class TreeCounters:
    """Verify steps of requests, the longest accepted path, and paths that left the
    node-index == depth line (off the spine: a node's index is at least its depth, so a path
    leaves the line where an index exceeds it). On the device; ``stats`` reads them."""

    def __init__(self, max_depth: int, device: torch.device) -> None:
        self.verified_rows = 0
        self._longest = torch.zeros((), dtype=torch.int32, device=device)
        self._off_line = torch.zeros((), dtype=torch.int64, device=device)
        self._index_line = torch.arange(1, max_depth + 1, dtype=torch.int32, device=device)

    def count(self, verdict: ops.Verdict) -> None:
        self.verified_rows += verdict.num_accepted.shape[0]
        torch.maximum(self._longest, verdict.num_accepted.max(), out=self._longest)
        self._off_line += (verdict.accepted > self._index_line).any(dim=1).sum()

    def stats(self) -> dict[str, int]:
        return {"verified_rows": self.verified_rows, "longest_accepted": int(self._longest),
                "paths_off_the_index_line": int(self._off_line)}


class TreeVerifier:
    # Read by V2's start-up warm-up as of any rejection sampler: vLLM's chain sizing stays
    # off (adaptive trees are sized by adaptive/sizing.py, in the runner's manager's seat).
    enable_adaptive_verification = False

    def __init__(self, trees: TreeStore, budget: int, depth: int, spec: Any,
                 grammar_trees: bool = True) -> None:
        self.trees, self.budget, self.max_depth = trees, budget, min(depth, budget)
        # Structured output verifies trees (the scheduler masks each node along its tree:
        # grammar_tree.py), unless a reasoning parser bounds the grammar per path.
        self.grammar_trees = grammar_trees
        device = trees.first_child.device
        self.synthetic = None
        if spec.rejection_sample_method == "synthetic":  # benchmarking only
            self.synthetic = SyntheticAcceptance(
                spec.synthetic_acceptance_rates[:self.max_depth], device)
        self.counters = TreeCounters(self.max_depth, device)
        self.rejection: TreeRejectionSampler | None = None  # with_sampler
        self.commit: AcceptedPathCommit | None = None  # bind
        self.gdn: GDNTreeVerify | None = None  # bind, for a hybrid target
        self.sizing: Any = None  # adaptive trees' AdaptiveTreeSizing, told every verdict
        # Set for the forward of the first step with trees (V2's start-up warm-up step,
        # when it runs): tree attention then compiles every split variant a later step
        # may pick, so that none compiles while serving (attention/backend.py).
        self._warm_up: tuple[int, int] | None = None
        self._step: TreeStep | None = None  # begin_step's, read by the forward's seats
        self._path: TreeVerifyOutput | None = None  # the walk's, read by the drafter's

    def bind(self, vllm_config: Any, kv_cache_config: Any, block_tables: Any,
             draft_layers: set[str], target_attn_groups: list) -> None:
        """Once the KV cache exists (the speculator's set_attn): the target's TREE_ATTN
        builders get the trees (the drafter's builders are others: never)."""
        hand_to_builders(target_attn_groups, self.trees.attention)
        layers = gdn_layers(vllm_config)
        if layers:
            verify_tree_fits_state_block(vllm_config.cache_config, self.budget)
            self.gdn = GDNTreeVerify(self.max_depth, self.trees.parents.shape[0],
                                     self.budget + 1,
                                     node_sampling.max_verify_rows(vllm_config, self.budget),
                                     self.trees.first_child.device)
            for layer in layers:
                layer.ddtree_verify = self.gdn  # read by the hooks of patches 0005, 0008
        self.commit = AcceptedPathCommit(vllm_config, kv_cache_config, block_tables,
                                         set(draft_layers), self.gdn)
        if self.trees.first_child.device.type == "cuda":  # the Triton split variants
            sched = vllm_config.scheduler_config
            self._warm_up = (sched.max_num_batched_tokens, sched.max_num_seqs)

    def with_sampler(self, sampler: Any) -> TreeVerifier:
        """V2's sampler (the ModelState's custom_sampler): the node sampling's."""
        self.rejection = TreeRejectionSampler(sampler, self.budget, self.max_depth,
                                              self.synthetic, self.trees.first_child.device)
        return self

    def add_request(self, req_index: int, params: Any) -> None:
        """A new request in slot ``req_index``: whether it drafts trees or the chain
        (TreeStore)."""
        if params is None:
            return
        from vllm.v1.worker.gpu.sample.penalties import use_penalty

        self.trees.chain_only[req_index] = bool(
            use_penalty(params) or params.bad_words_token_ids
            or (params.structured_outputs is not None and not self.grammar_trees)
            or params.thinking_token_budget is not None)

    def begin_step(self, input_batch: Any) -> None:
        self._step = self._path = None
        if self.sizing is not None:  # adaptive trees time every step from here
            self.sizing.timer.step_start()
        if not input_batch.num_draft_tokens:
            self.trees.attention.clear()
            if self.gdn is not None:
                self.gdn.begin_step(None)
            return
        rows = input_batch.logits_indices
        slots = input_batch.expanded_idx_mapping.long()
        local = input_batch.expanded_local_pos.long()
        delta = self.trees.depths[slots, local].long() - local
        input_batch.positions[rows] += delta
        # A request's rows are a tree when it has drafts and they were not a chain.
        cu = input_batch.cu_num_logits
        is_tree = (cu[1:] - cu[:-1] > 1) & ~self.trees.chain[input_batch.idx_mapping]
        self.trees.attention.point(torch.where(is_tree, input_batch.idx_mapping, -1))
        self._step = TreeStep(rows, delta, chain_rows=self.trees.chain[slots])
        if self._warm_up is not None:
            self.trees.attention.set_warm_up(self._warm_up)
        if self.gdn is not None:  # chains' parents are chains (TreeStore.write)
            self.gdn.begin_step(self.trees.parents[input_batch.idx_mapping])

    def shift_rope_positions(self, positions: torch.Tensor | None) -> None:
        """Tree positions on every M-RoPE axis (Qwen3.5; the model state's own positions,
        [3, tokens]): a generated token advances each axis by one, so a node's offset from
        its chain position is the same on all three."""
        if positions is not None and positions.dim() == 2 and self._step is not None:
            positions[:, self._step.rows] += self._step.delta

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, input_batch: Any,
                 draft_logits: Any = None) -> Any:
        step = self._step
        assert step is not None and self.rejection is not None and self.commit is not None, \
            "a verify step before bind, with_sampler and begin_step"
        path = self.rejection(TreeVerifyInput(step, logits, input_batch, self.trees))
        self.commit.caches(path)
        input_batch.positions[step.rows] -= step.delta  # chain positions, for the drafter
        self.counters.count(path.verdict)
        if self.sizing is not None:
            self.sizing.observe(path.verdict, input_batch)
        if self._warm_up is not None:  # after the first tree step's forward: done
            self.trees.attention.set_warm_up(None)
            self._warm_up = None
        self._path = path
        return path.sampler_output()

    def commit_hidden_states(self, hidden_states: list[torch.Tensor]) -> None:
        """Before drafting: the accepted path's rows of the target's hidden states."""
        path, self._path = self._path, None
        if path is not None:
            AcceptedPathCommit.hidden_states(path, hidden_states)

    def stats(self) -> dict[str, Any]:
        """Verify steps of requests, the longest accepted path, paths off the spine; with
        adaptive trees, what they chose (adaptive/sizing.py)."""
        stats: dict[str, Any] = dict(self.counters.stats())
        if self.sizing is not None:
            stats["adaptive"] = self.sizing.stats()
        return stats
