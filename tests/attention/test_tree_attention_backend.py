"""The TREE_ATTN backend inside vLLM on the CPU: registered by name, taking CPU_ATTN's place
under ddtree; in a batch mixing tree and plain requests, the backend's metadata builder and
forward (CPU_ATTN runs for plain requests, masked attention for tree requests) match the
dense reference; the tree path reads every packing of CPU_ATTN's cache right; and so do the
CUDA backend's metadata builder and forward, run on CPU tensors under Triton's interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_cases import dense_reference, make_batch, require_cpu_attn_isa


def test_tree_attn_is_registered_and_takes_cpu_attns_place() -> None:
    """The plugin registers TREE_ATTN by name (this platform's implementation); a ddtree
    engine's speculator makes the CPU platform, which answers CPU_ATTN whatever is selected,
    answer TREE_ATTN's CPU backend (CPU_ATTN itself for rows without a tree)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    import vllm_ddtree
    from vllm_ddtree.attention import CPU_BACKEND_PATH
    from vllm_ddtree.spec_decode.speculator import _tree_attention_on_cpu

    vllm_ddtree.register()
    assert AttentionBackendEnum["TREE_ATTN"].get_path() == CPU_BACKEND_PATH
    config = AttentionSelectorConfig(**{f: False for f in AttentionSelectorConfig._fields} | {
        "head_size": 64, "dtype": torch.bfloat16, "kv_cache_dtype": "auto",
        "block_size": 32, "attn_type": "decoder"})
    _tree_attention_on_cpu()
    assert CpuPlatform.get_attn_backend_cls(None, config) == CPU_BACKEND_PATH


def cpu_builder(batch, dtype, window: int | None = None):
    """The backend's metadata builder, without a VllmConfig: only what build() reads."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_ddtree.attention.cpu_backend import TreeAttentionCPUMetadataBuilder

    builder = object.__new__(TreeAttentionCPUMetadataBuilder)
    page, kv_heads, head_size = batch.key_cache.shape[1:]
    builder.__dict__.update(
        num_heads=batch.query.shape[1], num_kv_heads=kv_heads, head_dim=head_size,
        dtype=dtype, window_size=window or -1, block_size=page, kv_cache_dtype="auto",
        isa=_get_attn_isa(dtype, page, head_size, "auto"), is_cross_attention=False,
        is_encoder_only_attention=False)
    return builder


# (sliding window, sinks): plain layers, and gpt-oss's windowed layers with sinks.
WINDOW_SINKS = [(None, False), (6, True)]


def layer_sinks(heads: int, with_sinks: bool) -> torch.Tensor | None:
    return torch.linspace(-2.0, 3.0, heads) if with_sinks else None


def run_cpu_mixed_batch(batch, dtype, monkeypatch, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """``batch`` through TREE_ATTN's CPU backend as vLLM drives it: the keys and values
    written by the impl's KV update (CPU_ATTN's op, which packs keys per ISA), metadata from
    the builder, then the impl's forward. Returns the tree requests and the output."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends import cpu_attn

    from vllm_ddtree.attention import tree_batch
    from vllm_ddtree.attention.cpu_backend import TreeAttentionCPUImpl

    num_reqs, (num_blocks, page, kv_heads, head_size) = len(batch.seq_lens), \
        batch.key_cache.shape
    builder = cpu_builder(batch, dtype, window)
    # The impl reads only the model dtype from the current config.
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))
    impl = TreeAttentionCPUImpl(batch.query.shape[1], head_size, batch.scale, kv_heads, None,
                                window, "auto", sinks=sinks)
    # vLLM gives each layer its builder's ISA (CPUAttentionMetadataBuilder._set_isa_to_layers).
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, isa=builder.isa)
    kv_cache = torch.zeros(num_blocks, kv_heads, page, 2 * head_size, dtype=dtype)
    impl.do_kv_cache_update(layer, batch.key_cache.flatten(0, 1),
                            batch.value_cache.flatten(0, 1), kv_cache,
                            torch.arange(num_blocks * page))
    slots = torch.zeros(batch.query.shape[0], dtype=torch.int64)
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, query_start_loc_cpu=batch.query_start_loc,
        seq_lens=batch.seq_lens, num_reqs=num_reqs, num_actual_tokens=batch.query.shape[0],
        max_query_len=int(batch.query_start_loc.diff().max()),
        max_seq_len=int(batch.seq_lens.max()), block_table_tensor=batch.block_table,
        slot_mapping=slots)
    trees = tree_batch.TreeBatch(16, 11, "cpu")
    trees.set_trees(batch.tree_index, batch.ancestor_mask, batch.depths)
    builder.read_trees(trees)
    metadata = builder.build(0, common)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(layer, batch.query, None, None, kv_cache, metadata, out)
    return metadata.tree_requests, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kinds, contexts", [
    (["prefill", "bushy", "decode", "decode", "chain", "prefill"], [40, 7, 90, 33, 0, 64]),
    (["star", "deep"], [31, 64]),
    (["decode", "prefill"], [12, 70]),
])
@pytest.mark.parametrize("window, with_sinks", WINDOW_SINKS)
def test_cpu_backend_mixed_batch_matches_reference(dtype, kinds, contexts, window, with_sinks,
                                                   monkeypatch) -> None:
    batch = make_batch(7, kinds, 12, contexts, 8, 2, 64, 32, dtype)
    sinks = layer_sinks(8, with_sinks)
    tree_requests, out = run_cpu_mixed_batch(batch, dtype, monkeypatch, window, sinks)
    assert tree_requests == [r for r, k in enumerate(kinds) if k not in ("prefill", "decode")]
    # Plain requests ran through CPU_ATTN's kernel, tree requests through the torch path.
    err = (out.double() - dense_reference(batch, window, sinks)).abs().max().item()
    assert err <= (1e-4 if dtype == torch.float32 else 3e-2), err


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page, head_size", [(32, 64), (128, 128)])
def test_strided_reading_of_every_cpu_attn_packing(isa, dtype, page, head_size) -> None:
    require_cpu_attn_isa(isa, dtype)
    # Each packing CPU_ATTN's cache-write op has (probed from the op on this machine, for
    # every ISA's layout) reads through a strided view, and that view gives what the
    # definition of the layout (a gather by `perm`) gives.
    from vllm_ddtree.attention.cpu_backend import block_reading, read_tiles, slot_views

    gen = torch.Generator().manual_seed(page + head_size)
    cache = torch.randn(6, 2, page, head_size, generator=gen).to(dtype)
    blocks = torch.tensor([4, 0, 5, 4])
    for perm, form in block_reading(isa, dtype, page, head_size):
        assert form is not None
        want = cache[blocks].flatten(2)[:, :, perm].view(4, 2, page, head_size)
        assert torch.equal(read_tiles(cache, blocks, perm, form), want)
        assert torch.equal(read_tiles(cache, blocks, perm, None), want)
    # A single token and dim stride (a 4-D view of the packing) except amx's 16-token slabs.
    kv = torch.zeros(6, 2, page, 2 * head_size, dtype=dtype)
    assert (slot_views(SimpleNamespace(isa=isa), kv) is None) == (isa == "amx")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("isa, page, head_size", [
    (isa, page, head) for isa in ("vec", "vec16", "amx")
    for page, head in ((32, 64), (640, 64), (288, 512))
    if not (isa == "amx" and head > 256)])  # amx takes head sizes up to 256
def test_the_probed_layout_reads_what_cpu_attn_wrote(isa, dtype, page, head_size) -> None:
    """Keys and values written by CPU_ATTN's own cache-write op read back exactly, through
    the probed layout, at blocks of more than 256 tokens too (a hybrid target's attention
    blocks take 640 on CPU; bf16 holds integers exactly only up to 256)."""
    require_cpu_attn_isa(isa, dtype)
    from vllm import _cpu_ops as ops

    from vllm_ddtree.attention.cpu_backend import block_reading, read_tiles

    gen = torch.Generator().manual_seed(page)
    key, value = (torch.randn(page, 1, head_size, generator=gen).to(dtype) for _ in range(2))
    kv = torch.zeros(2, 1, 2 * page, head_size, dtype=dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                   page + torch.arange(page), isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    for cache, want, (perm, form) in zip((key_cache, value_cache), (key, value),
                                         block_reading(isa, dtype, page, head_size)):
        tiles = read_tiles(cache, torch.tensor([1]), perm, form)
        assert torch.equal(tiles[0, 0], want[:, 0])


def test_a_packing_without_strided_form_is_gathered() -> None:
    from vllm_ddtree.attention.cpu_backend import read_tiles, strided_form

    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(16 * 8, generator=gen)
    assert strided_form(perm, 16, 8) is None
    cache = torch.randn(3, 2, 16, 8, generator=gen)
    tiles = read_tiles(cache, torch.tensor([2, 1]), perm, None)
    for n, block in enumerate((2, 1)):
        for h in range(2):
            for t, d in ((0, 0), (5, 3), (15, 7)):
                assert tiles[n, h, t, d] == cache[block, h].flatten()[perm[t * 8 + d]]


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compaction_of_every_cpu_attn_packing(isa, dtype) -> None:
    require_cpu_attn_isa(isa, dtype)
    # Compaction in CPU_ATTN's packed cache (the native op over slot views for vec and
    # vec16, the host path for amx's slabs) moves exactly what the reference moves in the
    # unpacked keys and values, bit for bit, in every layer.
    from tree_cases import follow_choices, random_topk

    from vllm_ddtree import ops, reference
    from vllm_ddtree.attention.cpu_backend import CPUAttnCompaction, block_layout

    page, head_size, heads, num_blocks = 32, 64, 2, 5
    roots, logprobs, ids = random_topk(7, 3, 6, 8, 8, ties=False)
    trees = ops.build_tree(roots, logprobs, ids, 20)
    verdict = ops.verify_tree(trees, follow_choices(trees, 7, 0.9), 6)
    assert int((verdict.accepted > torch.arange(2, 8)).sum()) > 0  # some entries move
    gen = torch.Generator().manual_seed(1)
    qsl = torch.arange(4, dtype=torch.int32) * 21
    slots = torch.randperm(num_blocks * page, generator=gen)[:63]
    layer = SimpleNamespace(isa=isa)
    caches = [torch.randn(num_blocks, heads, page, 2 * head_size, generator=gen).to(dtype)
              for _ in range(2)]

    def unpacked(cache: torch.Tensor) -> list[torch.Tensor]:
        tiles = cache.view(num_blocks, heads, 2, page * head_size)
        return [tiles[:, :, side][:, :, perm].view(num_blocks, heads, page, head_size)
                for side, perm in enumerate(block_layout(isa, dtype, page, head_size))]

    want = [t.clone() for c in caches for t in unpacked(c)]
    reference.compact_tree(want, torch.empty(0), slots, qsl, verdict.accepted,
                           verdict.num_accepted)
    compact = CPUAttnCompaction([(layer, c) for c in caches])
    assert len(compact.packed) == (2 if isa == "amx" else 0)
    compact(slots, qsl, verdict)
    got = [t for c in caches for t in unpacked(c)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("kinds, contexts", [
    (["prefill", "bushy", "decode", "chain"], [40, 7, 90, 0]),
    (["star", "deep"], [31, 64]),
])
@pytest.mark.parametrize("window, with_sinks", WINDOW_SINKS)
def test_cuda_backend_glue_on_the_interpreter(kinds, contexts, window, with_sinks) -> None:
    # The CUDA backend's own code (metadata builder, forward over the Triton backend's cache
    # layout) has no GPU to run on here: run it on CPU tensors, the kernel under Triton's
    # interpreter, against the dense reference. (vLLM turns its own Triton kernels off on
    # a CPU-only machine, so the cache is written here, in the layout the Triton backend
    # documents and writes: [blocks, kv_heads, block_size, 2 * head_size], K then V.)
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_ddtree.attention import tree_batch
    from vllm_ddtree.attention.backend import TreeAttentionImpl, TreeAttentionMetadataBuilder

    dtype = torch.float32
    batch = make_batch(3, kinds, 12, contexts, 8, 2, 64, 16, dtype)
    num_reqs, kv_heads, head_size = len(kinds), *batch.key_cache.shape[2:]
    sinks = layer_sinks(8, with_sinks)
    impl = TreeAttentionImpl(8, head_size, batch.scale, kv_heads, None, window, "auto",
                             sinks=sinks)
    kv_cache = torch.cat([batch.key_cache, batch.value_cache], dim=-1).transpose(1, 2)
    builder = object.__new__(TreeAttentionMetadataBuilder)
    builder._no_trees = tree_batch.TreeBatch(16, 0, "cpu")
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, query_start_loc_cpu=batch.query_start_loc,
        seq_lens=batch.seq_lens, num_reqs=num_reqs, num_actual_tokens=batch.query.shape[0],
        max_query_len=int(batch.query_start_loc.diff().max()),
        max_seq_len=int(batch.seq_lens.max()), block_table_tensor=batch.block_table,
        slot_mapping=torch.zeros(batch.query.shape[0], dtype=torch.int64))
    trees = tree_batch.TreeBatch(16, 11, "cpu")
    trees.set_trees(batch.tree_index, batch.ancestor_mask, batch.depths)
    plain = builder.build(0, common)  # before it is handed trees
    builder.read_trees(trees)
    metadata = builder.build(0, common)
    # Padding rows past the batch's tokens are left alone.
    out = torch.full((batch.query.shape[0] + 3, *batch.query.shape[1:]), float("nan"))
    query = torch.cat([batch.query, torch.randn(3, *batch.query.shape[1:])])
    impl.forward(None, query, None, None, kv_cache, metadata, out)
    err = (out[:-3].double() - dense_reference(batch, window, sinks)).abs().max().item()
    assert err <= 1e-4, err
    assert out[-3:].isnan().all()
    # Without trees handed to it every request runs causal: a plain batch's attention.
    assert (plain.tree_index == -1).all()
    # vLLM's fusion pass must not hand it output scales (its forward refuses them).
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym

    assert not impl.fused_output_quant_supported(kFp8StaticTensorSym)
