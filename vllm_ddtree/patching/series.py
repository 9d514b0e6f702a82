"""The patch series: ``patches/series`` lists patch files in order; each starts with a header.

A patch file is a git-style mail (so ``git am`` and the rebase script can carry it) whose
header names what it does and why, where it stands upstream and when to drop it::

    From: vllm-ddtree <vllm-ddtree@users.noreply.github.com>
    Subject: [PATCH] <what it does>

    Why: <why vllm-ddtree needs it>
    Upstream-Status: <e.g. restores what vLLM PR #42121 removed / not upstreamable: ...>
    Drop-When: <the condition under which the patch goes away>
    ---
    diff --git a/vllm/... b/vllm/...
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_ddtree.patching import unified_diff

HEADER_FIELDS = ("Subject", "Why", "Upstream-Status", "Drop-When")


class PatchError(Exception):
    """The series cannot be read, does not fit the vLLM tree, or the tree is not ours to touch."""


@dataclass(frozen=True)
class Patch:
    name: str
    text: bytes
    header: dict[str, str]
    files: tuple[unified_diff.FileDiff, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text).hexdigest()


def parse_header(name: str, text: bytes) -> dict[str, str]:
    """The header fields of a patch; raises PatchError naming any that is missing."""
    head = re.split(rb"^(?:diff --git |--- )", text, maxsplit=1, flags=re.M)[0]
    header: dict[str, str] = {}
    for line in head.decode(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep and key in HEADER_FIELDS and value.strip():
            header[key] = value.strip()
    missing = [f for f in HEADER_FIELDS if f not in header]
    if missing:
        raise PatchError(
            f"patch {name} has no header field(s) {', '.join(missing)}: every patch must "
            f"begin with {', '.join(f + ':' for f in HEADER_FIELDS)}"
        )
    return header


def read_series(series_dir: Path) -> list[Patch]:
    """The patches named by ``series_dir/series``, in order, each checked for its header."""
    series_file = series_dir / "series"
    if not series_file.is_file():
        raise PatchError(f"no series file at {series_file}")
    patches = []
    for raw in series_file.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        path = series_dir / name
        if not path.is_file():
            raise PatchError(f"series names {name}, but {path} does not exist")
        text = path.read_bytes()
        header = parse_header(name, text)
        try:
            files = tuple(unified_diff.parse(text))
        except unified_diff.DiffError as e:
            raise PatchError(f"patch {name}: {e}") from None
        if not files:
            raise PatchError(f"patch {name} changes no file")
        patches.append(Patch(name, text, header, files))
    return patches
