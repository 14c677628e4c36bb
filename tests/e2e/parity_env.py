"""A one-turn env for the end-to-end tests: a random tiny model earns reward 1 for an even-length answer.

With a random policy about half the answers are rewarded, so every GRPO group has reward
variance and every step has a real gradient, which a task the tiny model cannot solve would not.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.tool_env import ToolEnv
from agentrl.tools.core import ToolContext

__all__ = ["ParityEnv"]


class ParityEnv(ToolEnv):
    """Answer anything; the reward is 1.0 when the answer has an even number of characters."""

    def __init__(self, max_turns: int = 1) -> None:
        super().__init__([], max_turns=max_turns)

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        n = 40 if split == "train" else 4
        return [
            {"prompt": [{"role": "user", "content": f"Say something about the number {split}-{i}."}],
             "data_source": "parity", "reward_model": {"style": "rule", "ground_truth": "even"}}
            for i in range(n)
        ]

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        rows = self.dataset_rows("train")
        return rows[(seed or 0) % len(rows)]

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return 1.0 if len(final_text) % 2 == 0 else 0.0
