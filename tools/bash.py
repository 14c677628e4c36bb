"""`bash`: run a shell command in the episode's sandbox session (SWE-style work on a repository).

Commands share one work dir for the whole episode, so files written by one call are there for the
next (background processes are not: each call's processes end with it). The session is the
environment's (`ToolContext.sandbox`) or one this tool opens on the first call and closes when the
episode ends. A failing command is the model's doing and shown as text; a broken sandbox is an
infrastructure fault.
"""

from __future__ import annotations

from agentrl.errors import SandboxError, ToolInfrastructureError
from agentrl.tools.core import Tool, ToolContext
from agentrl.tools.exec_output import format_exec_result
from agentrl.tools.session import episode_session, release_episode_session
from agentrl.types import ToolResult

__all__ = ["BashTool"]


class BashTool(Tool):
    """Runs shell commands in the episode's sandbox session (see the module docstring).

    Args:
        exec_timeout_s: Wall-clock limit of one command; past it every process of it is killed.
            Keep it below the environment's per-call deadline (`ToolEnv.tool_timeout_s`, 30 s),
            so a slow command is reported as the model's timeout, not as an infrastructure one.
        max_output_chars: Longest output shown to the model; longer output keeps head and tail.
    """

    name = "bash"

    def __init__(self, *, exec_timeout_s: float = 20.0, max_output_chars: int = 8000) -> None:
        super().__init__()
        self.exec_timeout_s = exec_timeout_s
        self.max_output_chars = max_output_chars

    async def run(self, ctx: ToolContext, command: str) -> ToolResult:
        """Run a bash command in your working directory and return its output and exit code.

        Args:
            command: The command line, e.g. "ls -la" or "python -m pytest -x tests/test_io.py".
        """
        session = await episode_session(ctx)
        try:
            result = await session.exec(command, timeout_s=self.exec_timeout_s)
        except SandboxError as exc:
            raise ToolInfrastructureError(f"The sandbox session failed: {exc}") from exc
        text, failed = format_exec_result(result, max_chars=self.max_output_chars, timeout_s=self.exec_timeout_s)
        if not failed and result.exit_code == 0 and not result.stdout and not result.stderr:
            text = "[done; no output]"
        return ToolResult(text, fault="model" if failed else None)

    async def release(self, ctx: ToolContext) -> None:
        await release_episode_session(ctx)
