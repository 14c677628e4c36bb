"""`gym`: a Gymnasium text environment, registered by id, played as an agentrl episode.

    agentrl eval env=gym env.kwargs.id=my_games:Wordle-v0          # "module:Id" imports the module first
    agentrl eval env=gym env.kwargs.id=Wordle-v0 'env.kwargs.make_kwargs={max_guesses: 6}'

Any environment `gymnasium.make(id)` builds whose observations and actions are strings: the reset
observation is the first user message (after `system_prompt` and the row's `prompt`), each
assistant turn's text is the action given to `step`, and each step's observation is the next user
message; rewards are summed and the episode ends when the env terminates or truncates. agentrl
generates the turns itself (token in, token out); the Gymnasium env only sees text. Numbers in the
last step's `info` are kept as the trajectory's metrics. A non-string observation is refused with a
message (this adapter is for text environments), and an env whose declared observation space is not
`spaces.Text` is refused when it is built, before any episode. An exception raised by the env is recorded by the
AgentLoop as an infrastructure fault (masked), never as a reward of 0.

Rows: the env makes its own (`dataset_rows`: one per seed); rows of yours may carry
`extra_info.seed` and `extra_info.reset_options` (passed to the env's `reset`).
"""

from __future__ import annotations

from typing import Any, ClassVar, SupportsFloat

import gymnasium
from gymnasium.envs.registration import _find_spec  # gymnasium.make's own lookup: imports "module:" first

from agentrl.envs.core import Env
from agentrl.errors import ConfigError, EnvError
from agentrl.types import Action, Message

__all__ = ["GymTextEnv", "seed_row", "seed_rows"]

DEFAULT_INSTRUCTIONS = (
    "You are playing a text game. Each user message is what the game shows you; answer with your next move only."
)


def seed_row(seed: int, data_source: str, instructions: str) -> dict[str, Any]:
    """A row that resets an env which draws its task at reset (Gymnasium, OpenEnv) with `seed`."""
    return {"prompt": [{"role": "user", "content": instructions}], "data_source": data_source,
            "extra_info": {"seed": seed}}


def seed_rows(split: str, data_source: str, instructions: str, n: int = 200) -> list[dict[str, Any]]:
    """`n` seed rows of `split`, train and test disjoint."""
    offset = {"train": 0, "test": 1_000_000}[split]
    return [seed_row(offset + i, data_source, instructions) for i in range(n)]


class GymTextEnv(Env):
    """A Gymnasium text environment by registered id (see the module docstring)."""

    requires_ground_truth: ClassVar[bool] = False

    def __init__(self, *, id: str, make_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None,
                 instructions: str = DEFAULT_INSTRUCTIONS) -> None:
        if not isinstance(id, str) or not id:
            raise ConfigError("env=gym needs env.kwargs.id: a registered Gymnasium id, e.g. 'my_pkg.games:Guess-v0'.")
        try:
            # gymnasium imports "module:Id" modules here, so an unknown id is found before any episode
            spec = _find_spec(id)
        except gymnasium.error.Error as exc:
            raise ConfigError(
                f"env.kwargs.id '{id}' is not a registered Gymnasium environment ({exc}). Register it with "
                "gymnasium.register(id=..., entry_point=...) in a module and name it as 'module:Id'."
            ) from exc
        except ImportError as exc:
            raise ConfigError(f"env.kwargs.id '{id}': the module that registers it cannot be imported: {exc}") from exc
        self.id = id
        self.spec_id = spec.id
        self.make_kwargs = dict(make_kwargs or {})
        self.system_prompt = system_prompt
        self.instructions = instructions
        try:
            self._inner: gymnasium.Env | None = gymnasium.make(id, **self.make_kwargs)
        except TypeError as exc:
            raise ConfigError(f"env.kwargs.make_kwargs {sorted(self.make_kwargs)} do not fit '{id}': {exc}") from exc
        space = self._inner.observation_space
        if space is not None and not isinstance(space, gymnasium.spaces.Text):
            self._inner.close()
            raise ConfigError(
                f"env.kwargs.id '{id}' observes a {type(space).__name__} space, not text: env=gym plays text "
                "environments (string observations and actions). Wrap it to render its observations as text "
                "(a gymnasium.ObservationWrapper with a spaces.Text observation space)."
            )
        self._open = False

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        """One row per seed (train and test disjoint): Gymnasium envs draw their task at reset."""
        return seed_rows(split, "gym", DEFAULT_INSTRUCTIONS)

    @staticmethod
    def make_row(seed: int, instructions: str | None = None) -> dict[str, Any]:
        """A row that resets the env with `seed`."""
        return seed_row(seed, "gym", instructions or DEFAULT_INSTRUCTIONS)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        row = (options or {}).get("row") or self.make_row(seed or 0, self.instructions)
        extra = row.get("extra_info") or {}
        episode_seed = extra.get("seed", seed)
        if self._inner is None:
            self._inner = gymnasium.make(self.id, **self.make_kwargs)
        observation, _ = self._inner.reset(
            seed=None if episode_seed is None else int(episode_seed), options=extra.get("reset_options"))
        self._open = True
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif isinstance(prompt, list):
            messages.extend(dict(m) for m in prompt)  # type: ignore[misc]  # a plain copy of each TypedDict message
        messages.append({"role": "user", "content": self._text(observation)})
        return messages, {"tools": [], "seed": episode_seed}

    def step(self, action: Action) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        if self._inner is None or not self._open:
            raise EnvError("GymTextEnv.step was called without an open episode; call reset first.")
        if not isinstance(action, Action):
            raise EnvError(f"step expects an agentrl.types.Action, got {type(action).__name__}.")
        observation, reward, terminated, truncated, inner_info = self._inner.step(action.text)
        if terminated or truncated:
            self._open = False
        metrics = {k: float(v) for k, v in (inner_info or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        info: dict[str, Any] = {"metrics": metrics}
        if truncated and not terminated:
            info["truncated_by"] = f"{self.spec_id} truncated the episode"
        return ([{"role": "user", "content": self._text(observation)}], float(reward), bool(terminated),
                bool(truncated), info)

    def close(self) -> None:
        inner, self._inner = self._inner, None
        self._open = False
        if inner is not None:
            inner.close()
        super().close()

    def _text(self, observation: Any) -> str:
        if not isinstance(observation, str):
            raise EnvError(
                f"the Gymnasium env '{self.id}' returned a {type(observation).__name__} observation; env=gym plays "
                "text environments (string observations and actions) only. Wrap yours to render its observations "
                "as text (a gymnasium.ObservationWrapper)."
            )
        return observation
