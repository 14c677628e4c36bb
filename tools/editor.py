"""`str_replace_editor`: view and edit files in the episode's sandbox session, SWE-agent style.

Commands: `view` (a file with line numbers, optionally a line range; a directory two levels deep),
`create` (a new file), `str_replace` (replace text that must occur exactly once), `insert` (new
text after a given line) and `undo_edit` (revert this episode's last edit of a file). Everything
goes through the session's `read_file`/`write_file`/`exec`, so paths are confined to the sandbox's
work dir by the sandbox itself. A wrong request (missing file, ambiguous match, bad line number) is
the model's fault and says how to fix it; a broken sandbox is an infrastructure fault.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import TYPE_CHECKING, Literal

from agentrl.errors import SandboxError, ToolArgumentError, ToolInfrastructureError
from agentrl.tools.core import Tool, ToolContext
from agentrl.tools.exec_output import truncate_middle
from agentrl.tools.session import episode_session, release_episode_session

if TYPE_CHECKING:
    from agentrl.sandboxes.protocol import SandboxSession

__all__ = ["EditorTool", "number_lines"]

_HISTORY_KEY = "_agentrl_editor_history"
_SNIPPET_CONTEXT = 4


def number_lines(text: str, first: int = 1) -> str:
    """`text` with right-aligned line numbers, like `cat -n`."""
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), start=first))


class EditorTool(Tool):
    """A file viewer and editor working in the sandbox session (see the module docstring).

    Args:
        max_output_chars: Longest view shown to the model; longer views keep head and tail.
    """

    name = "str_replace_editor"

    def __init__(self, *, max_output_chars: int = 12000) -> None:
        super().__init__()
        self.max_output_chars = max_output_chars

    async def run(  # the schema is this signature
        self,
        ctx: ToolContext,
        command: Literal["view", "create", "str_replace", "insert", "undo_edit"],
        path: str,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> str:
        """View, create and edit files. Paths are relative to the working directory.

        Args:
            command: One of view, create, str_replace, insert, undo_edit.
            path: The file or directory, e.g. "src/app.py".
            file_text: For create: the whole content of the new file.
            old_str: For str_replace: the exact text to replace; it must occur exactly once,
                so include enough surrounding lines to make it unique.
            new_str: For str_replace: the replacement text (empty to delete). For insert: the
                text to insert.
            insert_line: For insert: the line after which to insert (0 inserts at the top).
            view_range: For view: [first, last] line numbers to show, 1-based; last may be -1.
        """
        session = await episode_session(ctx)
        try:
            if command == "view":
                return await self._view(session, path, view_range)
            if command == "create":
                return await self._create(ctx, session, path, file_text)
            if command == "str_replace":
                return await self._str_replace(ctx, session, path, old_str, new_str)
            if command == "insert":
                return await self._insert(ctx, session, path, insert_line, new_str)
            return await self._undo(ctx, session, path)
        except SandboxError as exc:
            raise ToolInfrastructureError(f"The sandbox session failed: {exc}") from exc

    async def release(self, ctx: ToolContext) -> None:
        ctx.state.pop(_HISTORY_KEY, None)
        await release_episode_session(ctx)

    # ── commands ────────────────────────────────────────────────────────────────────────────
    async def _read(self, session: SandboxSession, path: str) -> str:
        try:
            data = await session.read_file(path)
        except FileNotFoundError:
            raise ToolArgumentError(f"The path {path} does not exist (or is a directory). "
                                    "Use `view` on a directory to list files, or `create` for a new file.") from None
        except (PermissionError, ValueError) as exc:
            raise ToolArgumentError(f"Cannot access {path}: {exc}") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolArgumentError(f"{path} is not a UTF-8 text file; it cannot be viewed or edited here.") from None

    async def _write(self, ctx: ToolContext, session: SandboxSession, path: str, text: str, previous: str | None) -> None:
        try:
            await session.write_file(path, text)
        except (PermissionError, ValueError, OSError) as exc:
            raise ToolArgumentError(f"Cannot write {path}: {exc}") from None
        ctx.state.setdefault(_HISTORY_KEY, {}).setdefault(_key(path), []).append(previous)

    async def _view(self, session: SandboxSession, path: str, view_range: list[int] | None) -> str:
        listing = await session.exec(
            f"if [ -d {shlex.quote(path)} ]; then find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' "
            "| sort | head -n 500; else echo __FILE__; fi", timeout_s=15)
        if listing.stdout.strip() != "__FILE__" and listing.exit_code == 0:
            return f"Files and directories up to 2 levels deep in {path}:\n{listing.stdout.rstrip()}"
        text = await self._read(session, path)
        lines = text.split("\n")
        first = 1
        if view_range is not None:
            if len(view_range) != 2:
                raise ToolArgumentError("view_range must be two line numbers [first, last], e.g. [10, 40].")
            first, last = view_range
            last = len(lines) if last == -1 else last
            if not 1 <= first <= len(lines) or not first <= last:
                raise ToolArgumentError(
                    f"view_range {view_range} is not within the file's {len(lines)} lines; "
                    f"use 1 <= first <= last <= {len(lines)} (or last = -1)."
                )
            lines = lines[first - 1:last]
        body = truncate_middle(number_lines("\n".join(lines), first), self.max_output_chars)
        return f"Here is the result of running `cat -n` on {path}:\n{body}"

    async def _create(self, ctx: ToolContext, session: SandboxSession, path: str, file_text: str | None) -> str:
        if file_text is None:
            raise ToolArgumentError("`create` needs `file_text`, the content of the new file.")
        exists = await session.exec(f"test -e {shlex.quote(path)}", timeout_s=15)
        if exists.exit_code == 0:
            raise ToolArgumentError(f"{path} already exists; `create` does not overwrite files. "
                                    "Use `str_replace` to edit it.")
        await self._write(ctx, session, path, file_text, None)
        return f"File created successfully at: {path}"

    async def _str_replace(self, ctx: ToolContext, session: SandboxSession, path: str, old_str: str | None,
                           new_str: str | None) -> str:
        if not old_str:
            raise ToolArgumentError("`str_replace` needs a non-empty `old_str`, the exact text to replace.")
        text = await self._read(session, path)
        count = text.count(old_str)
        if count == 0:
            raise ToolArgumentError(f"No replacement was made: `old_str` does not occur verbatim in {path}. "
                                    "Check whitespace and indentation with `view`.")
        if count > 1:
            starts, at = [], text.find(old_str)
            while at != -1:
                starts.append(text.count("\n", 0, at) + 1)
                at = text.find(old_str, at + 1)
            raise ToolArgumentError(f"No replacement was made: `old_str` occurs {count} times in {path} "
                                    f"(at lines {starts}). Include more surrounding lines to make it unique.")
        new_str = new_str or ""
        updated = text.replace(old_str, new_str, 1)
        await self._write(ctx, session, path, updated, text)
        line = text[: text.find(old_str)].count("\n")
        return self._snippet(path, updated, line, line + new_str.count("\n"))

    async def _insert(self, ctx: ToolContext, session: SandboxSession, path: str, insert_line: int | None,
                      new_str: str | None) -> str:
        if insert_line is None or new_str is None:
            raise ToolArgumentError("`insert` needs `insert_line` (0 for the top) and `new_str`.")
        text = await self._read(session, path)
        lines = text.split("\n")
        if not 0 <= insert_line <= len(lines):
            raise ToolArgumentError(f"insert_line {insert_line} is outside the file; use 0 to {len(lines)}.")
        new_lines = new_str.split("\n")
        updated = "\n".join(lines[:insert_line] + new_lines + lines[insert_line:])
        await self._write(ctx, session, path, updated, text)
        return self._snippet(path, updated, insert_line, insert_line + len(new_lines) - 1)

    async def _undo(self, ctx: ToolContext, session: SandboxSession, path: str) -> str:
        history = ctx.state.get(_HISTORY_KEY, {}).get(_key(path))
        if not history:
            raise ToolArgumentError(f"There is no edit of {path} to undo in this episode.")
        previous = history.pop()
        if previous is None:
            await session.exec(f"rm -f {shlex.quote(path)}", timeout_s=15)
            return f"Undid the creation of {path}; the file is removed."
        await session.write_file(path, previous)
        return self._snippet(path, previous, 0, min(previous.count("\n"), 2 * _SNIPPET_CONTEXT)).replace(
            "has been edited", "is restored", 1)

    def _snippet(self, path: str, text: str, first_line0: int, last_line0: int) -> str:
        lines = text.split("\n")
        lo = max(0, first_line0 - _SNIPPET_CONTEXT)
        hi = min(len(lines), last_line0 + _SNIPPET_CONTEXT + 1)
        body = truncate_middle(number_lines("\n".join(lines[lo:hi]), lo + 1), self.max_output_chars)
        return (f"The file {path} has been edited. Here is the result of running `cat -n` on a snippet:\n"
                f"{body}\nReview the changes and make sure they are as expected.")


def _key(path: str) -> str:
    return posixpath.normpath(path.removeprefix("/workspace/"))
