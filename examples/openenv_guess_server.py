"""An OpenEnv environment server, written the way OpenEnv's docs show (`openenv init`'s template):
a number-guessing game that `agentrl eval env=openenv` plays over OpenEnv's protocol.

    python examples/openenv_guess_server.py --port 8000          # serve it; then, elsewhere:
    agentrl eval env=openenv env.kwargs.url=http://127.0.0.1:8000

    # or let agentrl start it for each episode (and stop it after):
    agentrl eval env=openenv 'env.kwargs.command=[python, examples/openenv_guess_server.py, --port, "{port}"]'

The secret is a number from 1 to 10 drawn from the reset seed; each action is a guess (`message`,
free text: its first integer counts), and the observation says "higher", "lower" or "correct".
The episode ends with reward 1.0 on a correct guess, or 0.0 after four wrong ones. Nothing here
knows agentrl: it is a plain OpenEnv `Environment` served by `create_app`.
"""

from __future__ import annotations

import argparse
import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 4


class GuessAction(Action):
    """A guess: free text whose first integer is the number guessed."""

    message: str = Field(..., description="Your guess, e.g. '7'")


class GuessObservation(Observation):
    """What the game says: the rules at reset, then higher / lower / correct."""

    text: str = Field(default="", description="The game's answer")


class GuessEnvironment(Environment):
    """Guess a number from 1 to 10 in at most four tries (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, 10)
        return GuessObservation(text=f"I picked a number from 1 to 10. Guess it: answer with one number. "
                                     f"You have {MAX_GUESSES} tries.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        found = re.search(r"-?\d+", action.message)
        guess = int(found.group()) if found else None
        if guess == self._secret:
            return GuessObservation(text="correct", done=True, reward=1.0)
        out_of_tries = self._state.step_count >= MAX_GUESSES
        hint = "not a number" if guess is None else ("higher" if guess < self._secret else "lower")
        return GuessObservation(text=hint, done=out_of_tries, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
