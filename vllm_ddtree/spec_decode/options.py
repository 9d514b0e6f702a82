"""The tree options of methods "ddtree" and "jetspec" and their checks: the one place
that names the methods, the fields and their defaults. Each error names the field at fault.

vLLM's patched code calls in here (patch 0001: ``with_speculator_options``; 0006:
``max_committed_drafts``; 0009: ``declared_causal_head``), so this module imports nothing of
vLLM's at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_ddtree.tree import MAX_BUDGET

METHODS = ("ddtree", "jetspec")
DEFAULT_TREE_BUDGET = 64
TREE_FIELDS = ("tree_budget", "tree_spine", "tree_build", "tree_width")
# The user's fields, and what the resolved options carry too: the depth, and whether trees
# are sized adaptively (the user's enable_adaptive_verification).
OPTION_NAMES = (*TREE_FIELDS, "tree_depth", "adaptive")
TREE_BUILDS = ("best_first", "jetspec")
DEFAULT_TREE_WIDTH = 7  # JetSpec's W
MAX_WIDTHS = 32  # per-depth widths the build op takes (csrc/tree.h kMaxWidths)


def is_tree_method(spec: Any) -> bool:
    """Whether a (configured) speculative config is ddtree's or jetspec's."""
    return spec is not None and getattr(spec, "custom_method", None) in METHODS


@dataclass
class TreeOptions:
    """The tree fields, as the checks below read them (``spec.<field>``)."""

    model: str
    tree_budget: int = DEFAULT_TREE_BUDGET
    tree_depth: int | None = None
    tree_spine: bool = True
    tree_build: str | None = None
    tree_width: int | list[int] | None = None
    adaptive: bool = False


def with_speculator_options(spec: dict) -> dict:
    """The documented form of a ddtree or jetspec speculative config (tree fields at the top
    level) as vLLM 0.34 takes it: under ``speculator_options``. Called on the user's
    dict by EngineArgs (patch 0001); other methods' configs are returned
    as they are."""
    if spec.get("method") not in METHODS:
        return spec
    spec = dict(spec)
    given = spec.pop("speculator_options", None)
    check_options_mapping(given, spec["method"])
    options = dict(given or {})
    for name in TREE_FIELDS:
        if name not in spec:
            continue
        value = spec.pop(name)
        # Both forms at once: neither silently wins.
        if name in options and options[name] != value:
            raise ValueError(f"speculative_config.{name} is given twice: {value!r} beside "
                             f"method and {options[name]!r} in speculator_options; give it "
                             f"once")
        options[name] = value
    return spec | ({"speculator_options": options} if options else {})


def check_options_mapping(options: Any, method: str) -> None:
    """speculator_options is None or a dict: anything else (a string, a list) would fail
    later in ``dict()`` with a message that names no field."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"speculative_config.speculator_options must be a mapping of option "
                         f"names to values (method {method!r}: {', '.join(TREE_FIELDS)}), "
                         f"got {type(options).__name__} {options!r}")


def tree_options(spec: Any) -> TreeOptions:
    """The resolved tree fields of a configured speculative config."""
    options = spec.speculator_options or {}
    return TreeOptions(spec.model, **{k: options[k] for k in OPTION_NAMES if k in options})


def max_committed_drafts(vllm_config: Any) -> int:
    """The most drafts a step can commit, which sizes the recurrent layers' state slots and
    conv window (patch 0006): a tree's depth, not the budget it verifies; other methods'
    num_speculative_tokens."""
    spec = vllm_config.speculative_config
    if is_tree_method(spec):
        return tree_options(spec).tree_depth
    return vllm_config.num_speculative_tokens


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


def declared_causal_head(hf: Any) -> bool | None:
    """A drafter config's ``dflash_config.causal_head`` (a JetSpec head: causal in-block
    attention), None when absent; a config whose ``is_causal`` or ``dflash_config.causal``
    contradicts it is refused. vLLM's DFlash loader reads it through patch 0009 (under
    method dflash too), the tree methods' configure through ``verify_head``."""
    dflash = getattr(hf, "dflash_config", None) or {}
    causal_head = dflash.get("causal_head")
    if causal_head is not None and not isinstance(causal_head, bool):
        raise ValueError(f"dflash_config.causal_head must be true or false, got "
                         f"{causal_head!r}")
    for name, value in (("dflash_config.causal", dflash.get("causal")),
                        ("is_causal", getattr(hf, "is_causal", None))):
        if causal_head and value is not None and not value:
            raise ValueError(f"{name} is {value!r} but dflash_config.causal_head is true (a "
                             f"causal JetSpec head): the drafter's config contradicts itself")
    return causal_head


def verify_head(spec: Any, hf: Any) -> bool:
    """Whether the drafter is a JetSpec head (declared_causal_head), refusing a head missing
    the fields its drafting needs; errors name the drafter."""
    try:
        causal_head = bool(declared_causal_head(hf))
    except ValueError as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from e
    for name in ("mask_token_id", "target_layer_ids") if causal_head else ():
        if name not in hf.dflash_config:
            raise ValueError(f"speculative_config.model {spec.model!r}: dflash_config has no "
                             f"{name}, which a causal (JetSpec) head needs")
    return causal_head


def tree_widths(spec: Any) -> tuple[int, ...]:
    """The build op's per-depth widths: empty for the best-first build."""
    if spec.tree_build != "jetspec":
        return ()
    return tuple(spec.tree_width) if isinstance(spec.tree_width, list) else (spec.tree_width,)


def resolve_build(spec: Any, causal_head: bool, vocab: int) -> None:
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
