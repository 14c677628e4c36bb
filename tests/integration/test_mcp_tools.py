"""MCP tools against real MCP servers: a `fastmcp` server of the tests (tests/mcp/calc_server.py) over
stdio (under bubblewrap and unisolated) and over streamable HTTP on loopback, and `mcp-server-time`
from PyPI, offline under bubblewrap. What they guard: the listed schemas are the tool schemas the
Qwen2.5 chat template renders; a call returns the server's content; `isError` is the model's
fault and the episode goes on; a hang past the tool deadline, a crash and a server that cannot
start are infrastructure failures; a shared server keeps its state across episodes; and no server
process is left after an episode, after the run's shared servers close, or after the driver is
killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs.mcp_env import McpEnv
from agentrl.errors import ToolInfrastructureError
from agentrl.tools.mcp_shared import SharedMCPServers
from agentrl.types import Action, ToolCall

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")
pytestmark = pytest.mark.slow

SERVER_DIR = Path(__file__).resolve().parents[1] / "mcp"
CALC = {"name": "calc", "command": "python", "args": [str(SERVER_DIR / "calc_server.py")], "ro_paths": [str(SERVER_DIR)]}
ROW = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "data_source": "agentrl/arithmetic",
       "reward_model": {"style": "rule", "ground_truth": "5"}}


def call(name: str, **arguments: Any) -> Action:
    return Action(f"calling {name}", (ToolCall(name, arguments, id=f"call_{name}"),))


# ── processes ───────────────────────────────────────────────────────────────────────────────


def _stat(pid: int) -> tuple[int, str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> set[int]:
    """Every live process under `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[1] != "Z":
            children.setdefault(st[0], []).append(int(entry))
    out: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if (st := _stat(p)) is not None and st[1] != "Z"}


def wait_gone(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


# ── stdio, per episode ──────────────────────────────────────────────────────────────────────


def test_stdio_server_tools_render_and_answer_and_errors_are_the_models(assets: Path) -> None:
    from agentrl.chat import ChatTemplate

    before = descendants(os.getpid())
    env = McpEnv(servers=[CALC], tool_timeout_s=30.0)
    messages, info = env.reset(options={"row": ROW})
    servers = descendants(os.getpid()) - before
    assert servers, "the stdio server should run while the episode does"
    tools = {t["function"]["name"]: t for t in info["tools"]}
    assert set(tools) == {"add", "divide", "kv_set", "kv_get", "picture", "hang", "crash"}
    assert tools["add"] == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}}

    template = ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")
    text = template.render(messages, info["tools"])
    tools_block = text[text.rindex("<tools>") + len("<tools>"):text.rindex("</tools>")]
    rendered = [json.loads(line) for line in tools_block.strip().splitlines()]
    assert rendered == info["tools"]  # each schema rendered whole, as the model will read it

    obs, reward, term, trunc, step_info = env.step(call("add", a=2, b=3))
    assert obs == [{"role": "tool", "content": "5", "tool_call_id": "call_add", "name": "add"}]
    obs, reward, term, trunc, step_info = env.step(call("divide", a=1, b=0))
    assert obs[0]["content"] == "Error: division by zero: b must not be 0"
    assert (term, trunc, step_info["metrics"]["tool_errors_model"], step_info["metrics"]["tool_errors_infra"]) == (
        False, False, 1, 0)
    obs, *_ = env.step(call("add", a="two", b=3))  # the server checks the arguments against its schema
    assert obs[0]["content"].startswith("Error: ") and "a" in obs[0]["content"]
    obs, *_ = env.step(Action("bad json", (ToolCall("add", "{not json", id="c1"),)))
    assert "not valid JSON" in obs[0]["content"]
    obs, *_ = env.step(call("picture"))
    assert obs[0]["content"] == "[image image/png of 70 bytes: not shown]\na one-pixel picture"
    env.step(call("kv_set", key="k", value="v1"))
    obs, reward, term, trunc, step_info = env.step(call("kv_get", key="k"))
    assert obs[0]["content"] == "v1" and not term
    obs, reward, term, trunc, step_info = env.step(Action("The answer is \\boxed{5}."))
    assert (reward, term, step_info["metrics"]["tool_calls"]) == (1.0, True, 7)
    assert wait_gone(servers) == set(), "the episode's server must be gone when the episode ends"

    env.reset(options={"row": ROW})  # a new episode gets a fresh server: no state carried over
    obs, *_ = env.step(call("kv_get", key="k"))
    assert obs[0]["content"] == "(unset)"
    servers = descendants(os.getpid()) - before
    env.close()
    assert wait_gone(servers) == set()


@pytest.mark.parametrize("tool", ["hang", "crash"])
def test_a_hang_past_the_tool_deadline_and_a_crash_are_infrastructure_failures(tool: str) -> None:
    before = descendants(os.getpid())
    env = McpEnv(servers=[CALC], tool_timeout_s=2.0)
    env.reset(options={"row": ROW})
    servers = descendants(os.getpid()) - before
    with pytest.raises(ToolInfrastructureError) as err:
        env.step(call(tool))
    assert err.value.fault == "infra"
    assert ("did not answer within 2 s" if tool == "hang" else "crashed") in str(err.value)
    assert wait_gone(servers) == set(), f"the server that {tool}ed must be stopped with the episode"
    env.close()


def test_a_server_that_cannot_start_fails_the_reset_as_infrastructure() -> None:
    env = McpEnv(servers=[{"command": "python", "args": ["-c", "import sys; sys.stderr.write('no such server'); sys.exit(2)"]}])
    with pytest.raises(ToolInfrastructureError, match="could not be started or initialized.*no such server"):
        env.reset(options={"row": ROW})
    env.close()


def test_unisolated_stdio_server_and_a_shared_one_that_keeps_state_across_episodes() -> None:
    from agentrl.sandboxes.local import LocalSandbox

    sandbox = LocalSandbox(isolation="none", pool_size=0)
    shared = SharedMCPServers()
    before = descendants(os.getpid())
    shared_calc = {**CALC, "per_episode": False, "tool_prefix": "shared_"}

    async def episodes() -> tuple[str, str, set[int]]:
        first = McpEnv(servers=[CALC, shared_calc], sandbox=sandbox, shared_mcp=shared)
        _, info = await first.areset(options={"row": ROW})
        assert {"add", "shared_add", "shared_kv_get"} <= {t["function"]["name"] for t in info["tools"]}
        await first.astep(call("shared_kv_set", key="k", value="kept"))
        await first.astep(call("kv_set", key="k", value="own"))
        await first.astep(Action("\\boxed{5}"))
        await first.aclose()
        second = McpEnv(servers=[CALC, shared_calc], sandbox=sandbox, shared_mcp=shared)
        await second.areset(options={"row": ROW})
        kept = (await second.astep(call("shared_kv_get", key="k")))[0][0]["content"]
        own = (await second.astep(call("kv_get", key="k")))[0][0]["content"]
        running = descendants(os.getpid()) - before
        await second.aclose()
        # the shared server crashes: that episode is infra-failed, the next one gets a new server
        third = McpEnv(servers=[shared_calc], sandbox=sandbox, shared_mcp=shared)
        await third.areset(options={"row": ROW})
        with pytest.raises(ToolInfrastructureError, match="crashed"):
            await third.astep(call("shared_crash"))
        fourth = McpEnv(servers=[shared_calc], sandbox=sandbox, shared_mcp=shared)
        await fourth.areset(options={"row": ROW})
        after_crash = (await fourth.astep(call("shared_kv_get", key="k")))[0][0]["content"]
        await fourth.aclose()
        return kept, own, after_crash, running

    kept, own, after_crash, running = asyncio.run(episodes())
    assert (kept, own, after_crash) == ("kept", "(unset)", "(unset)")
    assert shared.server_count == 1
    restarted = descendants(os.getpid()) - before
    assert restarted and not alive(running) & restarted, "the crashed server was replaced by a new process"
    shared.close()
    assert wait_gone(restarted | running) == set(), "closing the run's shared servers stops them"
    asyncio.run(sandbox.close())


# ── streamable HTTP ─────────────────────────────────────────────────────────────────────────


@pytest.fixture
def http_server() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(SERVER_DIR / "calc_server.py"), "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the HTTP MCP server did not start: {proc.stderr.read().decode()[-2000:]}") from None
            time.sleep(0.2)
    yield proc, f"http://127.0.0.1:{port}/mcp"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_streamable_http_server_answers_and_its_death_is_infrastructure(http_server: Any) -> None:
    proc, url = http_server
    env = McpEnv(servers=[{"url": url}])
    _, info = env.reset(options={"row": ROW})
    assert "add" in {t["function"]["name"] for t in info["tools"]}
    assert env.step(call("add", a=40, b=2))[0][0]["content"] == "42"
    obs, _, _, _, step_info = env.step(call("divide", a=1, b=0))
    assert obs[0]["content"].startswith("Error: division by zero") and step_info["metrics"]["tool_errors_model"] == 1
    with pytest.raises(ToolInfrastructureError):
        env.step(call("crash"))
    env.close()
    assert proc.wait(timeout=10) == 3


# ── a server from PyPI, offline ─────────────────────────────────────────────────────────────


def test_mcp_server_time_from_pypi_runs_offline_under_bubblewrap() -> None:
    pytest.importorskip("mcp_server_time")
    server = {"name": "time", "command": "python", "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
    env = McpEnv(servers=[server])
    _, info = env.reset(options={"row": ROW})
    assert {"get_current_time", "convert_time"} <= {t["function"]["name"] for t in info["tools"]}
    obs, *_ = env.step(call("get_current_time", timezone="UTC"))
    answer = json.loads(obs[0]["content"])
    assert answer["timezone"] == "UTC" and answer["datetime"][:4] == time.strftime("%Y", time.gmtime())
    obs, *_ = env.step(call("get_current_time", timezone="Not/AZone"))
    assert obs[0]["content"].startswith("Error: ")  # reported by the server as isError: the model's
    env.close()


# ── the driver dies ─────────────────────────────────────────────────────────────────────────

DRIVER = """
import asyncio, sys, time
from agentrl.envs.mcp_env import McpEnv
from agentrl.sandboxes.local import LocalSandbox
from agentrl.tools.mcp_shared import SharedMCPServers
calc = {calc!r}
sandbox = LocalSandbox(isolation={isolation!r}, pool_size=0)
shared = SharedMCPServers()
async def main():
    env = McpEnv(servers=[calc, {{**calc, "per_episode": False, "tool_prefix": "s_"}}], sandbox=sandbox, shared_mcp=shared)
    await env.areset(options={{"row": {{"prompt": "hi", "reward_model": {{"ground_truth": "1"}}}}}})
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_no_server_survives_a_sigkill_of_the_driver(isolation: str, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(calc=CALC, isolation=isolation))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
        servers = descendants(driver.pid)
        # two servers, each a lifeline and its command (and, under bwrap, bwrap's processes)
        assert len(servers) >= 4, servers
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert wait_gone(servers) == set(), "every MCP server process must die with the driver"
    finally:
        if driver.poll() is None:
            driver.kill()
