"""`AgentEnv` end to end: real agents (functions, threads, processes) through a real gateway socket.

The rollout worker plays each episode by running the agent, which calls the gateway with the
official `openai` client; the model is scripted (real tokenizer, real template and parser) so that
the agents' paths are reproducible: tool calls, a history rewrite, a crash, a timeout, a refused
call, a judge that is down. Checked: every episode returns its trajectories (segments flattened
into the group), the reward comes from the row, and failures are classified (infra: masked;
budgets: trained, reward 0; a reward that cannot be measured: missing with its cause, never 0).
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.chat import ChatTemplate
from agentrl.gateway import AgentEnv, AgentTask
from agentrl.gateway.standalone import serve_gateway
from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
from agentrl.tools.parsers import HermesParser
from agentrl.types import FinishReason, Generation, Segment, TokenOrigin, Trajectory

openai = pytest.importorskip("openai", reason="needs the openai client, a dev extra: pip install -e '.[dev]'")

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call><|im_end|>'
ANSWER = "So it is \\boxed{42}.<|im_end|>"
ROW = {"prompt": [{"role": "user", "content": "What is 40 + 2?"}], "data_source": "toy",
       "reward_model": {"style": "rule", "ground_truth": "42"}}


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")


class ScriptedModel:
    """Each session's k-th call is answered with script[k] (the last entry repeats)."""

    def __init__(self, template: ChatTemplate, script: list[str]) -> None:
        self.tok, self.script = template.tokenizer, script
        self.sent: dict[str, list[list[int]]] = {}

    async def generate(self, prompt_ids: list[int], sampling: Any, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        calls = self.sent.setdefault(session_id, [])
        calls.append(list(prompt_ids))
        ids = self.tok.encode(self.script[min(len(calls), len(self.script)) - 1], add_special_tokens=False)
        return Generation(ids, [-0.5] * len(ids), "stop", weight_version=1)


def _run(template: ChatTemplate, env_factory: Any, *, samples: int = 2, script: list[str] | None = None,
         **cfg: Any) -> tuple[list[Trajectory], ScriptedModel]:
    model = ScriptedModel(template, script or [CALL, ANSWER])
    loop = AgentLoop(model, template, HermesParser(), AgentLoopConfig(**{"max_turns": 4, **cfg}))

    async def go() -> list[Trajectory]:
        return await RolloutWorker(loop, env_factory, freeze_gc=False).run_group(ROW, samples, seed=0, group_id="g0")

    return asyncio.run(go()), model


async def tool_agent(task: AgentTask) -> str:
    """An ordinary OpenAI-SDK tool loop."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
    messages: list[Any] = list(task.messages)
    for _ in range(4):
        reply = (await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            return reply.message.content or ""
        for call in reply.message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return ""


def test_a_function_agent_is_trained_on_its_exact_calls_and_scored_by_the_row(template: ChatTemplate) -> None:
    def reward_fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any) -> dict[str, Any]:
        return {"score": float(ground_truth in solution_str), "source_ok": float(data_source == "toy")}

    trajs, model = _run(template, lambda: AgentEnv(tool_agent, reward_fn=reward_fn))
    assert len(trajs) == 2 and {t.episode_id for t in trajs} == {"g0-0", "g0-1"}
    for t in trajs:
        assert (t.reward, t.finish_reason, t.fault) == (1.0, FinishReason.DONE, None), t.error
        assert t.segment == Segment(index=0, of=1) and t.info["answer"] == "So it is \\boxed{42}."
        assert t.metrics["reward/source_ok"] == 1.0 and t.metrics["llm_calls"] == 2 and t.metrics["agent_s"] > 0
        t.validate()
        sent = model.sent[t.episode_id]
        assert sent[1][: len(sent[0])] == sent[0] and t.token_ids[: len(sent[1])] == sent[1]
        assert template.tokenizer.decode(t.tokens_of(TokenOrigin.SAMPLED)) == CALL + ANSWER
        assert template.tokenizer.decode(t.tokens_of(TokenOrigin.TOOL)) == "42"


def test_a_blocking_agent_and_a_history_rewrite(template: ChatTemplate) -> None:
    def rewriting_agent(task: AgentTask) -> str:
        """Sync client in its own thread; after the tool call it keeps only a summary of the history."""
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key)
        first = client.chat.completions.create(model="x", messages=task.messages, tools=TOOLS).choices[0].message
        summary = [*task.messages, {"role": "user", "content": f"You called add and got 42 ({len(first.tool_calls)})."}]
        return client.chat.completions.create(model="x", messages=summary, tools=TOOLS).choices[0].message.content

    trajs, model = _run(template, lambda: AgentEnv(rewriting_agent), samples=1)
    assert [t.segment for t in trajs] == [Segment(index=0, of=2), Segment(index=1, of=2)]
    assert all(t.reward == 1.0 and t.finish_reason == FinishReason.DONE for t in trajs)
    assert trajs[1].metrics["rewrites"] == 1 and "rewrites" not in trajs[0].metrics
    for t, prompt in zip(trajs, model.sent["g0-0"], strict=True):
        t.validate()
        assert t.token_ids[: len(prompt)] == prompt and t.num_turns == 1


def test_a_command_agent_gets_the_base_url_and_key_in_its_environment(template: ChatTemplate, tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import openai
        prompt = sys.stdin.read()
        task = json.load(open(os.environ["AGENTRL_TASK_FILE"]))
        client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
        messages, tools = task["messages"], json.loads(os.environ["TOOLS"])
        reply = client.chat.completions.create(model=os.environ["AGENTRL_MODEL"], messages=messages, tools=tools)
        call = reply.choices[0].message.tool_calls[0]
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        final = client.chat.completions.create(model="x", messages=messages, tools=tools)
        print("progress goes to stderr", file=sys.stderr)
        print(final.choices[0].message.content)
    """))
    env = {"TOOLS": json.dumps(TOOLS)}
    trajs, _ = _run(template, lambda: AgentEnv(command=[sys.executable, str(script)], environment=env), samples=1)
    (t,) = trajs
    assert (t.reward, t.fault, t.info["answer"]) == (1.0, None, "So it is \\boxed{42}."), t.error
    assert "progress goes to stderr" in t.info["agent_stderr"] and t.metrics["llm_calls"] == 2


def test_failures_are_classified_like_tool_failures(template: ChatTemplate, tmp_path: Path) -> None:
    async def crashes(task: AgentTask) -> str:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
        await client.chat.completions.create(model="x", messages=task.messages)
        raise RuntimeError("agent bug")

    async def sleeps(task: AgentTask) -> str:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
        await client.chat.completions.create(model="x", messages=task.messages)
        await asyncio.sleep(60)
        return "late"

    async def never_calls(task: AgentTask) -> str:
        return "42"

    async def loops_forever(task: AgentTask) -> str:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages: list[Any] = list(task.messages)
        while True:  # raises BadRequestError once rollout.max_turns is spent
            reply = await client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": "42"}]

    exits = tmp_path / "exits.py"
    exits.write_text("import sys; print('boom', file=sys.stderr); sys.exit(3)\n")
    cases = {
        "crash": (lambda: AgentEnv(crashes), FinishReason.ERROR, "infra", "agent bug"),
        "timeout": (lambda: AgentEnv(sleeps, timeout_s=2.0), FinishReason.TIMEOUT, "infra", "within 2.0 s"),
        "no calls": (lambda: AgentEnv(never_calls), FinishReason.ERROR, "infra", "no successful model call"),
        "exit code": (lambda: AgentEnv(command=[sys.executable, str(exits)]), FinishReason.ERROR, "infra",
                      "exited with code 3"),
        "budget": (lambda: AgentEnv(loops_forever), FinishReason.MAX_TURNS, None, None),
    }
    for name, (factory, reason, fault, error) in cases.items():
        started = time.monotonic()
        trajs, _ = _run(template, factory, samples=1, script=[CALL])
        (t,) = trajs
        assert (t.finish_reason, t.fault) == (reason, fault), (name, t.error)
        if error is None:
            assert t.reward == 0.0 and t.trainable and t.metrics["refused_turns"] == 1 and t.num_turns == 4
            assert "max_turns" in t.info["agent_error"] or "model calls" in t.info["agent_error"]
        else:
            assert error in (t.error or ""), (name, t.error)
            assert not t.trainable and t.reward is None
        if name == "exit code":
            assert "boom" in (t.error or "")
        assert time.monotonic() - started < 30, name


def test_the_standalone_gateway_records_each_api_key_as_an_episode(template: ChatTemplate, tmp_path: Path) -> None:
    model = ScriptedModel(template, [CALL, ANSWER])
    loop = AgentLoop(model, template, HermesParser(), AgentLoopConfig(max_turns=4))

    async def go() -> Any:
        stop = asyncio.Event()
        urls: list[str] = []
        server = asyncio.create_task(serve_gateway(loop, output_dir=tmp_path, ready=lambda g: urls.append(g.url),
                                                   stop=stop, idle_timeout_s=None))
        while not urls:
            await asyncio.sleep(0.01)
        for key in ("run-a", "run-b"):
            await tool_agent(AgentTask(base_url=f"{urls[0]}/v1", api_key=key, model="m", messages=ROW["prompt"],
                                       row=ROW))
        async with httpx.AsyncClient() as http:
            ended = await http.post(f"{urls[0]}/agentrl/sessions/run-a/end", json={"reward": 1.0})
        stop.set()
        return ended.json(), await server

    ended, writer = asyncio.run(go())
    assert ended == {"key": "run-a", "segments": 1, "calls": 2}
    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["session"], r["reward"]) for r in records] == [("run-a", 1.0), ("run-b", None)]
    assert writer.sessions == 2 and all(r["text"].endswith("\\boxed{42}.<|im_end|>") for r in records)
    for r in records:
        Trajectory.from_dict({k: v for k, v in r.items() if k not in ("session", "text")}).validate()


def test_episodes_share_the_owners_gateway_until_the_owner_closes_it() -> None:
    from agentrl.gateway import SharedGateway

    async def go() -> tuple[bool, bool, bool, bool]:
        shared = SharedGateway()
        async with shared:
            first, second = await asyncio.gather(shared.get(), shared.get())
            async with httpx.AsyncClient() as http:
                up = (await http.get(f"{first.url}/health")).status_code == 200
        closed = not shared.started
        third = await shared.get()  # a later episode after the close: a fresh gateway
        await shared.aclose()
        return first is second, up, closed, third is not first

    assert asyncio.run(go()) == (True, True, True, True)


def test_the_job_owns_the_gateway_its_envs_share(assets: Path) -> None:
    from agentrl.config import load_config
    from agentrl.gateway import SharedGateway
    from agentrl.orchestration.build import build_job

    config = load_config(None, ["env=agent", f"model.path={assets / 'tiny-random-qwen2'}",
                                "model.chat_template=chatml-tools"])
    job = build_job(config, "eval", own_client=True)
    first, second = job.make_env(), job.make_env()
    assert isinstance(job.gateway, SharedGateway)
    assert isinstance(first, AgentEnv) and isinstance(second, AgentEnv)
    assert first.gateway is second.gateway is job.gateway

    async def go() -> tuple[int, bool]:
        gateway = await job.gateway.get()  # type: ignore[union-attr]
        async with httpx.AsyncClient() as http:
            status = (await http.get(f"{gateway.url}/health")).status_code
        await job.aclose()
        return status, job.gateway.started  # type: ignore[union-attr]

    assert asyncio.run(go()) == (200, False)


def test_a_judge_that_is_down_leaves_the_agents_episode_unscored_with_its_cause(template: ChatTemplate) -> None:
    """A reward the judge cannot give is missing (cause `infra`, what was asked kept), never 0."""
    import socket

    from agentrl.config import JudgeConfig, RewardConfig
    from agentrl.envs.reward_sources import build_reward

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    reward = build_reward(RewardConfig(judge=JudgeConfig(url=f"http://127.0.0.1:{closed}/v1", timeout_s=5)))
    trajs, _ = _run(template, lambda: AgentEnv(tool_agent, reward_fn=reward))
    assert len(trajs) == 2
    for t in trajs:
        assert (t.reward, t.fault, t.finish_reason) == (None, "infra", FinishReason.ERROR)
        assert t.info["reward_missing"]["cause"] == "infra" and "cannot be reached" in t.info["reward_missing"]["message"]
        assert t.info["reward"]["parts"]["judge"]["missing"] == "infra"
        assert t.error is not None and t.error.startswith("the reward could not be measured (infra)")
