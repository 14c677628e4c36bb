"""A small MCP server written with `fastmcp` for agentrl's MCP tests: stdio (default) or streamable HTTP.

    python calc_server.py              # stdio
    python calc_server.py http PORT    # streamable HTTP on 127.0.0.1:PORT, endpoint /mcp

Tools: `add` (a result), `divide` (reports division by zero as a tool error, isError), `kv_set` /
`kv_get` (state kept by the server process), `pid` (the server's own pid, as it sees it), `picture`
(an image and a text part), `hang` (sleeps far past any tool deadline) and `crash` (the process
exits at once, mid-call).
"""

from __future__ import annotations

import base64
import os
import sys
import time

from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.utilities.types import Image

mcp = FastMCP("agentrl-test-calc")
_store: dict[str, str] = {}


@mcp.tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@mcp.tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("division by zero: b must not be 0")
    return a / b


@mcp.tool
def kv_set(key: str, value: str) -> str:
    """Remember a value under a key."""
    _store[key] = value
    return "ok"


@mcp.tool
def kv_get(key: str) -> str:
    """The value remembered under a key, or (unset)."""
    return _store.get(key, "(unset)")


@mcp.tool
def picture() -> list:
    """A tiny image and a caption."""
    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
    return [Image(data=png, format="png"), "a one-pixel picture"]


@mcp.tool
def hang(seconds: float = 3600.0) -> str:
    """Sleep for a long time."""
    time.sleep(seconds)
    return "woke up"


@mcp.tool
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        mcp.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), show_banner=False, log_level="WARNING")
    else:
        mcp.run(show_banner=False, log_level="WARNING")
