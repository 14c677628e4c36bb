"""`agentrl eval env=gym` with the hf engine and the tiny random Qwen2: a Gymnasium text env written
as Gymnasium's docs show (tests/gym_text) played by a real model through the real server, AgentLoop
and adapter. What the model sampled is the action the env got: replaying the recorded assistant turns
in a fresh env gives the recorded hints and reward. Every episode ends measured, none masked."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

from agentrl.config import load_config
from agentrl.orchestration.evaluate import run_eval

pytestmark = pytest.mark.slow

GUESS_ID = "gym_text.guess_text_env:GuessText-v0"  # tests/ is on sys.path (its conftest)
TEST_SEEDS = (1_000_000, 1_000_001)  # the seeds of GymTextEnv.dataset_rows("test")[:2]


def _replays(turns: list[str], hints: list[str], reward: float, seed: int) -> bool:
    """Whether the env of `seed`, given `turns`, answers `hints` and pays `reward`."""
    env = gymnasium.make(GUESS_ID)
    env.reset(seed=seed)
    answers, total = [], 0.0
    for text in turns:
        observation, r, terminated, truncated, _ = env.step(text)
        answers.append(observation)
        total += float(r)
        if terminated or truncated:
            break
    env.close()
    return answers[: len(hints)] == hints and total == reward


def test_eval_of_a_gymnasium_text_env_with_the_hf_engine_and_a_tiny_model(assets: Path, tmp_path: Path) -> None:
    config = load_config(overrides=[
        "env=gym", f"env.kwargs.id={GUESS_ID}", f"model.path={assets / 'tiny-random-qwen2'}",
        "inference.engine=hf", "eval.k=1", "eval.max_rows=2", "rollout.max_turns=3",
        "rollout.max_tokens_per_turn=32", f"eval.output_dir={tmp_path / 'eval'}",
        # the random model seldom samples its end-of-turn token: the first 20,000 ids end a turn too, so most
        # turns end (and reach the env as actions) instead of running into the token budget
        f"rollout.extra_stop_token_ids=[{','.join(str(i) for i in range(20000))}]"])
    report = run_eval(config)
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 and report.infra_failed_episodes == 0
    stepped = 0
    for episode in episodes:
        assert episode["fault"] is None and episode["num_sampled"] > 0
        messages = episode["messages"]
        assert messages[1]["content"] == "Guess my number from 1 to 10 in 3 tries."  # the reset observation
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        hints = [m["content"] for m in messages[2:] if m["role"] == "user"]
        stepped += len(hints)
        assert 1 <= len(turns) <= 3 and len(hints) in (len(turns) - 1, len(turns))
        if episode["finish_reason"] == "done":  # the env ended it: only a correct guess does
            assert episode["reward"] == 1.0
        assert any(_replays(turns, hints, episode["reward"], seed) for seed in TEST_SEEDS)
    assert stepped > 0  # some sampled turns reached the env
