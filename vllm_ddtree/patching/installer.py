"""Apply, check, revert and report the patch series on a ``vllm/`` tree, atomically.

The tree root is the folder holding ``vllm/`` (site-packages for an installed vLLM, the
unpacked wheel for the Docker image). Beside ``vllm/`` the tool keeps its record in
``vllm_ddtree_patch_state/``: ``state.json`` (series applied, and for every file it changed
the sha256 before and after) and ``originals/`` (each changed file as it was), so that
``revert`` restores every file byte for byte and ``status`` sees later edits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from vllm_ddtree.patching import unified_diff
from vllm_ddtree.patching.series import Patch, PatchError, read_series
from vllm_ddtree.upstream import pinned_version, tree_version

STATE_DIR = "vllm_ddtree_patch_state"

APPLIED = "applied"
NOT_APPLIED = "not applied"
MODIFIED = "modified since apply"
STALE = "applied, but the series changed since"


def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


@dataclass
class PatchState:
    """What the last ``apply`` did to the tree (``state.json``)."""

    upstream_version: str
    series: list[dict[str, str]]  # [{"name", "sha256"}] in order
    files: dict[str, dict[str, str | None]]  # path -> {"before", "after"} sha256

    @classmethod
    def load(cls, root: Path) -> PatchState | None:
        path = root / STATE_DIR / "state.json"
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))

    def original(self, root: Path, rel: str) -> bytes | None:
        if self.files[rel]["before"] is None:
            return None
        return (root / STATE_DIR / "originals" / rel).read_bytes()

    def modified_files(self, root: Path) -> list[str]:
        return [r for r, s in self.files.items() if _sha(_read(root / r)) != s["after"]]


@dataclass
class Status:
    state: str
    details: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([self.state, *("  " + d for d in self.details)])


def check_version(root: Path, series_dir: Path) -> None:
    """Refuse a tree whose vLLM release is not the pinned one."""
    pinned = pinned_version(series_dir)
    found = tree_version(root)
    if found != pinned:
        raise PatchError(
            f"installed vLLM is {found} (at {root / 'vllm'}), but the patch series is "
            f"pinned to vLLM {pinned}: install vllm=={pinned} or rebase the series "
            f"(scripts/rebase_upstream.py --to {found})"
        )


def _run_series(
    patches: list[Patch], root: Path, state: PatchState | None
) -> tuple[dict[str, bytes | None], dict[str, bytes | None]]:
    """Originals and results of the series over the pristine tree, all in memory."""
    paths = {f.path for p in patches for f in p.files} | set(state.files if state else ())
    originals = {
        rel: state.original(root, rel) if state and rel in state.files else _read(root / rel)
        for rel in sorted(paths)
    }
    results = dict(originals)
    for patch in patches:
        for fd in patch.files:
            try:
                results[fd.path] = unified_diff.apply(fd, results[fd.path])
            except unified_diff.DiffError as e:
                raise PatchError(f"patch {patch.name} does not apply: {e}") from None
    return originals, results


def check_series(root: Path, series_dir: Path) -> list[str]:
    """A dry run: the files the series would change; raises PatchError if it does not fit."""
    check_version(root, series_dir)
    patches = read_series(series_dir)
    originals, results = _run_series(patches, root, PatchState.load(root))
    return [rel for rel in results if results[rel] != originals[rel]]


def series_status(root: Path, series_dir: Path) -> Status:
    state = PatchState.load(root)
    if state is None:
        return Status(NOT_APPLIED)
    modified = state.modified_files(root)
    if modified:
        return Status(MODIFIED, [f"{r} changed after apply" for r in modified])
    applied = [{"name": p.name, "sha256": p.sha256} for p in read_series(series_dir)]
    if applied != state.series:
        return Status(STALE, ["run `vllm-ddtree patches apply` to bring it up to date"])
    return Status(APPLIED, [p["name"] for p in state.series])


def apply_series(root: Path, series_dir: Path) -> str:
    """Apply every patch of the series, or change nothing. Returns what it did."""
    check_version(root, series_dir)
    patches = read_series(series_dir)
    state = PatchState.load(root)
    if state is not None:
        modified = state.modified_files(root)
        if modified:
            raise PatchError(
                "files changed since the series was applied: " + ", ".join(modified)
                + "; run `vllm-ddtree patches revert --force` first"
            )
        if state.series == [{"name": p.name, "sha256": p.sha256} for p in patches]:
            return "already applied: nothing changed"
    originals, results = _run_series(patches, root, state)
    changed = {rel for rel in results if results[rel] != originals[rel]}
    new_state = PatchState(
        upstream_version=tree_version(root),
        series=[{"name": p.name, "sha256": p.sha256} for p in patches],
        files={r: {"before": _sha(originals[r]), "after": _sha(results[r])} for r in changed},
    )
    _commit(root, originals, results, new_state)
    return f"applied {len(patches)} patch(es) to {len(changed)} file(s)"


def revert_series(root: Path, force: bool = False) -> str:
    """Restore every file the series changed, byte for byte."""
    state = PatchState.load(root)
    if state is None:
        return "not applied: nothing to revert"
    modified = state.modified_files(root)
    if modified and not force:
        raise PatchError(
            "files changed since the series was applied: " + ", ".join(modified)
            + "; `revert --force` discards those changes"
        )
    originals = {rel: state.original(root, rel) for rel in state.files}
    _commit(root, originals, originals, None)
    return f"reverted {len(originals)} file(s)"


def _write(path: Path, data: bytes | None) -> None:
    if data is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".ddtree-tmp")
    tmp.write_bytes(data)
    if path.exists():
        shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _commit(
    root: Path,
    originals: dict[str, bytes | None],
    after: dict[str, bytes | None],
    new_state: PatchState | None,
) -> None:
    """Write ``after`` into the tree and record ``new_state``; all or nothing."""
    state_dir, staged, old = (root / (STATE_DIR + s) for s in ("", ".new", ".old"))
    for d in (staged, old):
        shutil.rmtree(d, ignore_errors=True)
    if new_state is not None:
        for rel in new_state.files:
            if originals[rel] is not None:
                (staged / "originals" / rel).parent.mkdir(parents=True, exist_ok=True)
                (staged / "originals" / rel).write_bytes(originals[rel])
        staged.mkdir(exist_ok=True)
        (staged / "state.json").write_text(json.dumps(new_state.__dict__, indent=1) + "\n")
    snapshot = {rel: _read(root / rel) for rel in after}
    done: list[str] = []
    try:
        for rel in sorted(after):
            if after[rel] != snapshot[rel]:
                _write(root / rel, after[rel])
                done.append(rel)
        if state_dir.exists():
            os.replace(state_dir, old)
        if new_state is not None:
            os.replace(staged, state_dir)
    except BaseException:
        for rel in done:
            _write(root / rel, snapshot[rel])
        if old.exists() and not state_dir.exists():
            os.replace(old, state_dir)
        raise
    finally:
        for d in (staged, old):
            shutil.rmtree(d, ignore_errors=True)
