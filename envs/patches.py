"""Unified diffs, read and applied in Python: the `patch` and `test_patch` fields of SWE instances.

`parse_patch` splits a unified diff (`git diff` or `diff -u` output) into `FilePatch`es with their
hunks; `apply_patch` applies one file's hunks to that file's text, finding each hunk at its stated
line or, like `patch`, at the nearest place its context matches exactly (no fuzz: a hunk that does
not match raises `PatchError`). `make_patch` writes the diff between two versions of a set of files;
`reverse_patch` turns a diff around (SWE-smith ships the diff that introduces a bug; its fix is
the reverse).
The SWE environment applies hidden test patches on the host with these, so grading needs neither
`git` nor `patch` inside the sandbox. Binary diffs, renames and mode changes are not supported.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from agentrl.errors import DatasetError

__all__ = ["FilePatch", "Hunk", "PatchError", "apply_patch", "make_patch", "parse_patch", "reverse_patch"]

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(DatasetError):
    """A diff is malformed or does not apply to the file it names."""


@dataclass
class Hunk:
    """One `@@` block: where it starts in the old file, and its lines with their ' ', '-', '+' marks."""

    old_start: int
    lines: list[str] = field(default_factory=list)
    new_start: int = 0
    old_no_newline: bool = False
    """The old file's last line, in this hunk, has no newline ("\\ No newline at end of file")."""
    new_no_newline: bool = False

    @property
    def old_lines(self) -> list[str]:
        return [line[1:] for line in self.lines if line[:1] in (" ", "-")]

    @property
    def new_lines(self) -> list[str]:
        return [line[1:] for line in self.lines if line[:1] in (" ", "+")]


@dataclass
class FilePatch:
    """The hunks of one file; `old_path`/`new_path` are None for a created/deleted file."""

    old_path: str | None
    new_path: str | None
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def _strip_prefix(raw: str) -> str | None:
    name = raw.split("\t", 1)[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name.startswith(("a/", "b/")) else name


def parse_patch(text: str) -> list[FilePatch]:
    """The files and hunks of a unified diff; raises PatchError for a diff it cannot read."""
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:])))
            i += 2
            continue
        m = _HUNK_RE.match(line)
        if m:
            if not files:
                raise PatchError(f"Hunk {line!r} comes before any '--- a/file' / '+++ b/file' header.")
            old_len = int(m.group(2) or 1)
            new_len = int(m.group(4) or 1)
            hunk = Hunk(int(m.group(1)), new_start=int(m.group(3)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len or lines[i].startswith("\\")):
                body = lines[i]
                mark = body[:1] or " "  # some tools strip the space of an empty context line
                if mark == "\\":  # "\ No newline at end of file": about the line before it
                    last = hunk.lines[-1][:1] if hunk.lines else " "
                    hunk.old_no_newline |= last in (" ", "-")
                    hunk.new_no_newline |= last in (" ", "+")
                    i += 1
                    continue
                if mark not in (" ", "-", "+"):
                    raise PatchError(f"Hunk of {files[-1].path} ends early at line {i + 1}: {body!r}.")
                hunk.lines.append(mark + body[1:])
                seen_old += mark in (" ", "-")
                seen_new += mark in (" ", "+")
                i += 1
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError("The patch holds no file diff ('--- a/file' and '+++ b/file' lines).")
    return files


def apply_patch(original: str | None, file_patch: FilePatch) -> str | None:
    """`original` (None: the file does not exist) with the hunks applied; None if the file is deleted."""
    if file_patch.new_path is None:
        return None
    lines = [] if original is None else original.split("\n")
    trailing_newline = original is None or original.endswith("\n")
    if lines and lines[-1] == "" and trailing_newline:
        lines.pop()
    offset = 0
    for hunk in file_patch.hunks:
        old = hunk.old_lines
        want = max(0, hunk.old_start - 1 + offset) if old else max(0, hunk.old_start + offset)
        at = _find(lines, old, want)
        if at is None:
            raise PatchError(
                f"Hunk at line {hunk.old_start} of {file_patch.path} does not apply: its context is not in the file."
            )
        lines[at:at + len(old)] = hunk.new_lines
        offset += len(hunk.new_lines) - len(old)
        if hunk.new_no_newline:
            trailing_newline = False
        elif hunk.old_no_newline:
            trailing_newline = True
    return "\n".join(lines) + ("\n" if lines and trailing_newline else "")


def _find(lines: list[str], block: list[str], want: int) -> int | None:
    """Where `block` occurs in `lines`, nearest to `want` first."""
    if not block:
        return min(want, len(lines))
    for delta in range(len(lines) + 1):
        for at in (want - delta, want + delta) if delta else (want,):
            if 0 <= at <= len(lines) - len(block) and lines[at:at + len(block)] == block:
                return at
    return None


def make_patch(before: dict[str, str], after: dict[str, str]) -> str:
    """A unified diff (git-style `a/` `b/` paths) turning the files `before` into `after`."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        diff = difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            fromfile=f"a/{path}" if old is not None else "/dev/null",
            tofile=f"b/{path}" if new is not None else "/dev/null",
        )
        out.append(f"diff --git a/{path} b/{path}\n")
        out.extend(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in diff)
    return "".join(out)


def reverse_patch(text: str) -> str:
    """The diff that undoes `text`: old and new sides swapped, file by file and line by line."""
    out: list[str] = []
    swap = {"-": "+", "+": "-", " ": " "}
    for fp in parse_patch(text):
        old, new = fp.new_path, fp.old_path
        out.append(f"diff --git a/{old or new} b/{new or old}\n")
        out.append(f"--- {'a/' + old if old else '/dev/null'}\n+++ {'b/' + new if new else '/dev/null'}\n")
        for h in fp.hunks:
            lines = [swap[line[:1]] + line[1:] for line in h.lines]
            n_old = sum(line[:1] in (" ", "-") for line in lines)
            n_new = sum(line[:1] in (" ", "+") for line in lines)
            out.append(f"@@ -{h.new_start},{n_old} +{h.old_start},{n_new} @@\n")
            for i, line in enumerate(lines):
                out.append(line + "\n")
                last_old = i == max((j for j, x in enumerate(lines) if x[:1] in (" ", "-")), default=-1)
                last_new = i == max((j for j, x in enumerate(lines) if x[:1] in (" ", "+")), default=-1)
                if (last_old and h.new_no_newline and line[:1] in (" ", "-")) or (
                        last_new and h.old_no_newline and line[:1] in (" ", "+")):
                    out.append("\\ No newline at end of file\n")
    return "".join(out)
