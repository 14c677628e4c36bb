"""An MCP server of your own: a notebook the agent writes to and reads from (stdio, official `mcp` SDK).

agentrl starts it once per episode (`examples/mcp_tools.py`), so each episode begins with an empty
notebook. Any MCP client can use it too: `python examples/mcp_notes_server.py` speaks MCP on stdio.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes")
notes: dict[str, str] = {}


@server.tool(description="Save a note under a title (replacing any note of that title).")
def save_note(title: str, text: str) -> str:
    """Returns a confirmation."""
    notes[title] = text
    return f"saved '{title}' ({len(notes)} notes)"


@server.tool(description="Read the note saved under a title.")
def read_note(title: str) -> str:
    """An unknown title is a tool error (isError): the model's mistake, shown to it."""
    if title not in notes:
        raise ToolError(f"no note titled '{title}'; saved titles: {sorted(notes) or 'none'}")
    return notes[title]


if __name__ == "__main__":
    server.run()
