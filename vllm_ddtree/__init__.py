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
    """vLLM's plugin hook: load the native ops once per process, register methods ddtree
    and jetspec in vLLM's speculator registry and TREE_ATTN as an attention backend, and
    warn if the patch series is not applied (without it the documented top-level tree
    fields, hybrid targets and the whole-config checks are missing)."""
    global _registered
    if _registered:
        return
    from vllm_ddtree.patching.installer import STATE_DIR
    from vllm_ddtree.upstream import installed_vllm_root, pinned_version, tree_version

    found, pin = tree_version(installed_vllm_root()), pinned_version()
    if found != pin:  # the plugin API and the hooks it uses are the pin's
        raise RuntimeError(f"vllm-ddtree: this vLLM is {found}, but vllm-ddtree is for vLLM "
                           f"{pin} (patches/upstream-version); install vllm=={pin}, or rebase "
                           f"with scripts/rebase_upstream.py (`vllm-ddtree doctor` checks)")
    from vllm_ddtree import ops  # noqa: F401  (registers torch.ops.vllm_ddtree.*)
    from vllm_ddtree.spec_decode import config

    config.register()
    if not (installed_vllm_root() / STATE_DIR / "state.json").is_file():
        logger.warning("vllm-ddtree: the patch series is not applied to this vLLM; "
                       "run `vllm-ddtree patches apply`")
    logger.info("vllm-ddtree plugin registered (methods ddtree, jetspec)")
    _registered = True
