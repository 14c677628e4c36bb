"""Fuzzing the gateway's wire format: whatever an agent sends, the answer is a 2xx or a 4xx, never a 5xx.

A real gateway (uvicorn on loopback, in a thread of its own) serves a scripted model through the
real Qwen2 tokenizer, chat template and tool parser; hypothesis (derandomised in CI, see
tests/conftest.py) sends it chat completion, Responses and session-end requests whose fields have
the wrong types, odd Unicode, NaN, deep nesting and sizes around the body cap, and mutates the
encoded bytes (truncated, invalid UTF-8, lone surrogate escapes, wrapped in deep arrays). Every
answer must be below 500 and, when it is an error, in the OpenAI error shape. The second test
checks the loop is never stalled by a huge request: /health answers while one is being refused.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.chat import ChatTemplate
from agentrl.gateway import Gateway
from agentrl.rollout import AgentLoop, AgentLoopConfig
from agentrl.tools.parsers import HermesParser
from agentrl.types import Generation

hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis, a dev extra: pip install -e '.[dev]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
ANSWER = "The answer is \\boxed{3}.<|im_end|>"
CAP_MB = 0.5


class AlternatingModel:
    """Answers with a tool call or a final answer (by the prompt's parity), cut at `max_tokens`."""

    def __init__(self, template: ChatTemplate) -> None:
        self.answers = [template.tokenizer.encode(t, add_special_tokens=False) for t in (ANSWER, CALL)]

    async def generate(self, prompt_ids: list[int], sampling: Any, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        full = self.answers[len(prompt_ids) % 2]
        ids = full[: sampling.max_tokens]
        return Generation(ids, [-1.0] * len(ids), "length" if len(ids) < len(full) else "stop", weight_version=0)


@pytest.fixture(scope="module")
def http(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(assets: Path) -> Iterator[Gateway]:
    template = ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")
    backend = AgentLoop(AlternatingModel(template), template, HermesParser(),
                        AgentLoopConfig(max_turns=10_000, max_total_tokens=1024, gateway_max_request_mb=CAP_MB))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway-under-fuzz", daemon=True)
    thread.start()
    gw = Gateway(default_backend=backend)
    asyncio.run_coroutine_threadsafe(gw.start(), loop).result(60)
    yield gw
    asyncio.run_coroutine_threadsafe(gw.aclose(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


# ── what an agent might send ────────────────────────────────────────────────────────────────
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
big_text = st.sampled_from([0, 40, 3000, 200_000, int(CAP_MB * 1_000_000) + 1]).map(lambda n: "word " * (n // 5))
texts = st.text(max_size=40) | big_text
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image_url", "refusal", 3]),
                                        "text": texts | json_values}) | json_values, max_size=3)
tool_calls = st.lists(st.fixed_dictionaries(
    {"id": st.text(max_size=4) | json_values, "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["add", ""]) | json_values,
                                        "arguments": st.sampled_from(['{"a": 1}', "{not json", ""]) | json_values})})
    | json_values, max_size=2)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | json_values},
    optional={"content": texts | parts | json_values, "tool_calls": tool_calls, "tool_call_id": json_values,
              "name": json_values}), max_size=4) | json_values
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | json_values,
                                        "function": st.fixed_dictionaries({"name": st.just("add") | json_values},
                                                                          optional={"parameters": json_values})}
                                       ) | json_values, max_size=2) | json_values
flat_tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "file_search"]) | json_values,
                                             "name": st.just("add") | json_values},
                                            optional={"parameters": json_values}) | json_values, max_size=2)
options = {"model": json_values, "stream": st.booleans() | json_values, "stop": json_values,
           "max_tokens": st.integers(-3, 40) | json_values, "seed": json_values, "n": json_values,
           "logprobs": json_values, "temperature": json_values, "tool_choice": json_values,
           "stream_options": json_values}
chat_bodies = st.fixed_dictionaries({"messages": messages}, optional={"tools": tools, **options}) | json_values
items = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "other"])
     | json_values},
    optional={"role": st.sampled_from(["user", "assistant"]) | json_values, "content": texts | parts,
              "call_id": json_values, "name": json_values, "arguments": json_values, "output": json_values}),
    max_size=3)
responses_bodies = st.fixed_dictionaries({"input": texts | items | json_values}, optional={
    "instructions": json_values, "previous_response_id": st.sampled_from(["resp_x", ""]) | json_values,
    "tools": flat_tools | json_values, "max_output_tokens": st.integers(-1, 40) | json_values, **options,
}) | json_values
end_bodies = st.fixed_dictionaries({}, optional={"reward": st.floats() | json_values}) | json_values

ENDPOINTS = {"chat": ("/s/{key}/v1/chat/completions", chat_bodies),
             "responses": ("/s/{key}/v1/responses", responses_bodies),
             "end": ("/agentrl/sessions/{key}/end", end_bodies)}


def _mutate(raw: bytes, how: str, at: int) -> bytes:
    cut = at % (len(raw) + 1)
    return {
        "as is": raw,
        "truncated": raw[:cut],
        "invalid utf-8": raw[:cut] + b"\xff\xfe" + raw[cut:],
        "surrogate": raw.replace(b'"', b'"\\udc80', 1),
        "deep": b"[" * (at % 200_000) + raw + b"]" * (at % 200_000),
        "empty": b"",
    }[how]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(endpoint=st.sampled_from(sorted(ENDPOINTS)), data=st.data(), key=st.sampled_from(["a", "b", "c"]),
       how=st.sampled_from(["as is", "as is", "as is", "truncated", "invalid utf-8", "surrogate", "deep", "empty"]),
       at=st.integers(0, 1 << 20))
def test_no_request_gets_a_5xx(http: httpx.Client, endpoint: str, data: Any, key: str, how: str, at: int) -> None:
    path, bodies = ENDPOINTS[endpoint]
    body = data.draw(bodies)
    raw = _mutate(json.dumps(body).encode("utf-8"), how, at)  # json.dumps writes NaN and Infinity
    r = http.post(path.format(key=key), content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith(("data: [DONE]", "}")) and r.text.startswith(("data: ", "event: "))
    else:
        assert isinstance(r.json(), dict)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/s/big/v1/chat/completions", "/s/big/v1/responses", "/agentrl/sessions/big/end"])
def test_health_answers_while_a_huge_body_is_refused(gateway: Gateway, path: str, chunked: bool) -> None:
    """The upload stops half-way until /health (asked from another thread) has answered; were the
    event loop busy with the huge body, /health could not answer and the upload would give up."""
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        assert http.post("/s/big/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                         ).status_code == 200  # the session exists (the end route needs it)
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 16_000_000}], "input": "x",
                       "reward": 1.0}).encode()
    health: list[int] = []
    answered = threading.Event()

    def ask_health() -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            health.append(http.get("/health").status_code)
        answered.set()

    def upload() -> Iterator[bytes]:
        step = 1 << 18
        for k in range(0, len(huge), step):
            if k == 4 * step:
                threading.Thread(target=ask_health).start()
                answered.wait(timeout=30)
            yield huge[k:k + step]

    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        headers = {} if chunked else {"content-length": str(len(huge))}
        r = http.post(path, content=upload(), headers=headers)
    assert health == [200]
    assert r.status_code == 413 and "rollout.gateway_max_request_mb" in r.json()["error"]["message"]
