"""The OpenAI Responses API (`POST /v1/responses`), served as a chat completion over the same session.

A Responses request is translated into a `ChatRequest`: `instructions` becomes the system message,
`input` (a string, or a list of items) becomes chat messages, where an assistant `message` item
and the `function_call` items after it form one assistant message with tool calls (the way the
gateway answered them), and each `function_call_output` becomes a tool message. Function tools are
accepted in the Responses' flat form (`{"type": "function", "name", "parameters"}`). The answer is
the same `Completion` as for Chat Completions, written as a `response` object: an output `message`
with its `output_text`, then one `function_call` item per call; a turn cut by its token budget is
`status: "incomplete"`. Streaming sends the Responses event sequence (`response.created`, the
items' added/delta/done events, `response.completed`).

`previous_response_id` works within a session: the gateway keeps each response's conversation
(without its instructions, which the API does not carry over) and puts it before the new input.
Reasoning items in the input are dropped (the model's thinking is in its sampled tokens already);
built-in tools (web search, file search, computer use, ...) and non-text inputs are refused with
a 400. Since both APIs end in the same session, an episode's ledger is the same whichever the
agent uses; this module only translates.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.gateway.wire import (
    ChatRequest,
    Completion,
    WireError,
    parse_chat_request,
    to_template_message,
)
from agentrl.types import Message

__all__ = [
    "ResponsesRequest",
    "conversation_after",
    "parse_responses_request",
    "response_body",
    "response_events",
]


@dataclass
class ResponsesRequest:
    """A Responses API request: its chat translation plus what its answer echoes back."""

    chat: ChatRequest
    stream: bool
    instructions: str | None
    previous_response_id: str | None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    max_output_tokens: int | None = None
    conversation: list[Message] = field(default_factory=list)
    """The messages before `instructions` is added: what `previous_response_id` continues."""


def parse_responses_request(body: Any, previous: dict[str, list[Message]] | None = None) -> ResponsesRequest:
    """Translate a Responses request (module docstring); `previous` maps response ids to conversations."""
    if not isinstance(body, dict):
        raise WireError("The request body must be a JSON object.")
    history: list[Message] = []
    prev_id = body.get("previous_response_id")
    if prev_id is not None and not isinstance(prev_id, str):
        raise WireError(f"'previous_response_id' must be a string (the id of an earlier response), got "
                        f"{type(prev_id).__name__}.", param="previous_response_id")
    if prev_id:
        if previous is None or prev_id not in previous:
            raise WireError(f"No response {prev_id!r} in this session.", status=404, param="previous_response_id",
                            code="previous_response_not_found")
        history = [m.copy() for m in previous[prev_id]]
    conversation = history + _input_messages(body.get("input"))
    if not conversation:
        raise WireError("'input' must be a string or a non-empty list of items.", param="input")
    instructions = body.get("instructions")
    head = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    tools = _chat_tools(body.get("tools"))
    tool_choice = body.get("tool_choice") or "auto"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    chat_body: dict[str, Any] = {
        "model": body.get("model"), "messages": head + conversation, "tools": tools or None,
        "tool_choice": tool_choice, "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
    }
    chat = parse_chat_request(chat_body)
    return ResponsesRequest(
        chat=chat, stream=bool(body.get("stream")), instructions=instructions if head else None,
        previous_response_id=prev_id, tools=list(body.get("tools") or []), tool_choice=body.get("tool_choice") or "auto",
        max_output_tokens=body.get("max_output_tokens"), conversation=chat.messages[len(head):],
    )


def _chat_tools(raw: Any) -> list[dict[str, Any]]:
    if not raw:
        return []
    if not isinstance(raw, list):
        raise WireError("'tools' must be a list.", param="tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise WireError(f"tools[{i}] is a '{kind}' tool; the agentrl gateway serves function tools only.",
                            param=f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _input_messages(raw: Any) -> list[Message]:
    """Responses input items as chat messages (module docstring)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise WireError("'input' must be a string or a list of items.", param="input")
    out: list[dict[str, Any]] = []
    open_assistant: dict[str, Any] | None = None  # the assistant message later function_call items join
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise WireError(f"input[{i}] must be an object.", param=f"input[{i}]")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            msg = to_template_message({"role": item.get("role"), "content": item.get("content")}, i)
            out.append(dict(msg))
            open_assistant = out[-1] if msg["role"] == "assistant" else None
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}
            if open_assistant is None:
                open_assistant = {"role": "assistant", "content": ""}
                out.append(open_assistant)
            open_assistant.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": output if isinstance(output, (str, list)) else json.dumps(output)})
            open_assistant = None
        elif kind == "reasoning":
            continue
        else:
            raise WireError(f"input[{i}] is a '{kind}' item; the gateway reads messages, function calls and "
                            "their outputs.", param=f"input[{i}]")
    # Calls were collected raw: let the chat parser shape them (arguments decoded, tool names added).
    return [to_template_message(m, i) for i, m in enumerate(out)]


# ── answers ─────────────────────────────────────────────────────────────────────────────────
def _output_items(c: Completion) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": c.content or "", "annotations": [], "logprobs": []}]})
    for call in c.tool_calls:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                      "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False),
                      "status": "completed"})
    return items


def response_body(c: Completion, r: ResponsesRequest, *, output: list[dict[str, Any]] | None = None,
                  status: str | None = None) -> dict[str, Any]:
    """The `response` object of an answer."""
    incomplete = c.finish_reason == "length"
    return {
        "id": c.id.replace("chatcmpl-", "resp_"), "object": "response", "created_at": c.created,
        "status": status or ("incomplete" if incomplete else "completed"), "model": c.model,
        "output": _output_items(c) if output is None else output,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status is None else None,
        "error": None, "instructions": r.instructions, "previous_response_id": r.previous_response_id,
        "tools": r.tools, "tool_choice": r.tool_choice, "parallel_tool_calls": True,
        "max_output_tokens": r.max_output_tokens, "temperature": None, "top_p": None, "metadata": {},
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None, "store": True,
        "usage": {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": c.prompt_tokens + c.completion_tokens},
    }


def conversation_after(r: ResponsesRequest, c: Completion) -> list[Message]:
    """The conversation a later `previous_response_id` continues: the input, then this answer."""
    answer: Message = {"role": "assistant", "content": c.content or ""}
    if c.tool_calls:
        answer["tool_calls"] = [call.to_message_dict() for call in c.tool_calls]
    return [*r.conversation, answer]


def response_events(c: Completion, r: ResponsesRequest) -> Iterator[str]:
    """The server-sent events of a streamed response."""
    seq = iter(range(1 << 30))

    def event(kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": next(seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    started = response_body(c, r, output=[], status="in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    items = _output_items(c)
    for index, item in enumerate(items):
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            empty = {**part, "text": ""}
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part=empty)
            if part["text"]:
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=part["text"], logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    final = response_body(c, r, output=items)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)

