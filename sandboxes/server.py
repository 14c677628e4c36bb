"""`agentrl sandbox serve`: a sandbox backend over HTTP, so sandboxes can run on other machines.

A FastAPI app around one sandbox: a `LocalSandbox` by default, a `DockerSandbox` with `--backend
docker` (then sessions can run instance images that machine holds), or any `Sandbox`. Every route
but `/health` needs `Authorization: Bearer <token>` when a token is set; a non-loopback address
without a token is refused. At most `max_concurrency` jobs run at once; later requests wait
(back-pressure, never a rejection). Sessions idle for longer than `session_idle_s` are closed, so
a crashed client cannot leak sandboxes; at most `max_sessions` are open at once.
`images/sandbox-server/` holds a Dockerfile that packages this server for a fleet.

The wire protocol (what a remote provider implements to be a `RemoteSandbox`; JSON bodies, status
codes below, an ExecResult is `{stdout, stderr, exit_code, timed_out, killed_reason, duration_s}`):

    GET  /health                       liveness (no token needed)  -> {"status": "ok", ...}
    GET  /metrics                      Prometheus text: jobs by outcome, in flight, sessions, latency
    POST /v1/exec                      one-shot job                  -> ExecResult as JSON
    POST /v1/sessions                  open a session; optional body {"image", "workdir"} -> {"session_id"}
    POST /v1/sessions/{id}/exec        job in the session            -> ExecResult as JSON
    POST /v1/sessions/{id}/read        {"path"}                      -> {"data_b64"}
    POST /v1/sessions/{id}/write       {"path", "data_b64"}
    GET  /v1/sessions/{id}             -> {"alive"}
    DELETE /v1/sessions/{id}           close: kill everything, delete files
    POST /run_code                     SandboxFusion's request and response shape (python, bash)

A job is `{command | code, timeout_s, stdin, files: {relative path: base64}}`; a failing program
is a 200 with its ExecResult, never an error status. Errors: 400 a request the sandbox refuses
(both or neither of command/code, a path outside the work dir, images asked of a server without any),
401 a missing or wrong token, 403 a file path that resolves outside the work dir, 404 a missing
file (read) or an unknown session, 410 a session that is closed, 429 too many sessions, 503 the
sandbox itself failed, an image it does not have included (an infrastructure fault the client
raises as `SandboxError`).

SandboxFusion shape, as documented at bytedance.github.io/SandboxFusion (POST /run_code): request
`{code, language, compile_timeout, run_timeout, stdin, files: {path: base64}, fetch_files: [path]}`;
response `{status: Success|Failed|SandboxError, message, compile_result, run_result: {status:
Finished|Error|TimeLimitExceeded, execution_time, return_code, stdout, stderr}, executor_pod_name,
files: {path: base64}}`. Only `python` and `bash` are run; other languages answer `SandboxError`.
This module runs no code itself and isolates nothing; the sandbox behind it does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import inspect
import ipaddress
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import SandboxClosedError, SandboxError
from agentrl.types import ExecResult

__all__ = ["ExecRequest", "RunCodeRequest", "SessionRequest", "create_app", "serve"]

_log = logging.getLogger(__name__)


class ExecRequest(BaseModel):
    """One job: exactly one of `command` (bash) or `code` (Python)."""

    model_config = ConfigDict(extra="forbid")
    command: str | None = None
    """A shell command line, run with bash."""
    code: str | None = None
    """A Python program."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit in seconds."""
    stdin: str | None = None
    """Text fed to the program's standard input."""
    files: dict[str, str] = Field(default_factory=dict)
    """Files to write into the work dir first: relative path -> base64 content."""


class SessionRequest(BaseModel):
    """Options of a new session: an image to run it in and its work dir (backends that run images)."""

    model_config = ConfigDict(extra="forbid")
    image: str | None = None
    workdir: str | None = None


class FileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    data_b64: str | None = None


class RunCodeRequest(BaseModel):
    """SandboxFusion's `/run_code` request (see the module docstring)."""

    model_config = ConfigDict(extra="ignore")
    code: str
    language: str
    compile_timeout: float = 10
    run_timeout: float = 10
    stdin: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class _Stats:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.in_flight = 0
        self.seconds = 0.0
        self.started = time.time()


def _decode_files(files: dict[str, str]) -> dict[str, bytes]:
    try:
        return {path: base64.b64decode(data, validate=True) for path, data in files.items()}
    except ValueError as exc:
        raise HTTPException(400, f"files must map paths to base64 content: {exc}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(
    sandbox: Any = None,
    *,
    token: str | None = None,
    max_concurrency: int | None = None,
    max_sessions: int = 256,
    session_idle_s: float = 1800.0,
    **sandbox_kwargs: Any,
) -> FastAPI:
    """The HTTP app; builds a `LocalSandbox(max_concurrency=..., **sandbox_kwargs)` if none is given."""
    if sandbox is None:
        from agentrl.sandboxes.local import LocalSandbox

        sandbox = LocalSandbox(max_concurrency=max_concurrency, **sandbox_kwargs)
    limit = asyncio.Semaphore(int(max_concurrency or getattr(sandbox, "max_concurrency", None) or 4))
    sessions: dict[str, Any] = {}
    last_used: dict[str, float] = {}
    stats = _Stats()

    async def reap_idle() -> None:
        while True:
            await asyncio.sleep(min(30.0, session_idle_s / 4))
            now = time.monotonic()
            for sid in [s for s, t in last_used.items() if now - t > session_idle_s]:
                _log.info("closing sandbox session %s after %.0f s idle", sid, now - last_used[sid])
                last_used.pop(sid, None)
                with contextlib.suppress(Exception):
                    await sessions.pop(sid).close()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.ensure_future(reap_idle())
        try:
            yield
        finally:
            reaper.cancel()
            for sess in list(sessions.values()):
                with contextlib.suppress(Exception):
                    await sess.close()
            sessions.clear()
            await sandbox.close()

    app = FastAPI(title="agentrl sandbox server", lifespan=lifespan)

    def authorize(request: Request) -> None:
        if not token:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "Missing or wrong bearer token.", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(SandboxClosedError)
    async def _closed(_: Request, exc: SandboxClosedError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=410)

    @app.exception_handler(SandboxError)
    async def _broken(_: Request, exc: SandboxError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    async def run_job(target: Any, req: ExecRequest) -> ExecResult:
        if (req.command is None) == (req.code is None):
            raise HTTPException(400, "Give exactly one of 'command' or 'code'.")
        async with limit:
            stats.in_flight += 1
            try:
                result: ExecResult = await target.exec(req.command, code=req.code, timeout_s=req.timeout_s,
                                           stdin=req.stdin, files=_decode_files(req.files))
            except ValueError as exc:
                raise HTTPException(400, str(exc)) from None
            finally:
                stats.in_flight -= 1
        stats.outcomes[result.killed_reason or ("ok" if result.exit_code == 0 else "error")] += 1
        stats.seconds += result.duration_s
        return result

    def session_of(sid: str) -> Any:
        sess = sessions.get(sid)
        if sess is None:
            raise HTTPException(404, f"No open session {sid!r}; it was closed or never existed.")
        last_used[sid] = time.monotonic()
        return sess

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok" if await sandbox.is_alive() else "closed", "sessions": len(sessions),
                "in_flight": stats.in_flight}

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(authorize)])
    async def metrics() -> str:
        lines = ["# TYPE agentrl_sandbox_jobs_total counter"]
        lines += [f'agentrl_sandbox_jobs_total{{outcome="{k}"}} {v}' for k, v in sorted(stats.outcomes.items())]
        lines += [
            "# TYPE agentrl_sandbox_jobs_in_flight gauge", f"agentrl_sandbox_jobs_in_flight {stats.in_flight}",
            "# TYPE agentrl_sandbox_sessions_open gauge", f"agentrl_sandbox_sessions_open {len(sessions)}",
            "# TYPE agentrl_sandbox_job_seconds_total counter",
            f"agentrl_sandbox_job_seconds_total {stats.seconds:.6f}",
            "# TYPE agentrl_sandbox_uptime_seconds gauge",
            f"agentrl_sandbox_uptime_seconds {time.time() - stats.started:.1f}",
        ]
        return "\n".join(lines) + "\n"

    @app.post("/v1/exec", dependencies=[Depends(authorize)])
    async def exec_once(req: ExecRequest) -> dict[str, Any]:
        return asdict(await run_job(sandbox, req))

    takes_images = "image" in inspect.signature(sandbox.session).parameters

    @app.post("/v1/sessions", dependencies=[Depends(authorize)])
    async def open_session(req: SessionRequest | None = None) -> dict[str, str]:
        if len(sessions) >= max_sessions:
            raise HTTPException(429, f"{max_sessions} sessions are open; close one first.")
        options = {k: v for k, v in (req.model_dump() if req else {}).items() if v is not None}
        if options and not takes_images:
            raise HTTPException(400, f"This server's {type(sandbox).__name__} runs no images; start it with "
                                     "'agentrl sandbox serve --backend docker' to open sessions in images.")
        sid = uuid.uuid4().hex
        sessions[sid] = await sandbox.session(**options)  # an image it lacks: 503, saying how to get it
        last_used[sid] = time.monotonic()
        return {"session_id": sid}

    @app.post("/v1/sessions/{sid}/exec", dependencies=[Depends(authorize)])
    async def exec_in_session(sid: str, req: ExecRequest) -> dict[str, Any]:
        return asdict(await run_job(session_of(sid), req))

    @app.post("/v1/sessions/{sid}/read", dependencies=[Depends(authorize)])
    async def read_file(sid: str, req: FileRequest) -> dict[str, str]:
        try:
            data = await session_of(sid).read_file(req.path)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        except FileNotFoundError as exc:
            raise HTTPException(404, str(exc)) from None
        except PermissionError as exc:
            raise HTTPException(403, str(exc)) from None
        except OSError as exc:
            raise HTTPException(400, str(exc)) from None
        return {"data_b64": base64.b64encode(data).decode()}

    @app.post("/v1/sessions/{sid}/write", dependencies=[Depends(authorize)])
    async def write_file(sid: str, req: FileRequest) -> dict[str, bool]:
        data = _decode_files({req.path: req.data_b64 or ""})[req.path]
        try:
            await session_of(sid).write_file(req.path, data)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        except PermissionError as exc:
            raise HTTPException(403, str(exc)) from None
        except OSError as exc:
            raise HTTPException(400, str(exc)) from None
        return {"ok": True}

    @app.get("/v1/sessions/{sid}", dependencies=[Depends(authorize)])
    async def session_status(sid: str) -> dict[str, bool]:
        sess = sessions.get(sid)
        return {"alive": sess is not None and await sess.is_alive()}

    @app.delete("/v1/sessions/{sid}", dependencies=[Depends(authorize)])
    async def close_session(sid: str) -> dict[str, bool]:
        sess = sessions.pop(sid, None)
        last_used.pop(sid, None)
        if sess is not None:
            await sess.close()
        return {"closed": sess is not None}

    @app.post("/run_code", dependencies=[Depends(authorize)])
    async def run_code(req: RunCodeRequest) -> dict[str, Any]:
        language = req.language.lower()
        if language not in ("python", "bash"):
            return _fusion_error(f"language {req.language!r} is not supported here (python, bash)")
        job = ExecRequest(code=req.code if language == "python" else None,
                          command=req.code if language == "bash" else None,
                          timeout_s=min(max(req.run_timeout, 0.001), 3600), stdin=req.stdin, files=req.files)
        fetched: dict[str, str] = {}
        if req.fetch_files:
            sess = await sandbox.session()
            try:
                result = await run_job(sess, job)
                for path in req.fetch_files:
                    with contextlib.suppress(OSError, ValueError):
                        fetched[path] = base64.b64encode(await sess.read_file(path)).decode()
            finally:
                await sess.close()
        else:
            result = await run_job(sandbox, job)
        return _fusion_response(result, fetched)

    app.state.sandbox = sandbox
    app.state.sessions = sessions
    return app


def _fusion_error(message: str) -> dict[str, Any]:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def _fusion_response(result: ExecResult, files: dict[str, str]) -> dict[str, Any]:
    if result.killed_reason == "timeout":
        run_status = "TimeLimitExceeded"
    elif result.killed_reason is None:
        run_status = "Finished"
    else:
        run_status = "Error"
    return {
        "status": "Success" if result.ok else "Failed",
        "message": "" if result.ok else (result.killed_reason or f"exit code {result.exit_code}"),
        "compile_result": None,
        "run_result": {
            "status": run_status,
            "execution_time": result.duration_s,
            "return_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
            # agentrl's own field, ignored by SandboxFusion clients, read by RemoteSandbox.
            "killed_reason": result.killed_reason,
        },
        "executor_pod_name": None,
        "files": files,
    }


def serve(host: str = "127.0.0.1", port: int = 8090, token: str | None = None,
          max_concurrency: int | None = None, backend: str = "local", **sandbox_kwargs: Any) -> None:
    """Run the sandbox server with uvicorn until interrupted (`agentrl sandbox serve`).

    `backend` is a registered sandbox name (`local`, `docker`) or `package.module:Class`; the
    other keyword arguments are its own.
    """
    import uvicorn

    if not token and not _is_loopback(host):
        raise ValueError(
            f"Refusing to serve sandboxes on {host} without a token: anyone who can reach it could run "
            "code. Pass token=... (and give clients the same), or bind to 127.0.0.1."
        )
    sandbox = None
    if backend != "local":
        from agentrl.registry import SANDBOXES

        if max_concurrency:
            sandbox_kwargs["max_concurrency"] = max_concurrency
        sandbox = SANDBOXES.resolve(backend)(**sandbox_kwargs)
        sandbox_kwargs = {}
    app = create_app(sandbox, token=token, max_concurrency=max_concurrency, **sandbox_kwargs)
    uvicorn.run(app, host=host, port=port, log_level="info")
