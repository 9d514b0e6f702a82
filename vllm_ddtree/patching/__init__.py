"""The patch series tool: applies ``patches/series`` to an installed vLLM, safely."""

from vllm_ddtree.patching.installer import (
    PatchState,
    apply_series,
    check_series,
    revert_series,
    series_status,
)
from vllm_ddtree.patching.series import Patch, PatchError, read_series

__all__ = [
    "Patch",
    "PatchError",
    "PatchState",
    "apply_series",
    "check_series",
    "read_series",
    "revert_series",
    "series_status",
]
