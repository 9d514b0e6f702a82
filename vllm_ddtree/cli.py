"""``vllm-ddtree``: the project's command line: the patch series tool (``patches``) and the
install's checks (``doctor``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_ddtree import patching
from vllm_ddtree.upstream import installed_vllm_root, patches_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-ddtree")
    sub = parser.add_subparsers(dest="group", required=True)
    patches = sub.add_parser("patches", help="the patch series on the installed vLLM")
    patches.add_argument("action", choices=["apply", "check", "revert", "status"])
    patches.add_argument("--root", type=Path, default=None,
                         help="folder holding vllm/ (default: the installed vLLM's)")
    patches.add_argument("--patches-dir", type=Path, default=None,
                         help="the series folder (default: this checkout's patches/)")
    patches.add_argument("--force", action="store_true",
                         help="revert even files edited after apply")
    sub.add_parser("doctor", help="check the install (vLLM and the pin, the series, the native "
                   "ops, TREE_ATTN, the device) and say how to fix what fails")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.group == "doctor":
        from vllm_ddtree import selfcheck

        return selfcheck.main(prog="vllm-ddtree doctor")
    try:
        root = args.root or installed_vllm_root()
        series_dir = args.patches_dir or patches_dir()
        if args.action == "apply":
            print(patching.apply_series(root, series_dir))
        elif args.action == "check":
            changed = patching.check_series(root, series_dir)
            print(f"series applies cleanly to {root / 'vllm'}; it would change:")
            print("\n".join("  " + rel for rel in changed) or "  nothing")
        elif args.action == "revert":
            print(patching.revert_series(root, force=args.force))
        else:
            status = patching.series_status(root, series_dir)
            print(status)
            return 0 if status.state == patching.installer.APPLIED else 1
    except (patching.PatchError, RuntimeError, OSError) as e:
        print(f"vllm-ddtree patches {args.action}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
