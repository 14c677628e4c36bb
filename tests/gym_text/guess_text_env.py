"""A Gymnasium text environment written the way Gymnasium's docs show (an `Env` subclass with
`spaces.Text` observation and action spaces, registered by id), for the `env=gym` tests: guess a
number from 1 to 10, "higher"/"lower" hints, reward 1.0 for a correct guess, three guesses at most."""

from __future__ import annotations

import re
import string
from typing import Any, ClassVar

import gymnasium as gym
from gymnasium import spaces

ID = "GuessText-v0"


class GuessTextEnv(gym.Env):
    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, max_guesses: int = 3) -> None:
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=2000, charset=string.printable)
        self.max_guesses = max_guesses
        self._secret = 0
        self._guesses = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self._secret = int(self.np_random.integers(1, 11))
        self._guesses = 0
        return f"Guess my number from 1 to 10 in {self.max_guesses} tries.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self._guesses += 1
        found = re.search(r"-?\d+", action)
        guess = int(found.group()) if found else None
        info = {"guesses": self._guesses}
        if guess == self._secret:
            return "correct", 1.0, True, False, info
        hint = "not a number" if guess is None else ("higher" if guess < self._secret else "lower")
        return hint, 0.0, False, self._guesses >= self.max_guesses, info


gym.register(id=ID, entry_point=GuessTextEnv)
