"""The hybrid models' prefix-caching kernels (``vllm/v1/worker/mamba_utils.py``): PyTorch
(cpu_standin.kernels.mamba) against the Triton kernels in Triton's interpreter,
on random and edge inputs, bit for bit.

The copy kernels take raw addresses. Each call builds the metadata (the state tensors' and
block tables' ``data_ptr()``s, strides, sizes) from its own deep copies, as
``MambaSpecDecodeGPUContext._populate_metadata`` does, so that each run copies within its
own tensors; ``run_both`` then compares the state tensors and every other argument."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from kernel_harness import run_both
from vllm.v1.worker import mamba_utils
from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

from cpu_standin.kernels.mamba import MAMBA_UTILS

PREPROCESS = f"{MAMBA_UTILS}.preprocess_mamba_align_fused_kernel"
PRECOPY = f"{MAMBA_UTILS}.precopy_mamba_align_fused_kernel"
POSTPROCESS = f"{MAMBA_UTILS}.postprocess_mamba_fused_kernel"

MAX_REQS, MAX_BLOCKS, NUM_BLOCKS = 8, 12, 10


def rand(gen: torch.Generator, low: int, high: int, *shape: int,
         dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


# ----------------------------------------------------------------------------- model


@dataclass
class Model:
    """Mamba state tensors (a conv and a temporal state a layer, as GDN's) and one block
    table per Mamba group."""

    states: list[torch.Tensor]
    conv: list[bool]  # per state: a conv state (else temporal)
    groups: list[int]  # per state: its group's block table
    tables: list[torch.Tensor]  # [MAX_REQS, MAX_BLOCKS] int32, one a group
    dim_first: bool  # conv states (num_blocks, dim, state_len), else (.., state_len, dim)


def make_model(gen: torch.Generator, dim_first: bool, layers: list[tuple[int, int, torch.dtype]],
               padded: bool = False) -> Model:
    """``layers``: (group, conv state length, dtype) of each layer; ``padded``: the last
    temporal state a view with padded pages (block stride over its data)."""
    states, conv, groups = [], [], []
    for i, (group, width, dtype) in enumerate(layers):
        dim = 6 + 2 * i
        shape = (NUM_BLOCKS, dim, width) if dim_first else (NUM_BLOCKS, width, dim)
        states.append(torch.randn(shape, generator=gen).to(dtype))
        temporal = torch.randn(NUM_BLOCKS, 2, 3, 5, generator=gen).to(dtype)
        if padded and i == len(layers) - 1:
            raw = torch.randn(NUM_BLOCKS * 40, generator=gen).to(dtype)
            temporal = raw.as_strided((NUM_BLOCKS, 2, 3, 5), (40, 15, 5, 1))
        states.append(temporal)
        conv += [True, False]
        groups += [group, group]
    num_groups = max(groups) + 1
    tables = [rand(gen, 0, NUM_BLOCKS, MAX_REQS, MAX_BLOCKS) for _ in range(num_groups)]
    return Model(states, conv, groups, tables, dim_first)


def context(model: Model) -> MambaSpecDecodeGPUContext:
    """vLLM's context for the copy kernels, its metadata from ``model``'s tensors as
    ``_populate_metadata`` computes it."""
    n, num_groups = len(model.states), len(model.tables)

    def zeros(dtype: torch.dtype, size: int = n) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype)

    ctx = MambaSpecDecodeGPUContext(
        state_base_addrs=zeros(torch.int64), state_block_strides=zeros(torch.int64),
        state_elem_sizes=zeros(torch.int32), state_inner_sizes=zeros(torch.int64),
        state_conv_widths=zeros(torch.int32), state_group_indices=zeros(torch.int32),
        state_dim_row_count=zeros(torch.int32), state_dim_row_stride=zeros(torch.int64),
        block_size=4, num_states=n, mamba_group_ids=list(range(num_groups)),
        num_groups=num_groups, num_accepted_tokens_snapshot=zeros(torch.int32, MAX_REQS),
        block_table_ptrs=zeros(torch.int64, num_groups),
        aligned_index_block_table_ptrs=zeros(torch.int64, num_groups),
        is_initialized=True)
    for i, (state, is_conv) in enumerate(zip(model.states, model.conv)):
        elem = state.element_size()
        ctx.state_base_addrs[i] = state.data_ptr()
        ctx.state_block_strides[i] = state.stride(0) * elem
        ctx.state_elem_sizes[i] = elem
        ctx.state_group_indices[i] = model.groups[i]
        if not is_conv:
            ctx.state_inner_sizes[i] = state[0].numel()
        elif model.dim_first:
            ctx.state_conv_widths[i] = state.size(2)
            ctx.state_inner_sizes[i] = 1
            ctx.state_dim_row_count[i] = state.size(1)
            ctx.state_dim_row_stride[i] = state.stride(1) * elem
        else:
            ctx.state_conv_widths[i] = state.size(1)
            ctx.state_inner_sizes[i] = state.stride(1)
    for g, table in enumerate(model.tables):
        ctx.block_table_ptrs[g] = table.data_ptr()
    ctx.block_table_stride_req = model.tables[0].stride(0)
    return ctx


def metadata_args(ctx: MambaSpecDecodeGPUContext) -> tuple:
    return (ctx.block_table_ptrs, ctx.block_table_stride_req, ctx.state_base_addrs,
            ctx.state_block_strides, ctx.state_elem_sizes, ctx.state_inner_sizes,
            ctx.state_conv_widths, ctx.state_group_indices, ctx.state_dim_row_count,
            ctx.state_dim_row_stride)


def batch(gen: torch.Generator, num_reqs: int, filtered: bool) -> torch.Tensor:
    idx_mapping = torch.randperm(MAX_REQS, generator=gen)[:num_reqs].to(torch.int32)
    if filtered and num_reqs > 2:
        idx_mapping[1] = -1  # a filtered row (pipeline parallelism)
    return idx_mapping


# --------------------------------------------------------------------------- preprocess


def preprocess(idx_mapping, state_idx, computed, query_start_loc, accepted, src_col, src_off,
               num_reqs: int, block: int, mamba_block_size: int, has_idx_mapping: bool):
    mamba_utils.preprocess_mamba_align_fused_kernel[(-(-num_reqs // block),)](
        idx_mapping, state_idx, computed, query_start_loc, accepted, src_col, src_off,
        num_reqs, BLOCK_SIZE=block, MAMBA_BLOCK_SIZE=mamba_block_size,
        HAS_IDX_MAPPING=has_idx_mapping)


@pytest.mark.parametrize("num_reqs,block,has_idx_mapping",
                         [(0, 4, True), (1, 256, True), (7, 4, True), (8, 256, True),
                          (6, 4, False)])
def test_preprocess_align(num_reqs: int, block: int, has_idx_mapping: bool) -> None:
    gen = torch.Generator().manual_seed(10 + num_reqs * 3 + block)
    mamba_block_size = 4
    idx_mapping = batch(gen, num_reqs, filtered=True)
    if not has_idx_mapping:
        idx_mapping = torch.arange(num_reqs, dtype=torch.int32)
    computed = rand(gen, 0, 40, MAX_REQS)
    query_lens = rand(gen, 0, 9, num_reqs)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    # Running columns: fresh (-1), the block before, the block itself.
    state_idx = rand(gen, -1, 11, MAX_REQS)
    accepted = rand(gen, 1, 5, MAX_REQS)
    src_col = rand(gen, -9, -5, MAX_REQS)
    src_off = rand(gen, -9, -5, MAX_REQS)
    run_both(PREPROCESS, preprocess, idx_mapping if has_idx_mapping else None, state_idx,
             computed, query_start_loc, accepted, src_col, src_off, num_reqs, block,
             mamba_block_size, has_idx_mapping)


# ------------------------------------------------------------------------------ precopy


def precopy(model: Model, num_reqs: int, state_idx, src_col, token_bias, idx_mapping,
            zero_temporal: bool, tiles: int) -> None:
    ctx = context(model)
    grid = (num_reqs, ctx.num_states, tiles)
    mamba_utils.precopy_mamba_align_fused_kernel[grid](
        state_idx, src_col, token_bias, *metadata_args(ctx), idx_mapping, num_reqs,
        COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=model.dim_first,
        HAS_IDX_MAPPING=idx_mapping is not None, ZERO_TEMPORAL_TOKEN_BIAS=zero_temporal,
        TEMPORAL_TILES=tiles)


def precopy_inputs(gen: torch.Generator, model: Model, width: int):
    """Per request slot: the new running column, the old one (-1: fresh; the same: no
    copy) and the token bias; some slots' two columns mapped to the same block."""
    dst = rand(gen, 1, 8, MAX_REQS)
    src = torch.where(torch.rand(MAX_REQS, generator=gen) < 0.7, dst - 1, dst)
    src[0], src[1] = -1, dst[1] - 1
    bias = rand(gen, 0, width + 2, MAX_REQS)
    bias[1] = 1
    for table in model.tables:  # a same-block shift: slot 1 (and a random one)
        same = int(rand(gen, 2, MAX_REQS, 1))
        for slot in (1, same):
            table[slot, int(dst[slot])] = table[slot, max(int(src[slot]), 0)]
    return dst, src, bias


LAYERS = {
    "f32": [(0, 4, torch.float32)],
    "bf16_two_layers": [(0, 3, torch.bfloat16), (0, 4, torch.bfloat16)],
    "two_groups": [(0, 4, torch.float16), (1, 4, torch.float32)],
    "f64": [(0, 4, torch.float64)],  # (the DS kernel's byte-wise copy)
}


@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("layers", list(LAYERS))
def test_precopy(dim_first: bool, layers: str) -> None:
    gen = torch.Generator().manual_seed(20 + 2 * list(LAYERS).index(layers) + dim_first)
    model = make_model(gen, dim_first, LAYERS[layers], padded=layers == "two_groups")
    dst, src, bias = precopy_inputs(gen, model, width=4)
    idx_mapping = batch(gen, 5, filtered=True)
    idx_mapping[0], idx_mapping[2] = 1, 0  # the same-block slot, the fresh slot
    _, got = run_both(PRECOPY, precopy, model, 5, dst, src, bias, idx_mapping, False, 2)
    assert not torch.equal(got[0][0].states[0], model.states[0])  # (something was copied)


@pytest.mark.parametrize("case", ["no_idx_mapping", "zero_temporal_bias", "empty", "tiles"])
def test_precopy_flags(case: str) -> None:
    gen = torch.Generator().manual_seed(40 + ["no_idx_mapping", "zero_temporal_bias",
                                             "empty", "tiles"].index(case))
    model = make_model(gen, False, [(0, 4, torch.bfloat16)])
    dst, src, bias = precopy_inputs(gen, model, width=4)
    num_reqs = 0 if case == "empty" else 4
    idx_mapping = None if case == "no_idx_mapping" else batch(gen, num_reqs, filtered=True)
    tiles = 16 if case == "tiles" else 1
    run_both(PRECOPY, precopy, model, num_reqs if case != "tiles" else 2, dst, src, bias,
             idx_mapping, case == "zero_temporal_bias", tiles)


def test_precopy_fewer_tiles_than_temporal_tiles_falls_back() -> None:
    gen = torch.Generator().manual_seed(50)
    model = make_model(gen, False, [(0, 4, torch.float32)])
    dst, src, bias = precopy_inputs(gen, model, width=4)

    def launch(model: Model, dst, src, bias) -> None:
        ctx = context(model)
        mamba_utils.precopy_mamba_align_fused_kernel[(2, ctx.num_states, 1)](
            dst, src, bias, *metadata_args(ctx), None, 2, COPY_BLOCK_SIZE=1024,
            CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=False, TEMPORAL_TILES=2)

    run_both(PRECOPY, launch, model, dst, src, bias, fallback=True)


# -------------------------------------------------------------------------- postprocess


def postprocess(model: Model, num_reqs: int, accepted, state_idx, scheduled, computed, drafts,
                accepted_out, idx_mapping, precomputed: bool, skip_temporal: bool,
                tiles: int) -> None:
    ctx = context(model)
    grid = (num_reqs, ctx.num_states, tiles)
    mamba_utils.postprocess_mamba_fused_kernel[grid](
        accepted, state_idx, scheduled, computed, drafts, *metadata_args(ctx), accepted_out,
        idx_mapping, num_reqs, block_size=ctx.block_size, COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=model.dim_first, HAS_IDX_MAPPING=idx_mapping is not None,
        PRECOMPUTED_NEW_COMPUTED=precomputed, SKIP_TEMPORAL_STATE_COPY=skip_temporal,
        TEMPORAL_TILES=tiles)


def postprocess_inputs(gen: torch.Generator, model: Model) -> SimpleNamespace:
    """Per request slot, with blocks of 4 tokens: accepted tokens (1-4) after the running
    state's position, the post-step computed count, the running column (mostly the one
    holding the running state, some the boundary's own: a reset), the same counts as
    scheduled, computed (pre-step) and draft tokens."""
    block_size = 4
    accepted = rand(gen, 1, 5, MAX_REQS)
    new_computed = rand(gen, 5, 36, MAX_REQS)
    new_computed[0], accepted[0] = 8, 3  # a boundary crossed with a bias
    new_computed[1], accepted[1] = 12, 1  # reaching a boundary exactly
    running = new_computed - accepted + 1
    dst = new_computed // block_size - 1
    state_idx = torch.where(torch.rand(MAX_REQS, generator=gen) < 0.3, dst,
                            (running - 1) // block_size).to(torch.int32)
    state_idx[0] = dst[0]  # a same-column (reset) request with a shift
    drafts = rand(gen, 0, 4, MAX_REQS)
    scheduled = drafts + rand(gen, 1, 3, MAX_REQS)
    computed = running - scheduled + drafts
    for table in model.tables:  # same blocks at two columns: a same-block shift
        table[2, int(dst[2])] = table[2, max(int(state_idx[2]), 0)]
    return SimpleNamespace(accepted=accepted, state_idx=state_idx, new_computed=new_computed,
                           scheduled=scheduled, computed=computed, drafts=drafts)


@pytest.mark.parametrize("precomputed", [True, False])
@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("layers", ["f32", "two_groups"])
def test_postprocess(precomputed: bool, dim_first: bool, layers: str) -> None:
    gen = torch.Generator().manual_seed(60 + 4 * precomputed + 2 * dim_first + len(layers))
    model = make_model(gen, dim_first, LAYERS[layers], padded=layers == "two_groups")
    x = postprocess_inputs(gen, model)
    idx_mapping = batch(gen, 6, filtered=True)
    idx_mapping[0], idx_mapping[2] = 0, 2
    computed = x.new_computed if precomputed else x.computed
    accepted_out = x.accepted.clone()
    _, got = run_both(POSTPROCESS, postprocess, model, 6, x.accepted, x.state_idx,
                      None if precomputed else x.scheduled, computed,
                      None if precomputed else x.drafts, accepted_out, idx_mapping,
                      precomputed, False, 2)
    assert not torch.equal(got[0][0].states[0], model.states[0])  # (something was copied)


@pytest.mark.parametrize("case", ["no_idx_mapping", "skip_temporal", "empty", "bf16"])
def test_postprocess_flags(case: str) -> None:
    gen = torch.Generator().manual_seed(70 + len(case))
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    model = make_model(gen, case == "bf16", [(0, 4, dtype), (0, 3, dtype)])
    x = postprocess_inputs(gen, model)
    num_reqs = 0 if case == "empty" else 5
    idx_mapping = None if case == "no_idx_mapping" else batch(gen, num_reqs, filtered=True)
    run_both(POSTPROCESS, postprocess, model, num_reqs, x.accepted, x.state_idx, None,
             x.new_computed, None, x.accepted.clone(), idx_mapping, True,
             case == "skip_temporal", 1)


def test_postprocess_in_place_count_falls_back() -> None:
    gen = torch.Generator().manual_seed(80)
    model = make_model(gen, False, [(0, 4, torch.float32)])
    x = postprocess_inputs(gen, model)

    def in_place(model: Model, accepted, state_idx, new_computed) -> None:
        # (the accepted counts read and reset in the same tensor, as V1 did)
        postprocess(model, 3, accepted, state_idx, None, new_computed, None, accepted,
                    torch.arange(3, dtype=torch.int32), True, False, 1)

    run_both(POSTPROCESS, in_place, model, x.accepted, x.state_idx, x.new_computed,
             fallback=True)


# ----------------------------------------------------------- vLLM's wrappers, as a step


def step(model: Model, num_reqs: int, idx_mapping, state_idx, computed, query_start_loc,
         accepted, src_col, src_off, new_computed, num_sampled, replayssm: bool) -> None:
    """A hybrid step's three launches as MambaHybridModelState makes them: preprocess,
    the pre-copy (run_fused_precopy), then after sampling (the accepted counts scattered)
    the postprocess (run_fused_postprocess_align)."""
    ctx = context(model)
    if replayssm:
        ctx.replayssm = object()  # (the wrappers only ask whether there is one)
    preprocess(idx_mapping, state_idx, computed, query_start_loc, accepted, src_col, src_off,
               num_reqs, 256, ctx.block_size, True)
    ctx.run_fused_precopy(num_reqs, state_idx, src_col, src_off, idx_mapping)
    accepted[idx_mapping.long()] = num_sampled
    ctx.run_fused_postprocess_align(num_reqs, accepted, state_idx, new_computed, idx_mapping)


@pytest.mark.parametrize("dim_first,replayssm", [(False, False), (True, True)])
def test_step_through_vllm_wrappers(dim_first: bool, replayssm: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)
    gen = torch.Generator().manual_seed(90 + dim_first)
    model = make_model(gen, dim_first, [(0, 4, torch.bfloat16)])
    num_reqs = 2
    idx_mapping = torch.tensor([3, 5], dtype=torch.int32)
    # Blocks of 4 tokens. Request 3 verifies 4 drafts from 7 tokens, 3 accepted last step:
    # its running column 1 moves to 2, its conv window shifted by 2. Request 5 prefills 6
    # tokens from 9: column 2 to 3, no shift.
    computed = torch.zeros(MAX_REQS, dtype=torch.int32)
    computed[3], computed[5] = 7, 9
    query_start_loc = torch.tensor([0, 5, 11], dtype=torch.int32)
    state_idx = torch.zeros(MAX_REQS, dtype=torch.int32)
    state_idx[3], state_idx[5] = 1, 2
    accepted = torch.ones(MAX_REQS, dtype=torch.int32)
    accepted[3] = 3
    src_col = torch.full((MAX_REQS,), -1, dtype=torch.int32)
    src_off = torch.zeros(MAX_REQS, dtype=torch.int32)
    # Then request 3 accepts 3 tokens: 13 computed, its running state at 11, the boundary
    # at 12 in its own running column (a same-block shift by one, the count reset); request
    # 5 ends on the boundary at 16 (the count reset only).
    num_sampled = torch.tensor([3, 1], dtype=torch.int32)
    new_computed = computed.clone()
    new_computed[3], new_computed[5] = 13, 16
    names = (PREPROCESS, PRECOPY, POSTPROCESS)
    for name in names:  # each kernel in turn PyTorch, the others Triton
        run_both(name, step, model, num_reqs, idx_mapping, state_idx, computed,
                 query_start_loc, accepted, src_col, src_off, new_computed, num_sampled,
                 replayssm)
