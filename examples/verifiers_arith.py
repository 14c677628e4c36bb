"""A verifiers taskset (PyPI `verifiers` 0.4, its `verifiers.v1` API), written the way its docs show:
`TaskData` rows, a `Task` with a `@vf.reward`, a `Taskset` whose `load()` yields the tasks, exported
by `__all__`. `agentrl eval env=verifiers` runs it with agentrl generating every turn:

    agentrl eval env=verifiers env.kwargs.id=examples/verifiers_arith.py

Each task asks for a sum in `\\boxed{}`; the reward is 1.0 when the model's last reply boxes it.
Nothing here knows agentrl, and agentrl's process never imports it: it runs in env=verifiers' worker
process, over verifiers installed in a folder of its own (`bash scripts/install.sh verifiers`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]

SYSTEM_PROMPT = "Answer with the result only, as \\boxed{NUMBER}."


class ArithData(vf.TaskData):
    answer: str
    """The exact sum."""


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return float(vf.extract_boxed_answer(trace.last_reply, strict=True) == task.answer)


class ArithTaskset(vf.Taskset[ArithTask]):
    def load(self) -> Iterable[ArithTask]:
        rng = random.Random(0)
        for i in range(20):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield ArithTask(ArithData(id=f"sum-{i}", prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT,
                                      answer=str(a + b)), self.config.task)
