#!/usr/bin/env python3
"""Carry the patch series to a new upstream vLLM release.

    .venv/bin/python scripts/rebase_upstream.py --to 0.33.0
    .venv/bin/python scripts/rebase_upstream.py --to 0.33.0 --continue   # after a conflict

Takes the `vllm/` files the series touches from the official wheels of the pinned and the
new release (PyPI; nothing else is fetched), builds a git history in a work folder (the old
files with the series as commits on them, the new files, then each commit cherry-picked
onto the new files: a 3-way merge)
and reports each patch: applied cleanly, applied at an offset, merged by 3-way, already
upstream (droppable), conflict (files and hunks), or its file removed upstream. On success
it rewrites the patch files (headers kept, diffs regenerated), drops the droppable ones from
`series` and moves the pin. On a conflict it exits non-zero and leaves patches/ and the pin
untouched, and the work folder mid-cherry-pick for a person to resolve, with the commands to
continue; the patches after the conflict are still tried, in a scratch copy of the work
folder (the conflicting one left out), so one run reports every patch's fate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_ddtree.patching import read_series, unified_diff  # noqa: E402
from vllm_ddtree.upstream import WHEEL_CACHE, fetch_wheel, pinned_version  # noqa: E402

GIT = ["git", "-c", "user.name=vllm-ddtree rebase", "-c",
       "user.email=vllm-ddtree@users.noreply.github.com", "-c", "commit.gpgsign=false"]


def say(message: str) -> None:
    print(f"[rebase] {message}", flush=True)


def git(work: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*GIT, *args], cwd=work, capture_output=True, text=True, check=check)


def wheel_files(version: str, paths: list[str]) -> dict[str, bytes | None]:
    say(f"reading vllm=={version} from its official wheel (downloaded once into "
        f"{WHEEL_CACHE})")
    with zipfile.ZipFile(fetch_wheel(version)) as zf:
        names = set(zf.namelist())
        return {p: zf.read(p) if p in names else None for p in paths}


def tree_files(tree: Path, paths: list[str]) -> dict[str, bytes | None]:
    return {p: (tree / p).read_bytes() if (tree / p).is_file() else None for p in paths}


def write_tree(work: Path, files: dict[str, bytes | None]) -> None:
    for rel, data in files.items():
        path = work / rel
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def classify(patch, files: dict[str, bytes | None]) -> tuple[str, str]:
    """How a patch fits the new files, by the series tool's own applier."""
    removed = [fd.path for fd in patch.files if not fd.creates and files.get(fd.path) is None]
    if removed:
        return "file removed upstream", ", ".join(removed)
    offsets: list[int] = []
    try:
        for fd in patch.files:
            unified_diff.apply(fd, files.get(fd.path), offsets)
        moved = [o for o in offsets if o]
        if not moved:
            return "clean", ""
        return "offset", f"hunks moved by {', '.join(f'{o:+d}' for o in moved)} lines"
    except unified_diff.DiffError as e:
        failure = str(e)
    try:
        for fd in patch.files:
            unified_diff.apply(unified_diff.reverse(fd), files.get(fd.path))
        return "droppable", "upstream already contains this change"
    except unified_diff.DiffError:
        return "needs 3-way", failure


def regenerate(work: Path, series_dir: Path, results: list[dict], new_version: str) -> None:
    commits = git(work, "rev-list", "--reverse", "upstream-new..series").stdout.split()
    applied = [r for r in results if r["result"] != "droppable"]
    assert len(commits) == len(applied), (commits, applied)
    for r, commit in zip(applied, commits):
        path = series_dir / r["name"]
        text = path.read_text()
        header = text[:text.index("diff --git")]
        diff = git(work, "diff", "--no-color", "--full-index", f"{commit}^", commit).stdout
        path.write_text(header + diff)
    dropped = {r["name"] for r in results if r["result"] == "droppable"}
    lines = (series_dir / "series").read_text().splitlines()
    (series_dir / "series").write_text(
        "\n".join(line for line in lines if line.strip() not in dropped) + "\n")
    for name in dropped:
        (series_dir / name).unlink()
    (series_dir / "upstream-version").write_text(new_version + "\n")


def report(results: list[dict], old: str, new: str) -> str:
    rows = [f"| {r['name']} | {r['result']}{' (surveyed)' if r.get('surveyed') else ''} "
            f"| {r['detail']} |" for r in results]
    notes = []
    if any(r.get("surveyed") for r in results):
        notes = ["", "(surveyed): tried past the first conflict, without the patches that "
                 "conflicted; carried only once those are resolved."]
    return "\n".join([f"Patch series carried from vLLM {old} to {new}:", "",
                      "| patch | result | detail |", "|---|---|---|", *rows, *notes])


def pick(work: Path, patch, commit: str, new_files: dict) -> dict:
    """Cherry-picks one commit in ``work``; its result, "conflict" leaving the pick in
    progress. ``new_files`` follows what was carried, for the next patch's classification."""
    kind, detail = classify(patch, new_files)
    if kind != "droppable":
        applied = git(work, "cherry-pick", commit, check=False)
        if applied.returncode != 0:
            unmerged = git(work, "diff", "--name-only", "--diff-filter=U").stdout.split()
            if kind != "file removed upstream":
                kind, detail = "conflict", f"{detail}; files: {', '.join(unmerged) or '?'}"
        else:
            kind = "merged by 3-way" if kind == "needs 3-way" else kind
            for fd in patch.files:
                path = work / fd.path
                new_files[fd.path] = path.read_bytes() if path.is_file() else None
    say(f"{patch.name}: {kind}{' (' + detail + ')' if detail else ''}")
    return {"name": patch.name, "result": kind, "detail": detail}


STOPS = ("conflict", "file removed upstream")  # the fates that need a person


def carry(work: Path, patches, start: int, results: list[dict], new_files: dict) -> bool:
    """Cherry-pick the series' commits [start:] onto the new files; False at a conflict."""
    commits = git(work, "rev-list", "--reverse", "upstream-old..series-old").stdout.split()
    for patch, commit in list(zip(patches, commits))[start:]:
        results.append(pick(work, patch, commit, new_files))
        if results[-1]["result"] in STOPS:
            return False
    return True


def survey(work: Path, patches, start: int, new_files: dict) -> list[dict]:
    """The fates of the series' commits [start:] past a conflict: each tried in a scratch
    worktree at the last carried commit, left out where it conflicts."""
    commits = git(work, "rev-list", "--reverse", "upstream-old..series-old").stdout.split()
    scratch = Path(tempfile.mkdtemp(prefix="rebase-survey-")) / "tree"
    git(work, "worktree", "add", "-q", "--detach", str(scratch), "HEAD")
    try:
        fates = []
        for patch, commit in list(zip(patches, commits))[start:]:
            fates.append(pick(scratch, patch, commit, new_files) | {"surveyed": True})
            if fates[-1]["result"] in STOPS:
                git(scratch, "cherry-pick", "--abort", check=False)
        return fates
    finally:
        git(work, "worktree", "remove", "--force", str(scratch), check=False)
        shutil.rmtree(scratch.parent, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", required=True, help="the new upstream vLLM release")
    parser.add_argument("--patches-dir", type=Path, default=REPO / "patches")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--from-tree", type=Path, default=None,
                        help="a folder holding the old vllm/ (default: the pinned wheel)")
    parser.add_argument("--to-tree", type=Path, default=None,
                        help="a folder holding the new vllm/ (default: the new wheel)")
    parser.add_argument("--continue", dest="resume", action="store_true",
                        help="after resolving a conflict and `git am --continue`")
    parser.add_argument("--report", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    series_dir = args.patches_dir
    old = pinned_version(series_dir)
    patches = read_series(series_dir)
    work = args.workdir or WHEEL_CACHE.parent / f"rebase-{old}-to-{args.to}"
    state_file = work / ".rebase-state.json"
    paths = sorted({fd.path for p in patches for fd in p.files})

    if args.resume:
        state = json.loads(state_file.read_text())
        if (work / ".git" / "CHERRY_PICK_HEAD").exists():
            say(f"the cherry-pick is still in progress in {work}: resolve, `git add -A`, "
                f"then `git cherry-pick --continue`")
            return 1
        results = state["results"]
        results[-1]["result"] = "resolved by hand"
        new_files = tree_files(work, paths)
        start = len(results)
    else:
        old_files = (tree_files(args.from_tree, paths) if args.from_tree
                     else wheel_files(old, paths))
        new_files = (tree_files(args.to_tree, paths) if args.to_tree
                     else wheel_files(args.to, paths))
        say(f"building the history in {work}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        git(work, "init", "-q", "-b", "upstream-old")
        write_tree(work, old_files)
        git(work, "add", "-A")
        git(work, "commit", "-q", "--allow-empty", "-m", f"upstream vLLM {old}")
        # The series as commits on the old files, where it applies as it is...
        git(work, "checkout", "-q", "-b", "series-old")
        for patch in patches:
            git(work, "am", "--keep-cr", str(series_dir / patch.name))
        # ...then carried onto the new files one commit at a time (3-way merges).
        git(work, "checkout", "-q", "-b", "upstream-new", "upstream-old")
        write_tree(work, new_files)
        git(work, "add", "-A")
        git(work, "commit", "-q", "--allow-empty", "-m", f"upstream vLLM {args.to}")
        git(work, "checkout", "-q", "-b", "series")
        results, start = [], 0

    carried_files = dict(new_files)
    ok = carry(work, patches, start, results, carried_files)
    state_file.write_text(json.dumps({"results": results}))
    fates = [] if ok else survey(work, patches, len(results), carried_files)
    text = report(results + fates, old, args.to)
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    if not ok:
        say(f"conflict: {series_dir} and the pin are unchanged. To resolve:\n"
            f"  cd {work}\n  git status            # the conflicting files\n"
            f"  (edit them)\n  git add -A && git cherry-pick --continue --no-edit\n"
            f"  {sys.executable} {Path(__file__).resolve()} --to {args.to} "
            f"--patches-dir {series_dir} --workdir {work} --continue")
        return 1
    regenerate(work, series_dir, results, args.to)
    say(f"rewrote {series_dir} and moved the pin to {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
