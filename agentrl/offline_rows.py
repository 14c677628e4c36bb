"""Demonstration and preference rows, checked and rendered into token ledgers as an episode's would be.

Two row formats, read from the files `agentrl.datasets.read_rows` reads (JSONL, JSON, parquet):

- A demonstration (`agentrl sft`): `{"messages": [...], "tools": [...]?}`, the common chat format
  (TRL's conversational rows): a prompt (system and user messages), then assistant turns, which may
  carry `tool_calls` (OpenAI format; `function.arguments` an object or a JSON string), answered by
  `tool` messages or new user messages, ending on an assistant turn. `tools` are OpenAI function
  schemas, rendered by the chat template as a rollout's are.
- A preference pair (`agentrl dpo`): `{"prompt": ..., "chosen": ..., "rejected": ...}`, where the
  prompt is a string or a message list and each completion a string (one assistant turn) or a list
  of messages (assistant turns, tool results, ...); or `{"chosen": [...], "rejected": [...]}`, two
  whole conversations whose longest shared opening up to the first assistant message is the prompt
  (TRL's implicit prompt). `tools` as above.

`render_conversation` builds the `Trajectory` an AgentLoop would have recorded had the policy
sampled the assistant's turns: the prompt rendered whole (PROMPT), each assistant turn's tokens as
if sampled (SAMPLED, ending on the template's end-of-turn token, rollout logprob 0.0 and version 0:
nobody sampled them), and what follows each turn delta-tokenised after it (`ConversationTokenizer`:
tool results TOOL, role markers and closings TEMPLATE). So only the assistant's tokens carry loss
and a multi-turn row is masked exactly as the agent's own episodes are. An assistant turn's tokens
are its text in the template's full render, from the generation prompt to the end-of-turn marker,
tokenised on its own (a sampled turn is never re-tokenised with its context either).

A malformed row is reported with its file, row and field (`messages[2].tool_calls[0].function.arguments
is not valid JSON`), every one at once, as `agentrl.datasets` does for training data; with
`skip_bad_rows` the rest are used and the bad ones are listed in `RenderedRows.skipped`. A row whose
ledger is longer than the token limit given is a bad row too. This module does not batch, shuffle or
score; it imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.datasets import SkippedRow, read_rows
from agentrl.errors import ChatTemplateError, DatasetError
from agentrl.types import FinishReason, Generation, Message, ToolSchema, Trajectory

__all__ = [
    "PreferencePair",
    "RenderedRows",
    "RowProblem",
    "load_demonstrations",
    "load_preferences",
    "render_conversation",
]

_ROLES = ("system", "user", "assistant", "tool")
_MAX_SHOWN = 20
T = TypeVar("T")


class RowProblem(ValueError):
    """What is wrong with one row: the field and the reason (`str()` gives `field: reason`)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}" if where else reason)


@dataclass(frozen=True)
class PreferencePair:
    """One preference row rendered: two ledgers that share the prompt's tokens."""

    chosen: Trajectory
    rejected: Trajectory
    source: str
    """`file row N`."""


@dataclass
class RenderedRows(Generic[T]):
    """The rows of one or more files, rendered; the bad ones kept out (only with `skip_bad_rows`)."""

    examples: list[T] = field(default_factory=list)
    skipped: list[SkippedRow] = field(default_factory=list)
    total: int = 0
    template_mismatches: int = 0
    """Rows whose ledger differs from a full re-render of their conversation (`chat.render_difference`):
    the ledger, as an episode's would, holds the delta-tokenised text; counted, never refused."""

    def __len__(self) -> int:
        return len(self.examples)


# ── rendering ───────────────────────────────────────────────────────────────────────────────────
def _assistant_ids(template: ChatTemplate, history: list[Message], message: Message,
                   tools: list[ToolSchema] | None, where: str) -> list[int]:
    """The ids a policy would sample for `message` after `history`: its text between the generation
    prompt and the end-of-turn marker, then the marker's first token (the one a model stops on)."""
    try:
        before = template.render(history, tools, add_generation_prompt=True)
        whole = template.render([*history, message], tools, add_generation_prompt=False)
    except ChatTemplateError as exc:
        raise RowProblem(where, f"the chat template cannot render it ({exc})") from exc
    if not whole.startswith(before):
        raise RowProblem(where, "the chat template renders the turn without the generation prompt before it, "
                                "so it cannot be laid out as a sampled turn")
    body = whole[len(before):]
    closing = template.closing_text
    if not body.endswith(closing):
        raise RowProblem(where, f"the chat template does not end the turn with its end-of-turn text {closing!r}")
    return template.encode(body[: len(body) - len(closing)]) + list(template.closing_ids[:1])


def render_conversation(template: ChatTemplate, messages: Sequence[Message] | Sequence[dict[str, Any]],
                        tools: Sequence[ToolSchema] | None = None, *, field_name: str = "messages") -> Trajectory:
    """The ledger of a conversation whose assistant turns are laid out as sampled (module docstring).

    Raises `RowProblem` naming the field (`field_name[i]`) when the conversation cannot be a
    ledger: no prompt before the first assistant turn, no assistant turn, two assistant turns in a
    row, a conversation that does not end on an assistant turn, or a template that refuses it."""
    msgs = [cast(Message, dict(m)) for m in messages]
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None:
        raise RowProblem(field_name, "has no assistant message: nothing to train on")
    if first == 0:
        raise RowProblem(f"{field_name}[0]", "the conversation starts with the assistant: give the prompt before it")
    if msgs[-1]["role"] != "assistant":
        raise RowProblem(f"{field_name}[{len(msgs) - 1}]", f"the conversation ends with a {msgs[-1]['role']} "
                                                          "message: it must end on the assistant's turn")
    conv = ConversationTokenizer(template, verify=True)
    try:
        conv.start(msgs[:first], tools)
    except ChatTemplateError as exc:
        raise RowProblem(field_name, f"the chat template cannot render the prompt ({exc})") from exc
    shown_tools = conv.tools
    i = first
    while i < len(msgs):
        where = f"{field_name}[{i}]"
        message = msgs[i]
        ids = _assistant_ids(template, msgs[:i], message, shown_tools, where)
        conv.add_generation(Generation(ids, [0.0] * len(ids), "stop"), message)
        j = i + 1
        while j < len(msgs) and msgs[j]["role"] != "assistant":
            j += 1
        if j == i + 1 and j < len(msgs):
            raise RowProblem(f"{field_name}[{j}]", "two assistant messages in a row: an episode answers each "
                                                   "turn with a tool result or a user message first")
        if j > i + 1:
            try:
                conv.add_messages(msgs[i + 1 : j])
            except ChatTemplateError as exc:
                raise RowProblem(f"{field_name}[{i + 1}]", f"the chat template cannot append it ({exc})") from exc
        i = j
    trajectory = conv.trajectory
    trajectory.finish_reason = FinishReason.DONE
    return trajectory


# ── checking ────────────────────────────────────────────────────────────────────────────────────
def _normalised_message(m: object, where: str) -> dict[str, Any]:
    """The message as the chat template takes it (tool-call arguments parsed), or `RowProblem`."""
    if not isinstance(m, dict):
        raise RowProblem(where, f"must be a message object, got {type(m).__name__}")
    role = m.get("role")
    if role not in _ROLES:
        raise RowProblem(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
    out = dict(m)
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise RowProblem(f"{where}.tool_calls", "only assistant messages call tools")
    content = m.get("content")
    if content is None and calls:
        out["content"] = ""  # OpenAI writes null content beside tool calls
    elif not isinstance(content, str):
        raise RowProblem(f"{where}.content", f"must be a string, got {type(content).__name__}")
    if calls is not None:
        if not isinstance(calls, list):
            raise RowProblem(f"{where}.tool_calls", f"must be a list, got {type(calls).__name__}")
        out["tool_calls"] = [_normalised_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
        if not out["tool_calls"]:
            del out["tool_calls"]
    return out


def _normalised_call(call: object, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RowProblem(where, "must be {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
    function = dict(call["function"])
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise RowProblem(f"{where}.function.name", "must be a non-empty string")
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise RowProblem(f"{where}.function.arguments", f"is not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(args, dict):
        raise RowProblem(f"{where}.function.arguments", f"must be an object or a JSON object string, got {type(args).__name__}")
    function["arguments"] = args
    return {**call, "type": "function", "function": function}


def _messages(value: object, where: str, *, one_turn_role: str | None = None) -> list[Message]:
    """A message list (a string is one message of `one_turn_role` where given)."""
    if isinstance(value, str) and one_turn_role is not None:
        if not value.strip():
            raise RowProblem(where, "is an empty string")
        return [cast(Message, {"role": one_turn_role, "content": value})]
    if not isinstance(value, list) or not value:
        kind = "a string or " if one_turn_role else ""
        raise RowProblem(where, f"must be {kind}a non-empty list of messages, got "
                                f"{type(value).__name__ if value != [] else 'an empty list'}")
    return [cast(Message, _normalised_message(m, f"{where}[{i}]")) for i, m in enumerate(value)]


def _tools(row: dict[str, Any]) -> list[ToolSchema] | None:
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):  # parquet and CSV exports keep them as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise RowProblem("tools", f"is not valid JSON ({exc.msg})") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
        raise RowProblem("tools", "must be a list of OpenAI function schemas {'type': 'function', 'function': {...}}")
    return tools or None


def _demonstration(template: ChatTemplate, row: object) -> Trajectory:
    if not isinstance(row, dict):
        raise RowProblem("", f"a row must be an object, got {type(row).__name__}")
    if "messages" not in row:
        raise RowProblem("messages", "is missing (a demonstration is {'messages': [...], 'tools': [...]?})")
    return render_conversation(template, _messages(row["messages"], "messages"), _tools(row))


def _preference(template: ChatTemplate, row: object, source: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise RowProblem("", f"a row must be an object, got {type(row).__name__}")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise RowProblem(key, "is missing (a preference row is {'prompt'?, 'chosen', 'rejected'})")
    tools = _tools(row)
    if row.get("prompt") is not None:
        prompt = _messages(row["prompt"], "prompt", one_turn_role="user")
        chosen = prompt + _messages(row["chosen"], "chosen", one_turn_role="assistant")
        rejected = prompt + _messages(row["rejected"], "rejected", one_turn_role="assistant")
    else:
        chosen = _messages(row["chosen"], "chosen")
        rejected = _messages(row["rejected"], "rejected")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared] \
                and chosen[shared]["role"] != "assistant":
            shared += 1
        if shared == 0:
            raise RowProblem("chosen", "shares no opening message with 'rejected' and there is no 'prompt': "
                                       "give the prompt, or conversations that start alike")
        for name, conv in (("chosen", chosen), ("rejected", rejected)):
            if conv[shared]["role"] != "assistant":
                raise RowProblem(f"{name}[{shared}]", "the conversations part before an assistant turn: the "
                                                      "prompt (their shared opening) must be followed by the answers")
    pair = PreferencePair(render_conversation(template, chosen, tools, field_name="chosen"),
                          render_conversation(template, rejected, tools, field_name="rejected"), source)
    if pair.chosen.prompt_length != pair.rejected.prompt_length:
        raise RowProblem("rejected", "renders a different prompt than 'chosen'")
    return pair


# ── loading ─────────────────────────────────────────────────────────────────────────────────────
def _load(paths: Sequence[str | Path], render: Callable[[object, str], T], length: Callable[[T], int],
          max_tokens: int | None, limit_name: str, skip_bad_rows: bool, what: str) -> RenderedRows[T]:
    out: RenderedRows[T] = RenderedRows()
    for path in paths:
        for row_number, row in enumerate(read_rows(path)):
            index = out.total
            out.total += 1
            source = f"{path} row {row_number}"
            try:
                reason = getattr(row, "reason", None)  # a JSONL line that is not JSON (read_rows' placeholder)
                if reason is not None:
                    raise RowProblem("", str(reason))
                example = render(row, source)
                if max_tokens is not None and length(example) > max_tokens:
                    raise RowProblem("", f"renders to {length(example)} tokens, more than {limit_name}={max_tokens}; "
                                         f"shorten the row or raise {limit_name}")
            except RowProblem as problem:
                out.skipped.append(SkippedRow(index, str(path), row_number, str(problem)))
                continue
            out.examples.append(example)
    if out.skipped and (not skip_bad_rows or not out.examples):
        shown = "\n".join(f"  {s}" for s in out.skipped[:_MAX_SHOWN])
        more = f"\n  ... and {len(out.skipped) - _MAX_SHOWN} more" if len(out.skipped) > _MAX_SHOWN else ""
        hint = ("Fix them, or set data.skip_bad_rows=true to use the rest (each skipped row is logged)."
                if out.examples else "No row is usable; fix the file(s).")
        raise DatasetError(f"{len(out.skipped)} malformed {what} row(s) of {out.total}:\n{shown}{more}\n{hint}")
    if out.total == 0:
        raise DatasetError(f"No {what} rows in {', '.join(map(str, paths)) or 'no file'}; give data.train_files.")
    return out


def _mismatched(trajectory: Trajectory) -> int:
    return int(trajectory.metrics.get("template_mismatch", 0.0) > 0)


def load_demonstrations(paths: Sequence[str | Path], template: ChatTemplate, *, max_tokens: int | None = None,
                        limit_name: str = "max_tokens", skip_bad_rows: bool = False) -> RenderedRows[Trajectory]:
    """Every demonstration row of `paths`, rendered (`Trajectory.info["source"]` is `file row N`)."""

    def render(row: object, source: str) -> Trajectory:
        trajectory = _demonstration(template, row)
        trajectory.info["source"] = source
        trajectory.episode_id = source
        return trajectory

    rows = _load(paths, render, len, max_tokens, limit_name, skip_bad_rows, "demonstration")
    rows.template_mismatches = sum(_mismatched(t) for t in rows.examples)
    return rows


def load_preferences(paths: Sequence[str | Path], template: ChatTemplate, *, max_tokens: int | None = None,
                     limit_name: str = "max_tokens", skip_bad_rows: bool = False) -> RenderedRows[PreferencePair]:
    """Every preference row of `paths`, rendered; each pair's two ledgers share a `group_id`."""

    def render(row: object, source: str) -> PreferencePair:
        pair = _preference(template, row, source)
        for name, trajectory in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            trajectory.group_id = source
            trajectory.episode_id = f"{source} {name}"
            trajectory.info["source"] = source
        return pair

    rows = _load(paths, render, lambda p: max(len(p.chosen), len(p.rejected)), max_tokens, limit_name,
                 skip_bad_rows, "preference")
    rows.template_mismatches = sum(_mismatched(p.chosen) + _mismatched(p.rejected) for p in rows.examples)
    return rows
