"""`agentrl eval` (`run_eval`, what the command runs) of `env=mcp` with the tests' fastmcp server over
stdio: the real chat template, parser, AgentLoop, env and server, with a scripted policy that calls
the server's tools in the hermes format. It guards the whole path: the trajectory file holds each
tool call and the server's answer, a tool error (`isError`) is an ordinary scored episode, a hang
past `rollout.tool_timeout_s` is an infra-failed episode (masked, never scored), and the command
stops with an error when infra failures pass `run.max_infra_failure_rate`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.errors import InfraFailureError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval

pytest.importorskip("fastmcp")
pytestmark = pytest.mark.slow

SERVER_DIR = Path(__file__).resolve().parents[1] / "mcp"

# prompt phrase -> the policy's turns: a tool call (name, arguments), then the final answer
PLAYS: dict[str, list[Any]] = {
    "Add 2 and 3": [("add", {"a": 2, "b": 3}), "The sum is \\boxed{5}."],
    "Divide 1 by 0": [("divide", {"a": 1, "b": 0}), "It cannot be done, \\boxed{0}."],
    "Wait for the result": [("hang", {}), "\\boxed{1}"],
}


class ScriptedPolicy:
    """Plays PLAYS: the turn is the number of assistant turns already in the prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        play = next(turns for phrase, turns in PLAYS.items() if phrase in prompt)
        turn = play[min(prompt.count("<|im_start|>assistant") - 1, len(play) - 1)]
        if isinstance(turn, tuple):
            text = f'<tool_call>\n{json.dumps({"name": turn[0], "arguments": turn[1]})}\n</tool_call>'
        else:
            text = turn
        ids = self.tok.encode(text + "<|im_end|>", add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


def test_eval_of_an_mcp_env_records_tool_calls_and_results_and_stops_on_infra_failures(
        assets: Path, tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for phrase, answer in (("Add 2 and 3", "5"), ("Divide 1 by 0", "undefined"), ("Wait for the result", "1")):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{phrase}."}], "data_source": "mcp-test",
                                "reward_model": {"style": "rule", "ground_truth": answer}}) + "\n")
    server = (f"{{name: calc, command: python, args: [{SERVER_DIR / 'calc_server.py'}], "
              f"ro_paths: [{SERVER_DIR}]}}")
    config = load_config(overrides=[
        "env=mcp", f"model.path={assets / 'qwen2.5-0.5b-instruct'}", f"data.val_files=[{rows}]",
        f"env.kwargs.servers=[{server}]", "rollout.tool_timeout_s=3", "eval.k=1",
        "run.max_infra_failure_rate=0.2", f"eval.output_dir={tmp_path / 'eval'}"])
    policy = ScriptedPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    with pytest.raises(InfraFailureError, match="1 of 3 evaluation episodes failed for infrastructure"):
        run_eval(config, client=policy)

    episodes = {}
    for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines():
        episode = json.loads(line)
        episodes[next(p for p in PLAYS if p in json.dumps(episode))] = episode
    added, divided, hung = episodes["Add 2 and 3"], episodes["Divide 1 by 0"], episodes["Wait for the result"]
    call_turn, result = added["messages"][1:3]  # what the model called, what the server answered
    assert [c["function"] for c in call_turn["tool_calls"]] == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    assert (result["role"], result["name"], result["content"]) == ("tool", "add", "5")
    assert (added["reward"], added["fault"]) == (1.0, None)
    assert added["metrics"]["tool_calls"] == 1 and added["metrics"]["tool_errors_model"] == 0
    assert divided["messages"][2]["content"] == "Error: division by zero: b must not be 0"  # isError
    assert (divided["reward"], divided["fault"], divided["metrics"]["tool_errors_model"]) == (0.0, None, 1)
    assert hung["fault"] == "infra" and "did not answer within 3 s" in hung["error"]
