"""The patch series on vLLM 0.34.0: its shape, that this environment has it applied, and
what its two config hooks do (the documented top-level tree fields, patch 0001; the
whole-config checks and the decode CUDA graph request counts, patch 0002)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from engine_runs import REPO

from vllm_ddtree.patching import read_series

SERIES = REPO / "patches"
PAIR = REPO / "models" / "tiny-pair"


def test_the_series_is_small_and_says_why() -> None:
    patches = read_series(SERIES)
    assert (SERIES / "upstream-version").read_text().strip() == "0.34.0"
    assert len(patches) <= 14  # 0014: structured output's masks along a tree
    added = 0
    for patch in patches:
        text = (SERIES / patch.name).read_text()
        header = text[:text.index("diff --git")]
        for field in ("Why:", "Upstream-Status:", "Drop-When:"):
            assert field in header, (patch.name, field)
        added += len(re.findall(r"^\+(?!\+\+ )", text, flags=re.M))
    assert added <= 195, added  # 0014: the scheduler keeps and masks a tree (47 lines)


def test_it_is_applied_here() -> None:
    import vllm

    from vllm_ddtree.patching.installer import APPLIED, series_status

    status = series_status(Path(vllm.__file__).parent.parent, SERIES)
    assert status.state == APPLIED, status


def engine_config(spec: dict, **engine: object):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(PAIR / "target"), max_model_len=512, max_num_seqs=256,
                      speculative_config=spec, **engine).create_engine_config()


def test_the_documented_top_level_form_is_accepted() -> None:
    """{"method": "ddtree", "tree_budget": 16, ...} as the README writes it; other methods
    keep vLLM's refusal of fields they do not have."""
    spec = {"method": "ddtree", "model": str(PAIR / "drafter"), "tree_budget": 16,
            "tree_spine": False}
    options = engine_config(spec).speculative_config.speculator_options
    assert options["tree_budget"] == 16 and options["tree_spine"] is False
    with pytest.raises(Exception, match="tree_budget"):
        engine_config({"method": "dflash", "model": str(PAIR / "drafter"), "tree_budget": 16})


def decode_graph_requests(config) -> list[int]:
    """The request counts vLLM's own sizing (_set_cudagraph_sizes) gives decode CUDA graphs
    of this config, as on a GPU (the CPU platform turns graphs off before it runs)."""
    from vllm.config import CUDAGraphMode

    cc = config.compilation_config
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cc.cudagraph_capture_sizes = cc.max_cudagraph_capture_size = None
    config._set_cudagraph_sizes()
    return cc.decode_cudagraph_capture_request_sizes


@pytest.mark.parametrize("budget", [16, 64])
def test_verify_steps_have_decode_graphs_up_to_32_requests(budget: int) -> None:
    spec = {"method": "ddtree", "model": str(PAIR / "drafter"), "tree_budget": budget}
    config = engine_config(spec)
    assert config.uniform_decode_query_len == budget + 1
    sizes = decode_graph_requests(config)
    assert sizes == list(range(1, 33))  # every count: a padded request is a whole tree
    # The control: vLLM's default (no counts set) from the 512-token shared sizes.
    cc = config.compilation_config
    cc.max_decode_cudagraph_capture_requests = cc.decode_cudagraph_capture_request_sizes = None
    assert max(decode_graph_requests(config)) == 512 // (budget + 1)
    # The user's counts are kept.
    given = engine_config(spec, compilation_config={"max_decode_cudagraph_capture_requests": 8})
    assert max(decode_graph_requests(given)) == 8


def test_the_target_attends_through_tree_attn_and_the_drafter_keeps_its_choice() -> None:
    """What patch 0002's hook selects off the CPU (whose platform answers CPU_ATTN whatever
    is selected): TREE_ATTN for the target; a non-causal DFlash drafter's copy of the config,
    or one with the drafter's named backend, keeps its own; another backend for the target
    is refused by name."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backend

    import vllm_ddtree
    from vllm_ddtree.spec_decode.config import select_tree_attention

    vllm_ddtree.register()

    def config(backend, non_causal=False, drafter=None):
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=backend, use_non_causal=non_causal),
            speculative_config=SimpleNamespace(attention_backend=drafter))

    target = config(None)
    select_tree_attention(target)
    assert target.attention_config.backend == Backend["TREE_ATTN"]
    for kept in (config(None, non_causal=True),
                 config(Backend.FLASH_ATTN, drafter=Backend.FLASH_ATTN)):
        before = kept.attention_config.backend
        select_tree_attention(kept)
        assert kept.attention_config.backend == before
    with pytest.raises(ValueError, match="attention_config.backend is FLASH_ATTN"):
        select_tree_attention(config(Backend.FLASH_ATTN))
