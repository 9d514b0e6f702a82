"""scripts/rebase_upstream.py on small synthetic upstream trees: a clean carry, an offset,
a conflict (nothing lost, work left to resolve, then --continue), and a patch upstream
already merged (reported droppable and dropped)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from patch_cases import HEADER

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/rebase_upstream.py"
OLD = {"vllm/a.py": "".join(f"line {i}\n" for i in range(1, 21)), "vllm/b.py": "x = 1\ny = 2\n"}
PATCH_A = HEADER.format(subject="change a") + """diff --git a/vllm/a.py b/vllm/a.py
--- a/vllm/a.py
+++ b/vllm/a.py
@@ -9,3 +9,4 @@
 line 9
 line 10
+# ddtree hook
 line 11
"""
PATCH_B = HEADER.format(subject="change b") + """diff --git a/vllm/b.py b/vllm/b.py
--- a/vllm/b.py
+++ b/vllm/b.py
@@ -1,2 +1,2 @@
 x = 1
-y = 2
+y = 3
"""


def setup(tmp: Path, new: dict[str, str]) -> tuple[Path, list[str]]:
    for name, files in (("old", OLD), ("new", new)):
        for rel, text in files.items():
            (tmp / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name / rel).write_text(text)
    patches = tmp / "patches"
    patches.mkdir()
    (patches / "upstream-version").write_text("1.0.0\n")
    (patches / "series").write_text("0001-a.patch\n0002-b.patch\n")
    (patches / "0001-a.patch").write_text(PATCH_A)
    (patches / "0002-b.patch").write_text(PATCH_B)
    return patches, ["--to", "2.0.0", "--patches-dir", str(patches), "--workdir",
                     str(tmp / "work"), "--from-tree", str(tmp / "old"), "--to-tree",
                     str(tmp / "new")]


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_clean_carry_moves_the_pin_and_keeps_headers(tmp_path: Path) -> None:
    patches, args = setup(tmp_path, OLD)
    result = run(args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 0001-a.patch | clean |" in result.stdout
    assert "| 0002-b.patch | clean |" in result.stdout
    assert (patches / "upstream-version").read_text() == "2.0.0\n"
    text = (patches / "0001-a.patch").read_text()
    assert text.startswith(HEADER.format(subject="change a")) and "+# ddtree hook" in text


def test_offset_is_reported_and_the_regenerated_patch_fits_exactly(tmp_path: Path) -> None:
    moved = {**OLD, "vllm/a.py": "new 1\nnew 2\nnew 3\n" + OLD["vllm/a.py"]}
    patches, args = setup(tmp_path, moved)
    result = run(args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 0001-a.patch | offset | hunks moved by +3 lines |" in result.stdout
    from vllm_ddtree.patching import unified_diff

    (fd,) = unified_diff.parse((patches / "0001-a.patch").read_bytes())
    offsets: list[int] = []
    unified_diff.apply(fd, moved["vllm/a.py"].encode(), offsets)
    assert offsets == [0]  # the regenerated patch fits the new file where it says


def test_conflict_loses_nothing_and_can_be_continued(tmp_path: Path) -> None:
    clash = {**OLD, "vllm/b.py": "x = 1\ny = 5\n"}
    patches, args = setup(tmp_path, clash)
    before = snapshot(patches)
    result = run(args)
    assert result.returncode == 1
    assert "| 0002-b.patch | conflict |" in result.stdout and "vllm/b.py" in result.stdout
    assert "git cherry-pick --continue" in result.stdout + result.stderr
    assert snapshot(patches) == before  # the series and the pin are untouched
    work = tmp_path / "work"
    assert "<<<<<<<" in (work / "vllm/b.py").read_text()  # left for a person to resolve
    (work / "vllm/b.py").write_text("x = 1\ny = 3\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@e", "-c", "core.editor=true"]
    subprocess.run([*git, "add", "-A", "vllm"], cwd=work, check=True)
    subprocess.run([*git, "cherry-pick", "--continue", "--no-edit"], cwd=work, check=True,
                   capture_output=True)
    result = run([*args, "--continue"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 0002-b.patch | resolved by hand |" in result.stdout
    assert (patches / "upstream-version").read_text() == "2.0.0\n"
    assert "-y = 5\n+y = 3" in (patches / "0002-b.patch").read_text()


def test_change_already_upstream_is_dropped(tmp_path: Path) -> None:
    merged = {**OLD, "vllm/b.py": "x = 1\ny = 3\n"}
    patches, args = setup(tmp_path, merged)
    result = run(args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| 0002-b.patch | droppable |" in result.stdout
    assert (patches / "series").read_text() == "0001-a.patch\n"
    assert not (patches / "0002-b.patch").exists()


def test_patches_past_a_conflict_are_still_reported(tmp_path: Path) -> None:
    clash_a = {**OLD, "vllm/a.py": OLD["vllm/a.py"].replace("line 10\n", "line ten\n"),
               "vllm/b.py": "x = 1\ny = 3\n"}
    patches, args = setup(tmp_path, clash_a)
    before = snapshot(patches)
    result = run(args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "| 0001-a.patch | conflict |" in result.stdout
    # The second patch's fate, without the first: its change is upstream already.
    assert "| 0002-b.patch | droppable (surveyed) |" in result.stdout
    assert snapshot(patches) == before
    work = tmp_path / "work"
    assert "<<<<<<<" in (work / "vllm/a.py").read_text()  # the first conflict left to resolve
    listed = subprocess.run(["git", "worktree", "list"], cwd=work, capture_output=True,
                            text=True, check=True).stdout
    assert len(listed.splitlines()) == 1  # the scratch copy is gone


def test_a_patch_whose_file_upstream_removed_is_named(tmp_path: Path) -> None:
    patches, args = setup(tmp_path, {"vllm/a.py": OLD["vllm/a.py"]})
    before = snapshot(patches)
    result = run(args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "| 0001-a.patch | clean |" in result.stdout
    assert "| 0002-b.patch | file removed upstream | vllm/b.py |" in result.stdout
    assert snapshot(patches) == before


def test_every_fate_past_the_first_conflict(tmp_path: Path) -> None:
    """The first patch conflicts; the second's file is gone: both reported in one run."""
    gone_b = {"vllm/a.py": OLD["vllm/a.py"].replace("line 11\n", "line eleven\n")}
    patches, args = setup(tmp_path, gone_b)
    result = run(args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "| 0001-a.patch | conflict |" in result.stdout
    assert "| 0002-b.patch | file removed upstream (surveyed) | vllm/b.py |" in result.stdout
