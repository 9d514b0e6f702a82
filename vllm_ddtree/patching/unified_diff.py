"""A small unified-diff reader and applier, so the patch tool needs no external `patch`.

It applies hunks whose context matches exactly, at the recorded line or the nearest line
where it matches (an offset); it never applies with fuzz, so nothing lands in a wrong place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_EOL = b"\\ No newline at end of file"


class DiffError(Exception):
    """A diff that cannot be read or does not apply."""


@dataclass
class Hunk:
    old_start: int  # 1-based, as written in the @@ line
    old: list[bytes] = field(default_factory=list)  # lines, with their endings
    new: list[bytes] = field(default_factory=list)


@dataclass
class FileDiff:
    path: str  # relative to the tree root, one leading component stripped (-p1)
    creates: bool
    deletes: bool
    hunks: list[Hunk]


def _strip_path(raw: bytes) -> str | None:
    name = raw.split(b"\t")[0].strip().decode()
    if name == "/dev/null":
        return None
    return name.split("/", 1)[1] if "/" in name else name


def parse(diff: bytes) -> list[FileDiff]:
    """The file diffs of a unified diff; text before the first ``---`` is ignored."""
    lines = diff.splitlines(keepends=True)
    files: list[FileDiff] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith(b"--- ") and i + 1 < len(lines)
                and lines[i + 1].startswith(b"+++ ")):
            i += 1
            continue
        old_path, new_path = _strip_path(lines[i][4:]), _strip_path(lines[i + 1][4:])
        path = new_path or old_path
        if path is None:
            raise DiffError(f"line {i + 1}: diff with /dev/null on both sides")
        fd = FileDiff(path, old_path is None, new_path is None, [])
        i += 2
        while i < len(lines) and lines[i].startswith(b"@@"):
            m = _HUNK.match(lines[i])
            if m is None:
                raise DiffError(f"line {i + 1}: malformed hunk header in {path}")
            old_left = int(m.group(2) or b"1")
            new_left = int(m.group(4) or b"1")
            hunk = Hunk(int(m.group(1)))
            i += 1
            while (old_left > 0 or new_left > 0) and i < len(lines):
                line = lines[i]
                tag, body = line[:1], line[1:]
                if line.startswith(_NO_EOL):
                    i += 1
                    continue
                if tag == b" " or line in (b"\n", b"\r\n"):
                    body = body if tag == b" " else line
                    hunk.old.append(body)
                    hunk.new.append(body)
                    old_left, new_left = old_left - 1, new_left - 1
                elif tag == b"-":
                    hunk.old.append(body)
                    old_left -= 1
                elif tag == b"+":
                    hunk.new.append(body)
                    new_left -= 1
                else:
                    raise DiffError(f"line {i + 1}: unexpected line in hunk of {path}")
                i += 1
                # A "\ No newline" marker right after a line removes that line's ending.
                if i < len(lines) and lines[i].startswith(_NO_EOL):
                    for side in ((hunk.old,) if tag == b"-" else
                                 (hunk.new,) if tag == b"+" else (hunk.old, hunk.new)):
                        side[-1] = side[-1].rstrip(b"\r\n")
            if old_left or new_left:
                raise DiffError(f"truncated hunk in {path}")
            fd.hunks.append(hunk)
        files.append(fd)
    return files


def apply(fd: FileDiff, original: bytes | None, offsets: list[int] | None = None
          ) -> bytes | None:
    """The file after ``fd``; ``None`` means deleted. Raises DiffError when it does not fit.
    Each hunk's distance from its recorded line is appended to ``offsets`` when given."""
    if fd.creates:
        if original is not None:
            raise DiffError(f"{fd.path}: patch creates it, but it already exists")
        return b"".join(line for h in fd.hunks for line in h.new)
    if original is None:
        raise DiffError(f"{fd.path}: file does not exist")
    lines = original.splitlines(keepends=True)
    out: list[bytes] = []
    pos = 0  # first line of `lines` not yet copied to `out`
    shift = 0  # offset found by earlier hunks, carried to later ones
    for n, hunk in enumerate(fd.hunks, 1):
        at = _locate(lines, hunk.old, max(hunk.old_start - 1 + shift, pos), pos)
        if at is None:
            raise DiffError(f"{fd.path}: hunk {n} (line {hunk.old_start}) does not match")
        shift = at - (hunk.old_start - 1)
        if offsets is not None:
            offsets.append(shift)
        out.extend(lines[pos:at])
        out.extend(hunk.new)
        pos = at + len(hunk.old)
    out.extend(lines[pos:])
    result = b"".join(out)
    return None if fd.deletes and not result else result


def reverse(fd: FileDiff) -> FileDiff:
    """The diff that undoes ``fd``."""
    return FileDiff(fd.path, fd.deletes, fd.creates,
                    [Hunk(h.old_start, h.new, h.old) for h in fd.hunks])


def _locate(lines: list[bytes], old: list[bytes], want: int, lowest: int) -> int | None:
    """The matching start nearest to ``want``, not before ``lowest``."""
    def fits(at: int) -> bool:
        return lines[at:at + len(old)] == old
    for delta in range(len(lines) + 1):
        for at in (want - delta, want + delta) if delta else (want,):
            if lowest <= at <= len(lines) - len(old) and fits(at):
                return at
    return None
