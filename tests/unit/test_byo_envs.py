"""Environments of other standards as agentrl envs, without a model: `env=gym` plays a Gymnasium
text env written as Gymnasium's docs show (check_env, rewards, ends, refusals), and `env=openenv`
refuses configurations that cannot work before any episode starts."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from agentrl.envs import check_env, make_env
from agentrl.errors import ConfigError, EnvError
from agentrl.types import Action

GUESS_ID = "gym_text.guess_text_env:GuessText-v0"  # tests/gym_text: tests/ is on sys.path (its conftest)


@pytest.fixture
def guess_id() -> str:
    return GUESS_ID


def _secret(seed: int) -> int:
    return int(np.random.default_rng(seed).integers(1, 11))  # what GuessTextEnv draws at reset(seed)


def test_a_gymnasium_text_env_passes_check_env(guess_id: str) -> None:
    check_env(make_env("gym", id=guess_id))


def test_a_gymnasium_text_env_is_played_turn_by_turn_with_its_rewards(guess_id: str) -> None:
    env = make_env("gym", id=guess_id, system_prompt="Play well.")
    row = {"prompt": "Seed 5.", "extra_info": {"seed": 5}}
    messages, info = env.reset(options={"row": row})
    assert messages == [{"role": "system", "content": "Play well."}, {"role": "user", "content": "Seed 5."},
                        {"role": "user", "content": "Guess my number from 1 to 10 in 3 tries."}]
    assert info["tools"] == []
    wrong = 1 if _secret(5) != 1 else 2
    obs, reward, terminated, truncated, step_info = env.step(Action(f"I guess {wrong}"))
    assert (obs, reward, terminated, truncated) == ([{"role": "user", "content": "higher" if wrong < _secret(5)
                                                      else "lower"}], 0.0, False, False)
    assert step_info["metrics"] == {"guesses": 1.0}
    assert env.step(Action(str(_secret(5))))[1:4] == (1.0, True, False)
    with pytest.raises(EnvError, match="call reset first"):
        env.step(Action("3"))
    env.reset(options={"row": row})
    for _ in range(2):
        assert env.step(Action("11"))[1:4] == (0.0, False, False)
    obs, reward, terminated, truncated, step_info = env.step(Action("11"))
    assert (reward, terminated, truncated) == (0.0, False, True)  # the env's own limit: truncated, reward measured
    assert "truncated the episode" in step_info["truncated_by"]
    env.close()
    env.close()


def test_gym_refuses_an_unknown_id_and_non_text_observations(guess_id: str) -> None:
    with pytest.raises(ConfigError, match="not a registered Gymnasium environment"):
        make_env("gym", id="NoSuchGame-v9")
    with pytest.raises(ConfigError, match="cannot be imported"):
        make_env("gym", id="no_such_module_anywhere:Game-v0")
    with pytest.raises(ConfigError, match="observes a Box space, not text"):
        make_env("gym", id="CartPole-v1")
    with pytest.raises(ConfigError, match="do not fit"):
        make_env("gym", id=guess_id, make_kwargs={"no_such_argument": 1})


def test_openenv_refuses_configurations_that_cannot_work() -> None:
    if importlib.util.find_spec("openenv") is None:  # importing it takes seconds (gradio): only look
        pytest.skip("openenv-core is not installed")
    with pytest.raises(ConfigError, match="exactly one of env.kwargs.url"):
        make_env("openenv")
    with pytest.raises(ConfigError, match="exactly one of env.kwargs.url"):
        make_env("openenv", url="http://127.0.0.1:1", command=["python", "s.py", "{port}"])
    with pytest.raises(ConfigError, match="no '\\{port\\}' placeholder"):
        make_env("openenv", command=["python", "server.py"])
    with pytest.raises(ConfigError, match="is not an http"):
        make_env("openenv", url="127.0.0.1:8000")
    with pytest.raises(ConfigError, match="env.kwargs.cwd .* is the directory env.kwargs.command runs in"):
        make_env("openenv", url="http://127.0.0.1:1", cwd="/tmp")
    with pytest.raises(ConfigError, match="'/no/such/dir' is not a directory"):
        make_env("openenv", command=["python", "-m", "uvicorn", "server.app:app", "--port", "{port}"],
                 cwd="/no/such/dir")
