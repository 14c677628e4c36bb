"""The logic of env=verifiers' multi-turn path that needs no worker process: reading the worker's
answers (what is a reward, what is an infrastructure failure), the rows of a taskset played in turns,
the request that asks the worker to play an episode, and how a budget-cut episode ends. The worker
itself, verifiers and the gateway are exercised in tests/integration/test_verifiers_multiturn.py."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from agentrl.envs.verifiers_env import scored_answer
from agentrl.errors import ConfigError, EnvServerError, FeatureUnavailableError
from agentrl.gateway.agent_env import AgentTask
from agentrl.gateway.verifiers_agent import VerifiersAgentEnv
from agentrl.types import FinishReason

GAME = {"id": "guess-3", "prompt": "Guess my number.", "system_prompt": "Reply with a number.", "secret": 6}
OPENED_BY_ENV = {"idx": 1, "prompt": None}  # a task whose env opens the conversation (OpenEnv's)


class StubWorker:
    """What VerifiersEnv asks of its worker, answered from memory: a taskset played in turns."""

    def __init__(self, answer: dict[str, Any] | Exception | None = None) -> None:
        self.answer = answer
        self.requests: list[tuple[dict[str, Any], float]] = []

    def taskset(self, taskset_id: str, kwargs: dict[str, Any], max_rows: int) -> dict[str, Any]:
        tasks = [{"data": GAME, "key": "k0"}, {"data": OPENED_BY_ENV, "key": "k1"}]
        return {"ok": True, "tasks": tasks[:max_rows], "multi_turn": True, "env": "GuessEnv"}

    async def ataskset(self, taskset_id: str, kwargs: dict[str, Any], max_rows: int) -> dict[str, Any]:
        return self.taskset(taskset_id, kwargs, max_rows)

    async def arequest(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.requests.append((request, timeout_s))
        if isinstance(self.answer, Exception):
            raise self.answer
        assert self.answer is not None
        return self.answer


def make(worker: StubWorker, **kwargs: Any) -> VerifiersAgentEnv:
    return VerifiersAgentEnv(id="my_taskset", verifiers_worker=worker, **kwargs)  # type: ignore[arg-type]


def task_for(row: dict[str, Any], timeout_s: float = 90.0) -> AgentTask:
    return AgentTask(base_url="http://127.0.0.1:9/s/key/v1", api_key="key", model="agentrl-policy", messages=[],
                     row=row, timeout_s=timeout_s)


PLAYED = {"ok": True, "reward": 1.0, "rewards": {"solved": 1.0}, "metrics": {"guesses": 3}, "turns": 3,
          "stop": "user_closed", "reply": "6"}


def test_a_scored_answer_is_the_reward_and_its_parts_as_metrics() -> None:
    assert scored_answer(PLAYED, "the episode", "") == (1.0, {"reward/solved": 1.0, "guesses": 3.0})


@pytest.mark.parametrize(("answer", "error", "says"), [
    ({"ok": False, "kind": "timeout"}, EnvServerError, "the episode did not finish within 90 s (a deadline)."),
    ({"ok": False, "kind": "failed", "message": "HarnessError: exit 1"}, EnvServerError,
     "the episode failed: HarnessError: exit 1"),
    ({"ok": True, "reward": None, "rewards": {"solved": None}, "metrics": {}}, EnvServerError,
     "the verifiers rewards ['solved'] of the episode were not scored."),
    ({"ok": False, "kind": "config", "message": "no such taskset"}, ConfigError, "no such taskset"),
    ({"ok": False, "kind": "unavailable", "message": "two seats"}, FeatureUnavailableError, "two seats"),
])
def test_what_is_not_a_score_raises_never_scores_zero(answer: dict[str, Any], error: type, says: str) -> None:
    with pytest.raises(error) as caught:
        scored_answer(answer, "the episode", "90 s (a deadline)")
    assert str(caught.value) == says


def test_rows_of_a_taskset_played_in_turns_carry_their_task_and_no_measurable_prompt() -> None:
    env = make(StubWorker())
    game, opened = env.rows()
    assert game["prompt"] == [{"role": "system", "content": "Reply with a number."},
                              {"role": "user", "content": "Guess my number."}]
    assert game["extra_info"]["verifiers_task"] == GAME and game["extra_info"]["verifiers_multi_turn"] is True
    assert env.first_prompt(game) is None  # verifiers' own program renders the first call
    assert opened["prompt"] == [{"role": "user", "content": "(verifiers task 1: its env opens the conversation)"}]
    assert env.generate_row(3) == opened  # seeds pick rows round-robin


def test_stepping_a_taskset_played_in_turns_is_refused_with_the_way_to_run_it() -> None:
    env = make(StubWorker())
    with pytest.raises(FeatureUnavailableError, match=r"played in turns by its GuessEnv.*agentrl run\|eval"):
        asyncio.run(env.areset(options={"row": env.rows()[0]}))


def test_the_worker_is_asked_to_play_the_rows_task_against_the_sessions_base_url() -> None:
    worker = StubWorker(PLAYED)
    env = make(worker, max_turns=5)
    info: dict[str, Any] = {}
    reply = asyncio.run(env.arun_agent(task_for(env.rows()[0]), info))
    (request, timeout_s), = worker.requests
    assert request == {"op": "play", "taskset": "my_taskset", "kwargs": {}, "data": GAME,
                       "base_url": "http://127.0.0.1:9/s/key/v1", "model": "agentrl-policy", "max_turns": 5,
                       "timeout_s": 90.0}
    assert timeout_s > 90.0  # the worker has the deadline; past it plus a grace, it is wedged and killed
    assert reply == "6" and info["verifiers"]["task"] == "guess-3" and info["verifiers"]["turns"] == 3
    assert asyncio.run(env.ascore_episode(reply, env.rows()[0], info)) == (1.0, {"reward/solved": 1.0,
                                                                                  "guesses": 3.0}, {})


def test_an_episode_without_a_deadline_still_gives_the_worker_one() -> None:
    worker = StubWorker(PLAYED)
    asyncio.run(make(worker).arun_agent(task_for(make(worker).rows()[0], math.inf), {}))
    assert math.isfinite(worker.requests[0][0]["timeout_s"])


@pytest.mark.parametrize("answer", [EnvServerError("the verifiers worker (pid 7) was killed by signal 9"),
                                    {"ok": False, "kind": "failed", "message": "RuntimeError: boom"},
                                    {"ok": False, "kind": "timeout"}])
def test_a_dead_worker_or_a_failed_episode_fails_the_agent_step_naming_the_task(answer: Any) -> None:
    env = make(StubWorker(answer))
    info: dict[str, Any] = {}
    with pytest.raises(EnvServerError, match="the verifiers episode of task guess-3"):
        asyncio.run(env.arun_agent(task_for(env.rows()[0]), info))
    assert info["verifiers"] == {"task": "guess-3"}  # the failed episode still says which task it was


def test_an_unscored_reward_masks_the_episode() -> None:
    env = make(StubWorker({**PLAYED, "reward": None, "rewards": {"solved": None}}))
    info: dict[str, Any] = {}
    reply = asyncio.run(env.arun_agent(task_for(env.rows()[0]), info))
    with pytest.raises(EnvServerError, match=r"rewards \['solved'\] of task guess-3 were not scored"):
        asyncio.run(env.ascore_episode(reply, env.rows()[0], info))


@pytest.mark.parametrize(("stop", "reason"), [("max_turns", FinishReason.MAX_TURNS),
                                              ("max_total_tokens", FinishReason.MAX_LENGTH),
                                              ("user_closed", FinishReason.DONE), (None, FinishReason.DONE)])
def test_an_exchange_verifiers_cut_at_the_budget_ends_as_the_agent_loops_would(stop: str | None,
                                                                              reason: FinishReason) -> None:
    env = make(StubWorker())
    assert env.finish_reason(FinishReason.DONE, {"verifiers": {"task": "t", "stop": stop}}) == reason
