"""`RemoteSandbox`: run code on a sandbox server over HTTP (agentrl's own, or SandboxFusion).

With `api="agentrl"` (the default) it speaks the API of `agentrl sandbox serve`
(`agentrl.sandboxes.server`, whose docstring is the wire protocol a remote provider implements):
one-shot jobs, sessions with files, sessions in an image (`session(image=..., workdir=...)`, when
the server runs the docker backend), bearer-token auth. With
`api="sandboxfusion"` it sends one-shot jobs to any SandboxFusion-compatible `POST /run_code`
(Python as `language="python"`, commands as `language="bash"`); SandboxFusion has no sessions.

The client is an `httpx.AsyncClient` with a connection pool; each request's deadline is the job's
timeout plus `grace_s`. A server that cannot be reached, rejects the token or answers 5xx raises
`SandboxError` (an infrastructure fault); a program that fails comes back in the `ExecResult`.
Isolation is whatever the server provides; this module adds none. `SpreadSandbox` spreads jobs
and sessions over several servers (the sandbox hosts of a cluster run), each to the next in turn.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import httpx

from agentrl.errors import SandboxClosedError, SandboxError, SandboxUnavailableError
from agentrl.types import ExecResult

__all__ = ["RemoteSandbox", "RemoteSession", "SpreadSandbox"]


def _encode_files(files: Mapping[str, str | bytes] | None) -> dict[str, str]:
    out = {}
    for path, data in (files or {}).items():
        raw = data.encode() if isinstance(data, str) else bytes(data)
        out[path] = base64.b64encode(raw).decode()
    return out


def _stdin_text(stdin: str | bytes | None) -> str | None:
    if isinstance(stdin, bytes):
        return stdin.decode("utf-8", errors="replace")
    return stdin


def _check_job(command: str | None, code: str | None, timeout_s: float) -> None:
    if (command is None) == (code is None):
        raise ValueError("Pass exactly one of `command` (a shell command) or `code` (Python source).")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")


class RemoteSandbox:
    """A `Sandbox` served over HTTP (see the module docstring).

    Args:
        base_url: The server, e.g. "http://10.0.0.5:8090".
        token: Bearer token the server expects (None if it needs none).
        api: "agentrl" for `agentrl sandbox serve`, "sandboxfusion" for a SandboxFusion server.
        grace_s: Extra seconds allowed per request beyond the job's own timeout.
        max_connections: Size of the HTTP connection pool.
    """

    def __init__(self, base_url: str, *, token: str | None = None, api: str = "agentrl",
                 grace_s: float = 30.0, max_connections: int = 64) -> None:
        if api not in ("agentrl", "sandboxfusion"):
            raise ValueError(f"api must be 'agentrl' or 'sandboxfusion', got {api!r}.")
        self.base_url = base_url.rstrip("/")
        self.api = api
        self.grace_s = grace_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(grace_s),
        )
        self._closed = False

    # ── HTTP ────────────────────────────────────────────────────────────────────────────────
    async def _call(self, method: str, path: str, *, json: Any = None, timeout_s: float | None = None) -> Any:
        if self._closed:
            raise SandboxClosedError("This RemoteSandbox is closed; create a new one.")
        timeout = httpx.Timeout((timeout_s or 0) + self.grace_s)
        try:
            resp = await self._client.request(method, path, json=json, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise SandboxError(f"The sandbox server at {self.base_url} did not answer {path} in time.") from exc
        except httpx.TransportError as exc:
            raise SandboxUnavailableError(
                f"Cannot reach the sandbox server at {self.base_url} ({type(exc).__name__}: {exc}); "
                "start one with 'agentrl sandbox serve' or check the address."
            ) from exc
        if resp.status_code == 401:
            raise SandboxError(f"The sandbox server at {self.base_url} rejected the token; pass the one it was "
                               "started with.")
        if resp.status_code < 400:
            return resp.json()
        detail = _detail(resp)
        if resp.status_code in (404, 410) and "/sessions/" in path and not path.endswith("/read"):
            raise SandboxClosedError(f"The remote session is gone: {detail}")
        if resp.status_code == 404 and path.endswith("/read"):
            raise FileNotFoundError(detail)
        if resp.status_code == 403:
            raise PermissionError(detail)
        if resp.status_code in (400, 422):
            raise ValueError(f"The sandbox server refused the request: {detail}")
        raise SandboxError(f"The sandbox server at {self.base_url} failed ({resp.status_code}): {detail}")

    async def _exec_at(self, path: str, command: str | None, code: str | None, timeout_s: float,
                       stdin: str | bytes | None, files: Mapping[str, str | bytes] | None) -> ExecResult:
        _check_job(command, code, timeout_s)
        body = {"command": command, "code": code, "timeout_s": timeout_s, "stdin": _stdin_text(stdin),
                "files": _encode_files(files)}
        data = await self._call("POST", path, json=body, timeout_s=timeout_s)
        return ExecResult(**{k: data[k] for k in ExecResult.__dataclass_fields__ if k in data})

    # ── the Sandbox protocol ────────────────────────────────────────────────────────────────
    async def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_s: float,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        """Run one job on the server in a fresh sandbox; see `Sandbox.exec`."""
        if self.api == "sandboxfusion":
            return await self._run_code(command, code, timeout_s, stdin, files)
        return await self._exec_at("/v1/exec", command, code, timeout_s, stdin, files)

    async def _run_code(self, command: str | None, code: str | None, timeout_s: float,
                        stdin: str | bytes | None, files: Mapping[str, str | bytes] | None) -> ExecResult:
        _check_job(command, code, timeout_s)
        body = {"code": code if code is not None else command, "language": "python" if code is not None else "bash",
                "run_timeout": timeout_s, "stdin": _stdin_text(stdin), "files": _encode_files(files)}
        data = await self._call("POST", "/run_code", json=body, timeout_s=timeout_s)
        run = data.get("run_result") or {}
        if data.get("status") == "SandboxError" or not run:
            raise SandboxError(f"SandboxFusion could not run the job: {data.get('message') or data}")
        killed = run.get("killed_reason")
        if killed is None and run.get("status") == "TimeLimitExceeded":
            killed = "timeout"
        return ExecResult(
            stdout=run.get("stdout") or "", stderr=run.get("stderr") or "", exit_code=run.get("return_code"),
            timed_out=killed == "timeout", killed_reason=killed, duration_s=float(run.get("execution_time") or 0.0),
        )

    async def session(self, *, image: str | None = None, workdir: str | None = None) -> RemoteSession:
        """Open a session on the server (agentrl API only), in `image` if given (a docker-backed server)."""
        if self.api == "sandboxfusion":
            raise SandboxError("SandboxFusion has no sessions; use api='agentrl' with 'agentrl sandbox serve'.")
        options = {k: v for k, v in (("image", image), ("workdir", workdir)) if v is not None}
        data = await self._call("POST", "/v1/sessions", json=options or None)
        session = RemoteSession(self, data["session_id"])
        session.image, session.workdir = image, workdir
        return session

    async def health(self) -> dict[str, Any]:
        """The server's `/health` answer."""
        answer: dict[str, Any] = await self._call("GET", "/health")
        return answer

    async def close(self) -> None:
        """Close the connection pool (the server's sessions are closed by their owners)."""
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    async def is_alive(self) -> bool:
        if self._closed:
            return False
        if self.api == "sandboxfusion":
            return True
        try:
            return (await self.health()).get("status") == "ok"
        except SandboxError:
            return False


class RemoteSession:
    """A session on a sandbox server; see `SandboxSession`."""

    def __init__(self, owner: RemoteSandbox, session_id: str) -> None:
        self._owner = owner
        self.session_id = session_id
        self.image: str | None = None
        self.workdir: str | None = None
        """What the session was opened with (None: the server's defaults)."""
        self._closed = False

    def _path(self, suffix: str = "") -> str:
        if self._closed:
            raise SandboxClosedError("This remote session is closed; open a new one.")
        return f"/v1/sessions/{self.session_id}{suffix}"

    async def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_s: float,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> ExecResult:
        return await self._owner._exec_at(self._path("/exec"), command, code, timeout_s, stdin, files)

    async def read_file(self, path: str) -> bytes:
        data = await self._owner._call("POST", self._path("/read"), json={"path": path})
        return base64.b64decode(data["data_b64"])

    async def write_file(self, path: str, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._owner._call("POST", self._path("/write"),
                                json={"path": path, "data_b64": base64.b64encode(raw).decode()})

    async def close(self) -> None:
        if self._closed:
            return
        path = self._path()
        self._closed = True
        try:
            await self._owner._call("DELETE", path)
        except (SandboxClosedError, SandboxUnavailableError):
            pass  # already gone, or the server is down (its idle reaper will close it)

    async def is_alive(self) -> bool:
        if self._closed:
            return False
        try:
            return bool((await self._owner._call("GET", self._path()))["alive"])
        except SandboxError:
            return False


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    return detail if isinstance(detail, str) else str(detail)


class SpreadSandbox:
    """Several `RemoteSandbox`es as one `Sandbox`: each job or new session goes to the next in turn.

    A session stays on the server that opened it. `is_alive` is true while any server answers;
    `close` closes every client.
    """

    def __init__(self, sandboxes: list[RemoteSandbox]) -> None:
        if not sandboxes:
            raise ValueError("SpreadSandbox needs at least one sandbox.")
        self.sandboxes = list(sandboxes)
        self._next = 0

    def _pick(self) -> RemoteSandbox:
        sandbox = self.sandboxes[self._next % len(self.sandboxes)]
        self._next += 1
        return sandbox

    async def exec(self, command: str | None = None, *, code: str | None = None, timeout_s: float,
                   stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        return await self._pick().exec(command, code=code, timeout_s=timeout_s, stdin=stdin, files=files)

    async def session(self, **kwargs: Any) -> RemoteSession:
        return await self._pick().session(**kwargs)

    async def close(self) -> None:
        for sandbox in self.sandboxes:
            await sandbox.close()

    async def is_alive(self) -> bool:
        for sandbox in self.sandboxes:
            if await sandbox.is_alive():
                return True
        return False
