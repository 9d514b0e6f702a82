"""The engine on vLLM 0.34's Model Runner V2, in the CPU stand-in environment (.venv, built by
scripts/setup_env.sh on a machine without a GPU): its .pth file already set
TRITON_INTERPRET=1, so Triton kernels here run interpreted."""

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from importlib.metadata import version

    from cpu_standin import VLLM_VERSION

    if version("vllm") != VLLM_VERSION or os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(
            f"tests/engine run in the vLLM {VLLM_VERSION} CPU stand-in environment: "
            ".venv/bin/python -m pytest tests/engine (scripts/setup_env.sh builds it)")


@pytest.fixture
def cuda_tree_attn_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, the target's layers on the CPU platform attend through TREE_ATTN's
    CUDA backend (vllm_ddtree/attention/backend.py), its Triton kernel on the interpreter;
    the non-causal DFlash drafter keeps the CPU backend. vLLM's Triton cache write calls
    CUDA's device query, so the same write is done in torch. vLLM caches backend choices per
    process: cleared before and after."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.attention.selector import _cached_get_attn_backend

    from vllm_ddtree.attention import CUDA_BACKEND_PATH

    choose = CpuPlatform.get_attn_backend_cls.__func__

    def choose_cuda_for_causal(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_non_causal:
            return choose(cls, selected_backend, attn_selector_config, num_heads)
        return CUDA_BACKEND_PATH

    def write_kv(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        slots = slot_mapping.long()
        written = slots >= 0
        block, offset = slots[written] // key_cache.shape[1], slots[written] % key_cache.shape[1]
        key_cache[block, offset] = key[:len(slots)][written]
        value_cache[block, offset] = value[:len(slots)][written]

    _cached_get_attn_backend.cache_clear()
    monkeypatch.setattr(CpuPlatform, "get_attn_backend_cls",
                        classmethod(choose_cuda_for_causal))
    monkeypatch.setattr(TritonAttentionImpl, "do_kv_cache_update", write_kv)
    yield
    _cached_get_attn_backend.cache_clear()
