"""The OpenAI Chat Completions wire format, as the gateway reads and writes it.

`parse_chat_request` turns a `/v1/chat/completions` body into a `ChatRequest`: messages in the
shape chat templates render (content parts joined into one string, `developer` read as `system`,
tool-call arguments decoded from their JSON string into an object, a tool result given the name of
the call it answers), the tool schemas, and the options the gateway honours. Anything it cannot
serve is a `WireError`, which the server sends back as an OpenAI-style error body with a 4xx
status, never a 500. `completion_body`, `completion_chunks` and `error_body` build the answers:
a `chat.completion` object, the `chat.completion.chunk` stream (role, content, one delta per tool
call, the finish reason, usage when asked, then `[DONE]`), and `{"error": {...}}`.

`message_key` gives each message a comparable form: the gateway decides whether a request extends
the conversation it recorded by comparing keys, so an assistant message is compared by what the
model said (its text and its calls' names and decoded arguments), not by the call ids or by how the
client re-serialised the arguments. This module does no I/O and knows nothing of sessions.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Message, Role, ToolCall, ToolSchema

__all__ = [
    "ChatRequest",
    "Completion",
    "WireError",
    "assistant_message",
    "completion_body",
    "completion_chunks",
    "decode_body",
    "error_body",
    "message_key",
    "parse_chat_request",
    "to_template_message",
]

_ROLES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_TEXT_PARTS = ("text", "input_text", "output_text")
# Sampling options an agent may send that the gateway does not apply: during training every token
# is sampled with the run's settings, or the trainer's logprobs would not match the rollout's.
_IGNORED_SAMPLING = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias")
# Deeper JSON than any chat request needs; the template and the cache keys recurse into what they render.
MAX_JSON_DEPTH = 64
_MAX_STOPS = 4  # as the OpenAI API
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class WireError(Exception):
    """A request the gateway cannot serve; becomes an OpenAI-style error body with `status`."""

    def __init__(
        self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), kind=self.kind, code=self.code, param=self.param)


def error_body(message: str, *, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, the body the OpenAI API sends with a 4xx/5xx."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChatRequest:
    """What the gateway takes from one chat completion request."""

    model: str
    messages: list[Message]
    keys: list[str]
    tools: list[ToolSchema] | None = None
    tool_choice: Any = "auto"
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    seed: int | None = None
    ignored: tuple[str, ...] = ()
    """Options the client set that the gateway does not apply (sampling is the run's)."""

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls are read out of the model's text (tools offered, not `tool_choice: none`)."""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass
class Completion:
    """One answer, ready to be written as a `chat.completion` or as chunks."""

    model: str
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[tuple[str, float]] | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [_wire_call(c) for c in self.tool_calls]
        return msg

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _wire_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }


# ── requests ────────────────────────────────────────────────────────────────────────────────
def decode_body(raw: bytes) -> Any:
    """A request body as JSON the gateway can render: valid UTF-8 without lone surrogates, nested at
    most `MAX_JSON_DEPTH` deep; anything else is a 400 `WireError` saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"The request body is not valid UTF-8 (byte {exc.start}); send JSON encoded as UTF-8.",
                        code="invalid_json") from exc
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise WireError(f"The request body nests JSON more than {MAX_JSON_DEPTH} levels deep; no chat request "
                        "needs that.", code="invalid_json") from exc
    except ValueError as exc:
        raise WireError(f"The request body is not valid JSON: {exc}", code="invalid_json") from exc
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(value)
    if _SURROGATE_ESCAPE.search(raw) is not None:
        _check_strings(value)
    return value


def _check_depth(value: Any) -> None:
    """Refuse nesting deeper than `MAX_JSON_DEPTH` (iteratively: the depth is what it guards)."""
    level: list[Any] = [value]
    for _ in range(MAX_JSON_DEPTH + 1):
        level = [c for node in level for c in (node.values() if isinstance(node, dict) else node)
                 if isinstance(c, (dict, list))]
        if not level:
            return
    raise WireError(f"The request body nests JSON more than {MAX_JSON_DEPTH} levels deep; no chat request "
                    "needs that.", code="invalid_json")


def _check_strings(value: Any) -> None:
    """Refuse strings with lone surrogates (`"\\ud800"` decodes to one), which no tokenizer can encode."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, where = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            if isinstance(child, (dict, list)):
                stack.append((child, path))
            elif (isinstance(child, str) and not _is_utf8(child)) or (isinstance(key, str) and not _is_utf8(key)):
                path = path.lstrip(".").encode("utf-8", "backslashreplace").decode("utf-8")
                raise WireError(f"{path} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                                "which is not text; send valid Unicode.", param=path, code="invalid_json")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stops(stop: Any) -> tuple[str, ...]:
    """`stop` as the API takes it: a string, a list of up to 4 strings, or null."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and len(stop) <= _MAX_STOPS and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise WireError(f"'stop' must be a string or a list of up to {_MAX_STOPS} strings, got {_short(stop)}.",
                    param="stop")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a chat completion request body; raise `WireError` naming the bad field."""
    if not isinstance(body, dict):
        raise WireError("The request body must be a JSON object.")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise WireError("'messages' must be a non-empty list of chat messages.", param="messages")
    messages = [to_template_message(m, i) for i, m in enumerate(raw)]
    _name_tool_results(messages)
    n = body.get("n", 1)
    if n not in (1, None):
        raise WireError("The agentrl gateway samples one choice per request (n=1); make n separate calls.",
                        param="n")
    tools = _tools(body.get("tools"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise WireError(f"'max_tokens' must be a positive integer, got {_short(max_tokens)}.",
                        param="max_tokens")
    stops = _stops(body.get("stop"))
    seed = body.get("seed")
    options = body.get("stream_options") or {}
    return ChatRequest(
        model=str(body.get("model") or ""),
        messages=messages,
        keys=[message_key(m) for m in messages],
        tools=tools,
        tool_choice=body.get("tool_choice") or "auto",
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        max_tokens=max_tokens,
        stop=stops,
        logprobs=bool(body.get("logprobs")),
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        ignored=tuple(k for k in _IGNORED_SAMPLING if body.get(k) is not None),
    )


def _tools(raw: Any) -> list[ToolSchema] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise WireError("'tools' must be a list of function tools.", param="tools")
    tools: list[ToolSchema] = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise WireError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                            "'parameters': {...}}}}}; only function tools are served.", param=f"tools[{i}]")
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if k != "strict"}})
    return tools


def _text(content: Any, where: str) -> str:
    """A message's content as one string (text parts joined by newlines, as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "refusal":
                parts.append(str(part.get("refusal", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise WireError(f"{where}.content[{j}] is a '{kind}' part; the gateway serves text only.",
                                param=f"{where}.content")
        return "\n".join(parts)
    raise WireError(f"{where}.content must be a string or a list of text parts.", param=f"{where}.content")


def to_template_message(m: Any, index: int = 0) -> Message:
    """One OpenAI message in the shape Hugging Face chat templates render."""
    where = f"messages[{index}]"
    if not isinstance(m, Mapping):
        raise WireError(f"{where} must be an object with a 'role'.", param=where)
    role = _ROLES.get(str(m.get("role")))
    if role is None:
        raise WireError(f"{where}.role {m.get('role')!r} is not one of system, developer, user, assistant, "
                        "tool.", param=f"{where}.role")
    out: Message = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise WireError(f"{where}.tool_calls must be a list.", param=f"{where}.tool_calls")
            out["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        reasoning = m.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
    elif role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None:
            out["tool_call_id"] = str(call_id)
    if isinstance(m.get("name"), str) and m["name"]:
        out["name"] = m["name"]
    return out


def _template_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise WireError(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}.",
                        param=where)
    args: Any = fn.get("arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):  # templates render arguments with `tojson`: they want the object
            args = decoded
    elif args is None:
        args = {}
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _name_tool_results(messages: list[Message]) -> None:
    """Give each tool result the name of the call it answers (templates that render names need it)."""
    names: dict[str, str] = {}
    for m in messages:
        for c in m.get("tool_calls") or ():
            if c.get("id"):
                names[c["id"]] = c["function"]["name"]
        if m["role"] == "tool" and "name" not in m:
            name = names.get(m.get("tool_call_id", ""))
            if name:
                m["name"] = name


def message_key(m: Message) -> str:
    """A comparable form of a message (module docstring): what must be equal for "the same message"."""
    if m.get("role") == "assistant":
        calls = [
            [c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls") or ()
        ]
        return json.dumps(["assistant", m.get("content") or "", calls], sort_keys=True, ensure_ascii=False)
    return json.dumps(m, sort_keys=True, ensure_ascii=False)


def assistant_message(content: str, calls: Sequence[ToolCall]) -> Message:
    """The template-shaped assistant message of a turn the gateway answered."""
    msg: Message = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.to_message_dict() for c in calls]
    return msg


# ── answers ─────────────────────────────────────────────────────────────────────────────────
def completion_body(c: Completion) -> dict[str, Any]:
    """The `chat.completion` object of a non-streamed answer."""
    choice: dict[str, Any] = {"index": 0, "message": c.message(), "logprobs": _logprobs(c),
                              "finish_reason": c.finish_reason}
    return {"id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
            "choices": [choice], "usage": c.usage(), "system_fingerprint": None}


def _logprobs(c: Completion) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    return {"content": [
        {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace")), "top_logprobs": []}
        for tok, lp in c.logprobs
    ], "refusal": None}


def completion_chunks(c: Completion, *, include_usage: bool = False) -> Iterator[str]:
    """The server-sent events of a streamed answer, each a `data: ...` line pair, ending with `[DONE]`."""
    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        body = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if c.content:
        yield chunk({"content": c.content}, logprobs=_logprobs(c))
    for i, call in enumerate(c.tool_calls):
        wire = _wire_call(call)
        yield chunk({"tool_calls": [{"index": i, "id": wire["id"], "type": "function",
                                     "function": {"name": wire["function"]["name"], "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": wire["function"]["arguments"]}}]})
    yield chunk({}, c.finish_reason)
    if include_usage:
        usage = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
                 "choices": [], "usage": c.usage()}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
