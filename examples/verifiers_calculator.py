"""A verifiers taskset (PyPI `verifiers` 0.4, its `verifiers.v1` API) whose tasks come with a tool: a
calculator MCP server written as verifiers' `vf.Toolset`, the way its built-in Harbor and NeMo Gym
toolsets are. `agentrl eval env=verifiers` runs it, and `agentrl run` trains on it:

    agentrl eval env=verifiers env.kwargs.id=examples/verifiers_calculator.py

Each task asks for the product of two numbers. verifiers starts the task's `CalculatorToolset` as an MCP
server for the episode, lists its tool (`calculator_multiply`) to the model in each chat request, and
runs it when the model calls it; the tool's result is the next message the model reads. The reward
is 1.0 when the final reply holds the product; the metric `tool_calls` counts the tool's answers.

verifiers starts a toolset by running its module (`python -m MODULE`), so the module ends with the
`if __name__ == "__main__"` block below, as verifiers' own toolsets do (without it nothing would
serve: env=verifiers refuses such a taskset when it loads). Nothing here knows agentrl.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["CalculatorTask", "CalculatorTaskset", "CalculatorToolset"]

SYSTEM_PROMPT = "Use the calculator_multiply tool to multiply, then reply with the product only."


def read_number(reply: str) -> int | None:
    """The last whole number of a reply (thousands separators allowed), or None."""
    found = re.findall(r"-?\d[\d,]*", reply)
    return int(found[-1].replace(",", "")) if found else None


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calculator"

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two whole numbers and return the product."""
        return a * b


class CalculatorData(vf.TaskData):
    a: int
    """The first factor."""
    b: int
    """The second factor."""


class CalculatorTask(vf.Task[CalculatorData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        return float(read_number(trace.last_reply or "") == task.a * task.b)

    @vf.metric
    async def tool_calls(self, task: CalculatorData, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalculatorTaskset(vf.Taskset[CalculatorTask]):
    def load(self) -> Iterable[CalculatorTask]:
        rng = random.Random(0)
        for i in range(20):
            a, b = rng.randint(100, 9999), rng.randint(100, 9999)
            yield CalculatorTask(CalculatorData(id=f"multiply-{i}", a=a, b=b, system_prompt=SYSTEM_PROMPT,
                                                prompt=f"What is {a} times {b}?"), self.config.task)


if __name__ == "__main__":  # verifiers starts the tool server as `python -m` this module
    CalculatorToolset.run()
