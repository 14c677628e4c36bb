"""Pieces the fault-injection tests plug into real runs: a sandbox that breaks, an env that uses it.

`BreakingSandbox` is a real `LocalSandbox` that serves its first `works_for` executions and then
fails every later one as an infrastructure failure would (`SandboxError`). The pre-flight check
builds an instance of its own and runs two snippets on it, so `works_for=2` passes the
pre-flight and breaks the run. `SandboxParityEnv` runs one sandbox command when each episode
starts (as a SWE env sets up its repository), so every episode meets the sandbox whatever the
tiny random model writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agentrl.errors import SandboxError
from agentrl.sandboxes.local import LocalSandbox
from agentrl.tools.core import ToolContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from parity_env import ParityEnv

__all__ = ["BreakingSandbox", "SandboxParityEnv"]


class BreakingSandbox(LocalSandbox):
    """A LocalSandbox whose executions fail after the first `works_for` (see the module docstring)."""

    def __init__(self, works_for: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.works_for = works_for
        self.calls = 0

    async def exec(self, command: str | None = None, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.works_for:
            raise SandboxError("the sandbox's worker process is gone (injected fault)")
        return await super().exec(command, **kwargs)


class SandboxParityEnv(ParityEnv):
    """ParityEnv whose episodes start with a sandbox command (see the module docstring)."""

    def __init__(self, max_turns: int = 1, sandbox: Any | None = None) -> None:
        super().__init__(max_turns=max_turns)
        self.sandbox = sandbox

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        if self.sandbox is None:
            raise SandboxError("SandboxParityEnv was built without a sandbox")
        result = await self.sandbox.exec("echo ready", timeout_s=30)
        if result.stdout.strip() != "ready":
            raise SandboxError(f"the episode's set-up command failed: {result.stderr[-200:]}")
        return ToolContext(episode_id=episode_id, sandbox=self.sandbox)
