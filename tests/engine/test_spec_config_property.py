"""Property: a speculative config for methods "ddtree" and "jetspec", however wrong, is
either set up or refused at start-up by an error that names a field the user set.

Hypothesis draws whole configs (the tree fields and vLLM's verification fields, at the top
level and under ``speculator_options``; wrong types, out-of-range values, unknown keys,
conflicting settings, ``speculator_options`` itself of a wrong type), and each is built the
way a user's is: ``EngineArgs(...).create_engine_config()`` over the tiny pair. A config
that is set up must also hold what the tree methods run on (the resolved options)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
PAIR = REPO / "models" / "tiny-pair"
DRAFTERS = [str(PAIR / "drafter"), str(PAIR / "jetspec-drafter")]
BLOCK_SIZE = 8  # both drafters' block_size: at most 7 mask positions (the tree's depth)
# One engine config takes 2-20 ms once the model configs are cached (a few seconds the
# first time): 1000 configs take about 20 s on one core.
MAX_EXAMPLES = 1000

# Values of a wrong type for most fields (None is the default of some: then it is right).
WRONG = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
    st.text(max_size=4), st.lists(st.integers(-1, 3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 2), max_size=2))

# Per field: values the tree methods take (alone; together they may still conflict), and
# values of the right type that are out of range or that the tree methods refuse.
RATES = st.lists(st.floats(0, 1), min_size=7, max_size=7).map(
    lambda r: sorted(r, reverse=True))  # one per depth of the default tree (7)
SCHEDULE = st.tuples(st.integers(1, 16), st.integers(0, 80), st.integers(0, 80)).map(
    lambda t: [[1, t[0], t[1]], [t[0] + 1, 256, t[2]]])
GOOD = {
    "tree_budget": st.one_of(st.integers(1, 80), st.just(1024)),
    "tree_spine": st.booleans(),
    "tree_build": st.sampled_from(["best_first", "jetspec", None]),
    "tree_width": st.one_of(st.integers(1, 12),
                            st.lists(st.integers(1, 9), min_size=1, max_size=4)),
    "num_speculative_tokens": st.integers(1, BLOCK_SIZE - 1),
    # The tree's depth is num_speculative_tokens: the resolved options carry tree_depth,
    # the user's is refused (set up, it must be the resolved form).
    "tree_depth": st.integers(1, BLOCK_SIZE - 1),
    "rejection_sample_method": st.sampled_from(["standard", "synthetic"]),
    "enable_adaptive_verification": st.just(False),
    "draft_sample_method": st.just("greedy"),
    "synthetic_acceptance_length": st.floats(1, BLOCK_SIZE),
    "synthetic_acceptance_rates": RATES,
    "num_speculative_tokens_per_batch_size": SCHEDULE,
}
BAD = {
    "tree_budget": st.sampled_from([0, -1, 1025]),
    "tree_spine": st.nothing(),
    "tree_build": st.just("widest"),
    "tree_width": st.one_of(st.integers(-1, 0), st.just(2049),
                            st.lists(st.integers(0, 9), max_size=34)),
    "num_speculative_tokens": st.sampled_from([0, BLOCK_SIZE, 100]),
    "tree_depth": st.integers(-1, 2 * BLOCK_SIZE),
    "rejection_sample_method": st.sampled_from(["block", "fly", "exact"]),
    "enable_adaptive_verification": st.just(True),
    "draft_sample_method": st.sampled_from(["probabilistic", "random"]),
    "synthetic_acceptance_length": st.floats(allow_nan=True),
    "synthetic_acceptance_rates": st.lists(st.floats(-0.1, 1.1), max_size=9),
    "num_speculative_tokens_per_batch_size": st.lists(
        st.lists(st.integers(-1, 300), min_size=2, max_size=4), max_size=3),
}
FIELDS = sorted(GOOD)
# Keys no config has: typos and made-up names ("unknown_" keeps a made-up one from being
# found, by chance, as a word of some message).
UNKNOWN = st.one_of(st.sampled_from(["tree_size", "treebudget", "tree_budgets",
                                     "num_draft_tokens", "tree_widths", "max_tree_depth"]),
                    st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=5).map(
                        "unknown_".__add__))


@st.composite
def spec_configs(draw: st.DrawFn) -> dict:
    """A speculative config: method and drafter, some fields beside method, and maybe
    speculator_options (a dict of some fields, or of a wrong type). Half the configs are
    careful (each value one its field takes, so that many are set up), half are not
    (bad and wrongly typed values, unknown keys)."""
    careful = draw(st.booleans())

    def fields() -> dict:
        # Few fields at a time: a config with many is refused for its first bad one.
        names = draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True))
        drawn = {n: draw(GOOD[n] if careful else st.one_of(GOOD[n], BAD[n], WRONG))
                 for n in names}
        if not careful and draw(st.integers(0, 4)) == 0:
            drawn[draw(UNKNOWN)] = draw(WRONG)
        return drawn

    spec = {"method": draw(st.sampled_from(["ddtree", "jetspec"])),
            "model": draw(st.sampled_from(DRAFTERS))} | fields()
    kind = draw(st.sampled_from(["absent", "dict", "dict"] + ["wrong"] * (not careful)))
    if kind == "dict":
        spec["speculator_options"] = fields()
    elif kind == "wrong":
        spec["speculator_options"] = draw(st.one_of(
            st.text(max_size=4), st.lists(st.integers(), max_size=2), st.integers(),
            st.booleans(), st.floats(),
            st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2)))
    return spec


def fields_set(spec: dict) -> set[str]:
    """The fields the user set (method and model are always set, and right, here)."""
    names = set(spec) - {"method", "model"}
    options = spec.get("speculator_options")
    if isinstance(options, dict):
        names |= {str(k) for k in options}
    return names


def describe(exc: BaseException) -> str:
    """What an error tells the user: pydantic's errors by location and message (not the
    echo of the whole input, which would name every field), or the message."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "\n".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors())
        except TypeError:  # another errors() than pydantic's
            pass
    return str(exc)


def names_a_field(message: str, names: set[str]) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message)
               for n in names)


def engine_config(spec: dict) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(PAIR / "target"), max_model_len=512,
                      speculative_config=spec).create_engine_config()


def given_value(spec: dict, name: str) -> Any:
    """A field's value as the user gave it (beside method or under speculator_options)."""
    options = spec.get("speculator_options")
    return spec.get(name, options.get(name) if isinstance(options, dict) else None)


def assert_runnable(spec: dict, config: Any) -> None:
    """What the tree methods run on, in a config that was set up: no field given twice
    with two values, the resolved options (budget, depth within the drafter's block,
    build), the user's values kept, and vLLM's own later checks (the dynamic schedule)
    passing."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from vllm_ddtree.spec_decode.options import TREE_BUILDS, TREE_FIELDS

    given = spec.get("speculator_options") or {}
    twice = [n for n in TREE_FIELDS if n in spec and n in given and spec[n] != given[n]]
    assert not twice, f"set up with {twice} given twice, differently"
    sc = config.speculative_config
    options = sc.speculator_options
    budget, depth = options["tree_budget"], options["tree_depth"]
    assert (sc.method, sc.custom_method) == ("dflash", spec["method"])
    assert sc.num_speculative_tokens == budget
    assert 1 <= depth <= min(BLOCK_SIZE - 1, budget)
    assert options["tree_build"] in TREE_BUILDS
    if spec["method"] == "jetspec":
        assert options["tree_build"] == "jetspec"
    if given_value(spec, "tree_budget") is not None:
        assert budget == given_value(spec, "tree_budget")
    if (n := given_value(spec, "num_speculative_tokens")) is not None:
        assert depth == min(n, budget)
    assert sc.rejection_sample_method in ("standard", "synthetic")
    if sc.num_speculative_tokens_per_batch_size is not None:
        build_dynamic_sd_schedule_lookup(sc.num_speculative_tokens_per_batch_size,
                                         config.scheduler_config.max_num_seqs, budget)


@pytest.fixture(scope="module", autouse=True)
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs a few lines per config: hundreds of configs would fill the report (set
    after vLLM's import, which configures its logger)."""
    import logging

    import vllm.logger  # noqa: F401

    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=spec_configs())
def test_a_bad_speculative_config_is_refused_naming_a_field_it_set(spec: dict) -> None:
    try:
        config = engine_config(spec)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        message = describe(exc)
        event(f"refused: {type(exc).__name__}")
        assert names_a_field(message, fields_set(spec)), (
            f"{type(exc).__name__} names none of the fields set "
            f"{sorted(fields_set(spec))}: {message}")
        return
    event("set up")
    assert_runnable(spec, config)
