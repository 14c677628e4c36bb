"""Where sandbox tools run: the sandbox the episode was given, or one the episode owns.

The run builds one sandbox from `config.sandbox` and hands it to the env, which puts it (or a
`SandboxSession` of its own) in `ToolContext.sandbox`. `episode_sandbox(ctx)` is what `python`
calls: that sandbox. Tools that need a persistent work dir (`bash`, `str_replace_editor`) call
`episode_session(ctx)`: the context's session as is, or one opened once per episode from the
context's sandbox and shared by every tool of the episode through `ctx.state`.

An env built without a sandbox (in a notebook, by `check_env`) still runs its tools: the first
call makes a `LocalSandbox` for this episode alone, kept in `ctx.state`. There is no process-wide
sandbox. `release_episode_resources` closes whatever was opened here (`ToolEnv` calls it when the
episode ends); a sandbox or session the environment gave is its owner's to close. Sandbox failures
become `ToolInfrastructureError`, since they are not the model's doing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.errors import SandboxError, ToolInfrastructureError
from agentrl.tools.core import ToolContext

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from agentrl.sandboxes.protocol import Sandbox, SandboxSession

__all__ = ["episode_sandbox", "episode_session", "release_episode_resources", "release_episode_session"]

_SESSION_KEY = "_agentrl_sandbox_session"
_OWN_SANDBOX_KEY = "_agentrl_own_sandbox"


def _is_session(obj: object) -> TypeIs[SandboxSession]:
    return hasattr(obj, "read_file") and hasattr(obj, "write_file")


def episode_sandbox(ctx: ToolContext) -> SandboxSession | Sandbox:
    """Something with `exec`: the episode's session or sandbox, else a sandbox of its own."""
    given: SandboxSession | Sandbox | None = ctx.sandbox
    if given is not None:
        return given
    session: SandboxSession | None = ctx.state.get(_SESSION_KEY)
    return session if session is not None else _own_sandbox(ctx)


def _own_sandbox(ctx: ToolContext) -> Sandbox:
    sandbox: Sandbox | None = ctx.state.get(_OWN_SANDBOX_KEY)
    if sandbox is None:
        from agentrl.sandboxes.local import LocalSandbox

        try:
            sandbox = LocalSandbox(pool_size=0)
        except SandboxError as exc:
            raise ToolInfrastructureError(f"No sandbox is available to run code: {exc}") from exc
        ctx.state[_OWN_SANDBOX_KEY] = sandbox
    return sandbox


async def episode_session(ctx: ToolContext) -> SandboxSession:
    """The episode's `SandboxSession`, opening (and remembering) one if the context has none."""
    given: SandboxSession | Sandbox | None = ctx.sandbox
    if _is_session(given):
        return given
    session: SandboxSession | None = ctx.state.get(_SESSION_KEY)
    if session is None:
        owner = given if given is not None else _own_sandbox(ctx)
        try:
            session = await owner.session()
        except SandboxError as exc:
            raise ToolInfrastructureError(f"Could not open a sandbox session: {exc}") from exc
        ctx.state[_SESSION_KEY] = session
    return session


async def release_episode_session(ctx: ToolContext) -> None:
    """Close the session `episode_session` opened for this episode, if any."""
    session = ctx.state.pop(_SESSION_KEY, None)
    if session is not None:
        await session.close()


async def release_episode_resources(ctx: ToolContext) -> None:
    """Close the session and the episode's own sandbox opened here, if any (closing twice is harmless)."""
    try:
        await release_episode_session(ctx)
    finally:
        sandbox = ctx.state.pop(_OWN_SANDBOX_KEY, None)
        if sandbox is not None:
            await sandbox.close()
