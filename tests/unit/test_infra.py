"""Infrastructure failures: the monitor's window and threshold, the env and loop classification."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.envs import ToolEnv
from agentrl.errors import InfraFailureError, ToolInfrastructureError
from agentrl.orchestration.infra import InfraMonitor, describe_infra_failures, fix_for
from agentrl.tools.core import tool
from agentrl.types import Action, ToolCall, Trajectory


def ok() -> Trajectory:
    return Trajectory(reward=1.0)


def infra(error: str = "generation failed: server down") -> Trajectory:
    return Trajectory(fault="infra", error=error)


def test_the_monitor_waits_for_a_step_then_stops_above_the_rate() -> None:
    monitor = InfraMonitor(0.5, window=64, min_episodes=6)
    monitor.record([infra(), infra(), infra()])
    monitor.check()  # 3 episodes: not a step's worth yet
    monitor.record([ok(), infra("env step failed: LocalSandbox needs bubblewrap"), infra()])
    with pytest.raises(InfraFailureError) as caught:
        monitor.check()
    text = str(caught.value)
    assert "5 of the last 6 episodes (83%)" in text and "run.max_infra_failure_rate=0.5" in text
    assert "Commonest cause (4 episodes): generation failed: server down" in text
    assert monitor.failed == 5 and monitor.total == 6
    assert "continue the run" not in text  # an evaluation's monitor has no run to continue


def test_a_run_that_stops_names_its_own_resume_command() -> None:
    command = "agentrl run out/mine/config.yaml resume=true run.name=mine run.output_dir=out"
    monitor = InfraMonitor(0.5, window=4, resume_command=command)
    monitor.record([infra()] * 4)
    with pytest.raises(InfraFailureError) as caught:
        monitor.check()
    assert str(caught.value).endswith(f"\nThen continue the run with: {command}")


def test_the_window_forgets_old_failures_and_rate_one_never_stops() -> None:
    monitor = InfraMonitor(0.5, window=4, min_episodes=100)  # min is capped at the window
    monitor.record([infra()] * 4)
    with pytest.raises(InfraFailureError):
        monitor.check()
    monitor.record([ok()] * 3)
    assert monitor.rate == 0.25
    monitor.check()
    never = InfraMonitor(1.0, window=4)
    never.record([infra()] * 4)
    never.check()


def test_the_fix_is_chosen_by_the_error_text() -> None:
    assert "bubblewrap" in fix_for("LocalSandbox needs bubblewrap (the 'bwrap' binary)")
    assert "tool_timeout_s" in fix_for("tool 'python' failed: did not answer within 30 s")
    assert "driver.log" in fix_for("something nobody foresaw")
    # an env's own server is named as such, not as an LLM server
    openenv = fix_for("env step failed: the OpenEnv server at http://127.0.0.1:1 failed during step: ConnectionClosed")
    assert "env.kwargs.url / command" in openenv and "LLM server" not in openenv
    assert "env.kwargs.servers" in fix_for("MCP server 'calc' did not answer within 30 s (rollout.tool_timeout_s)")
    cause, count = describe_infra_failures([infra("a 0123456789abcdef0123 b"), infra("a fedcba98765432100000 b"), ok()])
    assert (cause, count) == ("a <id> b", 2)


@tool
async def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


class SlowEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([slow], max_turns=3, tool_timeout_s=0.2)

    def score(self, final_text, row, ctx) -> float:
        return 1.0


def test_a_tool_deadline_ends_the_episode_as_an_infrastructure_failure() -> None:
    async def play() -> None:
        env = SlowEnv()
        await env.areset(options={"row": {"prompt": "go"}})
        fast = await env.astep(Action("", (ToolCall("slow", {"seconds": 0.0}, id="a"),)))
        assert fast[0][0]["content"] == "woke" and not fast[2]
        with pytest.raises(ToolInfrastructureError, match="did not answer within 0.2 s"):
            await env.astep(Action("", (ToolCall("slow", {"seconds": 5.0}, id="b"),)))
        await env.aclose()

    asyncio.run(play())
