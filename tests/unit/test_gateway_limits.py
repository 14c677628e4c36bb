"""The gateway refuses what it cannot serve with the documented 4xx, and one agent cannot stall the others.

Each test drives a real gateway on loopback (uvicorn in the test's event loop) with the `openai`
client or raw HTTP, behind a scripted model (the real Qwen2 tokenizer, chat template and tool
parser; only the sampling is scripted). What is guarded: bad field types, lone surrogates and
absurd nesting are 400s naming what is wrong (never 500); a non-finite reward is refused, so the
trajectory file stays strict JSON; an oversized body is refused with 413 by its size, and the
event loop keeps answering other sessions while a big request is refused or tokenised; a reply
cut by its token budget inside a tool call finishes as `length`; a generation that ends after its
episode's deadline or end is dropped and counted, never written into trajectories handed over.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.chat import ChatTemplate
from agentrl.gateway import Gateway
from agentrl.gateway.standalone import TrajectoryWriter
from agentrl.rollout import AgentLoop, AgentLoopConfig
from agentrl.tools.parsers import HermesParser
from agentrl.types import FinishReason, Generation, TokenOrigin

openai = pytest.importorskip("openai", reason="needs the openai client, a dev extra: pip install -e '.[dev]'")

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 30, "b": 4}}\n</tool_call><|im_end|>')
ANSWER = "The answer is \\boxed{37}.<|im_end|>"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")


class ScriptedModel:
    """A GenerateClient answering each session's k-th call with `script[k]`, cut at `max_tokens`;
    with `gate`, each generation waits for it to be set."""

    def __init__(self, template: ChatTemplate, script: list[str], gate: asyncio.Event | None = None) -> None:
        self.tok = template.tokenizer
        self.script = script
        self.gate = gate
        self.calls = 0
        self.started = asyncio.Event()

    async def generate(self, prompt_ids: list[int], sampling: Any, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        text = self.script[min(self.calls - 1, len(self.script) - 1)]
        full = self.tok.encode(text, add_special_tokens=False)
        ids = full[: sampling.max_tokens]
        return Generation(ids, [-0.5] * len(ids), "length" if len(ids) < len(full) else "stop", weight_version=1)


def _loop(template: ChatTemplate, model: ScriptedModel, **cfg: Any) -> AgentLoop:
    return AgentLoop(model, template, HermesParser(), AgentLoopConfig(**{"max_turns": 6, **cfg}))


def _error_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ── bad requests are 400s naming the parameter ──────────────────────────────────────────────
def test_bad_types_surrogates_and_deep_nesting_are_400s_naming_the_parameter(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [ANSWER])

    async def run() -> tuple[list[tuple[int, dict[str, Any]]], Any, Any]:
        async with Gateway() as gateway:
            session = gateway.open_session(_loop(template, model), episode_id="ep")
            base = f"{gateway.url}/s/{session.key}/v1"
            client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
            out = []
            try:
                await client.chat.completions.create(model="m", messages=HI, stop=123)  # type: ignore[arg-type]
            except openai.BadRequestError as exc:
                out.append((exc.status_code, exc.response.json()))
            async with httpx.AsyncClient(base_url=base) as http:
                for path, raw in (
                    ("/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
                    ("/chat/completions", b"[" * 100_000 + b"]" * 100_000),
                    ("/responses", json.dumps({"input": "hi", "previous_response_id": ["resp_1"]}).encode()),
                    ("/chat/completions", b'{"messages": [{"role": "user", "content": "\xff"}]}'),
                ):
                    r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                    out.append((r.status_code, r.json()))
            ok = await client.chat.completions.create(model="m", messages=HI)
            return out, ok, session.trajectories(reward=0.0, finish_reason=FinishReason.DONE)

    errors, ok, segments = asyncio.run(run())
    stop, surrogate, deep, previous, not_utf8 = ((status, _error_shape(body)) for status, body in errors)
    assert stop[0] == 400 and stop[1]["param"] == "stop" and "123" in stop[1]["message"]
    assert surrogate[0] == 400 and surrogate[1]["param"] == "messages[0].content"
    assert "surrogate" in surrogate[1]["message"]
    assert deep[0] == 400 and "levels deep" in deep[1]["message"]
    assert previous[0] == 400 and previous[1]["param"] == "previous_response_id"
    assert not_utf8[0] == 400 and "UTF-8" in not_utf8[1]["message"]
    # The refusals recorded nothing; the next good call is the session's first and only one.
    assert ok.choices[0].message.content == "The answer is \\boxed{37}."
    assert model.calls == 1 and len(segments) == 1 and segments[0].metrics["llm_calls"] == 1


def test_a_non_finite_reward_is_refused_and_the_trajectory_file_stays_strict_json(
        template: ChatTemplate, tmp_path: Path) -> None:
    loop = _loop(template, ScriptedModel(template, [ANSWER]))
    writer = TrajectoryWriter(tmp_path / "trajectories.jsonl", template.tokenizer)

    async def run() -> list[tuple[int, dict[str, Any]]]:
        async with Gateway(default_backend=loop, on_session_end=writer) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="run-a", max_retries=0)
            await client.chat.completions.create(model="m", messages=HI)
            out = []
            async with httpx.AsyncClient(base_url=gateway.url) as http:
                for raw in (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": 1e999}', b'{"reward": 0.5}'):
                    r = await http.post("/agentrl/sessions/run-a/end", content=raw)
                    out.append((r.status_code, r.json()))
            return out

    nan, inf, overflow, ok = asyncio.run(run())
    for status, body in (nan, inf, overflow):
        error = _error_shape(body)
        assert status == 400 and error["param"] == "reward" and "finite" in error["message"]
    assert ok == (200, {"key": "run-a", "segments": 1, "calls": 1})

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not strict JSON")

    (line,) = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=no_constants)["reward"] == 0.5


# ── one agent cannot stall the others ───────────────────────────────────────────────────────
def test_an_oversized_body_is_413_by_its_size_while_health_keeps_answering(template: ChatTemplate) -> None:
    model = ScriptedModel(template, [ANSWER])
    eight_mb = json.dumps({"messages": [{"role": "user", "content": "word " * 1_600_000}]}).encode()
    events: list[str] = []
    answered = asyncio.Event()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused once it passes the cap
        for k in range(0, len(eight_mb), 1 << 16):
            if k == 1 << 20:
                events.append("upload half-way")
                await asyncio.wait_for(answered.wait(), 30)  # the upload waits, in flight, for /health
            yield eight_mb[k:k + (1 << 16)]
        events.append("upload done")

    async def health(http: httpx.AsyncClient) -> int:
        while "upload half-way" not in events:
            await asyncio.sleep(0.001)
        status = (await http.get("/health")).status_code
        events.append("health answered")
        answered.set()
        return status

    async def run() -> tuple[tuple[int, dict[str, Any]], tuple[int, dict[str, Any]], int]:
        async with Gateway() as gateway:
            session = gateway.open_session(_loop(template, model, gateway_max_request_mb=1.0), episode_id="ep")
            async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
                path = f"/s/{session.key}/v1/chat/completions"
                sized = await http.post(path, content=eight_mb)
                streamed, up = await asyncio.gather(http.post(path, content=chunked()), health(http))
            return (sized.status_code, sized.json()), (streamed.status_code, streamed.json()), up

    sized, streamed, up = asyncio.run(run())
    for status, body in (sized, streamed):
        error = _error_shape(body)
        assert status == 413 and error["code"] == "request_too_large"
        assert "rollout.gateway_max_request_mb" in error["message"] and "1 MB" in error["message"]
    assert str(len(eight_mb)) in sized[1]["error"]["message"]
    assert up == 200 and events.index("health answered") < events.index("upload done")
    assert model.calls == 0


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_rendered(template: ChatTemplate,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rendered: list[int] = []
    real = template.first_prompt_ids
    monkeypatch.setattr(template, "first_prompt_ids", lambda *a, **k: rendered.append(1) or real(*a, **k))
    model = ScriptedModel(template, [ANSWER])
    big = [{"role": "user", "content": "x" * 900_000}]

    async def run() -> Any:
        async with Gateway() as gateway:
            session = gateway.open_session(_loop(template, model, max_total_tokens=2048), episode_id="ep")
            client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key="unused", max_retries=0)
            try:
                await client.chat.completions.create(model="m", messages=big)
            except openai.BadRequestError as exc:
                return exc, session
        raise AssertionError("a prompt of 900,000 characters fit 2048 tokens")

    refused, session = asyncio.run(run())
    assert refused.body["code"] == "context_length_exceeded" and "at least" in refused.body["message"]
    assert rendered == [] and model.calls == 0
    assert session.budget_hit == FinishReason.MAX_LENGTH and session.counters["refused_context"] == 1


def test_a_big_prompt_is_tokenised_off_the_event_loop(template: ChatTemplate, monkeypatch: pytest.MonkeyPatch) -> None:
    """The template work of a big call waits (in its thread) until /health has answered: were it on
    the event loop, /health could not answer and the wait would run out."""
    health_answered = threading.Event()
    threads: list[threading.Thread] = []
    real = template.first_prompt_ids

    def first_prompt_ids(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        health_answered.wait(timeout=20)
        return real(*args, **kwargs)

    monkeypatch.setattr(template, "first_prompt_ids", first_prompt_ids)
    model = ScriptedModel(template, [ANSWER])
    big = [{"role": "user", "content": "numbers 12345 and words " * 4000}]

    async def run() -> tuple[Any, int]:
        async with Gateway() as gateway:
            session = gateway.open_session(_loop(template, model, max_total_tokens=200_000), episode_id="ep")
            client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key="unused", max_retries=0)
            call = asyncio.create_task(client.chat.completions.create(model="m", messages=big))
            while not threads:
                await asyncio.sleep(0.001)
            async with httpx.AsyncClient() as http:
                status = (await http.get(f"{gateway.url}/health")).status_code
            health_answered.set()
            return await call, status

    reply, status = asyncio.run(run())
    assert status == 200 and reply.choices[0].message.content == "The answer is \\boxed{37}."
    assert threads and threads[0] is not threading.main_thread()


# ── what the model sampled ──────────────────────────────────────────────────────────────────
def test_a_reply_cut_inside_a_tool_call_finishes_with_length(template: ChatTemplate) -> None:
    # Cut after the first call and part of the second: one call parsed, the rest half-written.
    budget = len(template.tokenizer.encode(CALLS.split("</tool_call>")[0] + '</tool_call>\n<tool_call>\n{"name"'))
    model = ScriptedModel(template, [CALLS])

    async def run() -> tuple[Any, Any]:
        async with Gateway() as gateway:
            session = gateway.open_session(_loop(template, model), episode_id="ep")
            client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key="unused", max_retries=0)
            chat = await client.chat.completions.create(model="m", messages=HI, tools=TOOLS, max_tokens=budget)
            response = await client.responses.create(model="m", input="hi again", max_output_tokens=budget,
                                                     tools=[{"type": "function", "name": "add",
                                                             "parameters": TOOLS[0]["function"]["parameters"]}])
            return chat, response

    chat, response = asyncio.run(run())
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == budget
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_a_generation_that_ends_after_the_episode_is_dropped_and_counted(template: ChatTemplate) -> None:
    async def run() -> dict[str, Any]:
        gate = asyncio.Event()
        model = ScriptedModel(template, [ANSWER], gate=gate)
        gate.set()  # the first call answers at once
        out: dict[str, Any] = {}
        async with Gateway() as gateway:
            # (a) the episode's deadline passes while the call generates; the session is still open
            timed = gateway.open_session(_loop(template, model), episode_id="timed")
            client = openai.AsyncOpenAI(base_url=gateway.base_url(timed), api_key="unused", max_retries=0)
            await client.chat.completions.create(model="m", messages=HI)
            gate.clear()
            model.started.clear()
            late = asyncio.create_task(client.chat.completions.create(
                model="m", messages=[*HI, {"role": "assistant", "content": "The answer is \\boxed{37}."},
                                     {"role": "user", "content": "again"}]))
            await model.started.wait()
            timed.deadline = time.monotonic() - 1.0  # the deadline is now behind it
            gate.set()
            with pytest.raises(openai.APIStatusError) as exc:
                await late
            out["timed"] = (exc.value.status_code, exc.value.body["code"],
                            timed.trajectories(reward=0.0, finish_reason=FinishReason.TIMEOUT))
            # (b) the episode is handed over (its trajectories taken) while a call generates
            ended = gateway.open_session(_loop(template, model), episode_id="ended")
            client = openai.AsyncOpenAI(base_url=gateway.base_url(ended), api_key="unused", max_retries=0)
            await client.chat.completions.create(model="m", messages=HI)
            gate.clear()
            model.started.clear()
            late = asyncio.create_task(client.chat.completions.create(model="m", messages=[
                *HI, {"role": "assistant", "content": "The answer is \\boxed{37}."}, {"role": "user", "content": "?"}]))
            await model.started.wait()
            handed = ended.trajectories(reward=0.0, finish_reason=FinishReason.TIMEOUT)
            snapshot = [list(t.token_ids) for t in handed]
            gate.set()
            with pytest.raises(openai.APIStatusError) as exc:
                await late
            out["ended"] = (exc.value.status_code, exc.value.body["code"], handed, snapshot, ended.counters)
        return out

    out = asyncio.run(run())
    status, code, (t,) = out["timed"]
    answer_tokens = len(template.tokenizer.encode(ANSWER))
    assert (status, code) == (408, "episode_timeout")
    assert t.metrics["llm_calls"] == 1 and t.metrics["late_calls"] == 1 and t.metrics["late_tokens"] == answer_tokens
    assert len(t.tokens_of(TokenOrigin.SAMPLED)) == answer_tokens  # the first answer only
    status, code, (t,), snapshot, counters = out["ended"]
    assert (status, code) == (410, "session_closed")
    assert [list(t.token_ids)] == snapshot  # the trajectory handed over did not change
    assert t.metrics["late_calls"] == 1 and t.metrics["late_tokens"] == 0  # counted while in flight
    assert counters["late_tokens_after_end"] == answer_tokens
