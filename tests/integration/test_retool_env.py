"""The retool env with its real sandboxed python tool: the contract, and a solved episode."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate
from agentrl.envs import check_env
from agentrl.envs.retool import RetoolEnv, shipped_rows
from agentrl.rollout import AgentLoop
from agentrl.tools.parsers import HermesParser
from agentrl.types import Action, FinishReason, Generation, SamplingParams, TokenOrigin, ToolCall

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")


def test_retool_passes_check_env_with_real_code_execution() -> None:
    actions = [Action("run", (ToolCall("python", {"code": "print(6 * 7)"}, id="c1"),)), Action("\\boxed{42}")]
    check_env(RetoolEnv(), actions=actions)


def test_an_agent_that_writes_the_right_code_earns_the_reward(assets: Path) -> None:
    row = next(r for r in shipped_rows("test") if r["extra_info"]["family"] == "primes")
    n = int(row["extra_info"]["question"].split()[-1].rstrip("?"))
    code = f"n = {n}\nprint(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, n)))"
    template = ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")
    tok = template.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    seen: list[str] = []

    class CodingClient:
        async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                           timeout_s: float | None = None) -> Generation:
            seen.append(tok.decode(prompt_ids))
            if len(seen) == 1:
                text = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"
            else:  # read the number the sandbox printed out of the prompt
                printed = seen[-1].split("<tool_response>\n")[-1].split("\n")[0].strip()
                text = f"There are \\boxed{{{printed}}} primes."
            ids = tok.encode(text, add_special_tokens=False) + [end]
            return Generation(ids, [-0.2] * len(ids), "stop", 1)

    async def episode():  # type: ignore[no-untyped-def]
        return await AgentLoop(CodingClient(), template, HermesParser()).run_episode(RetoolEnv(), row=row)

    traj = asyncio.run(episode())
    assert (traj.finish_reason, traj.reward) == (FinishReason.DONE, 1.0)
    assert tok.decode(traj.tokens_of(TokenOrigin.TOOL)).strip() == row["reward_model"]["ground_truth"]
    traj.validate()


def test_code_format_shows_worked_examples_and_runs_the_code_block() -> None:
    from agentrl.envs.retool import CODE_SYSTEM_PROMPT, FEW_SHOT_EXAMPLES
    from agentrl.tools.parsers import RetoolParser

    row = next(r for r in shipped_rows("test") if r["extra_info"]["family"] == "product")
    env = RetoolEnv(tool_format="code", few_shot=2)
    try:
        messages, info = env.reset(seed=0, options={"row": row})
        assert info["tools"] == []  # no schema: the system prompt describes the code block
        assert messages[0] == {"role": "system", "content": CODE_SYSTEM_PROMPT}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
        assert messages[1]["content"] == FEW_SHOT_EXAMPLES[0][0]
        assert messages[-1]["content"] == row["extra_info"]["question"]
        question = row["extra_info"]["question"].removeprefix("What is ").rstrip("?")
        action = RetoolParser().parse(f"```python\nprint({question})\n```")
        obs, reward, terminated, _, _ = env.step(action)
        assert obs[0]["content"] == row["reward_model"]["ground_truth"] and not terminated
        _, reward, terminated, _, _ = env.step(RetoolParser().parse(f"\\boxed{{{obs[0]['content']}}}"))
        assert terminated and reward == 1.0
    finally:
        env.close()
    with pytest.raises(ValueError, match="tool_format='code'"):
        RetoolEnv(few_shot=1)
    with pytest.raises(ValueError, match="few_shot must be between"):
        RetoolEnv(tool_format="code", few_shot=9)


def test_tool_reward_shapes_wrong_answers_after_code_that_ran() -> None:
    from agentrl.tools.parsers import RetoolParser

    row = next(r for r in shipped_rows("test") if r["extra_info"]["family"] == "product")
    parse = RetoolParser().parse
    rewards = {}
    for name, code, answer in (("ran", "print(1)", "\\boxed{7}"), ("crashed", "raise SystemExit(3)", "\\boxed{7}"),
                               ("none", None, "\\boxed{7}"), ("unboxed", "print(1)", "7")):
        env = RetoolEnv(tool_format="code", tool_reward=0.2, format_reward=0.1)
        try:
            env.reset(seed=0, options={"row": row})
            if code is not None:
                env.step(parse(f"```python\n{code}\n```"))
            _, rewards[name], terminated, _, _ = env.step(parse(answer))
            assert terminated
        finally:
            env.close()
    assert rewards == {"ran": 0.2, "crashed": 0.1, "none": 0.1, "unboxed": 0.0}
