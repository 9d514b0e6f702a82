"""vllm-ddtree: DDTree speculative decoding inside vLLM.

vLLM loads this package as a general plugin (entry point group ``vllm.general_plugins``)
in every process it starts; ``register`` must therefore be cheap and idempotent.
"""

from __future__ import annotations

import logging

# Under "vllm." so that vLLM's logging configuration formats and shows it.
logger = logging.getLogger("vllm.ddtree")
_registered = False


def register() -> None:
    """vLLM's plugin hook: load the native ops once per process; on vLLM 0.34 register
    the methods in its speculator registry, on the pin check the patch series."""
    global _registered
    if _registered:
        return
    from vllm_ddtree import ops  # noqa: F401  (registers torch.ops.vllm_ddtree.*)

    try:
        from vllm.v1.worker.gpu.spec_decode import speculator_config
    except ImportError:  # vLLM 0.32: the patch series
        speculator_config = None
    if speculator_config is not None and hasattr(speculator_config,
                                                 "register_speculative_method"):
        from vllm_ddtree.spec_decode import config

        config.register()
        logger.info("vllm-ddtree plugin registered (methods ddtree, jetspec)")
        _registered = True
        return
    from vllm_ddtree.patching.installer import STATE_DIR
    from vllm_ddtree.upstream import installed_vllm_root

    if not (installed_vllm_root() / STATE_DIR / "state.json").is_file():
        logger.warning("vllm-ddtree: the patch series is not applied to this vLLM; "
                       "run `vllm-ddtree patches apply`")
    logger.info("vllm-ddtree plugin registered (native ops loaded)")
    _registered = True
