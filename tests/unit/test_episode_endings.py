"""How episodes end: which budget ended them reaches the trajectory, and a budget of the AgentLoop
lets the env settle (grade) the episode through `Env.atruncate`, under a deadline of its own, with
its failures masked as infrastructure faults instead of scored 0."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.envs.tool_env import ToolEnv
from agentrl.errors import SandboxError
from agentrl.rollout import AgentLoop, AgentLoopConfig
from agentrl.tools.core import ToolContext, tool
from agentrl.tools.parsers import HermesParser
from agentrl.types import Action, FinishReason, Generation, Message, SamplingParams

CALL = '<tool_call>\n{"name": "note", "arguments": {"text": "working"}}\n</tool_call>'


@tool
def note(text: str) -> str:
    """Write a note.

    Args:
        text: The note.
    """
    return "noted"


class GradedEnv(ToolEnv):
    """Episodes judged by work done: scored when truncated; `grade` is what `ascore` does."""

    score_truncated = True
    end_without_tool_call = False

    def __init__(self, *, max_turns: int = 50, wall_budget_turns: int | None = None, grade: Any = None) -> None:
        super().__init__([note], max_turns=max_turns)
        self.wall_budget_turns = wall_budget_turns
        self.grade = grade
        self.truncations: list[str] = []
        self.scored = 0

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": "Do the work."}]}

    def budget_exceeded(self, action: Action, messages: list[Message]) -> str | None:
        if self.wall_budget_turns is not None and self._turn >= self.wall_budget_turns:
            return "max_wall_s"
        return None

    async def ascore(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        self.scored += 1
        if self.grade is not None:
            await self.grade()
        ctx.state["score_info"] = {"metrics": {"resolved": 1.0}}
        return 0.75

    async def atruncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        self.truncations.append(reason)
        return await super().atruncate(reason)


class Client:
    def __init__(self, template: ChatTemplate, text: str, delay_s: float = 0.0) -> None:
        self.tok, self.text, self.delay_s = template.tokenizer, text, delay_s
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        await asyncio.sleep(self.delay_s)
        ids = self.tok.encode(self.text, add_special_tokens=False) + [self.end]
        if len(ids) > sampling.max_tokens:
            return Generation(ids[: sampling.max_tokens], [-0.5] * sampling.max_tokens, "length", 1)
        return Generation(ids, [-0.5] * len(ids), "stop", 1)


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")


def play(template: ChatTemplate, env: GradedEnv, config: AgentLoopConfig, text: str = CALL, delay_s: float = 0.0):  # type: ignore[no-untyped-def]
    loop = AgentLoop(Client(template, text, delay_s), template, HermesParser(), config)
    return asyncio.run(loop.run_episode(env, seed=0))


def test_the_envs_own_truncation_reason_reaches_the_trajectory(template: ChatTemplate) -> None:
    env = GradedEnv(wall_budget_turns=2)
    traj = play(template, env, AgentLoopConfig(max_turns=10))
    assert (traj.finish_reason, traj.info["truncated_by"], traj.reward, traj.fault) == (
        FinishReason.MAX_TURNS, "max_wall_s", 0.75, None)
    assert traj.metrics["resolved"] == 1.0 and env.scored == 1
    assert env.truncations == []  # the env ended the episode itself: nothing to settle


@pytest.mark.parametrize(
    ("config", "text", "budget", "reason"),
    [
        (AgentLoopConfig(max_turns=2), CALL, "rollout.max_turns", FinishReason.MAX_TURNS),
        (AgentLoopConfig(max_turns=10, max_tokens_per_turn=8), "word " * 50, "rollout.max_tokens_per_turn",
         FinishReason.MAX_LENGTH),
        (AgentLoopConfig(max_turns=10, max_tokens_per_turn=64, max_total_tokens=260), CALL,
         "rollout.max_total_tokens", FinishReason.MAX_LENGTH),
    ],
    ids=["turns", "turn-tokens", "total-tokens"],
)
def test_a_loop_budget_lets_the_env_grade_the_episode(template: ChatTemplate, config: AgentLoopConfig, text: str,
                                                      budget: str, reason: FinishReason) -> None:
    env = GradedEnv()
    traj = play(template, env, config, text)
    assert env.truncations == [budget]
    assert (traj.finish_reason, traj.info["truncated_by"], traj.reward, traj.fault) == (reason, budget, 0.75, None)
    assert traj.metrics["resolved"] == 1.0 and traj.trainable
    assert env._ctx is None  # the episode's tools and context were released by atruncate


def test_the_wall_clock_budget_grades_but_stays_masked(template: ChatTemplate) -> None:
    env = GradedEnv()
    traj = play(template, env, AgentLoopConfig(max_turns=50, episode_timeout_s=0.6), delay_s=0.25)
    assert env.truncations == ["rollout.episode_timeout_s"]
    assert (traj.finish_reason, traj.info["truncated_by"], traj.fault) == (
        FinishReason.TIMEOUT, "rollout.episode_timeout_s", "infra")
    assert traj.reward == 0.75 and traj.metrics["resolved"] == 1.0  # graded, for the record


def test_a_grading_failure_is_an_infrastructure_fault_not_a_zero(template: ChatTemplate) -> None:
    async def broken() -> None:
        raise SandboxError("the container of the episode is gone")

    traj = play(template, GradedEnv(grade=broken), AgentLoopConfig(max_turns=2))
    assert (traj.finish_reason, traj.fault, traj.trainable) == (FinishReason.MAX_TURNS, "infra", False)
    assert "rollout.max_turns" in traj.error and "container of the episode is gone" in traj.error

    async def hangs() -> None:
        await asyncio.sleep(30)

    traj = play(template, GradedEnv(grade=hangs), AgentLoopConfig(max_turns=2, truncate_timeout_s=0.3))
    assert (traj.finish_reason, traj.fault) == (FinishReason.MAX_TURNS, "infra")
    assert "within 0.3 s" in traj.error


def test_envs_that_do_not_grade_truncations_score_zero(template: ChatTemplate) -> None:
    class Plain(GradedEnv):
        score_truncated = False

    env = Plain()
    traj = play(template, env, AgentLoopConfig(max_turns=2))
    assert (traj.reward, traj.fault, env.scored, traj.info["truncated_by"]) == (0.0, None, 0, "rollout.max_turns")
    info = json.loads(json.dumps(traj.to_dict()))["info"]
    assert [(o["turn"], o["status"]) for o in info.pop("call_outcomes")] == [(1, "ok"), (2, "ok")]
    assert info == {"truncated_by": "rollout.max_turns"}
