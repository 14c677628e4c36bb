"""The gateway with the real `openai` client (over an in-process ASGI transport) and a scripted model.

The model is scripted (each call answers the next text of a script, tokenised with the real Qwen2.5
tokenizer) so that tool calls, parallel calls, malformed calls and stop strings happen on demand;
the chat template, the tool parser, the HTTP layer and the client are the real ones. What is under
test: the OpenAI wire format, the sessions' ledgers (one exact segment per conversation), and that
the ledger equals the AgentLoop's for the same episode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.chat import ChatTemplate
from agentrl.envs import ToolEnv
from agentrl.errors import ServerUnavailableError
from agentrl.gateway import Gateway
from agentrl.gateway.wire import WireError, message_key, parse_chat_request
from agentrl.rollout import AgentLoop, AgentLoopConfig
from agentrl.tools import ToolContext, tool
from agentrl.tools.parsers import HermesParser
from agentrl.types import FinishReason, Generation, Segment, TokenOrigin, Trajectory

openai = pytest.importorskip("openai", reason="needs the openai client, a dev extra: pip install -e '.[dev]'")

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
CALLS = ('I will add both pairs.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 30, "b": 4}}\n</tool_call><|im_end|>')
ANSWER = "The sums are 3 and 34, so the answer is \\boxed{37}.<|im_end|>"


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")


class ScriptedModel:
    """A GenerateClient answering each session's k-th call with `script[k]` (tokenised for real)."""

    def __init__(self, template: ChatTemplate, script: list[str], *, fail_first: int = 0,
                 finish: str = "stop") -> None:
        self.tok = template.tokenizer
        self.script = script
        self.sent: dict[str, list[list[int]]] = {}
        self.fail_first = fail_first
        self.finish = finish

    async def generate(self, prompt_ids: list[int], sampling: Any, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        if self.fail_first:
            self.fail_first -= 1
            raise ServerUnavailableError("scripted outage")
        calls = self.sent.setdefault(session_id, [])
        calls.append(list(prompt_ids))
        text = self.script[min(len(calls) - 1, len(self.script) - 1)]
        ids = self.tok.encode(text, add_special_tokens=False)[: sampling.max_tokens]
        finish = "length" if len(ids) == sampling.max_tokens and not text.endswith("<|im_end|>") else self.finish
        return Generation(ids, [-0.25 - 0.01 * i for i in range(len(ids))], finish, weight_version=3)


def _loop(template: ChatTemplate, model: ScriptedModel, **cfg: Any) -> AgentLoop:
    return AgentLoop(model, template, HermesParser(), AgentLoopConfig(**{"max_turns": 6, **cfg}))


async def _client(gateway: Gateway, session: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gateway")
    return openai.AsyncOpenAI(base_url=f"http://gateway/s/{session.key}/v1", api_key="unused", http_client=http,
                              max_retries=0)


def _tool_results(message: Any) -> list[dict[str, Any]]:
    out = []
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        out.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return out


def _check(t: Trajectory, sent: list[list[int]]) -> None:
    """The ledger invariants: valid, every prompt sent is a prefix of the ledger, sampled ids kept."""
    t.validate()
    for prompt in sent:
        assert t.token_ids[: len(prompt)] == prompt


# ── the wire format ─────────────────────────────────────────────────────────────────────────
def test_requests_are_read_in_the_shape_chat_templates_render() -> None:
    req = parse_chat_request({
        "model": "gpt-4o", "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 7, "stop": "END", "temperature": 0.2, "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1, "b":2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ]})
    assert req.messages[0] == {"role": "system", "content": "Be brief.\nUse tools."}
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert req.messages[3] == {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"}
    assert (req.stream, req.include_usage, req.max_tokens, req.stop, req.ignored) == (True, True, 7, ("END",), ("temperature",))
    # The same assistant turn, echoed with other ids and other JSON spacing, is the same message.
    echoed = parse_chat_request({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "zz", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}]}]})
    assert message_key(echoed.messages[0]) == message_key(req.messages[2])
    for bad, field in (({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
                       ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                        "messages[0].content"),
                       ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role")):
        with pytest.raises(WireError) as err:
            parse_chat_request(bad)
        assert err.value.status == 400 and err.value.body()["error"]["param"] == field


# ── chat completions with the real client ──────────────────────────────────────────────────
def test_parallel_tool_calls_and_a_final_answer_make_one_exact_segment(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [CALLS, ANSWER])

    async def run() -> tuple[Any, Any, list[Trajectory]]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model), episode_id="ep")
        client = await _client(gateway, session)
        messages: list[Any] = [{"role": "user", "content": "What is 1+2 plus 30+4?"}]
        first = await client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        messages += [first.choices[0].message.model_dump(exclude_none=True), *_tool_results(first.choices[0].message)]
        second = await client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
        return first, second, session.trajectories(reward=1.0, finish_reason=FinishReason.DONE)

    first, second, segments = asyncio.run(run())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will add both pairs."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 30, "b": 4})]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    assert second.choices[0].finish_reason == "stop" and "\\boxed{37}" in second.choices[0].message.content
    assert first.model == "gpt-4o" and first.usage.completion_tokens == len(template.encode(CALLS))
    assert len(segments) == 1
    t = segments[0]
    _check(t, model.sent["ep"])
    assert t.segment == Segment(index=0, of=1) and t.reward == 1.0
    assert t.metrics["llm_calls"] == 2 and t.metrics["tool_calls"] == 2 and t.metrics["segments"] == 1
    assert template.tokenizer.decode(t.tokens_of(TokenOrigin.SAMPLED)) == CALLS + ANSWER
    assert template.tokenizer.decode(t.tokens_of(TokenOrigin.TOOL)) == "334"
    assert set(t.versions) == {-1, 3}


@tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


class AddEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([add], max_turns=6)

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return 1.0


def test_the_gateway_ledger_equals_the_agent_loops_for_the_same_episode(template: ChatTemplate) -> None:
    row = {"prompt": [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+2 and 30+4?"}]}

    async def via_loop() -> Trajectory:
        return await _loop(template, ScriptedModel(template, [CALLS, ANSWER])).run_episode(
            AddEnv(), row=row, episode_id="ep")

    async def via_gateway() -> Trajectory:
        gateway = Gateway()
        env = AddEnv()
        _, info = await env.areset(options={"row": row})
        session = gateway.open_session(_loop(template, ScriptedModel(template, [CALLS, ANSWER])), episode_id="ep")
        client = await _client(gateway, session)
        messages: list[Any] = list(row["prompt"])
        while True:
            reply = (await client.chat.completions.create(model="m", messages=messages, tools=info["tools"])).choices[0]
            messages.append(reply.message.model_dump(exclude_none=True))
            if not reply.message.tool_calls:
                break
            messages += _tool_results(reply.message)
        await env.aclose()
        return session.trajectories(reward=1.0, finish_reason=FinishReason.DONE)[0]

    a, b = asyncio.run(via_loop()), asyncio.run(via_gateway())
    assert a.finish_reason == FinishReason.DONE and a.fault is None
    for name in ("token_ids", "origins", "turns", "logprobs", "versions"):
        assert getattr(a, name) == getattr(b, name), name


def test_streaming_sends_content_and_tool_call_deltas_the_client_reassembles(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [CALLS])

    async def run() -> tuple[list[Any], Any]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model), episode_id="ep")
        client = await _client(gateway, session)
        messages = [{"role": "user", "content": "add"}]
        stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        async with client.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as s:
            final = await s.get_final_completion()
        return chunks, final

    chunks, final = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "I will add both pairs."
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert sorted({d.index for d in deltas}) == [0, 1] and all(d.id for d in deltas if d.function.name)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    calls = final.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"a": 1, "b": 2}, {"a": 30, "b": 4}]


def test_a_malformed_call_comes_back_as_content_not_an_error(template: ChatTemplate) -> None:
    bad = 'Calling.\n<tool_call>\n{"name": "add", "arguments": {"a": 1,,}}\n</tool_call><|im_end|>'
    model = ScriptedModel(template, [bad])

    async def run() -> tuple[Any, Trajectory]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model), episode_id="ep")
        reply = await (await _client(gateway, session)).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "add"}], tools=TOOLS)
        return reply, session.trajectories(reward=0.0, finish_reason=FinishReason.DONE)[0]

    reply, t = asyncio.run(run())
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert '"a": 1,,' in reply.choices[0].message.content
    assert t.metrics["parse_errors"] == 1 and t.num_sampled == len(template.encode(bad))


def test_a_rewritten_history_starts_a_new_exact_segment(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [CALLS, "Noted.<|im_end|>", ANSWER])

    async def run() -> list[Trajectory]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model), episode_id="ep", group_id="g")
        client = await _client(gateway, session)
        messages: list[Any] = [{"role": "user", "content": "What is 1+2 plus 30+4?"}]
        first = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        messages += [first.model_dump(exclude_none=True), *_tool_results(first)]
        second = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        # The agent summarises its history: the tool round-trip becomes one user note.
        summary = [messages[0], {"role": "user", "content": "Notes: 1+2=3, 30+4=34."},
                   second.model_dump(exclude_none=True), {"role": "user", "content": "Now answer."}]
        await client.chat.completions.create(model="m", messages=summary, tools=TOOLS)
        return session.trajectories(reward=1.0, finish_reason=FinishReason.DONE)

    segments = asyncio.run(run())
    assert [t.segment for t in segments] == [Segment(index=0, of=2), Segment(index=1, of=2)]
    first, second = segments
    sent = model.sent["ep"]
    _check(first, sent[:2])
    _check(second, sent[2:])
    assert first.num_turns == 2 and second.num_turns == 1
    assert second.metrics["rewrites"] == 1 and second.metrics["segments"] == 2
    # The new segment's prompt is the rewritten conversation rendered whole; its sampled turn is exact.
    summary_render = template.encode_prompt(second.messages[:-1], TOOLS)
    assert second.token_ids[: second.prompt_length] == summary_render
    assert template.tokenizer.decode(second.tokens_of(TokenOrigin.SAMPLED)) == ANSWER
    assert all(t.reward == 1.0 and t.episode_id == "ep" and t.group_id == "g" for t in segments)


def test_a_template_mismatch_stays_on_the_segment_it_happened_in(template: ChatTemplate, monkeypatch) -> None:
    """With `verify_template`, a segment whose re-render differs carries the count, not the episode's
    last segment: the trainer's gate masks the segment whose ledger it cannot trust, and only it."""
    model = ScriptedModel(template, [CALLS, "Noted.<|im_end|>", ANSWER])
    render = template.encode_prompt

    def planted(messages: Any, tools: Any = None, **kw: Any) -> list[int]:  # differs once a tool answered
        ids = render(messages, tools, **kw)
        return [*ids, 0] if any(m.get("role") == "tool" for m in messages) else ids

    async def run() -> list[Trajectory]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model, verify_template=True), episode_id="ep", group_id="g")
        client = await _client(gateway, session)
        messages: list[Any] = [{"role": "user", "content": "What is 1+2 plus 30+4?"}]
        first = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        messages += [first.model_dump(exclude_none=True), *_tool_results(first)]
        monkeypatch.setattr(template, "encode_prompt", planted)  # the check after the second call re-renders
        second = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        summary = [messages[0], {"role": "user", "content": "Notes: 1+2=3, 30+4=34."},
                   second.model_dump(exclude_none=True), {"role": "user", "content": "Now answer."}]
        await client.chat.completions.create(model="m", messages=summary, tools=TOOLS)
        return session.trajectories(reward=1.0, finish_reason=FinishReason.DONE)

    first, second = asyncio.run(run())
    assert [t.segment for t in (first, second)] == [Segment(index=0, of=2), Segment(index=1, of=2)]
    assert first.metrics["template_mismatch"] == 1.0 and second.metrics["template_mismatch"] == 0.0
    assert second.metrics["llm_calls"] == 3 and second.metrics["segments"] == 2  # the episode's counters stay


def test_budgets_and_outages_are_openai_errors_that_record_nothing(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [ANSWER], fail_first=1)

    async def run() -> tuple[list[Exception], Any, Any]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model, max_turns=1, max_total_tokens=64), episode_id="ep")
        client = await _client(gateway, session)
        errors: list[Exception] = []
        short = [{"role": "user", "content": "hi"}]
        for messages in ([{"role": "user", "content": "word " * 80}], short):
            try:
                await client.chat.completions.create(model="m", messages=messages)
            except openai.APIStatusError as exc:
                errors.append(exc)
        ok = await client.chat.completions.create(model="m", messages=short)  # the retry after the outage
        try:
            await client.chat.completions.create(model="m", messages=short)
        except openai.APIStatusError as exc:
            errors.append(exc)
        return errors, ok, session

    errors, ok, session = asyncio.run(run())
    too_long, outage, over_turns = errors
    assert too_long.status_code == 400 and too_long.body["code"] == "context_length_exceeded"
    assert "64 tokens" in too_long.body["message"]
    assert outage.status_code == 503 and outage.body["type"] == "server_error"
    assert over_turns.status_code == 400 and over_turns.body["code"] == "max_turns_exceeded"
    assert ok.choices[0].message.content.endswith("\\boxed{37}.")
    assert session.budget_hit == FinishReason.MAX_TURNS
    (t,) = session.trajectories(reward=0.0, finish_reason=FinishReason.MAX_TURNS)
    assert t.metrics["llm_calls"] == 1 and t.metrics["server_errors"] == 1 and t.metrics["refused_context"] == 1
    t.validate()


def test_stop_strings_cut_the_answer_and_keep_the_sampled_tokens(template: ChatTemplate) -> None:
    text = "Thought: add them.\nAction: add\nObservation: 3<|im_end|>"
    model = ScriptedModel(template, [text])

    async def run() -> tuple[Any, Trajectory]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model), episode_id="ep")
        reply = await (await _client(gateway, session)).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], stop=["Observation:"], logprobs=True)
        return reply, session.trajectories(reward=0.0, finish_reason=FinishReason.DONE)[0]

    reply, t = asyncio.run(run())
    assert reply.choices[0].message.content == "Thought: add them.\nAction: add"
    assert reply.choices[0].finish_reason == "stop"
    sampled = template.tokenizer.decode(t.tokens_of(TokenOrigin.SAMPLED))
    assert sampled.startswith("Thought: add them.\nAction: add\nObservation:") and "3" not in sampled
    assert "".join(lp.token for lp in reply.choices[0].logprobs.content) == sampled


class KeptSetModel(ScriptedModel):
    """A ScriptedModel that samples 'with truncation': each token comes with a kept set of two."""

    async def generate(self, prompt_ids: list[int], sampling: Any, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        self.sampling = sampling
        gen = await super().generate(prompt_ids, sampling, session_id=session_id, timeout_s=timeout_s)
        return dataclasses.replace(gen, kept_sets=[[t, t + 1] for t in gen.token_ids])


def test_truncated_sampling_reaches_the_engine_and_kept_sets_are_cut_with_the_answer(template: ChatTemplate) -> None:
    text = "Thought: add them.\nAction: add\nObservation: 3<|im_end|>"
    model = KeptSetModel(template, [text])

    async def run() -> Trajectory:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model, top_p=0.9, top_k=20, min_p=0.05, max_kept_set=32),
                                       episode_id="ep")
        await (await _client(gateway, session)).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], stop=["Observation:"])
        return session.trajectories(reward=0.0, finish_reason=FinishReason.DONE)[0]

    t = asyncio.run(run())
    s = model.sampling
    assert (s.top_p, s.top_k, s.min_p, s.max_kept_set) == (0.9, 20, 0.05, 32)  # the run's, not the agent's
    # The AgentLoop records them the same way, two turns of tool calls included.
    row = {"prompt": [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+2 and 30+4?"}]}
    loop = _loop(template, KeptSetModel(template, [CALLS, ANSWER]), top_k=20)
    played = asyncio.run(loop.run_episode(AddEnv(), row=row, episode_id="ep"))
    assert played.kept_sets == [[tok, tok + 1] for tok in played.tokens_of(TokenOrigin.SAMPLED)]
    assert played.num_turns == 2
    played.validate()
    sampled = t.tokens_of(TokenOrigin.SAMPLED)
    assert len(sampled) < len(template.tokenizer.encode(text, add_special_tokens=False))  # cut at the stop
    assert t.kept_sets == [[tok, tok + 1] for tok in sampled]
    t.validate()


def test_models_route_and_unknown_keys(template: ChatTemplate) -> None:
    async def run() -> tuple[Any, Exception]:
        gateway = Gateway(model_name="tiny")
        session = gateway.open_session(_loop(template, ScriptedModel(template, [ANSWER])), episode_id="ep")
        client = await _client(gateway, session)
        models = await client.models.list()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gateway")
        stranger = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="nobody", http_client=http, max_retries=0)
        try:
            await stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        except openai.AuthenticationError as exc:
            return models, exc
        raise AssertionError("an unknown key was served")

    models, refused = asyncio.run(run())
    assert [m.id for m in models.data] == ["tiny"]
    assert refused.body["code"] == "invalid_api_key"


# ── the Responses API ───────────────────────────────────────────────────────────────────────
def test_responses_api_calls_tools_and_continues_the_same_segment(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [CALLS, ANSWER, ANSWER])
    tools = [{"type": "function", "name": "add", "description": "Add two integers.",
              "parameters": TOOLS[0]["function"]["parameters"]}]

    async def run() -> tuple[Any, Any, list[Any], list[Trajectory]]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, model), episode_id="ep")
        client = await _client(gateway, session)
        items: list[Any] = [{"role": "user", "content": "What is 1+2 plus 30+4?"}]
        first = await client.responses.create(model="m", instructions="You add.", input=items, tools=tools)
        calls = [o for o in first.output if o.type == "function_call"]
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items += [{"type": "function_call_output", "call_id": c.call_id,
                   "output": str(sum(json.loads(c.arguments).values()))} for c in calls]
        second = await client.responses.create(model="m", instructions="You add.", input=items, tools=tools)
        events = [e async for e in await client.responses.create(
            model="m", instructions="You add.", previous_response_id=second.id,
            input=[{"role": "user", "content": "Again?"}], tools=tools, stream=True)]
        return first, second, events, session.trajectories(reward=1.0, finish_reason=FinishReason.DONE)

    first, second, events, segments = asyncio.run(run())
    assert [o.type for o in first.output] == ["message", "function_call", "function_call"]
    assert first.output[0].content[0].text == "I will add both pairs."
    assert second.output_text.endswith("\\boxed{37}.")
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text.endswith("\\boxed{37}.")
    assert len(segments) == 1 and segments[0].metrics["llm_calls"] == 3
    _check(segments[0], model.sent["ep"])
    assert template.tokenizer.decode(segments[0].tokens_of(TokenOrigin.TOOL)).startswith("334")


def test_what_the_gateway_does_not_serve_is_a_4xx_in_the_apis_shape(template: ChatTemplate) -> None:
    async def run() -> list[tuple[int, dict[str, Any]]]:
        gateway = Gateway()
        session = gateway.open_session(_loop(template, ScriptedModel(template, [CALLS])), episode_id="ep")
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app),
                                     base_url=f"http://gateway/s/{session.key}/v1") as http:
            for path, body in (
                ("/chat/completions", b"{not json"),
                ("/responses", {"input": "hi", "tools": [{"type": "web_search"}]}),
                ("/responses", {"input": "hi", "previous_response_id": "resp_unknown"}),
                ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                       "tool_choice": "none"}),
            ):
                r = await (http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body))
                out.append((r.status_code, r.json()))
        return out

    (bad_json, web_search, unknown_prev, no_tools) = asyncio.run(run())
    assert bad_json[0] == 400 and "not valid JSON" in bad_json[1]["error"]["message"]
    assert web_search[0] == 400 and web_search[1]["error"]["param"] == "tools[0]"
    assert unknown_prev[0] == 404 and unknown_prev[1]["error"]["code"] == "previous_response_not_found"
    # tool_choice "none": the model's call markup is the answer's text, not a tool call
    assert no_tools[0] == 200 and no_tools[1]["choices"][0]["finish_reason"] == "stop"
    assert "<tool_call>" in no_tools[1]["choices"][0]["message"]["content"]
