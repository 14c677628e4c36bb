"""MCP tools: the tools of Model Context Protocol servers, called through the official `mcp` SDK.

An `MCPServerConfig` names one server: a stdio command (`command`, `args`, `env`) that agentrl
starts, or the URL of a streamable-HTTP server someone else runs. `MCPConnection` is one client
session to it: it connects, lists the server's tools (`list_tools`, every page) and calls them
(`call_tool`). `MCPTool` is one listed tool as an agentrl `Tool`: its schema is the server's
(`inputSchema` as the function's `parameters`, the same shape `@tool` derives), and its arguments
are checked by the server, not here.

What a call returns, and whose fault a failure is:
- the result's text parts, joined by newlines, are the tool message; an embedded text resource
  contributes its text; images, audio and binary resources are not shown to the model (they become
  a one-line placeholder naming their MIME type and size, since the chat template renders text);
  a result with no content but `structuredContent` is shown as that JSON.
- `isError: true` is the model's fault (its arguments, its request): the message is its content.
- anything else (the server process died, the connection closed, a JSON-RPC/protocol error, an
  answer that is not a valid result) is an infrastructure failure (`ToolInfrastructureError`), and
  so is a call past the env's tool deadline (`Tool.invoke`): `ToolEnv` then ends the episode, which
  the AgentLoop masks as fault "infra".

Stdio servers run isolated (`stdio_argv`): under bubblewrap (`isolation="bwrap"`: private PID,
IPC, UTS, user and network namespaces, loopback only unless the server's `network: true`; the
host's /usr, the Python installation and venv of this process, and the server's `ro_paths`,
read-only, at the same place (under the private /tmp too); private tmpfs /tmp and /workspace; an
empty environment but PATH, HOME, LANG and the server's `env`) or not at all (`isolation="none"`,
the local sandbox's `isolation=none`). Either way the server runs under an agentrl lifeline
(`agentrl.lifeline`) in a process group of its own: closing the connection closes the server's
stdin, then ends the group; if the driver dies (even by SIGKILL) the lifeline ends the group
within a second plus its grace. Not covered: memory and CPU ceilings (no cgroup; a server is
trusted to behave like the user's own program).

The `mcp` package is imported lazily (`require_mcp`): agentrl imports without it, and an MCP
server configured without it is refused with `pip install 'agentrl[mcp]'`. Shared servers (one
per run) live in `agentrl.tools.mcp_shared`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import sys
import tempfile
from typing import IO, Annotated, Any, Literal

import pydantic

from agentrl.errors import ConfigError, FeatureUnavailableError, ToolInfrastructureError
from agentrl.lifeline import lifeline_argv
from agentrl.sandboxes.bwrap import SANDBOX_HOME, bwrap_argv, find_bwrap, ro_path_problem
from agentrl.tools.core import Tool
from agentrl.types import ToolResult, ToolSchema

__all__ = ["MCPConnection", "MCPServerConfig", "MCPTool", "require_mcp", "result_text", "stdio_argv"]

_log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_LIFELINE_GRACE_S = 2.0
Isolation = Literal["bwrap", "none"]


def require_mcp() -> Any:
    """The `mcp` package, or a FeatureUnavailableError saying how to install it."""
    try:
        import mcp
    except ImportError as exc:
        raise FeatureUnavailableError(
            f"MCP tool servers need the official MCP SDK, which is not installed ({exc}); "
            "run: pip install 'agentrl[mcp]'"
        ) from exc
    return mcp


def _showable(path: str) -> str:
    """`path` when a sandbox may show it (`ro_path_problem`); a ValueError saying why not otherwise."""
    problem = ro_path_problem(path)
    if problem is not None:
        raise ValueError(problem)
    return path


class MCPServerConfig(pydantic.BaseModel):
    """One MCP server an env takes its tools from (an entry of `env.kwargs.servers`)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = ""
    """A label for messages and for the tool prefix; default: the command or URL."""
    command: str | None = None
    """A stdio server: the program to start (`python` means this process's interpreter)."""
    args: list[str] = pydantic.Field(default_factory=list)
    """Arguments of `command`."""
    env: dict[str, str] = pydantic.Field(default_factory=dict)
    """Environment variables of the stdio server (it starts from an empty environment otherwise)."""
    url: str | None = None
    """A streamable-HTTP server's endpoint (e.g. http://127.0.0.1:8000/mcp), instead of `command`."""
    headers: dict[str, str] = pydantic.Field(default_factory=dict)
    """HTTP headers sent to a `url` server (e.g. Authorization)."""
    per_episode: bool = True
    """A stdio server of its own for each episode (fresh state); False: one server for the whole run,
    shared by every episode (its state is then the server's business). For a `url` server: a new
    MCP session per episode, or one session for the run."""
    network: bool = False
    """Let a stdio server use the host's network (default: loopback only, under bwrap)."""
    ro_paths: list[Annotated[str, pydantic.AfterValidator(_showable)]] = pydantic.Field(default_factory=list)
    """Host paths (files or folders; relative ones from the current directory) a bwrap-isolated stdio
    server may read (its own code or data), read-only at the same place, under /tmp too (without their
    siblings). The server starts in the current directory when that is one of them (or inside one), so
    relative paths in `args` work; otherwise in an empty private /workspace. Refused: a path that does
    not exist, or one that would undo the isolation (`/`, /tmp or /workspace itself, /proc, /dev, a home
    folder, or a symlink to one of those; see `agentrl.sandboxes.bwrap`)."""
    tool_prefix: str = ""
    """Put before each of this server's tool names (to tell two servers' same-named tools apart)."""
    tools: list[str] | None = None
    """Offer only these of the server's tools (by the server's names); default all."""
    startup_timeout_s: float = pydantic.Field(60.0, gt=0)
    """Deadline to start, initialize and list the tools of the server; past it the episode is infra-failed."""

    @pydantic.model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of 'command' (a stdio server) or 'url' (a streamable-HTTP server)")
        if self.url is not None and (self.args or self.env or self.ro_paths or self.network):
            raise ValueError("'args', 'env', 'ro_paths' and 'network' apply to stdio servers ('command') only")
        if not self.name:
            self.name = self.command if self.command is not None else str(self.url)
        return self

    @property
    def label(self) -> str:
        return f"MCP server '{self.name}'"


# ── isolation of stdio servers ──────────────────────────────────────────────────────────────


def stdio_argv(server: MCPServerConfig, isolation: Isolation) -> tuple[list[str], dict[str, str]]:
    """The command line (lifeline, bwrap, the server) and environment that start a stdio server."""
    assert server.command is not None
    command = sys.executable if server.command == "python" else server.command
    path = ":".join(dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]))
    env = {"PATH": path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if isolation == "bwrap":
        bwrap = find_bwrap()
        if bwrap is None:
            raise ConfigError(
                f"{server.label} is to run under bubblewrap (the sandbox's isolation) and 'bwrap' is not "
                "installed: run 'bash scripts/install.sh' or 'apt-get install bubblewrap'; or set "
                "sandbox.kwargs.isolation=none to run MCP servers unisolated (trusted servers only)."
            )
        # Checked when the config was read; again here, as a path may have gone since.
        problems = [f"ro_paths[{i}]: {problem}" for i, p in enumerate(server.ro_paths)
                    if (problem := ro_path_problem(p)) is not None]
        if problems:
            raise ConfigError(f"{server.label}: {'; '.join(problems)}.")
        # The interpreter's installation and this venv, so `python -m some_mcp_server` installed here runs.
        visible = [sys.base_prefix, sys.prefix, *server.ro_paths]
        inner_env = {**env, "HOME": SANDBOX_HOME, "TMPDIR": "/tmp", **server.env}
        shown = tuple(dict.fromkeys(os.path.abspath(p) for p in visible))
        argv = bwrap_argv(bwrap, privileged=False, extra_ro=shown, tmpfs_bytes=256 << 20, setenv=inner_env,
                          network=server.network)
        cwd = os.path.realpath(os.getcwd())
        # each listed path shows at its own place and at its symlinks' target (`bwrap_argv`)
        given = {q for p in server.ro_paths for q in (os.path.abspath(p), os.path.realpath(p))}
        if any(cwd == p or cwd.startswith(p.rstrip("/") + "/") for p in given):
            # the driver's directory is visible (in ro_paths): start there, so relative paths in
            # `args` mean what they mean to the user; else in the private /workspace
            argv[argv.index("--chdir") + 1] = cwd
        argv = [*argv, command, *server.args]
    else:
        env = {**env, "HOME": os.environ.get("HOME", "/tmp"), **server.env}
        argv = [command, *server.args]
    return lifeline_argv(argv, grace_s=_LIFELINE_GRACE_S, keep_stdin=True), env


# ── one connection ──────────────────────────────────────────────────────────────────────────


class MCPConnection:
    """One client session to one MCP server, held open by a task of its own on the current loop.

    The SDK's transports and sessions are anyio context managers that must be entered and left by
    the same task; `start` runs them in a dedicated task, so `call_tool` may be awaited from any
    task of the loop and `close` from any other. `tools` holds the listed tools after `start`.
    """

    def __init__(self, server: MCPServerConfig, *, isolation: Isolation = "bwrap") -> None:
        self.server = server
        self.isolation = isolation
        self.tools: list[Any] = []
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._ready: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self._errlog: IO[str] | None = None

    @property
    def alive(self) -> bool:
        return self._session is not None and self._task is not None and not self._task.done()

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers a ping now (a crashed server's session may still look open)."""
        session = self._session
        if session is None or not self.alive:
            return False
        try:
            await asyncio.wait_for(session.send_ping(), timeout_s)
        except Exception:  # a closed connection, a dead process, no answer in time
            return False
        return True

    async def start(self) -> None:
        """Start (or connect to) the server, initialize and list its tools; ToolInfrastructureError if it cannot."""
        require_mcp()
        loop = asyncio.get_running_loop()
        self._stop, self._ready = asyncio.Event(), loop.create_future()
        self._task = loop.create_task(self._hold(), name=f"mcp:{self.server.name}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.server.startup_timeout_s)
        except TimeoutError:
            await self.close()
            raise ToolInfrastructureError(
                f"{self.server.label} did not start and list its tools within startup_timeout_s="
                f"{self.server.startup_timeout_s:g} s; check that its command runs on its own, or raise the timeout."
            ) from None
        except BaseException:
            await self.close()
            raise

    async def _hold(self) -> None:
        from mcp import ClientSession

        assert self._ready is not None and self._stop is not None
        try:
            async with self._transport() as streams, ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                self.tools = await _list_all_tools(session)
                self._session = session
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # recorded for the next call; the task itself ends quietly
            self._failure = exc
            if not self._ready.done():
                tail = self.stderr_tail()
                self._ready.set_exception(ToolInfrastructureError(
                    f"{self.server.label} could not be started or initialized: {_describe(exc)}. "
                    f"{self._hint()}" + (f" Its stderr ended with: {tail}" if tail else "")
                ))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._session = None
            if self._errlog is not None:
                self._errlog.close()

    def _transport(self) -> Any:
        if self.server.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            if self.server.headers:
                import httpx2  # the SDK's HTTP client (a dependency of mcp)

                client = httpx2.AsyncClient(headers=self.server.headers, timeout=httpx2.Timeout(30.0, read=300.0))
                return streamable_http_client(self.server.url, http_client=client)
            return streamable_http_client(self.server.url)
        from mcp import StdioServerParameters, stdio_client

        argv, env = stdio_argv(self.server, self.isolation)
        # the server's stderr (its logs) goes to a file of its own: its tail explains a failed start
        self._errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        return stdio_client(StdioServerParameters(command=argv[0], args=argv[1:], env=env), errlog=self._errlog)

    def stderr_tail(self, chars: int = 600) -> str:
        """The end of what the stdio server wrote to stderr ('' for a URL server or none yet)."""
        errlog = self._errlog
        if errlog is None or errlog.closed:
            return ""
        try:
            errlog.seek(0, os.SEEK_END)
            size = errlog.tell()
            errlog.seek(max(0, size - chars))
            return errlog.read().strip()
        except (OSError, ValueError):
            return ""

    def _hint(self) -> str:
        if self.server.url is not None:
            return f"Check that a streamable-HTTP MCP server answers at {self.server.url}."
        return ("Check that the command starts an MCP server on stdio when run by hand"
                + (" and that everything it reads is under its ro_paths (it runs under bubblewrap)."
                   if self.isolation == "bwrap" else "."))

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """The server's `CallToolResult`; ToolInfrastructureError when the connection or protocol failed."""
        session = self._session
        if session is None:
            why = f": {_describe(self._failure)}" if self._failure is not None else ""
            raise ToolInfrastructureError(f"{self.server.label} is not connected (it stopped or crashed{why}).")
        try:
            return await session.call_tool(name, arguments)
        except Exception as exc:  # a dead process, a closed stream, a JSON-RPC error: never the model's doing
            raise ToolInfrastructureError(
                f"{self.server.label} failed on '{name}' ({_describe(exc)}); the server crashed, closed the "
                "connection or broke the protocol."
            ) from exc

    async def close(self) -> None:
        """Close the session and stop the server (stdin closed, then its process group ended). Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        if self._stop is not None:
            self._stop.set()
        try:
            # the SDK's own shutdown is bounded (about 5 s); past twice that, cancel it
            await asyncio.wait_for(asyncio.shield(task), 15.0)
        except TimeoutError:
            task.cancel()
            _log.warning("%s did not shut down in 15 s; cancelled its connection", self.server.label)
        except asyncio.CancelledError:
            if not task.cancelled():  # we were cancelled, not the connection's task: pass it on
                task.cancel()
                raise
        except Exception as exc:  # cleanup: log and go on
            _log.debug("%s ended with %s", self.server.label, _describe(exc))


async def _list_all_tools(session: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    for _ in range(1000):  # a server that pages forever is not worth more
        if cursor is None:
            page = await session.list_tools()
        else:
            from mcp import types

            page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        tools.extend(page.tools)
        cursor = getattr(page, "next_cursor", None)
        if not cursor:
            break
    return tools


def _describe(exc: BaseException | None) -> str:
    """One line for an exception, unwrapping anyio's exception groups to their first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"


# ── one tool ────────────────────────────────────────────────────────────────────────────────


def _field(obj: Any, snake: str, camel: str) -> Any:
    """A field of an SDK object by its v2 (snake_case) or v1 (camelCase) name."""
    return getattr(obj, snake, None) if hasattr(obj, snake) else getattr(obj, camel, None)


def result_text(result: Any) -> str:
    """The text a `CallToolResult` shows the model (see the module docstring)."""
    parts: list[str] = []
    for block in _field(result, "content", "content") or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            size = len(base64.b64decode(block.data, validate=False)) if getattr(block, "data", None) else 0
            parts.append(f"[{kind} {_field(block, 'mime_type', 'mimeType')} of {size} bytes: not shown]")
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if text is not None else
                         f"[resource {res.uri} ({_field(res, 'mime_type', 'mimeType')}): binary, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind or 'unknown'} content: not shown]")
    structured = _field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, default=str))
    return "\n".join(parts)


class MCPTool(Tool):
    """One tool of an MCP server, called through `connection` (an `MCPConnection` or a shared proxy)."""

    def __init__(self, listed: Any, connection: Any, *, prefix: str = "", server_label: str = "") -> None:
        self.mcp_name = str(listed.name)
        name = prefix + re.sub(r"[^a-zA-Z0-9_-]", "_", self.mcp_name)[: 64 - len(prefix)]
        if not _NAME_RE.match(name):
            raise ConfigError(f"{server_label}: its tool '{self.mcp_name}' cannot be given a valid name ({name!r}).")
        params = dict(_field(listed, "input_schema", "inputSchema") or {})
        params.pop("title", None)  # the same shape `@tool` derives: no pydantic titles
        if isinstance(params.get("properties"), dict):
            params["properties"] = {k: {f: v for f, v in p.items() if f != "title"} if isinstance(p, dict) else p
                                    for k, p in params["properties"].items()}
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        params.setdefault("required", [])
        self.connection = connection
        self._tool_name = name
        self._description = _field(listed, "description", "description") or _field(listed, "title", "title") or ""
        self._schema: ToolSchema = {
            "type": "function",
            "function": {"name": name, "description": self._description, "parameters": params},
        }
        self._fn = self._call
        self._is_async = True
        self._ctx_param = None

    def validate_arguments(self, arguments: dict[str, Any] | str) -> dict[str, Any]:
        """Only the JSON shape is checked here: the server validates against its own schema (and
        answers a bad call with `isError`, the model's fault)."""
        if isinstance(arguments, str) and not arguments.strip():
            return {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ValueError(f"Arguments for '{self._tool_name}' are not valid JSON ({exc.msg}); "
                                 "send a JSON object of named arguments.") from exc
        if not isinstance(arguments, dict):
            raise ValueError(f"Arguments for '{self._tool_name}' must be a JSON object, got {type(arguments).__name__}.")
        return {"arguments": arguments}

    async def _call(self, arguments: dict[str, Any]) -> ToolResult:
        result = await self.connection.call_tool(self.mcp_name, arguments)
        try:
            text = result_text(result)
            is_error = bool(_field(result, "is_error", "isError"))
        except Exception as exc:  # an answer that is not a CallToolResult is the server's fault
            raise ToolInfrastructureError(f"'{self._tool_name}' got an unreadable MCP result: {_describe(exc)}") from exc
        if is_error:
            return ToolResult(f"Error: {text}" if text else "Error: the tool reported an error.", fault="model")
        return ToolResult(text, fault=None)
