"""A multi-turn verifiers taskset (PyPI `verifiers` 0.4, its `verifiers.v1` API), written the way its
built-in games (`verifiers.v1.tasksets.textarena`) are: a `Taskset` of tasks with a `@vf.reward`, and
a `vf.Env` whose `run(task, agents)` plays each episode, the game answering every move of the
player's `interaction` as its user. `agentrl eval env=verifiers` runs it, and `agentrl run` trains on it:

    agentrl eval env=verifiers env.kwargs.id=examples/verifiers_guess.py

The player guesses a secret number from 1 to 100 and is told "higher" or "lower" after each guess,
for at most `MAX_GUESSES` guesses. The reward is 1.0 when some guess was the secret; the metric
`guesses` counts the guesses made. Nothing here knows agentrl: verifiers plays the episode in
env=verifiers' worker process, and the player's model calls reach agentrl's gateway, which
generates them with the policy and records them as the episode's trajectory.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]

MAX_GUESSES = 4
SYSTEM_PROMPT = "You play a guessing game. Reply with one whole number only."


def read_guess(reply: str) -> int | None:
    """The first whole number of a reply, or None."""
    found = re.search(r"-?\d+", reply)
    return int(found.group()) if found else None


def feedback(guess: int | None, secret: int) -> str:
    """What the game says to a guess that is not the secret."""
    if guess is None:
        return "That is not a number. Guess again."
    return f"{guess} is too low. Guess higher." if guess < secret else f"{guess} is too high. Guess lower."


class GuessData(vf.TaskData):
    secret: int
    """The number to guess."""


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        return float(any(read_guess(m.content or "") == task.secret for m in trace.assistant_messages))

    @vf.metric
    async def guesses(self, task: GuessData, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        secret = task.data.secret
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()  # the prompt opens the game: the player moves first
            for _ in range(MAX_GUESSES - 1):
                guess = read_guess(segment.last_reply)
                if segment.terminated or guess == secret:
                    break
                segment = await interaction.turn(feedback(guess, secret))


class GuessTaskset(vf.Taskset[GuessTask]):
    def load(self) -> Iterable[GuessTask]:
        rng = random.Random(0)
        for i in range(20):
            yield GuessTask(GuessData(id=f"guess-{i}", secret=rng.randint(1, 100), system_prompt=SYSTEM_PROMPT,
                                      prompt=f"I think of a number from 1 to 100. You have {MAX_GUESSES} guesses."),
                            self.config.task)
