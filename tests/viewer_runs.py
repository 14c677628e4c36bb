"""Run directories for the viewer's tests, made of real ledgers without a model.

`tool_episode` delta-tokenises a tool-calling episode with the real Qwen2.5 chat template exactly
as the AgentLoop does (a calculator call, its result, the final answer; or, with `code=True`, the
ReTool code block and its printed output); `make_run_dir` writes what `agentrl run` writes for
three steps around such episodes: `metrics.jsonl`, `eval.jsonl`, kept rollouts through the real
`RolloutLog` (a trained group, a filtered one, an infrastructure-failed one) and an evaluation
through `write_eval_trajectories`. `make_failing_run` writes a run that went wrong: reward and
pass@k 0 throughout, prompts that hold assistant messages of their own (the retool preset's worked
examples, a chat-history row), model output with a bidi override, lines in a rollout file that are
not episodes, and the file of the infrastructure failures the run stopped on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.types import FinishReason, Generation, Message, ToolResult, Trajectory

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
QWEN25 = ASSETS / "qwen2.5-0.5b-instruct"

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]  # fmt: skip


def tool_episode(template: ChatTemplate, *, reward: float = 1.0, version: int = 2, episode_id: str = "ep",
                 group_id: str = "g", fault: str | None = None, answer: str = "84", result: str = "84",
                 prompt: list[Message] | None = None, code: bool = False, final: str | None = None) -> Trajectory:
    """A two-turn episode: a calculator call (sampled), its result (tool), the final answer (sampled).

    `prompt` replaces the one user message; `code=True` calls ReTool's way (a ```python block, the
    `retool` parser, no tool schema in the prompt); `final` replaces the final answer's text."""
    from agentrl.registry import TOOL_PARSERS

    parser = TOOL_PARSERS.resolve("retool" if code else "hermes")()
    conv = ConversationTokenizer(template, Trajectory(episode_id=episode_id, group_id=group_id, data_source="calc"))
    conv.start(prompt or [{"role": "user", "content": "What is 12*7? Schöne Grüße"}], None if code else TOOLS)
    first = ("Let me run it.\n```python\nprint(12*7)\n```" if code else
             '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>')
    ids = [*template.encode(first), template.closing_ids[0]]
    action = parser.parse(template.decode_turn(ids))
    conv.add_generation(Generation(ids, [-0.25 - 0.2 * i for i in range(len(ids))], "stop", version),
                        action.to_message())
    call = action.tool_calls[0]
    conv.add_messages([ToolResult(result, None, call.name, call.id).to_message()])
    final = final if final is not None else f"The answer is \\boxed{{{answer}}}."
    ids = [*template.encode(final), template.closing_ids[0]]
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


def few_shot_prompt(question: str = "What is 12*7?") -> list[Message]:
    """The retool preset's prompt (`tool_format: code`, `few_shot: 2`): a system message, two worked
    examples (user, assistant code, tool output, assistant answer) and the question."""
    from agentrl.envs.retool import RetoolEnv

    return RetoolEnv(tool_format="code", few_shot=2).initial_messages({"prompt": [{"role": "user", "content": question}]})


CHAT_HISTORY: list[Message] = [
    {"role": "user", "content": "My name is Ada."},
    {"role": "assistant", "content": "Nice to meet you, Ada."},
    {"role": "user", "content": "What is 12*7?"},
]


def unanswered_episode(template: ChatTemplate, prompt: list[Message], *, episode_id: str = "stopped",
                       group_id: str = "gs") -> Trajectory:
    """An episode that failed for infrastructure reasons before the model's first turn: a prompt only."""
    conv = ConversationTokenizer(template, Trajectory(episode_id=episode_id, group_id=group_id, data_source="calc"))
    conv.start(prompt, None)
    t = conv.trajectory
    t.reward, t.finish_reason, t.fault = 0.0, FinishReason.ERROR, "infra"
    t.error = "no inference server answered within 30 s"
    return t


BIDI_ANSWER = "\u202eThe answer is \\boxed{85}. Done."  # an unclosed right-to-left override, then text
NOT_EPISODES = ["null", "[1, 2]", '"a string"', '{"not": "an episode"}', '{"segments": 5}', '{"format": "agentrl.traj']


def make_failing_run(root: Path, template: ChatTemplate) -> Path:
    """A run that went wrong (see the module docstring): one step logged, kept with `keep_rollouts:
    all` as four groups (retool few-shot prompts, chat-history rows, a bidi override in the answer),
    six lines that are not episodes after them, and step 3's stopped-run file."""
    from agentrl.orchestration.ledger import PromptRef
    from agentrl.orchestration.schedule import GroupResult
    from agentrl.records.trajectory_log import RolloutLog

    root.mkdir(parents=True, exist_ok=True)
    rows = [{"reward_model": {"ground_truth": "84"}, "data_source": "calc"} for _ in range(3)]
    few_shot = few_shot_prompt()
    groups = [
        GroupResult(PromptRef(0, 0), [tool_episode(template, reward=0.0, answer="85", code=True, prompt=few_shot,
                                                   episode_id=f"fs-{j}", group_id="few-shot") for j in range(2)], 2),
        GroupResult(PromptRef(0, 1), [tool_episode(template, reward=0.0, answer="85", prompt=CHAT_HISTORY,
                                                   episode_id=f"ch-{j}", group_id="history") for j in range(2)], 2),
        GroupResult(PromptRef(0, 2), [tool_episode(template, reward=0.0, final=BIDI_ANSWER, episode_id="bidi",
                                                   group_id="bidi")], 2),
    ]
    log = RolloutLog(root, template.tokenizer, "all")
    path = log.write_step(0, groups, [], rows)
    assert path is not None
    with path.open("a") as f:
        f.write("\n".join(NOT_EPISODES) + "\n")
    log.write_stopped(2, [unanswered_episode(template, few_shot),
                          tool_episode(template, fault="infra", episode_id="stopped-tool", group_id="gs"),
                          tool_episode(template, episode_id="fine", group_id="gs")])
    (root / "metrics.jsonl").write_text("".join(json.dumps({
        "step": step, "episodes/reward_mean": 0.0, "episodes/solved_frac": 0.0, "tools/error_rate_infra": 0.0,
        "tools/calls_per_episode": 1.0, "finish/done": 1.0, "actor/ppo_kl": 0.0, "time/step_s": 5.0,
    }) + "\n" for step in range(2)))
    (root / "eval.jsonl").write_text(json.dumps({"step": 0, "pass_at_1": 0.0, "pass_at_2": 0.0}) + "\n")
    (root / "config.yaml").write_text("env:\n  name: retool\nmodel:\n  path: " + str(QWEN25) + "\n")
    return root


BIG_OUTPUT_BYTES = 2_000_000
GAP = 1.5  # the logprob gap |rollout - trainer| set on one token of `make_big_run`'s first episode
ENTROPY = 5.0  # and the trainer's entropy there


def big_tool_output(n_bytes: int = BIG_OUTPUT_BYTES) -> str:
    """About `n_bytes` of a program's printed log: the kind of tool output that runs to half a million
    tokens (2 MB: about 585,000 with the Qwen2.5 tokenizer)."""
    words = ["request", "completed", "warning", "finished", "pending", "processed", "archived", "skipped", "received",
             "validated"]
    lines, size, i = [], 0, 0
    while size < n_bytes:
        line = f"[{i % 60:02d}] item {words[i % 10]} and {words[(i * 3) % 10]}, then {words[(i * 7) % 10]}: code={i % 9}\n"
        lines.append(line)
        size += len(line)
        i += 1
    return "".join(lines)


def make_big_run(root: Path, template: ChatTemplate) -> tuple[Path, int]:
    """A one-step run whose kept rollouts hold a small trained episode with the trainer's values
    (a gap of `GAP` and an entropy of `ENTROPY` on its first sampled token, the rollout's logprob
    elsewhere) and an episode whose tool printed ~2 MB; with the step's `onpolicy/*` metrics.
    Returns the run and the ledger index of the token with the gap."""
    from agentrl.orchestration.ledger import PromptRef
    from agentrl.orchestration.schedule import GroupResult
    from agentrl.records.trajectory_log import RolloutLog, TrainerTokens
    from agentrl.types import TokenOrigin

    root.mkdir(parents=True, exist_ok=True)
    small = tool_episode(template, reward=1.0, episode_id="small", group_id="g0")
    big = tool_episode(template, reward=0.0, episode_id="big", group_id="g0", result=big_tool_output(), answer="85")
    sampled = int(TokenOrigin.SAMPLED)
    at = small.origins.index(sampled)
    values = TrainerTokens(
        [lp - (GAP if i == at else 0.0) if o == sampled else None for i, (lp, o) in enumerate(zip(small.logprobs, small.origins, strict=True))],
        [(ENTROPY if i == at else 0.5) if o == sampled else None for i, o in enumerate(small.origins)],
    )  # fmt: skip
    log = RolloutLog(root, template.tokenizer, "all")
    log.write_step(0, [GroupResult(PromptRef(0, 0), [small, big], 2)], [], None,
                   trainer=lambda t: values if t is small else None)
    (root / "metrics.jsonl").write_text(json.dumps({
        "step": 0, "episodes/reward_mean": 0.5, "onpolicy/passed": 1.0, "onpolicy/max_gap": 0.125,
    }) + "\n")
    (root / "config.yaml").write_text("env:\n  name: arithmetic\nmodel:\n  path: " + str(QWEN25) + "\n")
    return root, at
