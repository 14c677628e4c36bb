"""Where sandbox tools run: the episode's sandbox session, or a default local sandbox.

An environment may put a `SandboxSession` (or a whole `Sandbox`) in `ToolContext.sandbox`. Tools
that need a persistent work dir (`bash`, `str_replace_editor`) call `episode_session(ctx)`: the
context's session as is, or one opened once per episode from the context's sandbox (or from the
process-wide default `LocalSandbox`) and shared by every tool of the episode through `ctx.state`.
`release_episode_session` closes a session opened here; one the environment gave is its to close.
Sandbox failures become `ToolInfrastructureError`, since they are not the model's doing.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from agentrl.errors import SandboxError, ToolInfrastructureError
from agentrl.tools.core import ToolContext

__all__ = [
    "close_default_sandbox",
    "default_sandbox",
    "episode_sandbox",
    "episode_session",
    "release_episode_session",
]

_STATE_KEY = "_agentrl_sandbox_session"
# One default sandbox per event loop: its warm workers are asyncio subprocesses bound to the loop
# that started them, so a sandbox shared across loops (an env's private loop for the sync API, then
# asyncio.run elsewhere) would talk to a closed loop.
_defaults: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def default_sandbox() -> Any:
    """The running event loop's `LocalSandbox`, used when an episode brings no sandbox of its own."""
    loop = asyncio.get_running_loop()
    sandbox = _defaults.get(loop)
    if sandbox is None:
        from agentrl.sandboxes.local import LocalSandbox

        try:
            sandbox = LocalSandbox()
        except SandboxError as exc:
            raise ToolInfrastructureError(f"No sandbox is available to run code: {exc}") from exc
        _defaults[loop] = sandbox
    return sandbox


async def close_default_sandbox() -> None:
    """Close the running loop's default sandbox (its warm workers), if one was started.

    Call it before an event loop you own ends: agentrl's own loops (env private loops, `check_env`,
    `agentrl eval`, rollout actors) do. A pool refill still starting a worker when `asyncio.run`
    cancels leftover tasks can block that shutdown (seen with Python 3.11), which this avoids.
    """
    sandbox = _defaults.pop(asyncio.get_running_loop(), None)
    if sandbox is not None:
        await sandbox.close()


def _is_session(obj: Any) -> bool:
    return hasattr(obj, "read_file") and hasattr(obj, "write_file")


def episode_sandbox(ctx: ToolContext) -> Any:
    """Something with `exec`: the episode's session or sandbox, else the default sandbox."""
    if ctx.sandbox is not None:
        return ctx.sandbox
    return ctx.state.get(_STATE_KEY) or default_sandbox()


async def episode_session(ctx: ToolContext) -> Any:
    """The episode's `SandboxSession`, opening (and remembering) one if the context has none."""
    if _is_session(ctx.sandbox):
        return ctx.sandbox
    session = ctx.state.get(_STATE_KEY)
    if session is None:
        owner = ctx.sandbox if ctx.sandbox is not None else default_sandbox()
        try:
            session = await owner.session()
        except SandboxError as exc:
            raise ToolInfrastructureError(f"Could not open a sandbox session: {exc}") from exc
        ctx.state[_STATE_KEY] = session
    return session


async def release_episode_session(ctx: ToolContext) -> None:
    """Close the session `episode_session` opened for this episode, if any."""
    session = ctx.state.pop(_STATE_KEY, None)
    if session is not None:
        await session.close()
