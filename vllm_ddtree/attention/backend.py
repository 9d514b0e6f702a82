"""TREE_ATTN on CUDA: vLLM's Triton attention backend with the tree-attention kernel.

It keeps the Triton backend's KV cache (per layer ``[blocks, kv_heads, block_size,
2 * head_size]``, K and V side by side) and its cache writes, and replaces the attention
call with ``tree_attention``: causal for requests without a tree, tree-masked for the
others, one launch. Everything the kernel reads comes from persistent buffers (the runner's
and the ``TreeBatch`` the speculator handed the builder), so a uniform verify batch can be
captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.attention.features import TreeAttentionFeatures, refuse_unsupported
from vllm_ddtree.attention.tree_batch import TreeBatch, TreeBatchReader
from vllm_ddtree.attention.triton_tree_attention import split_choices, tree_attention
from vllm_ddtree.ops import compact_tree
from vllm_ddtree.tree import Verdict


class TreeAttentionBackend(TreeAttentionFeatures, TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeAttentionImpl]:
        return TreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeAttentionMetadataBuilder]:
        return TreeAttentionMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 32 <= head_size <= 256


@dataclass
class TreeAttentionMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    tree_index: torch.Tensor  # int32 [num_reqs]
    ancestor_mask: torch.Tensor  # int32 [max_num_reqs, budget + 1, words]
    depths: torch.Tensor  # int32 [max_num_reqs, budget + 1]
    # (max tokens, max requests) per step for a warm-up forward (TreeBatch.set_warm_up):
    # each layer first launches the kernel at every split count it can pick for steps of
    # up to these sizes (each a variant Triton compiles on its own), with the forward's own
    # arguments, so one forward compiles them all.
    warm_up: tuple[int, int] | None = None


class TreeAttentionMetadataBuilder(TreeBatchReader, TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        self._no_trees = TreeBatch(max_reqs, 0, device)

    @classmethod
    def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec) -> int | None:
        """Adaptive trees verify each request's own prefix of its tree: the kernel takes
        every request's length from the device's query_start_loc (its grid covers any
        split of the step's tokens), so a FULL decode graph replays any mix of 1 to
        tree_budget + 1 tokens a request."""
        return vllm_config.uniform_decode_query_len

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TreeAttentionMetadata:
        cm = common_attn_metadata
        trees = self.trees or self._no_trees
        return TreeAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping, tree_index=trees.tree_index[:cm.num_reqs],
            ancestor_mask=trees.ancestor_mask, depths=trees.depths, warm_up=trees.warm_up)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> TreeAttentionMetadata:
        metadata = self.build(0, common_attn_metadata)
        metadata.seq_lens.fill_(1)
        return metadata


class TreeAttentionImpl(TritonAttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = "decoder", kv_sharing_target_layer_name=None,
                 **kwargs) -> None:
        refuse_unsupported(alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                           **{k: v for k, v in kwargs.items() if k != "sinks"})
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **kwargs)

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False  # the tree kernel writes the model's dtype (forward refuses scales)

    @staticmethod
    def kv_compaction(layers: list) -> Callable[[torch.Tensor, torch.Tensor, Verdict], None]:
        """compact_tree bound to one KV-cache group's (layer, cache) pairs: each cache is
        a ``[blocks, kv_heads, block_size, 2 * head_size]`` view (keys and values move
        together). Called with (slot_mapping, query_start_loc, verdict)."""
        caches = [cache for _, cache in layers]
        return lambda slot_mapping, qsl, verdict: compact_tree(
            caches, qsl.new_empty(0), slot_mapping, qsl, verdict)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TREE_ATTN does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        window = self.sliding_window[0] + 1 if self.sliding_window[0] >= 0 else None
        launch = functools.partial(
            tree_attention, query[:n], key_cache, value_cache, output[:n],
            attn_metadata.block_table, attn_metadata.seq_lens, attn_metadata.query_start_loc,
            attn_metadata.tree_index, attn_metadata.ancestor_mask, self.scale,
            sliding_window=window, sinks=self.sinks, depths=attn_metadata.depths)
        if attn_metadata.warm_up is not None:  # start-up: the variants later steps pick
            for splits in split_choices(query.dtype, query.shape[1], key_cache.shape[2],
                                        window is not None, *attn_metadata.warm_up,
                                        query.device):
                launch(num_splits=splits)
        launch()
        return output
