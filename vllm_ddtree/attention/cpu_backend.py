"""TREE_ATTN on the CPU: vLLM's CPU_ATTN for requests without a tree, masked attention
for tree requests (CPU_ATTN's kernel takes no mask).

A batch without trees runs exactly as CPU_ATTN. In a mixed batch, each maximal run of
consecutive plain requests is one CPU_ATTN call (its scheduler metadata rebuilt for the run
when metadata is built, once per step), and the tree requests go through
``torch_tree_attention`` (planned once per step and window size, run per layer). Sliding
windows and attention sinks go to both. The KV cache is CPU_ATTN's, written by CPU_ATTN's
own op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from vllm import _cpu_ops as ops
from vllm import envs
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.attention.features import TreeAttentionFeatures, refuse_unsupported
from vllm_ddtree.attention.torch_tree_attention import TreeGroup, attend, plan_tree_groups
from vllm_ddtree.attention.tree_batch import TreeBatchReader
from vllm_ddtree.ops import compact_tree
from vllm_ddtree.tree import Verdict

EXACT_DIGITS = 256  # integers 1..256 are exact in bf16; block_layout probes in this base


@functools.cache
def block_layout(isa: str, dtype: torch.dtype, block_size: int,
                 head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where CPU_ATTN's cache-write op puts each (token, dim) of a block, for keys and for
    values: index tensors ``perm`` with ``tile.flatten()[perm[t * head_size + d]]`` holding
    element (t, d). The op packs keys per ISA (for "vec": dim pairs major, tokens minor); the
    map is read off the op itself, by writing each token's index, then each dim's index, in
    base-256 digits (a digit + 1 is at most 256: exact in every supported dtype, bf16
    included; a whole index past 256 is not, and hybrid targets' blocks hold 640 tokens)."""
    perms = []
    coords = (torch.arange(block_size).view(-1, 1, 1).expand(-1, 1, head_size),
              torch.arange(head_size).view(1, 1, -1).expand(block_size, 1, -1))
    for side in (0, 1):
        found = []
        for coord in coords:
            index = torch.zeros(block_size * head_size, dtype=torch.long)
            for scale in (1, EXACT_DIGITS):
                kv = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
                key_cache, value_cache = kv.chunk(2, dim=2)
                values = (coord // scale % EXACT_DIGITS + 1).to(dtype).contiguous()
                ops.cpu_attn_reshape_and_cache(values, values, key_cache, value_cache,
                                               torch.arange(block_size), isa, k_scale=1.0,
                                               v_scale=1.0, kv_cache_dtype="auto")
                index += scale * ((key_cache, value_cache)[side].flatten().long() - 1)
            found.append(index)
        token, dim = found
        perm = torch.empty(block_size * head_size, dtype=torch.long)
        perm[token * head_size + dim] = torch.arange(block_size * head_size)
        perms.append(perm)
    return perms[0], perms[1]


def strided_form(perm: torch.Tensor, block_size: int,
                 head_size: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``perm`` (see ``block_layout``) as sizes and strides of a strided view of a tile, when
    it is one: tokens split as (t1, t0) and dims as (d1, d0) with offset linear in each (every
    packing CPU_ATTN has is: keys dim-major for "vec", in 16-token slabs for "amx", dim pairs
    for bf16). Reading through the view is a plain strided copy; a gather by ``perm`` was
    about 6x slower. None when no such form fits."""
    where = perm.view(block_size, head_size)
    for slab in (s for s in range(1, block_size + 1) if block_size % s == 0):
        for pack in (e for e in range(1, head_size + 1) if head_size % e == 0):
            sizes = (block_size // slab, slab, head_size // pack, pack)
            strides = tuple(int(where[t, d]) for t, d in (
                (slab % block_size, 0), (1 % block_size, 0), (0, pack % head_size),
                (0, 1 % head_size)))
            if sum((n - 1) * st for n, st in zip(sizes, strides)) >= block_size * head_size:
                continue  # would reach past the tile
            view = torch.arange(block_size * head_size).as_strided(sizes, strides)
            if torch.equal(view.reshape(block_size, head_size), where):
                return sizes, strides
    return None


@functools.cache
def block_reading(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple:
    """``(perm, strided_form)`` for keys and for values, worked out once per layout."""
    return tuple((perm, strided_form(perm, block_size, head_size))
                 for perm in block_layout(isa, dtype, block_size, head_size))


def read_tiles(cache: torch.Tensor, blocks: torch.Tensor, perm: torch.Tensor,
               form: tuple[tuple[int, ...], tuple[int, ...]] | None) -> torch.Tensor:
    """Blocks of one side (keys or values) of CPU_ATTN's cache, unpacked: a strided view
    ``[n, heads, block_size, head_size]`` of a copy of the blocks (``reshape`` copies again
    only where the packing has no single token and dim stride: amx's slabs)."""
    tiles = cache.index_select(0, blocks)  # [n, heads, block_size, head_size], packed
    n, heads, block_size, head_size = tiles.shape
    if form is None:
        tiles = tiles.flatten(2)[:, :, perm]
    else:
        sizes, strides = form
        tiles = tiles.as_strided((n, heads, *sizes), tiles.stride()[:2] + strides)
    return tiles.reshape(n, heads, block_size, head_size)


def slot_views(layer, cache: torch.Tensor) -> list[torch.Tensor] | None:
    """One layer's CPU_ATTN keys and values as views ``[blocks, kv_heads, block_size,
    head_size]`` of its cache, the form ``compact_tree`` takes, when each side's packing is
    one (one token stride and one dim stride: ISAs vec and vec16; amx packs tokens in slabs
    of 16). None otherwise."""
    blocks, heads, page, width = cache.shape
    head_size = width // 2
    tiles = cache.view(blocks, heads, 2, page * head_size)  # keys tile, values tile
    views = []
    for side, (_, form) in enumerate(block_reading(layer.isa, cache.dtype, page, head_size)):
        if form is None:
            return None
        sizes, strides = form
        split = tiles[:, :, side].as_strided((blocks, heads, *sizes),
                                             tiles.stride()[:2] + strides)
        try:
            views.append(split.view(blocks, heads, page, head_size))
        except RuntimeError:  # no single token or dim stride
            return None
    return views


class CPUAttnCompaction:
    """compact_tree for the target's CPU_ATTN caches, whose keys are packed per ISA inside a
    block: the native op over the layers' slot views (bound once), and for layers whose
    packing has none, boolean masks on the host (the CPU has no graph to break)."""

    def __init__(self, layers: list) -> None:
        self.views: list[torch.Tensor] = []
        self.packed = []
        for layer, cache in layers:
            views = slot_views(layer, cache)
            if views is None:
                self.packed.append((layer, cache))
            else:
                self.views += views

    def __call__(self, slot_mapping: torch.Tensor, qsl: torch.Tensor, verdict: Verdict) -> None:
        if self.views:
            compact_tree(self.views, qsl.new_empty(0), slot_mapping, qsl, verdict)
        if self.packed:
            _compact_packed(self.packed, slot_mapping, qsl, verdict)


def _compact_packed(layers: list, slot_mapping: torch.Tensor, qsl: torch.Tensor,
                    verdict: Verdict) -> None:
    step = torch.arange(verdict.accepted.shape[1], device=qsl.device)
    moves = (step < verdict.num_accepted[:, None]) & (verdict.accepted != step + 1)
    src = (qsl[:-1, None] + verdict.accepted)[moves]
    dst = (qsl[:-1, None] + step + 1).expand_as(moves)[moves]
    if src.numel() == 0:
        return
    src_slots, dst_slots = slot_mapping[src].long(), slot_mapping[dst].long()
    for layer, cache in layers:
        blocks, heads, page, width = cache.shape
        head_size = width // 2
        perm_k, perm_v = block_layout(layer.isa, cache.dtype, page, head_size)
        tiles = cache.view(blocks, heads, 2, page * head_size)  # keys tile, values tile
        for side, perm in ((0, perm_k), (1, perm_v)):
            where = perm.view(page, head_size)
            read = where[src_slots % page]  # [moves, head_size] offsets in the tile
            write = where[dst_slots % page]
            h = torch.arange(heads)[None, :, None]
            values = tiles[(src_slots // page)[:, None, None], h, side, read[:, None, :]]
            tiles[(dst_slots // page)[:, None, None], h, side, write[:, None, :]] = values


class TreeAttentionCPUBackend(TreeAttentionFeatures, CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeAttentionCPUImpl]:
        return TreeAttentionCPUImpl

    @staticmethod
    def get_builder_cls() -> type[TreeAttentionCPUMetadataBuilder]:
        return TreeAttentionCPUMetadataBuilder


@dataclass
class PlainRun:
    """Consecutive requests without a tree, as one CPU_ATTN call."""

    tokens: slice
    query_start_loc: torch.Tensor  # rebased to 0
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class TreeAttentionCPUMetadata(CPUAttentionMetadata):
    tree_requests: list[int] = field(default_factory=list)
    tree_plan: tuple = ()  # plan_tree_groups' arguments but the window
    planned: dict[int | None, list[TreeGroup]] = field(default_factory=dict)
    plain_runs: list[PlainRun] = field(default_factory=list)

    def tree_groups(self, sliding_window: int | None) -> list[TreeGroup]:
        """The tree requests' groups for layers of this window: planned by the first such
        layer of the step, reused by the others (a KV cache group may mix windows)."""
        if sliding_window not in self.planned:
            self.planned[sliding_window] = plan_tree_groups(*self.tree_plan, sliding_window)
        return self.planned[sliding_window]


class TreeAttentionCPUMetadataBuilder(TreeBatchReader, CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TreeAttentionCPUMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata = TreeAttentionCPUMetadata(**base.__dict__)
        trees = self.trees
        num_reqs = common_attn_metadata.num_reqs
        if trees is None:  # the drafter's builders, and engines without trees
            return metadata
        index = trees.tree_index[:num_reqs]
        kinds = index.tolist()
        metadata.tree_requests = [r for r, t in enumerate(kinds) if t >= 0]
        if not metadata.tree_requests:
            return metadata
        cm = common_attn_metadata
        metadata.tree_plan = (
            cm.query_start_loc_cpu, cm.seq_lens[:num_reqs], cm.block_table_tensor, index,
            trees.ancestor_mask, metadata.tree_requests, self.block_size, self.num_heads)
        r = 0
        while r < num_reqs:
            if kinds[r] >= 0:
                r += 1
                continue
            end = r
            while end < num_reqs and kinds[end] < 0:
                end += 1
            metadata.plain_runs.append(self._plain_run(common_attn_metadata, r, end))
            r = end
        return metadata

    def _plain_run(self, cm: CommonAttentionMetadata, start: int, end: int) -> PlainRun:
        qsl = cm.query_start_loc[start:end + 1]
        rebased = (qsl - qsl[0]).to(torch.int32)
        seq_lens = cm.seq_lens[start:end]
        return PlainRun(
            tokens=slice(int(qsl[0]), int(qsl[-1])), query_start_loc=rebased,
            seq_lens=seq_lens, block_table=cm.block_table_tensor[start:end],
            scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                num_reqs=end - start, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype,
                query_start_loc=rebased, causal=True, sliding_window_size=self.window_size,
                isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype))


class TreeAttentionCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = "decoder", kv_sharing_target_layer_name=None,
                 sinks=None, **kwargs) -> None:
        refuse_unsupported(alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                           **kwargs)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)

    @staticmethod
    def kv_compaction(layers: list) -> CPUAttnCompaction:
        """compact_tree bound to one KV-cache group's (layer, cache) pairs, in CPU_ATTN's
        packing. Called with (slot_mapping, query_start_loc, verdict)."""
        return CPUAttnCompaction(layers)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        md = attn_metadata
        if md is None or not md.tree_requests:
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TREE_ATTN does not fuse output quantization")
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.float()  # as CPU_ATTN does: its kernel takes these two
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        # CPU_ATTN's cache: per (block, head) block_size keys, then block_size values.
        key_cache, value_cache = kv_cache.view(
            num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        for run in md.plain_runs:
            ops.cpu_attention_with_kv_cache(
                query=query[run.tokens], key_cache=key_cache, value_cache=value_cache,
                output=output[run.tokens], query_start_loc=run.query_start_loc,
                seq_lens=run.seq_lens, scale=self.scale, causal=True, alibi_slopes=None,
                sliding_window=self.sliding_window, block_table=run.block_table, softcap=0,
                scheduler_metadata=run.scheduler_metadata, s_aux=self.sinks,
                dynamic_causal=None,
                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype)
        reading = block_reading(layer.isa, key_cache.dtype, block_size, self.head_size)

        def read_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(read_tiles(cache, blocks, perm, form)
                         for cache, (perm, form) in zip((key_cache, value_cache), reading))

        window = self.sliding_window if self.sliding_window > 0 else None
        attend(query, output, md.tree_groups(window), self.scale, read_blocks, self.sinks)
        return output
