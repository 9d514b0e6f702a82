"""The patch series tool on small synthetic trees: version check, atomicity, idempotence,
byte-identical revert, status, header check."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from patch_cases import HEADER

from vllm_ddtree.cli import main as cli
from vllm_ddtree.patching import (
    PatchError,
    apply_series,
    check_series,
    read_series,
    revert_series,
    series_status,
)
from vllm_ddtree.patching.installer import APPLIED, MODIFIED, NOT_APPLIED, STALE

ORIGINAL = {
    "vllm/_version.py": "__version__ = version = '0.32.0'\n",
    "vllm/a.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "vllm/b.py": "alpha\nbeta\ngamma\n",
}


def make_tree(root: Path, files: dict[str, str] = ORIGINAL) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def write_series(series_dir: Path, patches: dict[str, str], pin: str = "0.32.0") -> Path:
    series_dir.mkdir(parents=True, exist_ok=True)
    (series_dir / "upstream-version").write_text(pin + "\n")
    (series_dir / "series").write_text("# order\n" + "\n".join(patches) + "\n")
    for name, body in patches.items():
        (series_dir / name).write_text(body)
    return series_dir


def diff(path: str, hunks: str) -> str:
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n{hunks}"


GOOD_A = HEADER.format(subject="change a") + diff(
    "vllm/a.py", "@@ -4,3 +4,4 @@\n line 4\n-line 5\n+LINE 5\n+inserted\n line 6\n")
GOOD_B = HEADER.format(subject="change b") + diff(
    "vllm/b.py", "@@ -1,3 +1,3 @@\n alpha\n-beta\n+BETA\n gamma\n")
NEW_FILE = HEADER.format(subject="new file") + (
    "--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n")
BROKEN_B = HEADER.format(subject="broken") + diff(
    "vllm/b.py", "@@ -1,3 +1,3 @@\n alpha\n-not there\n+BETA\n gamma\n")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "site")


def test_apply_revert_round_trip_is_byte_identical(tree: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A, "2.patch": GOOD_B,
                                           "3.patch": NEW_FILE})
    before = snapshot(tree)
    assert series_status(tree, series).state == NOT_APPLIED
    assert sorted(check_series(tree, series)) == ["vllm/a.py", "vllm/b.py", "vllm/new.py"]
    assert snapshot(tree) == before  # check is a dry run

    assert "applied 3 patch(es) to 3 file(s)" in apply_series(tree, series)
    assert (tree / "vllm/b.py").read_text() == "alpha\nBETA\ngamma\n"
    assert "LINE 5\ninserted\nline 6\n" in (tree / "vllm/a.py").read_text()
    assert (tree / "vllm/new.py").read_text() == "x = 1\ny = 2\n"
    assert series_status(tree, series).state == APPLIED

    revert_series(tree)
    assert snapshot(tree) == before  # byte for byte, the created file gone, no state left
    assert series_status(tree, series).state == NOT_APPLIED


def test_second_apply_changes_nothing(tree: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A})
    apply_series(tree, series)
    after = snapshot(tree)
    assert apply_series(tree, series).startswith("already applied")
    assert snapshot(tree) == after


def test_broken_patch_changes_no_file(tree: Path, tmp_path: Path) -> None:
    # The first patch fits; the second does not: the first must not land either.
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A, "2.patch": BROKEN_B})
    before = snapshot(tree)
    with pytest.raises(PatchError, match=r"patch 2.patch does not apply: vllm/b.py: hunk 1"):
        apply_series(tree, series)
    assert snapshot(tree) == before
    with pytest.raises(PatchError, match="2.patch"):
        check_series(tree, series)


def test_failure_while_writing_rolls_back(tree: Path, tmp_path: Path, monkeypatch) -> None:
    from vllm_ddtree.patching import installer

    series = write_series(tmp_path / "p", {"1.patch": GOOD_A, "2.patch": GOOD_B})
    before = snapshot(tree)
    real_write, calls = installer._write, []

    def failing_write(path: Path, data: bytes | None) -> None:
        calls.append(path)
        if len(calls) == 2:  # the second file of the series: the first is already written
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(installer, "_write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        apply_series(tree, series)
    assert snapshot(tree) == before


def test_refuses_other_vllm_version_naming_both(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "site", {**ORIGINAL,
                                         "vllm/_version.py": "__version__ = '0.33.0'\n"})
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A})
    before = snapshot(tree)
    with pytest.raises(PatchError, match=r"installed vLLM is 0\.33\.0.*pinned to vLLM 0\.32\.0"):
        apply_series(tree, series)
    assert snapshot(tree) == before


def test_local_version_label_is_the_same_release(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "site", {**ORIGINAL,
                                         "vllm/_version.py": "__version__ = '0.32.0+cpu'\n"})
    apply_series(tree, write_series(tmp_path / "p", {"1.patch": GOOD_A}))


def test_refuses_patch_without_header(tree: Path, tmp_path: Path) -> None:
    headless = GOOD_A.replace("Drop-When: never\n", "")
    series = write_series(tmp_path / "p", {"1.patch": headless})
    with pytest.raises(PatchError, match="1.patch has no header field.*Drop-When"):
        read_series(series)
    with pytest.raises(PatchError):
        apply_series(tree, series)


def test_status_sees_edits_and_revert_guards_them(tree: Path, tmp_path: Path) -> None:
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A, "2.patch": GOOD_B})
    apply_series(tree, series)
    (tree / "vllm/b.py").write_text("someone edited this\n")
    status = series_status(tree, series)
    assert status.state == MODIFIED and "vllm/b.py" in str(status)
    with pytest.raises(PatchError, match="vllm/b.py"):
        revert_series(tree)
    with pytest.raises(PatchError, match="vllm/b.py"):
        apply_series(tree, series)
    revert_series(tree, force=True)
    assert snapshot(tree) == snapshot(make_tree(tmp_path / "fresh"))


def test_changed_series_is_stale_and_reapply_starts_from_originals(
    tree: Path, tmp_path: Path
) -> None:
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A, "2.patch": GOOD_B})
    apply_series(tree, series)
    write_series(series, {"1.patch": GOOD_A, "3.patch": NEW_FILE})  # b dropped, new added
    assert series_status(tree, series).state == STALE
    apply_series(tree, series)
    assert (tree / "vllm/b.py").read_text() == ORIGINAL["vllm/b.py"]
    assert (tree / "vllm/new.py").exists()
    revert_series(tree)
    assert snapshot(tree) == snapshot(make_tree(tmp_path / "fresh"))


def test_offset_hunk_applies_at_its_new_place(tmp_path: Path) -> None:
    shifted = {**ORIGINAL, "vllm/a.py": "new first\nnew second\n" + ORIGINAL["vllm/a.py"]}
    tree = make_tree(tmp_path / "site", shifted)
    apply_series(tree, write_series(tmp_path / "p", {"1.patch": GOOD_A}))
    assert "line 4\nLINE 5\ninserted\nline 6\n" in (tree / "vllm/a.py").read_text()


def test_cli_exit_codes_and_messages(tree: Path, tmp_path: Path, capsys) -> None:
    series = write_series(tmp_path / "p", {"1.patch": GOOD_A})
    args = ["--root", str(tree), "--patches-dir", str(series)]
    assert cli(["patches", "status", *args]) == 1
    assert cli(["patches", "check", *args]) == 0
    assert cli(["patches", "apply", *args]) == 0
    assert cli(["patches", "apply", *args]) == 0
    assert "already applied" in capsys.readouterr().out
    assert cli(["patches", "status", *args]) == 0
    assert cli(["patches", "revert", *args]) == 0
    (tree / "vllm/_version.py").write_text("__version__ = '0.31.0'\n")
    assert cli(["patches", "apply", *args]) == 2
    err = capsys.readouterr().err
    assert "0.31.0" in err and "0.32.0" in err
