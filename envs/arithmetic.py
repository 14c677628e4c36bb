"""`arithmetic`: multi-step arithmetic problems that a small model solves with a calculator tool.

The smallest complete environment in agentrl, and the reference implementation of the `ToolEnv`
contract: each task is an expression over multi-digit integers ("Compute (4821 * 367) - 9124"),
generated from the reset seed or read from a verl-format dataset row. The agent may call the
`calculator` tool any number of times and must end with a final answer in `\\boxed{...}` (its rows'
data source, `agentrl/arithmetic`, also accepts the last number when nothing is boxed); the reward
is 1.0 when that answer equals the exact value, else 0.0. The reward comes from `reward_fn` (verl's
signature, see `agentrl.envs.rewards`; the run passes `reward.function`), by default
`rewards.compute_score`, which chooses the answer format by the row's `data_source`, so GSM8K or
DAPO-Math rows are scored in their own formats; with `reward.judge`, `reward.model` or
`reward.combine` it is the run's combined reward (`agentrl.envs.reward_sources`), whose record
goes into the trajectory's `info["reward"]`. It needs no sandbox and no network.
"""

from __future__ import annotations

import random
from typing import Any

from agentrl.envs.reward_sources import ascore_row
from agentrl.envs.rewards import RewardFn, RewardResult, compute_score, score_row
from agentrl.envs.tool_env import ToolEnv
from agentrl.tools.calculator import calculator, evaluate_expression, format_number
from agentrl.tools.core import ToolContext

__all__ = ["ArithmeticEnv", "make_arithmetic_row"]

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for every computation, "
    "then give the final answer as \\boxed{NUMBER}."
)
DATA_SOURCE = "agentrl/arithmetic"


def make_arithmetic_row(seed: int, *, num_terms: int = 3, digits: int = 4) -> dict[str, Any]:
    """A verl-format dataset row for one problem, fully determined by `seed`."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    expr = str(rng.randint(lo, hi))
    for i in range(num_terms - 1):
        op = rng.choice(["+", "-", "*"] if i else ["*"])
        operand = rng.randint(lo, hi) if op != "*" else rng.randint(11, 10 ** max(2, digits - 1))
        expr = f"({expr} {op} {operand})" if i < num_terms - 2 else f"{expr} {op} {operand}"
    answer = format_number(evaluate_expression(expr))
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Compute {expr}."},
        ],
        "data_source": DATA_SOURCE,
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"seed": seed, "expression": expr},
    }


class ArithmeticEnv(ToolEnv):
    """Arithmetic word problems with a calculator tool (see the module docstring)."""

    recorded_info = ("reward",)
    """A combined reward's record (each source's score; a judge's request and verdict)."""

    def __init__(self, *, max_turns: int = 6, num_terms: int = 3, digits: int = 4,
                 tool_timeout_s: float = 10.0, reward_fn: RewardFn | None = None) -> None:
        super().__init__([calculator], max_turns=max_turns, tool_timeout_s=tool_timeout_s)
        self.num_terms = num_terms
        self.digits = digits
        self.reward_fn: RewardFn = reward_fn if reward_fn is not None else compute_score

    @classmethod
    def dataset_rows(cls, split: str, n: int = 200) -> list[dict[str, Any]]:
        """`n` generated rows; train and test use disjoint seed ranges."""
        offset = {"train": 0, "test": 1_000_000}[split]
        return [make_arithmetic_row(offset + i) for i in range(n)]

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        return make_arithmetic_row(seed or 0, num_terms=self.num_terms, digits=self.digits)

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return self._keep(score_row(self.reward_fn, row, final_text, default_data_source=DATA_SOURCE), ctx)

    async def ascore(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return self._keep(await ascore_row(self.reward_fn, row, final_text, default_data_source=DATA_SOURCE), ctx)

    def _keep(self, result: RewardResult, ctx: ToolContext) -> float:
        ctx.state["score_info"] = {"metrics": result.metrics(), "reward_extra": result.extra}
        if result.record:
            ctx.state["score_info"]["reward"] = result.record
        return result.score
