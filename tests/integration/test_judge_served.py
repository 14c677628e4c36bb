"""A judge the run serves itself (`reward.judge.model_path`): a real `agentrl gateway` of the tiny
random Qwen2 on the hf engine, started by the first judge request under a lifeline. The tiny model
answers noise, so its verdicts are unreadable: each reward is missing with its cause (never 0),
with the judge's reply and its own session's URL kept; every exchange reaches the judge gateway's
trajectories.jsonl with its tokens. A judge server that is SIGKILLed makes the next rewards
missing as `infra`, naming its exit code and its log; one that cannot start says why. The eval path with a served judge (pre-flight included) is in
test_judge_eval.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.envs.arithmetic import make_arithmetic_row
from agentrl.envs.judge import JudgeReward
from agentrl.envs.reward_sources import CombinedReward, ascore_row, build_reward
from agentrl.errors import RewardMissingError

pytestmark = pytest.mark.slow  # each test starts a judge server: about 10-20 s


def _reward(*overrides: str) -> CombinedReward:
    config = load_config(overrides=[
        "reward.judge.engine=hf", "reward.judge.max_tokens=8", "reward.judge.verdict_regex=(?P<score>[01])",
        "reward.judge.startup_timeout_s=300",
        "reward.combine=[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]", *overrides])
    reward = build_reward(config.reward)
    assert isinstance(reward, CombinedReward)
    return reward


def _judge(reward: CombinedReward) -> JudgeReward:
    return next(scorer for source, _, scorer in reward.parts if source == "judge")


def _score(reward: CombinedReward, rows: list[dict], answer: str) -> list[BaseException | object]:
    async def main() -> list[BaseException | object]:
        try:
            return list(await asyncio.gather(*(ascore_row(reward, row, answer) for row in rows), return_exceptions=True))
        finally:
            await _judge(reward).aclose()

    return asyncio.run(main())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def tiny_judge(assets: Path) -> list[str]:
    return [f"reward.judge.model_path={assets / 'tiny-random-qwen2'}",
            "reward.judge.server_args=[model.chat_template=chatml-tools]"]


def test_the_run_serves_its_judge_keeps_every_exchange_and_a_killed_one_is_missing_not_zero(
        tiny_judge: list[str]) -> None:
    reward = _reward(*tiny_judge)
    judge = _judge(reward)
    server = judge.server
    assert server is not None and server.pid is None  # nothing runs before the first request
    rows = [make_arithmetic_row(i) for i in range(3)]
    try:
        outcomes = _score(reward, rows, "\\boxed{42}")
        lifeline = server.pid
        assert lifeline is not None and server.failure is None
        assert all(isinstance(o, RewardMissingError) for o in outcomes), outcomes  # the tiny judge answers noise
        causes = {o.cause for o in outcomes if isinstance(o, RewardMissingError)}
        assert causes <= {"parse", "truncated"} and causes
        records = [o.record["parts"]["judge"] for o in outcomes if isinstance(o, RewardMissingError)]
        urls = sorted(r["url"] for r in records)
        assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/s/judge-[012]/v1", u) for u in urls), urls
        assert len(set(urls)) == 3  # one session per request
        assert all(isinstance(r["reply"], str) and "Compute" in r["request"] for r in records)
        assert server.out_dir is not None
        exchanges = [json.loads(line) for line in (server.out_dir / "trajectories.jsonl").read_text().splitlines()]
        assert len(exchanges) == 3 and all(e["token_ids"] for e in exchanges)  # each session ended once answered
        assert "gateway at http://127.0.0.1" in (server.out_dir / "judge-server.log").read_text()

        os.killpg(lifeline, signal.SIGKILL)  # the lifeline leads the group: the gateway and its engine die too
        assert _gone(lifeline)
        for outcome in _score(reward, rows[:2], "\\boxed{42}"):  # missing, naming the exit, never 0
            assert isinstance(outcome, RewardMissingError) and outcome.cause == "infra", outcome
            assert "the reward judge the run serves" in str(outcome) and "was killed by signal 9 (SIGKILL)" in str(outcome)
            assert str(server.log_path) in str(outcome)
    finally:
        reward.stop()
    assert server.pid is None


def test_a_judge_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    reward = _reward(f"reward.judge.model_path={tmp_path / 'no-such-model'}")
    try:
        outcome = _score(reward, [make_arithmetic_row(0)], "\\boxed{42}")[0]
        assert isinstance(outcome, RewardMissingError) and outcome.cause == "infra", outcome
        message = str(outcome)
        assert "the reward judge the run serves" in message and "exited with code 1" in message
        assert "no-such-model' is neither a model directory" in message  # the gateway's own error, from its log
    finally:
        reward.stop()
