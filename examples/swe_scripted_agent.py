"""Play the shipped SWE tasks with two scripted agents: one applies the reference fix, one does nothing.

    python examples/swe_scripted_agent.py                      # every task, local bubblewrap sandbox
    python examples/swe_scripted_agent.py --sandbox docker     # the same in Docker containers
    python examples/swe_scripted_agent.py --limit 3            # the first three tasks only

The fixing agent edits the repository through `str_replace_editor`, one call per hunk of the
instance's reference patch, then calls `submit`; the do-nothing agent submits at once. Both go
through the real environment: a sandbox session per episode, hidden tests copied in at grading.
The fixing agent must resolve every task (reward 1) and the do-nothing agent none (reward 0);
the script exits with status 1 otherwise. To score a model instead, run `agentrl eval env=swe`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentrl.envs.swe import SweEnv, reference_fix_actions
from agentrl.envs.swe_tasks import shipped_tasks, task_row
from agentrl.registry import SANDBOXES
from agentrl.types import Action, ToolCall

DO_NOTHING = [Action("I could not find the problem.", (ToolCall("submit", {"summary": "no change"}, id="c0"),))]


async def play(env: SweEnv, row: dict, actions: list[Action]) -> tuple[float, dict]:
    """One episode: reset on `row`, then the scripted turns until the episode ends."""
    await env.areset(options={"row": row})
    for action in actions:
        _, reward, terminated, truncated, info = await env.astep(action)
        if terminated or truncated:
            return float(reward), info
    raise RuntimeError("the scripted turns ended before the episode did")


async def main(sandbox: str, limit: int | None) -> int:
    tasks = list(shipped_tasks())[:limit]
    backend = SANDBOXES.resolve(sandbox)()  # one sandbox for every episode, as `agentrl run` builds it
    env = SweEnv(sandbox=backend)
    resolved = {"reference fix": 0, "do nothing": 0}
    try:
        for task in tasks:
            row = task_row(task)
            fixed, info = await play(env, row, reference_fix_actions(task))
            idle, _ = await play(env, row, DO_NOTHING)
            resolved["reference fix"] += fixed == 1.0
            resolved["do nothing"] += idle == 1.0
            swe = info["swe"]
            print(f"{task.instance_id:40s} fix: reward {fixed:.1f} "
                  f"(FAIL_TO_PASS {swe['fail_to_pass_passed']}/{swe['fail_to_pass_total']}, "
                  f"PASS_TO_PASS {swe['pass_to_pass_passed']}/{swe['pass_to_pass_total']})  "
                  f"do-nothing: reward {idle:.1f}")
    finally:
        await env.aclose()
        await backend.close()
    n = len(tasks)
    for agent, count in resolved.items():
        print(f"{agent} agent: resolved {count}/{n} (rate {count / n:.2f})")
    return 0 if resolved["reference fix"] == n and resolved["do nothing"] == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandbox", default="local", choices=["local", "docker"], help="sandbox backend")
    parser.add_argument("--limit", type=int, default=None, help="play only the first N tasks")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.sandbox, args.limit)))
