"""The sandbox contract: where model-written code runs.

A `Sandbox` runs one command or program and returns an `ExecResult`; it never raises because the
program failed, hung or misbehaved (that is what `exit_code`, `timed_out` and `killed_reason`
report). It raises `SandboxError` only when the sandbox itself cannot work (isolation tools
missing, service down, session closed). A `SandboxSession` adds a persistent working directory and
files for multi-step tasks (SWE-style), and must leave no processes or files behind after `close`.

Backends that run images (`docker`, and `remote` against a docker-backed server) also take
`session(image=..., workdir=...)`: a session in that image, run as it is, whose work dir is
`workdir` inside it (e.g. /testbed); callers check for the parameter. A remote provider
implements the HTTP protocol written out in `agentrl.sandboxes.server` (what `RemoteSandbox`
speaks; `agentrl sandbox serve` is its reference server, `images/sandbox-server/` packages it).

Everything is async, so thousands of episodes can share one event loop. Backends (local, docker,
remote) implement these protocols; this module only defines them. Each backend's own module
docstring says which threats it covers and which it does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from agentrl.types import ExecResult

__all__ = ["ExecResult", "Sandbox", "SandboxSession"]


@runtime_checkable
class SandboxSession(Protocol):
    """A live, stateful sandbox: one working directory that persists across `exec` calls."""

    async def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_s: float,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run a shell `command`, or a Python program `code` (exactly one of the two).

        `files` are written into the working directory first (paths relative to it). The whole
        process tree is killed at `timeout_s` wall-clock seconds; the result says why it ended.
        """
        ...

    async def read_file(self, path: str) -> bytes:
        """Read a file from the working directory (a relative path; escaping it is refused)."""
        ...

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file into the working directory, creating parent directories."""
        ...

    async def close(self) -> None:
        """Kill every process of the session and delete its files. Closing twice is a no-op."""
        ...

    async def is_alive(self) -> bool:
        """True while the session can still run commands."""
        ...


@runtime_checkable
class Sandbox(Protocol):
    """A sandbox backend: one-shot `exec` calls, and `session()` for stateful work."""

    async def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_s: float,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run one command or program in a fresh, throw-away sandbox (see `SandboxSession.exec`)."""
        ...

    async def session(self) -> SandboxSession:
        """Open a stateful session; the caller must `close()` it (sessions are not shared)."""
        ...

    async def close(self) -> None:
        """Release every resource of the backend (pools, containers). Closing twice is a no-op."""
        ...

    async def is_alive(self) -> bool:
        """True while the backend can run commands."""
        ...
