"""The example OpenEnv guess server (examples/openenv_guess_server.py), except that an episode reset
with seed 13 kills its own server process (SIGKILL) at the first step: a server dying mid-episode."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import openenv_guess_server as example
from openenv.core.env_server.http_server import create_app

DYING_SEED = 13


class DyingGuessEnvironment(example.GuessEnvironment):
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> example.GuessObservation:
        self.dies = seed == DYING_SEED
        return super().reset(seed=seed, episode_id=episode_id, **kwargs)

    def step(self, action: example.GuessAction, timeout_s: float | None = None, **kwargs: Any) -> example.GuessObservation:  # type: ignore[override]
        if getattr(self, "dies", False):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action, timeout_s=timeout_s, **kwargs)


example.app = create_app(DyingGuessEnvironment, example.GuessAction, example.GuessObservation, env_name="guess",
                         max_concurrent_envs=64)

if __name__ == "__main__":
    example.main()
