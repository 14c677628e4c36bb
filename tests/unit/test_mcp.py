"""MCP tools without a server: what a result shows the model, the tool schema an MCP tool becomes,
the command line that isolates a stdio server, and the errors a wrong `env.kwargs.servers` or a
missing `mcp` package give. (Real servers: tests/integration/test_mcp_tools.py.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs.mcp_env import McpEnv
from agentrl.errors import ConfigError, FeatureUnavailableError
from agentrl.tools.mcp import MCPServerConfig, MCPTool, result_text, stdio_argv

types = pytest.importorskip("mcp").types


def test_result_text_shows_text_and_names_what_it_cannot_show() -> None:
    result = types.CallToolResult(content=[
        types.TextContent(type="text", text="first"),
        types.ImageContent(type="image", data="aGVsbG8=", mime_type="image/png"),
        types.EmbeddedResource(type="resource", resource=types.TextResourceContents(uri="file:///a.txt", text="inside")),
        types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(
            uri="file:///b.bin", blob="aGVsbG8=", mime_type="application/octet-stream")),
        types.ResourceLink(type="resource_link", uri="file:///c", name="c"),
    ])
    assert result_text(result).splitlines() == [
        "first", "[image image/png of 5 bytes: not shown]", "inside",
        "[resource file:///b.bin (application/octet-stream): binary, not shown]", "[resource file:///c]"]
    assert result_text(types.CallToolResult(content=[], structured_content={"x": 1})) == '{"x": 1}'


def test_an_mcp_tool_gets_an_openai_name_and_the_servers_schema_without_titles() -> None:
    listed = types.Tool(name="files.read", description="Read a file.", input_schema={
        "type": "object", "title": "Args", "properties": {"path": {"type": "string", "title": "Path"}},
        "required": ["path"]})
    tool = MCPTool(listed, connection=None, prefix="fs_")
    assert (tool.tool_name, tool.mcp_name) == ("fs_files_read", "files.read")
    assert tool.schema == {"type": "function", "function": {
        "name": "fs_files_read", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    assert tool.validate_arguments('{"path": "x"}') == {"arguments": {"path": "x"}}
    with pytest.raises(ValueError, match="must be a JSON object"):
        tool.validate_arguments("[1]")


def test_a_stdio_server_runs_under_a_lifeline_and_bwrap_without_network_unless_allowed() -> None:
    server = MCPServerConfig(command="python", args=["-m", "srv"], env={"TOKEN": "t"})
    argv, _ = stdio_argv(server, "bwrap")
    lifeline_end = argv.index("--")
    assert "--stdin" in argv[:lifeline_end] and "lifeline.py" in argv[2]
    bwrap = argv[lifeline_end + 1:]
    assert "--unshare-net" in bwrap and "--die-with-parent" in bwrap
    assert bwrap[-3:] == [sys.executable, "-m", "srv"]
    assert bwrap[bwrap.index("TOKEN") + 1] == "t"  # --setenv TOKEN t: the server's env, inside
    networked, _ = stdio_argv(server.model_copy(update={"network": True}), "bwrap")
    assert "--unshare-net" not in networked
    plain, plain_env = stdio_argv(server, "none")
    assert plain[plain.index("--") + 1:] == [sys.executable, "-m", "srv"] and plain_env["TOKEN"] == "t"


def test_a_bwrap_server_starts_in_the_current_directory_only_when_it_is_visible(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    hidden, _ = stdio_argv(MCPServerConfig(command="python", args=["srv.py"]), "bwrap")
    assert hidden[hidden.index("--chdir") + 1] == "/workspace"
    shown, _ = stdio_argv(MCPServerConfig(command="python", args=["srv.py"], ro_paths=["."]), "bwrap")
    assert shown[shown.index("--chdir") + 1] == str(tmp_path.resolve())
    assert shown[shown.index(str(tmp_path.resolve())) - 1] == "--ro-bind"  # visible, read-only
    # tmp_path is under /tmp: bound after the private /tmp is made, or that tmpfs would hide it
    assert shown.index("/tmp") < shown.index(str(tmp_path.resolve()))


def test_ro_paths_a_sandbox_cannot_show_are_refused_naming_each_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to("/proc")
    with pytest.raises(ConfigError) as caught:
        McpEnv(servers=[{"command": "python", "ro_paths": ["."]},
                        {"command": "python", "ro_paths": [".", "nowhere", "/tmp", "link"]}])
    assert caught.value.errors == [
        f"env.kwargs.servers[1].ro_paths[1]: 'nowhere' does not exist on this machine (relative to {tmp_path}): "
        "give an existing file or folder",
        "env.kwargs.servers[1].ro_paths[2]: '/tmp' is the sandbox's private /tmp: "
        "list the files or folders under it that are needed",
        "env.kwargs.servers[1].ro_paths[3]: 'link' leads through symlinks to '/proc', which is /proc, "
        "which the sandbox makes anew and never shows the host's",
    ]
    with pytest.raises(ConfigError, match=r"^env\.kwargs\.servers\[0\]\.ro_paths: Input should be a valid list"):
        McpEnv(servers=[{"command": "python", "ro_paths": "."}])


@pytest.mark.parametrize(("entry", "message"), [
    ({"command": "x", "url": "http://h/mcp"}, "exactly one of 'command'"),
    ({}, "exactly one of 'command'"),
    ({"url": "http://h/mcp", "args": ["a"]}, "apply to stdio servers"),
    ({"command": "x", "colour": "red"}, "colour"),
])
def test_a_wrong_server_entry_names_the_entry_and_the_problem(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"env\.kwargs\.servers\[0\].*" + message.replace("(", r"\(")):
        McpEnv(servers=[entry])
    with pytest.raises(ConfigError, match="at least one MCP server"):
        McpEnv(servers=[])


def test_without_the_mcp_package_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # `import mcp` now raises ImportError
    with pytest.raises(FeatureUnavailableError, match=r"pip install 'agentrl\[mcp\]'"):
        McpEnv(servers=[{"command": "python"}])


def test_stdio_servers_follow_the_local_sandbox_and_refuse_others() -> None:
    from agentrl.sandboxes.local import LocalSandbox

    assert McpEnv(sandbox=LocalSandbox(isolation="none", pool_size=0)).isolation == "none"
    assert McpEnv().isolation == "bwrap"

    class DockerSandbox:
        pass

    with pytest.raises(ConfigError, match="use sandbox=local"):
        McpEnv(sandbox=DockerSandbox())


@pytest.mark.slow  # loads a tokenizer and builds a whole job: ~20 s on a busy 2-core machine
def test_the_job_owns_one_set_of_shared_servers_for_its_envs(assets: Path) -> None:
    import asyncio

    from agentrl.config import load_config
    from agentrl.orchestration.build import build_job
    from agentrl.tools.mcp_shared import SharedMCPServers

    config = load_config(overrides=["env=mcp", f"model.path={assets / 'qwen2.5-0.5b-instruct'}", "eval.max_rows=2"])
    job = build_job(config, "eval", own_client=True)
    assert isinstance(job.shared_mcp, SharedMCPServers)
    env = job.make_env()
    assert isinstance(env, McpEnv) and env.shared_mcp is job.shared_mcp and len(job.val_rows) == 2
    asyncio.run(job.aclose())
