"""A deployment's self-check (the Docker image runs it at build time): the patch series is
applied, the native ops load, TREE_ATTN is a backend, and method "ddtree" is configurable."""

from __future__ import annotations

import sys


def main() -> int:
    import dataclasses

    import torch
    from vllm.config import SpeculativeConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree import ops  # noqa: F401  (loads the native ops)
    from vllm_ddtree.patching import series_status
    from vllm_ddtree.patching.installer import APPLIED
    from vllm_ddtree.upstream import installed_vllm_root, patches_dir

    status = series_status(installed_vllm_root(), patches_dir())
    checks = {
        "patch series applied": status.state == APPLIED,
        "native ops loaded": hasattr(torch.ops.vllm_ddtree, "build_tree"),
        "--attention-backend TREE_ATTN": "TREE_ATTN" in AttentionBackendEnum.__members__,
        "method ddtree configurable": {"tree_budget", "tree_spine"} <= {
            f.name for f in dataclasses.fields(SpeculativeConfig)},
    }
    for name, ok in checks.items():
        print(f"vllm-ddtree selfcheck: {name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
