"""`python`: run a Python program in a sandbox and show the model what it printed.

The program runs through the episode's sandbox (`ToolContext.sandbox`: a session keeps files
between calls) or, without one, a throw-away job in the default `LocalSandbox`. Output is cut in
the middle when long. A program that fails, hangs or hits a limit is the model's doing and comes
back as text with `fault="model"`; a sandbox that cannot run anything is an infrastructure fault.
This module does not isolate anything itself; the sandbox does.
"""

from __future__ import annotations

from agentrl.errors import SandboxError, ToolInfrastructureError
from agentrl.tools.core import Tool, ToolContext
from agentrl.tools.exec_output import format_exec_result
from agentrl.tools.session import episode_sandbox
from agentrl.types import ToolResult

__all__ = ["PythonTool"]


class PythonTool(Tool):
    """Runs model-written Python in a sandbox (see the module docstring).

    Args:
        exec_timeout_s: Wall-clock limit of one program; past it the program is killed.
        max_output_chars: Longest output shown to the model; longer output keeps head and tail.
    """

    name = "python"

    def __init__(self, *, exec_timeout_s: float = 10.0, max_output_chars: int = 4000) -> None:
        super().__init__()
        self.exec_timeout_s = exec_timeout_s
        self.max_output_chars = max_output_chars

    async def run(self, ctx: ToolContext, code: str) -> ToolResult:
        """Run a Python program in a sandbox and return what it printed (stdout, then stderr).

        Args:
            code: The complete program. Print the values you want to see; there is no REPL echo.
        """
        sandbox = episode_sandbox(ctx)
        try:
            result = await sandbox.exec(code=code, timeout_s=self.exec_timeout_s)
        except SandboxError as exc:
            raise ToolInfrastructureError(f"The Python sandbox failed: {exc}") from exc
        text, failed = format_exec_result(result, max_chars=self.max_output_chars, timeout_s=self.exec_timeout_s)
        return ToolResult(text, fault="model" if failed else None)
