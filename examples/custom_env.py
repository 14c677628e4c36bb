"""Write your own environment: a tool-using env in ~30 lines, checked and played by a scripted agent.

    python examples/custom_env.py

A `ToolEnv` subclass gives the first messages (from a dataset row), the tools and the reward;
agentrl handles tool calls, errors, per-episode lifecycle and the Gymnasium API.
"""

from __future__ import annotations

from typing import Any

import agentrl
from agentrl.envs import ToolEnv, check_env
from agentrl.tools import ToolContext
from agentrl.types import Action, ToolCall


@agentrl.tool
def lookup_capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's English name, e.g. "France".
    """
    capitals = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi"}
    try:
        return capitals[country.strip().lower()]
    except KeyError:
        raise ValueError(f"No capital known for {country!r}; try one of {sorted(capitals)}.") from None


@agentrl.register_env("capitals")
class CapitalsEnv(ToolEnv):
    """Answer "what is the capital of X?" using the lookup tool."""

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__([lookup_capital], max_turns=max_turns)

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        country, capital = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi")][(seed or 0) % 3]
        return {"prompt": f"What is the capital of {country}?", "reward_model": {"ground_truth": capital}}

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return float(row["reward_model"]["ground_truth"].lower() in final_text.lower())


def main() -> float:
    env = agentrl.make_env("capitals")
    check_env(env)  # the same conformance check every built-in env passes
    obs, info = env.reset(seed=1)
    print("prompt:", obs[0]["content"], "| tools:", [t["function"]["name"] for t in info["tools"]])
    call = ToolCall("lookup_capital", {"country": "Japan"}, id="call_0")
    obs, _, _, _, _ = env.step(Action("Let me look it up.", (call,)))
    print("tool said:", obs[0]["content"])
    obs, reward, done, _, info = env.step(Action(f"The capital is {obs[0]['content']}."))
    print(f"reward={reward} done={done} metrics={info['metrics']}")
    env.close()
    return reward


if __name__ == "__main__":
    main()
