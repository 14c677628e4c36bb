"""`SharedMCPServers`: the MCP servers a whole run shares (`per_episode: false`), one connection each.

A run builds one (`agentrl.orchestration.build` passes it to envs that take `shared_mcp`; the
job closes it) and every episode's env asks it for the connection of a server config: the first
asks start the server, later ones reuse it, and one that finds the server dead (it crashed) starts
a new one (each episode's first ask pings it), so one crash fails the episodes that were calling
it, not the rest of the run. What the
server remembers between episodes is its own business.

The connections live on an event loop of their own, on a thread of their own: episodes on any
loop (the driver's, an env's private loop in `env.step`) call through `asyncio.wrap_future`, and
`aclose` works from any loop or none. It does not isolate episodes from each other; a server that
must not be shared is left `per_episode: true` (the default).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from agentrl.errors import ToolInfrastructureError
from agentrl.tools.mcp import Isolation, MCPConnection, MCPServerConfig

__all__ = ["SharedMCPServers"]

_log = logging.getLogger(__name__)
_CLOSE_TIMEOUT_S = 30.0


class _SharedConnection:
    """An episode's handle on a shared connection: calls run on the shared loop."""

    def __init__(self, connection: MCPConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.connection = connection
        self.server = connection.server
        self.tools = connection.tools
        self._loop = loop

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        future = asyncio.run_coroutine_threadsafe(self.connection.call_tool(name, arguments), self._loop)
        return await asyncio.wrap_future(future)  # cancelling this cancels the call on the shared loop


class SharedMCPServers:
    """The run's shared MCP server connections (see the module docstring). Close with `aclose`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._connections: dict[str, MCPConnection] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._closed = False

    def _shared_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise ToolInfrastructureError("The run's shared MCP servers are closed (the run is ending).")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="agentrl-mcp-shared", daemon=True)
                self._thread.start()
            return self._loop

    async def connect(self, server: MCPServerConfig, isolation: Isolation) -> _SharedConnection:
        """The connection to `server` (started on first use, restarted if it died)."""
        loop = self._shared_loop()
        future = asyncio.run_coroutine_threadsafe(self._connection(server, isolation), loop)
        return _SharedConnection(await asyncio.wrap_future(future), loop)

    async def _connection(self, server: MCPServerConfig, isolation: Isolation) -> MCPConnection:
        key = f"{isolation}:{server.model_dump_json()}"
        async with self._starting.setdefault(key, asyncio.Lock()):
            connection = self._connections.get(key)
            if connection is not None and await connection.healthy():
                return connection
            if connection is not None:
                _log.warning("%s (shared by the run) stopped; starting it again", server.label)
                await connection.close()
            connection = MCPConnection(server, isolation=isolation)
            await connection.start()
            self._connections[key] = connection
            return connection

    @property
    def server_count(self) -> int:
        """How many shared servers are connected now."""
        return sum(c.alive for c in self._connections.values())

    async def _close_all(self) -> None:
        connections, self._connections = list(self._connections.values()), {}
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop every shared server and the shared loop's thread. Closing twice is harmless."""
        with self._lock:
            loop, self._loop, self._closed = self._loop, None, True
        if loop is None:
            return
        try:
            future = asyncio.run_coroutine_threadsafe(self._close_all(), loop)
            await asyncio.wait_for(asyncio.wrap_future(future), _CLOSE_TIMEOUT_S)
        except Exception as exc:  # a stuck close must not stop the run's other cleanups
            _log.warning("closing the shared MCP servers failed: %s", exc)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                await asyncio.to_thread(self._thread.join, 10.0)
            if not loop.is_running():
                loop.close()

    def close(self) -> None:
        """`aclose` for callers without an event loop."""
        asyncio.run(self.aclose())
