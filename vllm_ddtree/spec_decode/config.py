"""Methods "ddtree" and "jetspec" in vLLM 0.34's speculator registry (Model Runner V2).

They are registered with ``register_speculative_method`` (vllm_ddtree.register, in every
process) as configs built on DFlash's: vLLM then moves the name to ``custom_method``, sets
``method = "dflash"``, and DFlash's whole set-up (draft model config, aux hidden states of the
target, context handling) applies. The tree fields go in ``speculator_options`` (vLLM refuses
unknown top-level fields of the speculative config); patch 0001 moves the
documented top-level ones there (``options.with_speculator_options``):

    {"method": "ddtree", "model": DRAFTER, "tree_budget": 64}
    {"method": "ddtree", "model": DRAFTER, "speculator_options": {"tree_budget": 64}}

``num_speculative_tokens``, if given, is the tree's depth (the drafter's mask positions,
default block_size - 1). After ``configure`` it is ``tree_budget``, the draft tokens the
scheduler schedules per request, and the resolved tree fields, ``tree_depth`` included, are
back in ``speculator_options`` (``options.tree_options`` reads them). The fields and their
checks are in ``options.py``; here, vLLM's registry and the checks that need the whole
config. Config modules are imported in every process, so this one imports no speculator.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, ClassVar

from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig

from vllm_ddtree.recurrent.limits import (
    memory_beside_kv_cache,
    verify_recurrent_engine,
    verify_recurrent_target,
    verify_stash_fits,
    verify_states_fit,
)
from vllm_ddtree.spec_decode.options import (
    METHODS,
    OPTION_NAMES,
    TREE_FIELDS,
    TreeOptions,
    check_options_mapping,
    check_tree_fields,
    is_tree_method,
    per_depth_synthetic_rates,
    resolve_build,
    tree_options,
    verify_head,
)

logger = logging.getLogger("vllm.ddtree")
# Verify steps replay FULL decode graphs keyed by request count at tree_budget + 1 tokens a
# request. Off SM100 vLLM derives its default counts from the 512-token shared sizes (7
# requests at budget 64), every second count past 6: trees get every count up to this many
# (a padded request costs a whole tree of rows), unless the user set the counts.
DECODE_GRAPH_REQUESTS = 32


# Settings of V2's verification that tree verification does not honour: (field, the value
# that leaves it off, why).
_REFUSED = (
    ("draft_sample_method", ("greedy",), "trees are built from the drafter's top-k "
     "log-probabilities"),
    ("rejection_sample_method", ("standard", "synthetic"), "trees are verified by walking "
     "the target's choice at every node; block and FLy verification are chain rules"),
)


class DDTreeSpeculatorConfig(DFlashSpeculatorConfig):
    speculator_class = "vllm_ddtree.spec_decode.speculator.DDTreeSpeculator"
    supported_options = frozenset({"speculator_options"})
    supports_watermarking = False
    # The build a method implies (None: by the drafter's head; "jetspec" for jetspec).
    implied_build: ClassVar[str | None] = None
    method_name: ClassVar[str] = METHODS[0]

    @classmethod
    def configure(cls, spec: Any) -> None:
        options = cls._read_options(spec)
        block_size = cls._drafter_block_size(spec)
        # A config set up before (vLLM re-runs __post_init__) carries a depth it resolved;
        # any other tree_depth is the user's, refused (a bad one would fail unnamed below).
        depth_given = options.tree_depth
        resolved = (spec.num_speculative_tokens == options.tree_budget
                    and isinstance(depth_given, int) and not isinstance(depth_given, bool)
                    and 1 <= depth_given <= min(block_size - 1, options.tree_budget))
        if depth_given is not None and not resolved:
            raise ValueError(f"speculative_config.speculator_options.tree_depth is "
                             f"{options.tree_depth!r}: the tree's depth is "
                             f"num_speculative_tokens (method {cls.method_name!r}); set "
                             f"that instead")
        depth = options.tree_depth if resolved else spec.num_speculative_tokens
        if depth is not None and depth > block_size - 1:
            raise ValueError(f"speculative_config.num_speculative_tokens is {depth}, deeper "
                             f"than the drafter drafts: at most block_size - 1 = "
                             f"{block_size - 1}")
        spec.num_speculative_tokens = depth or block_size - 1  # DFlash's set-up wants one
        super().configure(spec)
        hf = spec.draft_model_config.hf_config
        # A tree of B nodes is at most B deep: the drafter need not draft further.
        options.tree_depth = min(depth or block_size - 1, options.tree_budget)
        resolve_build(options, verify_head(options, hf), hf.vocab_size)
        target = spec.target_model_config
        if hf.vocab_size != target.get_vocab_size():
            raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                             f"{hf.vocab_size} tokens, the target {target.get_vocab_size()}: "
                             f"they must match")
        verify_target_model(target, cls.method_name)
        _refuse_parallel_settings(spec.target_parallel_config, cls.method_name)
        _verify_dynamic_schedule(spec)
        if target.is_hybrid or target.has_inner_state:
            verify_recurrent_target(target)
        spec.num_speculative_tokens = options.tree_budget
        # Adaptive trees are ddtree's own (adaptive/sizing.py, in the runner's manager
        # seat): vLLM's chain sizing and the backends' checks for it stay off.
        if not isinstance(options.adaptive, bool):
            raise ValueError(f"speculative_config.speculator_options.adaptive must be true or "
                             f"false, got {options.adaptive!r}")
        options.adaptive = options.adaptive or bool(spec.enable_adaptive_verification)
        spec.enable_adaptive_verification = False
        if options.adaptive:
            _refuse_with_adaptive(spec)
        spec.speculator_options = {k: v for k, v in asdict(options).items() if k != "model"}
        # Synthetic acceptance (benchmarking only): per-depth rates, padded for vLLM's
        # check; a config set up before keeps its padded rates.
        if spec.rejection_sample_method == "synthetic" and not resolved:
            per_depth_synthetic_rates(spec, options.tree_depth, options.tree_budget,
                                      cls.method_name)

    @classmethod
    def _drafter_block_size(cls, spec: Any) -> int:
        """The drafter's block size, from its config file: DFlash's set-up (which wraps the
        checkpoint's architecture as a DFlash one) fails unhelpfully on anything else."""
        from transformers import PretrainedConfig

        found, _ = PretrainedConfig.get_config_dict(spec.model, revision=spec.revision)
        block_size = found.get("block_size")
        if not found.get("dflash_config") or not isinstance(block_size, int) or (
                block_size < 2):
            raise ValueError(f"speculative_config.model {spec.model!r} is not a DFlash "
                             f"drafter (its config has no dflash_config and block_size): "
                             f"method {cls.method_name!r} drafts with one")
        return block_size

    @classmethod
    def _read_options(cls, spec: Any) -> TreeOptions:
        for name, allowed, why in _REFUSED:
            if getattr(spec, name) not in allowed:
                raise ValueError(f"speculative_config.{name} is {getattr(spec, name)!r}: "
                                 f"method {cls.method_name!r} does not support it ({why}); "
                                 f"leave it {allowed[0]!r}")
        if spec.model is None:
            raise ValueError(f"speculative_config.model: method {cls.method_name!r} needs a "
                             f"DFlash drafter checkpoint (the same ones method 'dflash' takes)")
        check_options_mapping(spec.speculator_options, cls.method_name)
        given = dict(spec.speculator_options or {})
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            raise ValueError(f"speculative_config.speculator_options.{unknown[0]} is not an "
                             f"option of method {cls.method_name!r} (options: "
                             f"{', '.join(TREE_FIELDS)})")
        if cls.implied_build is not None:
            if given.get("tree_build", cls.implied_build) != cls.implied_build:
                raise ValueError(f"speculative_config.tree_build is "
                                 f"{given['tree_build']!r}: method {cls.method_name!r} builds "
                                 f"{cls.implied_build!r} trees; use method 'ddtree' for "
                                 f"another build")
            given["tree_build"] = cls.implied_build
        options = TreeOptions(spec.model, **given)
        check_tree_fields(options, "speculative_config")  # either form: the same fields
        return options

    @property
    def num_lookahead_tokens(self) -> int:
        # KV slots past the scheduled tokens: the drafter's depth + 1 queries (the bonus
        # token, then the masks) start right after the accepted path, so they end at most
        # depth + 1 past a prefill and within depth + 1 past a verify step's tree_budget + 1
        # (the path is at most depth long, and depth <= tree_budget). DFlash's own value,
        # num_speculative_tokens + 1, would reserve a whole tree more per request.
        depth = tree_options(self.spec_config).tree_depth
        return super().num_lookahead_tokens if depth is None else depth + 1

    def max_num_draft_seqs(self, max_num_batched_tokens: int) -> int:
        # A verify step takes tree_budget + 1 tokens a request; the drafter fewer. Adaptive
        # trees schedule what fits (AdaptiveTreeSizing.drafts_to_schedule): the drafter's
        # query pass, tree_depth + 1 tokens a request, is the bound.
        options = tree_options(self.spec_config)
        per_request = options.tree_depth if options.adaptive else self.num_speculative_tokens
        return max_num_batched_tokens // ((per_request or self.num_speculative_tokens) + 1)

    def hash_factors(self) -> list[Any]:
        options = self.spec_config.speculator_options or {}
        return [(k, str(options.get(k))) for k in OPTION_NAMES]


def verify_vllm_config(vllm_config: Any) -> None:
    """In VllmConfig.__post_init__ (patch 0002, for any speculative config), before the CUDA
    graph sizes are resolved: what the tree methods need beyond the speculative config."""
    from vllm.platforms import current_platform

    if not is_tree_method(vllm_config.speculative_config):
        return
    model, cc = vllm_config.model_config, vllm_config.compilation_config
    budget = vllm_config.speculative_config.num_speculative_tokens
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if budget + 1 > tokens:
        raise ValueError(f"speculative_config.tree_budget is {budget}: a verify step needs "
                         f"tree_budget + 1 = {budget + 1} tokens, more than "
                         f"max_num_batched_tokens ({tokens})")
    if model is not None and model.is_hybrid:
        verify_recurrent_engine(vllm_config.cache_config, current_platform)
        verify_stash_fits(vllm_config, memory_beside_kv_cache(vllm_config,
                                                                current_platform))
        verify_states_fit(vllm_config, current_platform)
    if not current_platform.is_cpu():  # the CPU platform: the speculator (CPU_ATTN's place)
        select_tree_attention(vllm_config)
    if (cc.max_decode_cudagraph_capture_requests is None
            and cc.decode_cudagraph_capture_request_sizes is None):
        cc.decode_cudagraph_capture_request_sizes = list(range(
            1, min(DECODE_GRAPH_REQUESTS, vllm_config.scheduler_config.max_num_seqs) + 1))


def select_tree_attention(vllm_config: Any) -> None:
    """The target attends through TREE_ATTN: selected unless the user chose it; another
    backend the user chose is refused. DFlash's drafter loads with a copy of the config
    (its own attention settings, this hook run again): a non-causal drafter's copy, or one
    with the backend speculative_config.attention_backend names, keeps its choice; a causal
    JetSpec head's copy gets TREE_ATTN too, which attends without trees for the drafter's
    layers (their builders are never handed the trees: attention/tree_batch.py)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention, tree = vllm_config.attention_config, AttentionBackendEnum["TREE_ATTN"]
    drafter_backend = vllm_config.speculative_config.attention_backend
    if attention.use_non_causal or (drafter_backend is not None
                                    and attention.backend == drafter_backend):
        return
    if attention.backend is None:
        attention.backend = tree
    elif attention.backend != tree:
        raise ValueError(f"attention_config.backend is {attention.backend.name}, which "
                         f"cannot attend over a token tree: methods 'ddtree' and 'jetspec' "
                         f"need TREE_ATTN (leave --attention-backend unset or set it to "
                         f"TREE_ATTN; speculative_config.attention_backend sets the "
                         f"drafter's)")


def _refuse_parallel_settings(parallel: Any, method: str) -> None:
    """Parallel layouts in which a rank would verify, or compact the KV cache of, only part
    of a step: the verifier runs on the last pipeline stage, batch-sharded sampling verifies
    each request on one tensor-parallel rank, context parallelism splits a request's KV
    slots, micro-batches split the step's trees; every rank must compact every request."""
    for name, allowed in (("pipeline_parallel_size", (1,)),
                          ("decode_context_parallel_size", (1,)),
                          ("prefill_context_parallel_size", (1,)), ("enable_dbo", (False,)),
                          ("enable_batch_sharded_sampling", (None, False))):
        value = getattr(parallel, name, allowed[0])
        if value not in allowed:
            raise ValueError(f"parallel_config.{name} is {value!r}: method {method!r} "
                             f"compacts every request's accepted path on every rank; "
                             f"leave it unset (use tensor parallelism)")


def _verify_dynamic_schedule(spec: Any) -> None:
    """vLLM checks num_speculative_tokens_per_batch_size only when it first uses it (the
    scheduler, the CUDA graph sizes), some of its messages naming no field: checked here
    by vLLM's own rules, so that a schedule that cannot run is refused at start-up."""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    if spec.num_speculative_tokens_per_batch_size is None:
        return
    try:
        validate_and_normalize_dynamic_sd_schedule(spec.num_speculative_tokens_per_batch_size)
    except ValueError as e:
        raise ValueError(f"speculative_config.num_speculative_tokens_per_batch_size is "
                         f"{spec.num_speculative_tokens_per_batch_size!r}: {e}") from e


def _refuse_with_adaptive(spec: Any) -> None:
    """Settings adaptive trees cannot honour, named with it: synthetic acceptance replaces
    the target's verdicts the calibration learns from, and a per-batch-size schedule
    fixes the drafts per step that the sizing chooses."""
    if spec.rejection_sample_method == "synthetic":
        raise ValueError("speculative_config.enable_adaptive_verification cannot be "
                         "combined with rejection_sample_method 'synthetic': adaptive trees "
                         "calibrate on the target's verdicts, which synthetic acceptance "
                         "replaces; benchmark a fixed tree_budget instead")
    if spec.num_speculative_tokens_per_batch_size is not None:
        raise ValueError("speculative_config.enable_adaptive_verification cannot be "
                         "combined with num_speculative_tokens_per_batch_size: both size "
                         "each step's drafts; set one of them")


class JetSpecSpeculatorConfig(DDTreeSpeculatorConfig):
    """JetSpec's build (per-depth widths) over a DFlash or JetSpec-head drafter."""

    implied_build = "jetspec"
    method_name = METHODS[1]


def register() -> None:
    """Both methods, by class (vLLM resolves a name registered as a string on every read of
    ``speculator_config``, which its scheduler does every step), and TREE_ATTN as an
    attention backend of this platform (vLLM looks a layer's backend up by name)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import register_backend
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    from vllm_ddtree.attention import CPU_BACKEND_PATH, CUDA_BACKEND_PATH

    for config in (DDTreeSpeculatorConfig, JetSpecSpeculatorConfig):
        register_speculative_method(config.method_name, config)
    register_backend("TREE_ATTN",
                     CPU_BACKEND_PATH if current_platform.is_cpu() else CUDA_BACKEND_PATH)


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
