"""What TREE_ATTN does and does not do, shared by its CUDA and CPU backends: decoder
self-attention (causal, or tree-masked), with sliding windows and attention sinks (as in
gpt-oss), and no ALiBi, soft cap, multimodal prefix or chunked local attention; KV caches in
the model's dtype."""

from __future__ import annotations

from typing import Any, ClassVar

NAME = "TREE_ATTN"


class TreeAttentionFeatures:
    """Mixed into both backend classes, ahead of the vLLM backend they build on."""

    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == "decoder"

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False


def refuse_unsupported(**features: Any) -> None:
    """For the impls' constructors: a layer asking for a feature TREE_ATTN lacks fails."""
    for name, value in features.items():
        if value not in (None, False, -1):
            raise NotImplementedError(f"TREE_ATTN does not support {name}")


def refuse_quantized_kv_cache(cache_dtype: str) -> None:
    """At start-up: TREE_ATTN keeps the KV cache in the model's dtype."""
    if cache_dtype not in TreeAttentionFeatures.supported_kv_cache_dtypes:
        raise ValueError(f"cache_config.cache_dtype is {cache_dtype!r}: TREE_ATTN keeps the KV "
                         f"cache in the model's dtype (one of "
                         f"{TreeAttentionFeatures.supported_kv_cache_dtypes}), no quantized "
                         f"cache; leave --kv-cache-dtype unset")
