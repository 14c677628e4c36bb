"""`retool`: math problems solved with a Python interpreter running in a sandbox (the ReTool recipe).

The agent gets a math question and the `python` tool, which runs its code in the sandbox (the
default `LocalSandbox`: no network, bounded time and memory) and shows what it printed. It may
call the tool several times and ends with `\\boxed{answer}`. The reward is 1.0 when the answer
matches the row's `reward_model.ground_truth` (exact rational equality, or symbolic equivalence
through math-verify when installed), else 0.0; with `format_reward` > 0 a wrong but well-formed
boxed answer earns that much (optional format shaping).

Rows use verl's format, so DAPO-Math or AIME parquet files work unchanged. Without a row,
`reset(seed=s)` picks a problem of the shipped synthetic set (`agentrl.envs.retool_data`), from
its `train` split by default. The environment does not decide how many turns or tokens an episode
may take beyond `max_turns`; the AgentLoop's budgets do.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from agentrl.envs.answers import answers_match, extract_boxed
from agentrl.envs.retool_data import shipped_path
from agentrl.envs.tool_env import ToolEnv
from agentrl.tools.core import ToolContext
from agentrl.tools.python import PythonTool

__all__ = ["RetoolEnv", "shipped_rows"]


@cache
def shipped_rows(split: str) -> tuple[dict[str, Any], ...]:
    """The rows of a shipped split ("train" or "test"), read once per process."""
    with shipped_path(split).open() as f:
        return tuple(json.loads(line) for line in f if line.strip())


class RetoolEnv(ToolEnv):
    """Math with a sandboxed Python tool (see the module docstring)."""

    def __init__(
        self,
        *,
        max_turns: int = 4,
        exec_timeout_s: float = 5.0,
        max_output_chars: int = 2000,
        format_reward: float = 0.0,
        split: str = "train",
        tool_timeout_s: float = 30.0,
    ) -> None:
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        tool = PythonTool(exec_timeout_s=exec_timeout_s, max_output_chars=max_output_chars)
        super().__init__([tool], max_turns=max_turns, tool_timeout_s=tool_timeout_s)
        self.format_reward = format_reward
        self.split = split

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        """The shipped synthetic rows of `split` ("train" or "test"), for runs given no data files."""
        return list(shipped_rows(split))

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        rows = shipped_rows(self.split)
        return rows[(seed or 0) % len(rows)]

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        truth = str((row.get("reward_model") or {}).get("ground_truth", ""))
        answer = extract_boxed(final_text)
        if answer is None or not truth:
            return 0.0
        if answers_match(answer, truth):
            return 1.0
        return self.format_reward
