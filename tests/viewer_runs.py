"""Run directories for the viewer's tests, made of real ledgers without a model.

`tool_episode` delta-tokenises a tool-calling episode with the real Qwen2.5 chat template exactly
as the AgentLoop does (a calculator call, its result, the final answer); `make_run_dir` writes what
`agentrl run` writes for three steps around such episodes: `metrics.jsonl`, `eval.jsonl`, kept
rollouts through the real `RolloutLog` (a trained group, a filtered one, an infrastructure-failed
one) and an evaluation through `write_eval_trajectories`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.types import FinishReason, Generation, ToolResult, Trajectory

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
QWEN25 = ASSETS / "qwen2.5-0.5b-instruct"

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]  # fmt: skip


def tool_episode(template: ChatTemplate, *, reward: float = 1.0, version: int = 2, episode_id: str = "ep",
                 group_id: str = "g", fault: str | None = None, answer: str = "84",
                 result: str = "84") -> Trajectory:
    """A two-turn episode: a calculator call (sampled), its result (tool), the final answer (sampled)."""
    from agentrl.registry import TOOL_PARSERS

    parser = TOOL_PARSERS.resolve("hermes")()
    conv = ConversationTokenizer(template, Trajectory(episode_id=episode_id, group_id=group_id, data_source="calc"))
    conv.start([{"role": "user", "content": "What is 12*7? Schöne Grüße"}], TOOLS)
    first = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    ids = [*template.encode(first), template.closing_ids[0]]
    action = parser.parse(template.decode_turn(ids))
    conv.add_generation(Generation(ids, [-0.25 - 0.2 * i for i in range(len(ids))], "stop", version),
                        action.to_message())
    conv.add_messages([ToolResult(result, None, "calculator", action.tool_calls[0].id).to_message()])
    ids = [*template.encode(f"The answer is \\boxed{{{answer}}}."), template.closing_ids[0]]
    conv.add_generation(Generation(ids, [-0.125] * len(ids), "stop", version + 1),
                        parser.parse(template.decode_turn(ids)).to_message())
    t = conv.trajectory
    t.reward, t.finish_reason, t.fault = reward, FinishReason.DONE, fault  # type: ignore[assignment]
    if fault == "infra":
        t.reward, t.finish_reason, t.error = 0.0, FinishReason.ERROR, "tool call failed: the sandbox's worker process is gone"
    t.metrics.update({"tool_calls": 1.0, "tool_errors_model": 0.0, "tool_errors_infra": 1.0 if fault == "infra" else 0.0})
    return t


def make_run_dir(root: Path, template: ChatTemplate, steps: int = 3) -> Path:
    """A run directory as `agentrl run` leaves it after `steps` steps (see the module docstring)."""
    from agentrl.orchestration.ledger import PromptRef
    from agentrl.orchestration.schedule import GroupResult
    from agentrl.records.trajectory_log import RolloutLog, write_eval_trajectories

    root.mkdir(parents=True, exist_ok=True)
    rows = [{"reward_model": {"ground_truth": "84"}, "data_source": "calc"} for _ in range(4)]

    def group(i: int, rewards: list[float], fault: str | None = None) -> GroupResult:
        trajs = [tool_episode(template, reward=r, episode_id=f"e{i}-{j}", group_id=f"g{i}", fault=fault,
                              answer="84" if r else "85") for j, r in enumerate(rewards)]
        return GroupResult(PromptRef(0, i), trajs, version=2)

    log = RolloutLog(root, template.tokenizer, 2)
    with (root / "metrics.jsonl").open("w") as f:
        for step in range(steps):
            log.write_step(step, [group(0, [1.0, 0.0]), group(1, [0.0, 0.0])],
                           [group(2, [0.0, 0.0], fault="infra"), group(3, [1.0, 1.0])], rows)
            f.write(json.dumps({
                "step": step, "episodes/reward_mean": 0.25 + 0.1 * step, "episodes/solved_frac": 0.25,
                "tools/error_rate_infra": 0.5 if step == 1 else 0.0, "tools/calls_per_episode": 1.0,
                "finish/done": 0.75, "finish/error": 0.25, "finish/max_length": 0.0, "actor/ppo_kl": 0.0,
                "time/rollout_s": 10.0, "time/train_s": 6.0, "time/export_s": 1.0, "time/weight_sync_s": 2.0,
                "time/step_s": 18.5,
            }) + "\n")
    (root / "eval.jsonl").write_text("".join(json.dumps({"step": s, "pass_at_1": 0.1 * s + 0.1, "pass_at_2": 0.2 * s + 0.1})
                                             + "\n" for s in (0, steps)))
    for s in (0, steps):
        write_eval_trajectories(root / "eval" / f"step-{s:06d}" / "trajectories.jsonl",
                                [[tool_episode(template, episode_id=f"v{s}-0"), tool_episode(template, reward=0.0, answer="85", episode_id=f"v{s}-1")]],
                                rows[:1], template.tokenizer)
    (root / "config.yaml").write_text("env:\n  name: arithmetic\nmodel:\n  path: " + str(QWEN25) + "\nrun:\n  mode: sync\n")
    return root
