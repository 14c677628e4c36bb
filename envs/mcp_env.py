"""`mcp`: an environment whose tools come from MCP servers, over any verl-format dataset.

    agentrl eval env=mcp data.val_files=rows.jsonl \\
        'env.kwargs.servers=[{command: python, args: [server.py], ro_paths: [.]}]'

The servers are listed in `env.kwargs.servers`, each an `agentrl.tools.mcp.MCPServerConfig`: a
stdio `command` (with `args`, `env`) that agentrl starts, isolated like the run's sandbox
(`sandbox.kwargs.isolation`: bubblewrap by default, no network unless the server's `network`),
or a streamable-HTTP `url`. At each episode's start (`reset`) every per-episode server is
started and its tools are listed; the shared ones (`per_episode: false`) are started once for
the run (`agentrl.tools.mcp_shared`). Their tools, with the schemas the servers give, are the
episode's tools (`info["tools"]`, rendered by the chat template) and the model's calls go to
them (see `agentrl.tools.mcp` for what a result shows and whose fault a failure is). When the
episode ends its per-episode servers are stopped. A server that cannot start fails the episode as
infrastructure (masked, not scored).

The episode ends when the model answers without calling a tool; the answer is scored by the run's
reward function (`reward.function`, verl's signature; by default `rewards.compute_score`,
which chooses the answer format by the row's `data_source`) against the row's
`reward_model.ground_truth`. `system_prompt` is put first when a row's prompt has no system
message. Without `servers` the env runs the shipped calculator server (`data/mcp_calculator.py`)
on the `arithmetic` env's rows, a complete example; with servers of your own, give your rows
(`data.train_files` / `data.val_files`).

Why an env and not an option of every `ToolEnv`: tools in agentrl are fixed when an env is built,
while an MCP server's tools are known only once it runs (and per-episode servers run per episode),
so this env lists them at reset; custom envs can do the same with `MCPConnection` and `MCPTool`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic

from agentrl.envs.arithmetic import make_arithmetic_row
from agentrl.envs.rewards import RewardFn, compute_score, score_row
from agentrl.envs.tool_env import ToolEnv
from agentrl.errors import ConfigError
from agentrl.sandboxes.bwrap import find_bwrap
from agentrl.tools.core import Tool, ToolContext
from agentrl.tools.mcp import Isolation, MCPConnection, MCPServerConfig, MCPTool, require_mcp
from agentrl.tools.mcp_shared import SharedMCPServers
from agentrl.types import Message

__all__ = ["McpEnv", "default_server"]

_CONNECTIONS_KEY = "_agentrl_mcp_connections"


def default_server() -> MCPServerConfig:
    """The server of `env=mcp` without `env.kwargs.servers`: the shipped calculator (stdio, per episode)."""
    path = Path(__file__).resolve().parent / "data" / "mcp_calculator.py"
    return MCPServerConfig(name="calculator", command="python", args=[str(path)], ro_paths=[str(path.parent)])


def _key(loc: Sequence[int | str]) -> str:
    """A pydantic error location as the rest of a dotted config key: ('ro_paths', 1) -> '.ro_paths[1]'."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


def _problem(error: Any) -> str:
    """A pydantic error's message, without the 'Value error, ' its validators' own messages get."""
    cause = error.get("ctx", {}).get("error")
    return str(cause) if error["type"] == "value_error" and cause is not None else str(error["msg"])


def _isolation(sandbox: Any) -> Isolation:
    """Stdio servers run under the isolation of the run's sandbox: the local sandbox's, or bwrap."""
    if sandbox is None:
        return "bwrap"
    isolation = getattr(sandbox, "isolation", None)
    if type(sandbox).__name__ == "LocalSandbox" and isolation in ("bwrap", "none"):
        return "bwrap" if isolation == "bwrap" else "none"
    raise ConfigError(
        f"env=mcp starts its stdio MCP servers on this machine under the local sandbox's isolation, and the "
        f"run's sandbox is a {type(sandbox).__name__}: use sandbox=local (isolation bwrap or none), or give "
        "the servers as streamable-HTTP 'url's running where you want them."
    )


class McpEnv(ToolEnv):
    """Tools from MCP servers over dataset rows (see the module docstring)."""

    def __init__(
        self,
        *,
        servers: Sequence[dict[str, Any] | MCPServerConfig] | None = None,
        system_prompt: str | None = None,
        max_turns: int = 8,
        tool_timeout_s: float = 30.0,
        sandbox: Any | None = None,
        reward_fn: RewardFn | None = None,
        shared_mcp: SharedMCPServers | None = None,
    ) -> None:
        super().__init__([], max_turns=max_turns, tool_timeout_s=tool_timeout_s, sandbox=sandbox)
        if servers is None:
            servers = [default_server()]
        if not servers:
            raise ConfigError(
                "env=mcp needs at least one MCP server: set env.kwargs.servers, e.g. "
                "'env.kwargs.servers=[{command: python, args: [my_server.py]}]' or "
                "'env.kwargs.servers=[{url: http://127.0.0.1:8000/mcp}]'."
            )
        parsed: list[MCPServerConfig] = []
        for i, entry in enumerate(servers):
            try:
                parsed.append(entry if isinstance(entry, MCPServerConfig) else MCPServerConfig.model_validate(entry))
            except pydantic.ValidationError as exc:
                lines = [f"env.kwargs.servers[{i}]{_key(e['loc'])}: {_problem(e)}" for e in exc.errors()]
                raise ConfigError("\n".join(lines), errors=lines) from exc
        require_mcp()
        self.servers = parsed
        self.system_prompt = system_prompt
        self.isolation: Isolation = _isolation(sandbox)
        if self.isolation == "bwrap" and find_bwrap() is None and any(s.command for s in parsed):
            raise ConfigError(
                "env=mcp runs its stdio MCP servers under bubblewrap (the sandbox's isolation) and 'bwrap' is "
                "not installed: run 'bash scripts/install.sh' or 'apt-get install bubblewrap'; or set "
                "sandbox.kwargs.isolation=none to run them unisolated (trusted servers only)."
            )
        self.reward_fn: RewardFn = reward_fn if reward_fn is not None else compute_score
        self._own_shared = shared_mcp is None and any(not s.per_episode for s in parsed)
        self.shared_mcp = SharedMCPServers() if self._own_shared else shared_mcp

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]] | None:
        """The `arithmetic` env's rows, which the default calculator server solves; give your own
        (`data.train_files`, `data.val_files`) for other servers."""
        offset = {"train": 0, "test": 1_000_000}[split]
        return [make_arithmetic_row(offset + i) for i in range(200)]

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        return make_arithmetic_row(seed or 0)

    # ToolEnv narrows Env.first_prompt to always answer; this env cannot, so it answers as Env allows
    def first_prompt(self, row: dict[str, Any]) -> None:  # type: ignore[override]  # narrower than ToolEnv's: see above
        """None: the tool schemas are the servers', known only once an episode has started them."""
        return None

    def initial_messages(self, row: dict[str, Any]) -> list[Message]:
        messages = super().initial_messages(row)
        if self.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        ctx = await super().create_context(episode_id, row)
        own = [MCPConnection(s, isolation=self.isolation) for s in self.servers if s.per_episode]
        ctx.state[_CONNECTIONS_KEY] = own
        try:
            results = await asyncio.gather(*(c.start() for c in own), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            connections: dict[int, Any] = {id(s): c for s, c in zip(
                [s for s in self.servers if s.per_episode], own, strict=True)}
            for server in self.servers:
                if not server.per_episode:
                    assert self.shared_mcp is not None
                    connections[id(server)] = await self.shared_mcp.connect(server, self.isolation)
            self.tools = self._episode_tools(connections)
        except BaseException:
            await self.release_context(ctx)
            raise
        return ctx

    def _episode_tools(self, connections: dict[int, Any]) -> dict[str, Tool]:
        tools: dict[str, Tool] = {}
        for server in self.servers:
            connection = connections[id(server)]
            for listed in connection.tools:
                if server.tools is not None and listed.name not in server.tools:
                    continue
                mcp_tool = MCPTool(listed, connection, prefix=server.tool_prefix, server_label=server.label)
                if mcp_tool.tool_name in tools:
                    raise ConfigError(
                        f"Two MCP tools are both named '{mcp_tool.tool_name}' ({server.label} has one); "
                        "give the servers different tool_prefix values, or pick tools with 'tools: [...]'."
                    )
                tools[mcp_tool.tool_name] = mcp_tool
        missing = [(s.name, n) for s in self.servers for n in (s.tools or [])
                   if not any(getattr(t, "mcp_name", None) == n for t in tools.values())]
        if missing:
            raise ConfigError(f"env.kwargs.servers: these tools were asked for but not listed by their server: {missing}.")
        return tools

    async def release_context(self, ctx: ToolContext) -> None:
        own = ctx.state.pop(_CONNECTIONS_KEY, [])
        await asyncio.gather(*(c.close() for c in own), return_exceptions=True)

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        result = score_row(self.reward_fn, row, final_text)
        ctx.state["score_info"] = {"metrics": result.metrics(), "reward_extra": result.extra}
        return result.score

    async def aclose(self) -> None:
        await super().aclose()
        if self._own_shared and self.shared_mcp is not None:
            await self.shared_mcp.aclose()
