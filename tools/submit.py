"""`submit` and `finish`: the model declares its final answer and ends the episode.

Both record the answer in `ctx.state["answer"]` and set `ctx.state["done"] = True`, which
`ToolEnv` reads to terminate the episode after this turn; the environment's `score` then judges
`ctx.state["answer"]`. They are the same tool under the two names prompts commonly use.
"""

from __future__ import annotations

from agentrl.tools.core import ToolContext, tool

__all__ = ["finish", "submit"]


def _record(ctx: ToolContext, answer: str) -> str:
    ctx.state["answer"] = answer
    ctx.state["done"] = True
    return "Answer submitted; the episode is over."


@tool
def submit(answer: str, ctx: ToolContext) -> str:
    """Submit your final answer and end the task. Call it once, when you are sure.

    Args:
        answer: The final answer, exactly as it should be graded.
    """
    return _record(ctx, answer)


@tool
def finish(answer: str, ctx: ToolContext) -> str:
    """Finish the task with your final answer. Call it once, when you are done.

    Args:
        answer: The final answer or a short summary of the result.
    """
    return _record(ctx, answer)
