"""`env=verifiers` over a verifiers 0.4 taskset whose tasks declare a tool server (a `vf.Toolset`):
verifiers starts the MCP server for the episode, its chat program lists the tool in each chat request
to the gateway, the gateway renders it with the model's template and parses the model's call with
the run's tool parser, the chat program calls the server and the result is the model's next message.

Guards, on examples/verifiers_calculator.py (a calculator MCP tool; the reward checks the product):
with a scripted policy that calls the tool and then answers with what the tool returned, every episode
played to its end is rewarded 1.0 by the taskset's rubric, the tool's result is in the prompt of the
second call and in the trajectory as a masked tool turn, the tool server ran as its own process while
the episode ran and none is left after the eval, whether the tasks or the taskset declare the toolset;
a worker SIGKILLed mid-episode (in the first of the three episodes of the task-scoped eval, which the
tests of both share) fails that episode only and leaves no tool server behind; and the tiny random
model through the `agentrl eval` command (hf engine) books every token once."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_verifiers_multiturn import check_ledger, eval_with_tiny_model, tagged_processes, worker_pids

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.envs import make_env
from agentrl.errors import ConfigError, FeatureUnavailableError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval

pytestmark = [pytest.mark.slow, pytest.mark.verifiers]

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = REPO / "examples" / "verifiers_calculator.py"


def tool_servers(tag: str) -> list[tuple[int, str]]:
    """The live tool servers (`python -m agentrl_taskset_...`) started under the test tag `tag`: pid, command."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if f"AGENTRL_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if " -m agentrl_taskset_" in command:
                    found.append((int(proc.name), command))
        except (OSError, ValueError):
            continue
    return found


class CalculatorCaller:
    """Calls `calculator_multiply` on the factors of its prompt (hermes `<tool_call>` JSON), then answers
    with the number the tool's response holds, which it never computes itself. At its second call it
    notes the tool servers alive, and, if `kill`, SIGKILLs the verifiers worker before answering."""

    def __init__(self, tokenizer: Any, tag: str, kill: bool = False) -> None:
        self.tok = tokenizer
        self.tag = tag
        self.kill = kill
        self.prompts: list[str] = []
        self.servers_seen: list[list[str]] = []
        self.killed: list[int] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        self.prompts.append(prompt)
        result = re.search(r"<tool_response>\s*(-?\d+)\s*</tool_response>", prompt)
        if result is None:
            a, b = re.search(r"What is (\d+) times (\d+)\?", prompt).groups()
            call = {"name": "calculator_multiply", "arguments": {"a": int(a), "b": int(b)}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"
        else:
            self.servers_seen.append(tool_servers(self.tag))
            if self.kill and not self.killed:
                self.killed = worker_pids()
                for pid in self.killed:
                    os.kill(pid, signal.SIGKILL)
            text = f"{result.group(1)}<|im_end|>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


TASK_TOOLSETS = '''    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]
'''


def taskset_scoped(folder: Path) -> Path:
    """examples/verifiers_calculator.py with its toolset declared by the taskset (one server for the
    episode's env, which verifiers starts with the env: task-agnostic) instead of by each task."""
    source = CALCULATOR.read_text()
    assert TASK_TOOLSETS in source
    source = source.replace(TASK_TOOLSETS, "").replace(
        "class CalculatorTaskset(vf.Taskset[CalculatorTask]):\n",
        "class CalculatorTaskset(vf.Taskset[CalculatorTask]):\n" + TASK_TOOLSETS.replace("TaskConfig", "TasksetConfig"))
    path = folder / "calculator_shared.py"
    path.write_text(source)
    return path


def run_calculator_eval(assets: Path, out: Path, tag: str, *, rows: int, kill: bool = False,
                        taskset: Path = CALCULATOR) -> tuple[list[dict], CalculatorCaller]:
    config = load_config(overrides=[
        "env=verifiers", f"env.kwargs.id={taskset}", f"env.kwargs.max_rows={rows}",
        f"model.path={assets / 'tiny-random-qwen2'}", "eval.k=1", "rollout.max_turns=4",
        "run.max_infra_failure_rate=0.6", "rollout.max_concurrent_episodes=1", f"eval.output_dir={out}"])
    policy = CalculatorCaller(ChatTemplate.from_pretrained(config.model.path).tokenizer, tag, kill)
    run_eval(config, client=policy)
    return [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()], policy


def factors(episode: dict) -> tuple[int, int]:
    a, b = re.search(r"What is (\d+) times (\d+)\?", episode["messages"][1]["content"]).groups()
    return int(a), int(b)


@pytest.fixture(scope="module")
def task_scoped_eval(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], CalculatorCaller, str]:
    """One eval of three rows of examples/verifiers_calculator.py (a tool server per task) whose caller
    SIGKILLs the verifiers worker at the first episode's second call (1 of 3 failed: under the 0.6
    allowed); a fresh worker plays the two after it. Its episodes, the caller, and the tag every process
    it started carries (the workers and their tool servers inherit AGENTRL_TEST_TAG)."""
    tag = f"verifiers-tools-kill-{os.getpid()}-{time.monotonic_ns()}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTRL_TEST_TAG", tag)
        episodes, policy = run_calculator_eval(assets, tmp_path_factory.mktemp("tools") / "eval", tag, rows=3,
                                               kill=True)
    return episodes, policy, tag


def check_tool_use(episodes: list[dict], policy: CalculatorCaller, tag: str) -> None:
    """Every episode the worker played to its end (two) called the tool and was rewarded 1.0 by the
    rubric; the tool was offered in the rendered prompt, its answer reached the episode's second call,
    and each episode had a tool server of its own, gone after the eval. A killed episode (first, in
    row order) has only its calls before those of the played ones in `policy`."""
    played = [e for e in episodes if e["fault"] is None]
    assert len(played) == 2
    for episode in played:
        a, b = factors(episode)
        assert (episode["fault"], episode["reward"], episode["finish_reason"]) == (None, 1.0, "done"), episode
        assert episode["metrics"]["reward/correct"] == 1.0 and episode["metrics"]["tool_calls"] == 1.0
        assert [m["role"] for m in episode["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        call = episode["messages"][2]["tool_calls"][0]["function"]
        assert (call["name"], call["arguments"]) == ("calculator_multiply", {"a": a, "b": b})
        assert episode["messages"][3]["content"] == str(a * b)  # what the MCP server returned
        assert episode["messages"][4]["content"] == str(a * b)
        assert episode["info"]["tools"][0]["function"]["name"] == "calculator_multiply"
        tool_ids = [s for s in episode["segments"] if s["origin"] == "tool"]
        assert tool_ids and all("logprobs" not in s for s in tool_ids)
    # the tool was offered in the rendered prompt, and its answer reached the second call's prompt
    prompts, servers_seen = policy.prompts[-4:], policy.servers_seen[-2:]
    assert len(policy.prompts) == 2 * len(episodes) and "calculator_multiply" in prompts[0]
    products = sorted(a * b for a, b in map(factors, played))
    assert sorted(int(re.search(r"<tool_response>\n(\d+)\n</tool_response>", p).group(1))
                  for p in prompts[1::2]) == products
    # one tool server per episode, alive while it ran: this interpreter running the taskset's module
    assert [len(s) for s in servers_seen] == [1, 1] and servers_seen[0] != servers_seen[1]
    assert all(s[0][1].startswith(f"{sys.executable} -m agentrl_taskset_") for s in servers_seen)
    assert tagged_processes(tag) == [] and worker_pids() == []


def test_a_scripted_policy_calls_the_tasks_mcp_tool_and_the_rubric_scores_its_answer(
        task_scoped_eval: tuple[list[dict], CalculatorCaller, str]) -> None:
    check_tool_use(*task_scoped_eval)


def test_a_scripted_policy_calls_the_tasksets_mcp_tool_and_the_rubric_scores_its_answer(
        assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = f"verifiers-tools-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("AGENTRL_TEST_TAG", tag)
    episodes, policy = run_calculator_eval(assets, tmp_path / "eval", tag, rows=2, taskset=taskset_scoped(tmp_path))
    assert len(episodes) == 2
    check_tool_use(episodes, policy, tag)


def test_a_worker_killed_mid_episode_leaves_no_tool_server(
        task_scoped_eval: tuple[list[dict], CalculatorCaller, str]) -> None:
    episodes, policy, tag = task_scoped_eval
    assert len(policy.killed) == 1 and [len(s) for s in policy.servers_seen][:1] == [1]
    faults = sorted((e["fault"], e["reward"]) for e in episodes if e["fault"])
    assert faults == [("infra", None)], episodes
    assert [e["reward"] for e in episodes if not e["fault"]] == [1.0, 1.0]
    assert tagged_processes(tag) == [] and worker_pids() == []  # nor the killed worker's tool server


def test_agentrl_eval_runs_the_toolset_taskset_with_the_tiny_model_and_books_every_token(
        assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    tag = f"verifiers-tools-cli-{os.getpid()}-{time.monotonic_ns()}"
    eval_with_tiny_model(assets, out, tag, f"env.kwargs.id={CALCULATOR}", "env.kwargs.max_rows=2", "rollout.max_turns=3")
    episodes = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 2
    for episode in episodes:
        assert episode["fault"] is None and episode["segment"] == {"index": 0, "of": 1}, episode["error"]
        a, b = factors(episode)
        replies = [m for m in episode["messages"] if m["role"] == "assistant"]
        assert episode["reward"] == float(str(a * b) in (replies[-1]["content"] or "").replace(",", ""))
        assert episode["info"]["tools"][0]["function"]["name"] == "calculator_multiply"
        check_ledger(episode)
    assert tagged_processes(tag) == []  # no worker, chat program or tool server outlived the command


def test_a_toolset_in_a_container_runtime_is_refused_saying_why_and_what_to_use(tmp_path: Path) -> None:
    taskset = tmp_path / "docker_tools.py"
    taskset.write_text(CALCULATOR.read_text().replace(
        "return [CalculatorToolset(vf.ToolsetConfig())]",
        "return [CalculatorToolset(vf.ToolsetConfig(runtime={'type': 'docker', 'image': 'python:3.11-slim'}))]"))
    env = make_env("verifiers", id=str(taskset))
    try:
        with pytest.raises(FeatureUnavailableError) as caught:
            env.rows()
    finally:
        env.worker.close()
    message = str(caught.value)
    assert "runs its tool server 'calculator' (CalculatorToolset) in a 'docker' runtime" in message
    assert "Give the toolset runtime={'type': 'subprocess'}" in message and "env=mcp" in message


def test_a_toolset_module_without_a_main_block_is_refused_at_load_with_the_lines_to_add(tmp_path: Path) -> None:
    """verifiers starts a tool server as `python -m` its module; without a `__main__` block nothing would
    serve and verifiers would wait minutes for the server's port: refused when the taskset loads."""
    source = CALCULATOR.read_text()
    taskset = tmp_path / "no_main.py"
    taskset.write_text(source[:source.index('if __name__ == "__main__":')])
    env = make_env("verifiers", id=str(taskset))
    try:
        with pytest.raises(ConfigError) as caught:
            env.rows()
    finally:
        env.worker.close()
    assert f"{taskset} has no `if __name__ == \"__main__\":` block" in str(caught.value)
    assert str(caught.value).endswith('if __name__ == "__main__":\n    CalculatorToolset.run()')
