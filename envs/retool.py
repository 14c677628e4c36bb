"""`retool`: math problems solved with a Python interpreter running in a sandbox (the ReTool recipe).

The agent gets a math question and the `python` tool, which runs its code in the run's sandbox
(`config.sandbox`, passed to the constructor as `sandbox`; the local bubblewrap sandbox by default:
no network, bounded time and memory) and shows what it printed. It may
call the tool several times and ends with `\\boxed{answer}`. The reward is `reward_fn`'s score of the
final reply against the row's `reward_model.ground_truth` (verl's signature, see
`agentrl.envs.rewards`; the run passes `reward.function`). The default, `rewards.compute_score`,
gives 1.0 when the answer in the row's `data_source` format (the shipped rows: `\\boxed{}`; DAPO
rows: `Answer:`; GSM8K rows: `####`) matches (exact rational equality, or symbolic equivalence
through math-verify), else 0.0; with `reward.judge`, `reward.model` or `reward.combine` it is the
run's combined reward (`agentrl.envs.reward_sources`; its record goes into the trajectory's
`info["reward"]`). Optional shaping for a wrong answer: with `format_reward` > 0 a
well-formed final answer (one the source's format finds) earns that much, and with `tool_reward` >
0 a well-formed answer after code that ran without error at least once earns that much (the
larger applies, and never lowers the function's own score; a correct answer earns 1.0). Shaping
without the final answer was tried and backfired: the 135M model learned to run correct code and
then stopped writing `\\boxed{}`. Only a reward of 1.0 counts as solved in evaluations.

Two ways to call the tool (`tool_format`):
- `function` (default): the tool's schema is in the prompt (the chat template lists it) and the
  model calls it with the family's function-call syntax (`<tool_call>` JSON for Qwen/ChatML; use
  the `hermes` parser).
- `code`: the ReTool style. No schema; the system prompt asks for a ```` ```python ```` block, which
  runs and whose output comes back as the tool message (use the `retool` parser). With
  `few_shot=N` the prompt starts with N short worked conversations showing the protocol (code,
  output, boxed answer). This is how the 135M default model is trained on a CPU: it cannot emit
  tool-call JSON reliably, but it can write a code block after one example. The demonstrations
  are prompt tokens, never trained on, and the same for every problem.

Rows use verl's format, so DAPO-Math or AIME parquet files work unchanged. Without a row,
`reset(seed=s)` picks a problem of the shipped synthetic set (`agentrl.envs.retool_data`), from
its `train` split by default. The environment does not decide how many turns or tokens an episode
may take beyond `max_turns`; the AgentLoop's budgets do.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any, Literal

from agentrl.envs.retool_data import shipped_path
from agentrl.envs.reward_sources import ascore_row
from agentrl.envs.rewards import RewardFn, RewardResult, answer_format, compute_score, score_row
from agentrl.envs.tool_env import ToolEnv
from agentrl.tools.core import ToolContext
from agentrl.tools.python import PythonTool
from agentrl.types import Message, ToolSchema

__all__ = ["CODE_SYSTEM_PROMPT", "FEW_SHOT_EXAMPLES", "RetoolEnv", "shipped_rows"]

CODE_SYSTEM_PROMPT = (
    "You solve math problems by writing Python. Put code in a ```python block; it runs and you see "
    "what it prints. Then give the final answer as \\boxed{NUMBER}."
)

# (question, code, printed output, final answer) of the worked examples `few_shot` shows.
FEW_SHOT_EXAMPLES: tuple[tuple[str, str, str, str], ...] = (
    ("What is 123 * 45 - 67?", "print(123 * 45 - 67)", "5468", "5468"),
    ("What is the sum of the squares of the integers from 1 to 30?",
     "print(sum(i * i for i in range(1, 30 + 1)))", "9455", "9455"),
    ("What is the remainder when 7^222 is divided by 1000?", "print(pow(7, 222, 1000))", "49", "49"),
)


@cache
def shipped_rows(split: str) -> tuple[dict[str, Any], ...]:
    """The rows of a shipped split ("train" or "test"), read once per process."""
    with shipped_path(split).open() as f:
        return tuple(json.loads(line) for line in f if line.strip())


class RetoolEnv(ToolEnv):
    """Math with a sandboxed Python tool (see the module docstring)."""

    recorded_info = ("reward",)
    """A combined reward's record (each source's score; a judge's request and verdict)."""

    def __init__(
        self,
        *,
        max_turns: int = 4,
        exec_timeout_s: float = 5.0,
        max_output_chars: int = 2000,
        format_reward: float = 0.0,
        split: str = "train",
        tool_timeout_s: float = 30.0,
        tool_format: Literal["function", "code"] = "function",
        few_shot: int = 0,
        tool_reward: float = 0.0,
        sandbox: Any | None = None,
        reward_fn: RewardFn | None = None,
    ) -> None:
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        if not 0.0 <= tool_reward < 1.0:
            raise ValueError(f"tool_reward must be in [0, 1), got {tool_reward}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if tool_format not in ("function", "code"):
            raise ValueError(f"tool_format must be 'function' or 'code', got {tool_format!r}")
        if not 0 <= few_shot <= len(FEW_SHOT_EXAMPLES):
            raise ValueError(f"few_shot must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {few_shot}")
        if few_shot and tool_format != "code":
            raise ValueError("few_shot examples show the code-block protocol; set tool_format='code' too")
        tool = PythonTool(exec_timeout_s=exec_timeout_s, max_output_chars=max_output_chars)
        super().__init__([tool], max_turns=max_turns, tool_timeout_s=tool_timeout_s, sandbox=sandbox)
        self.format_reward = format_reward
        self.split = split
        self.tool_format = tool_format
        self.few_shot = few_shot
        self.tool_reward = tool_reward
        self.reward_fn: RewardFn = reward_fn if reward_fn is not None else compute_score

    @classmethod
    def dataset_rows(cls, split: str) -> list[dict[str, Any]]:
        """The shipped synthetic rows of `split` ("train" or "test"), for runs given no data files."""
        return list(shipped_rows(split))

    def initial_messages(self, row: dict[str, Any]) -> list[Message]:
        messages = super().initial_messages(row)
        if self.tool_format == "function":
            return messages
        out: list[Message] = [{"role": "system", "content": CODE_SYSTEM_PROMPT}]
        for question, code, printed, answer in FEW_SHOT_EXAMPLES[: self.few_shot]:
            out += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"```python\n{code}\n```"},
                {"role": "tool", "content": printed},
                {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
            ]
        return out + [m for m in messages if m.get("role") != "system"]

    def prompt_tools(self) -> list[ToolSchema]:
        if self.tool_format == "code":
            return []  # the prompt describes the code block; no schema to render
        return super().prompt_tools()

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        rows = shipped_rows(self.split)
        return rows[(seed or 0) % len(rows)]

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return self._shaped(score_row(self.reward_fn, row, final_text), final_text, row, ctx)

    async def ascore(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return self._shaped(await ascore_row(self.reward_fn, row, final_text), final_text, row, ctx)

    def _shaped(self, result: RewardResult, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        ctx.state["score_info"] = {"metrics": result.metrics(), "reward_extra": result.extra}
        if result.record:
            ctx.state["score_info"]["reward"] = result.record
        if result.score >= 1.0 or not (self.format_reward or self.tool_reward):
            return result.score
        if answer_format(row.get("data_source")).extract(final_text) is None:
            return result.score  # shaping only ever rewards a well-formed final answer
        ran_code = self._metrics.get("tool_calls", 0) > self._metrics.get("tool_errors_model", 0) + self._metrics.get(
            "tool_errors_infra", 0)
        return max(result.score, self.tool_reward if ran_code else 0.0, self.format_reward)
