"""vllm-ddtree: DDTree speculative decoding inside vLLM.

vLLM loads this package as a general plugin (entry point group ``vllm.general_plugins``)
in every process it starts; ``register`` must therefore be cheap and idempotent.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """vLLM's plugin hook: load the native ops once per process."""
    global _registered
    if _registered:
        return
    from vllm_ddtree import ops  # noqa: F401  (registers torch.ops.vllm_ddtree.*)

    _registered = True
