"""The example OpenEnv guess server (examples/openenv_guess_server.py), except that an episode reset
with seed 13 kills its own server process (SIGKILL) at the first step: a server dying mid-episode.

It serves OpenEnv's HTTP and WebSocket protocol only, without OpenEnv's optional web interface: the
tests start it once per episode, and `openenv.core` imports gradio for that interface whenever gradio
is installed (about 5 s of CPU a start, most of the server's start-up), though nothing here serves it.
OpenEnv itself goes on without it when gradio is missing, which is what a `None` in `sys.modules` reads as."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]  # see the module docstring

import openenv_guess_server as example  # noqa: E402 (after the two lines above)
from openenv.core.env_server.http_server import create_app  # noqa: E402

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
