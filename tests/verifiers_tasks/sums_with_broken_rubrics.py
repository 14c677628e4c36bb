"""A verifiers taskset for the `env=verifiers` tests, written as verifiers' docs show: sums scored by a
`@vf.reward` and a `@vf.metric`, one whose reward kills the process scoring it (SIGKILL: the worker
dies mid-episode), one whose reward raises and one whose reward hangs (the episode must be masked as
infrastructure, never scored 0)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["SumsTaskset"]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        if task.id == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        if task.id == "raises":
            raise RuntimeError("the grader crashed")
        if task.id == "hangs":
            await asyncio.sleep(3600)
        return float(vf.extract_boxed_answer(trace.last_reply, strict=True) == task.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsTaskset(vf.Taskset[SumTask]):
    def load(self) -> Iterable[SumTask]:
        for name, a, b in (("dies", 6, 6), ("right", 2, 3), ("wrong", 4, 4), ("raises", 1, 1), ("hangs", 5, 5)):
            yield SumTask(SumData(id=name, prompt=f"Task {name}: what is {a} + {b}?", answer=str(a + b),
                                  system_prompt="Box the answer."), self.config.task)
