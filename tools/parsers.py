"""Tool-call parsers: turn one sampled assistant turn into an `Action` (text, calls, errors).

One parser per model family, all with the same small interface, `parse(text) -> Action`:

- `HermesParser` (`hermes`): Hermes / Qwen2.5 / Qwen3, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `MistralParser` (`mistral`): `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]` and the newer
  `[TOOL_CALLS]name[ARGS]{...}` (optionally `name[CALL_ID]id[ARGS]{...}`).
- `Llama3Parser` (`llama3`): Llama-3.x JSON calls, `{"name": ..., "parameters": {...}}`, bare or after
  `<|python_tag|>`; several separated by `;` or in a JSON list. Code after `<|python_tag|>` that is not
  JSON is Llama's built-in code interpreter and becomes a call to the `python` tool.
- `RetoolParser` (`retool`): ReTool-style code, in ```` ```python ```` fences or `<code>...</code>` blocks,
  each a call to the `python` tool with `{"code": ...}`.

Rules shared by all of them. Several calls per turn are read in order. A call that is malformed (bad
JSON, no name, arguments that are not an object) is not returned; instead `parse_errors` gets one message
per bad call that says what was wrong and shows the expected format, for the environment to send back.
Every call attempted is also a typed `CallOutcome` in `Action.outcomes`, in order, with its span in the
text (`agentrl.types.ParseStatus`): `ok`, `invalid_json`, `unclosed_block` (a block, message or JSON that
never ends: in a block without its closing tag, a body that does not parse was cut off), `missing_name`,
`bad_arguments` (not an object); `unknown_tool` and schema `bad_arguments` are the tool env's to decide.
Arguments given as a JSON *string* holding an object (the OpenAI wire form) are decoded. A call without
an id gets a deterministic 9-character one (a hash of its position and text), because Mistral's template
refuses any other length. A final block left open because generation stopped on the closing tag (a stop
string) is still read. Beyond `max_calls` calls the rest is ignored with one error.

`Action.text` is the turn's text without the markup of the calls that parsed (malformed markup stays, so
nothing the model wrote is lost), stripped; for `retool` it is the whole text, since there the code is the
prose. Parsers expect text decoded with special tokens kept (`[TOOL_CALLS]` and `<|python_tag|>` are special
tokens) but without the end-of-turn token. They never raise, whatever the input: anything unexpected
becomes a parse error.

This module parses text only; it does not run tools, check arguments against schemas, or render calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from agentrl.types import Action, CallOutcome, ParseStatus, ToolCall

__all__ = [
    "HermesParser",
    "Llama3Parser",
    "MistralParser",
    "RetoolParser",
    "ToolCallParser",
    "call_id",
]

log = logging.getLogger(__name__)

_ID_CHARS = re.compile(r"[A-Za-z0-9]{9}")
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_DECODER = json.JSONDecoder()


def call_id(index: int, raw: str) -> str:
    """A deterministic 9-character alphanumeric id for the `index`-th call of a turn."""
    return hashlib.sha1(f"{index}\x00{raw}".encode("utf-8", "surrogatepass")).hexdigest()[:9]


class _CallError(Exception):
    """One malformed call; its message is what the model will read, its `status` the outcome's type."""

    def __init__(self, message: str, status: ParseStatus = "invalid_json") -> None:
        super().__init__(message)
        self.status: ParseStatus = status

    def cut(self, close_tag: str) -> _CallError:
        """This error as seen in a block that never closed: a body that does not parse there was cut off."""
        if self.status != "invalid_json":
            return self
        return _CallError(f"it is cut off before {close_tag} ({self})", "unclosed_block")


_Items = list[tuple[int, int, "ToolCall | CallOutcome"]]
"""What a parser found, in order: (start, end, the call or the failed outcome) with its span in the text."""


class ToolCallParser(ABC):
    """Base of every tool-call parser: `parse(text) -> Action`, never raising.

    Subclasses implement `_parse` and raise nothing on purpose; `parse` turns any surprise into a
    parse error so that a bad generation can never crash an episode.
    """

    name: ClassVar[str] = ""
    expected_format: ClassVar[str] = ""

    def __init__(self, max_calls: int = 64) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.max_calls = max_calls

    def parse(self, text: str) -> Action:
        """Read the tool calls in one assistant turn."""
        if not isinstance(text, str):
            return Action("", (), (f"Expected the assistant turn as text, got {type(text).__name__}.",))
        try:
            return self._parse(text)
        except Exception as exc:  # a parser bug must not end the episode; log it loudly instead
            log.exception("%s parser failed on a %d-character turn", self.name, len(text))
            return Action(
                text,
                (),
                (f"Your tool calls could not be read ({type(exc).__name__}). {self.expected_format}",),
            )

    @abstractmethod
    def _parse(self, text: str) -> Action: ...

    # ── shared helpers ──────────────────────────────────────────────────────────────────────
    def _collect(self, text: str, items: _Items, keep_text: bool = False) -> Action:
        """Build the Action from (start, end, call-or-failure) items found in `text`: its calls, errors and
        typed outcomes, each outcome with its span in `text`."""
        calls: list[ToolCall] = []
        errors: list[str] = []
        outcomes: list[CallOutcome] = []
        pieces: list[str] = []
        pos = 0
        extra = 0
        span = (0, 0)
        for start, end, item in items:
            if len(outcomes) >= self.max_calls:
                extra += 1
                continue
            # A list of calls (Mistral, Llama 3) gives its later calls an empty span, so that its markup
            # leaves the text once; each call of the list came from the whole list.
            span = span if start == end and outcomes else (start, end)
            if isinstance(item, ToolCall):
                calls.append(item)
                outcomes.append(CallOutcome("ok", item, chars=span))
                pieces.append(text[pos:start])
                pos = end
            else:
                errors.append(item.message)
                outcomes.append(CallOutcome(item.status, item.call, item.message, chars=span))
        if extra:
            errors.append(f"Only {self.max_calls} tool calls are read per turn; the rest were ignored.")
        pieces.append(text[pos:])
        body = text if keep_text else "".join(pieces).strip()
        return Action(body, tuple(calls), tuple(errors), tuple(outcomes))

    def _error(self, index: int, what: str, status: ParseStatus = "invalid_json") -> CallOutcome:
        """The failed outcome of the `index`-th call, with the message the model reads."""
        return CallOutcome(status, message=f"Tool call {index + 1} was not understood: {what}. {self.expected_format}")

    def _fail(self, index: int, exc: _CallError) -> CallOutcome:
        return self._error(index, str(exc), exc.status)


def _decode_json(fragment: str, start: int = 0, *, at_end: bool = False) -> tuple[Any, int]:
    """Decode one JSON value at `start`; return it and where it ended. Raises _CallError.

    `at_end`: `fragment` runs to the end of the turn, so JSON that never closes there was cut off
    (`unclosed_block`) rather than written wrong (`invalid_json`)."""
    try:
        return _DECODER.raw_decode(fragment, start)
    except json.JSONDecodeError as exc:
        what = f"it is not valid JSON ({exc.msg} at character {exc.pos - start})"
        if at_end and _json_incomplete(fragment, start):
            raise _CallError(f"{what}: the turn ends before its JSON does", "unclosed_block") from None
        raise _CallError(what) from None
    except RecursionError:
        raise _CallError("its JSON is nested too deeply") from None


def _json_incomplete(fragment: str, start: int = 0) -> bool:
    """Whether JSON starting at `start` is still inside a string or an object or list at the end of `fragment`."""
    depth, in_string, escaped = 0, False, False
    for ch in fragment[start:]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return False
    return in_string or depth > 0


def _make_call(obj: Any, index: int, raw: str, arg_keys: tuple[str, ...], keep_id: bool = False) -> ToolCall:
    """Validate a decoded `{"name": ..., <args key>: {...}}` object. Raises _CallError."""
    if not isinstance(obj, dict):
        raise _CallError(f"expected a JSON object, got {_json_type(obj)}", "missing_name")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _CallError('it has no "name" string', "missing_name")
    key = next((k for k in arg_keys if k in obj), None)
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise _CallError(f'"{key}" of {name!r} is a string that is not a JSON object') from None
    if not isinstance(args, dict):
        raise _CallError(f'"{key}" of {name!r} must be a JSON object, got {_json_type(args)}', "bad_arguments")
    given_id = obj.get("id")
    ident = (
        given_id
        if keep_id and isinstance(given_id, str) and _ID_CHARS.fullmatch(given_id)
        else call_id(index, raw)
    )
    return ToolCall(name=name.strip(), arguments=args, id=ident, raw=raw)


def _json_type(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ── Hermes / Qwen ───────────────────────────────────────────────────────────────────────────────
class HermesParser(ToolCallParser):
    """Hermes-style calls used by Qwen2.5 and Qwen3: `<tool_call>{json}</tool_call>`, one per block.

    Blocks inside a Qwen3 `<think>...</think>` are drafts, not calls: only text after the thinking
    is searched (a turn cut inside its thinking therefore has no calls).
    """

    name = "hermes"
    expected_format = 'Write each call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>.'
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def _parse(self, text: str) -> Action:
        items: _Items = []
        pos = _end_of_thinking(text, self.open_tag)
        while len(items) <= self.max_calls:
            start = text.find(self.open_tag, pos)
            if start < 0:
                break
            body_start = start + len(self.open_tag)
            close = text.find(self.close_tag, body_start)
            reopen = text.find(self.open_tag, body_start)
            if close < 0 or (0 <= reopen < close):
                # Unclosed: read it if it is the last block (generation stopped on the closing tag).
                end = len(text) if reopen < 0 else reopen
                body, block_end = text[body_start:end], end
                unclosed = True
            else:
                body, block_end = text[body_start:close], close + len(self.close_tag)
                unclosed = False
            index = len(items)
            try:
                if unclosed and reopen >= 0:
                    raise _CallError(f"its {self.open_tag} tag is never closed with {self.close_tag}", "unclosed_block")
                stripped = body.strip()
                if not stripped:
                    raise _CallError(f"the {self.open_tag} block is empty", "missing_name")
                obj, end_json = _decode_json(stripped)
                if stripped[end_json:].strip():
                    raise _CallError("there is text after the JSON object inside the block")
                items.append(
                    (
                        start,
                        block_end,
                        _make_call(obj, index, text[start:block_end], ("arguments", "parameters")),
                    )
                )
            except _CallError as exc:
                if unclosed:
                    exc = exc.cut(self.close_tag)
                items.append((start, block_end, self._fail(index, exc)))
            pos = block_end
        return self._collect(text, items)


def _end_of_thinking(text: str, call_tag: str) -> int:
    """Where a leading `<think>` block ends (0 if there is none, len(text) if it never closes).

    Thinking opened by the prompt shows only its `</think>`; that counts when no call comes before
    it, so that a `</think>` inside a call's JSON arguments is not mistaken for one.
    """
    close = text.find("</think>")
    if text.lstrip().startswith("<think>"):
        return len(text) if close < 0 else close + len("</think>")
    if close >= 0 and call_tag not in text[:close]:
        return close + len("</think>")
    return 0


# ── Mistral ─────────────────────────────────────────────────────────────────────────────────────
class MistralParser(ToolCallParser):
    """Mistral calls: `[TOOL_CALLS][{...}, ...]` (v3, Nemo) or `[TOOL_CALLS]name[ARGS]{...}` (v11+)."""

    name = "mistral"
    expected_format = (
        'Write calls as [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>, "id": <9 letters '
        "or digits>}, ...]."
    )
    marker = "[TOOL_CALLS]"

    def _parse(self, text: str) -> Action:
        items: _Items = []
        pos = 0
        while len(items) <= self.max_calls:
            start = text.find(self.marker, pos)
            if start < 0:
                break
            at = start + len(self.marker)
            while at < len(text) and text[at].isspace():
                at += 1
            if text.startswith("[", at) or text.startswith("{", at):
                pos = self._read_list(text, start, at, items)
            else:
                pos = self._read_named(text, start, at, items)
        return self._collect(text, items)

    def _read_list(self, text: str, start: int, at: int, items: _Items) -> int:
        try:
            value, end = _decode_json(text, at, at_end=True)
        except _CallError as exc:
            nxt = text.find(self.marker, at)
            end = len(text) if nxt < 0 else nxt
            items.append((start, end, self._fail(len(items), exc)))
            return end
        raw = text[start:end]
        entries = value if isinstance(value, list) else [value]
        if not entries:
            items.append((start, end, self._error(len(items), "the list of calls is empty", "missing_name")))
        for k, obj in enumerate(entries):
            index = len(items)
            try:
                call = _make_call(obj, index, raw, ("arguments", "parameters"), keep_id=True)
                # Only the first call of a list carries the span, so the markup leaves the text once.
                items.append((start, end, call) if k == 0 else (end, end, call))
            except _CallError as exc:
                items.append((start, end, self._fail(index, exc)))
        return end

    def _read_named(self, text: str, start: int, at: int, items: _Items) -> int:
        index = len(items)
        args_at = text.find("[ARGS]", at)
        nxt = text.find(self.marker, at)
        if args_at < 0 or (0 <= nxt < args_at):
            end = len(text) if nxt < 0 else nxt
            status: ParseStatus = "unclosed_block" if nxt < 0 else "invalid_json"  # the turn ends before [ARGS]
            items.append((start, end, self._error(index, "no [ARGS] follows the function name", status)))
            return end
        head = text[at:args_at]
        name, _, given_id = head.partition("[CALL_ID]")
        if not _NAME.fullmatch(name.strip()):
            end = args_at + len("[ARGS]")
            items.append((start, end, self._error(index, f"{name.strip()[:40]!r} is not a function name", "missing_name")))
            return end
        try:
            args, end = _decode_json(text, args_at + len("[ARGS]"), at_end=True)
        except _CallError as exc:
            end = len(text) if nxt < 0 else nxt
            items.append((start, end, self._fail(index, exc)))
            return end
        try:
            obj = {"name": name, "arguments": args, "id": given_id.strip()}
            items.append((start, end, _make_call(obj, index, text[start:end], ("arguments",), keep_id=True)))
        except _CallError as exc:
            items.append((start, end, self._fail(index, exc)))
        return end


# ── Llama 3 ─────────────────────────────────────────────────────────────────────────────────────
class Llama3Parser(ToolCallParser):
    """Llama-3.x JSON calls: `{"name": ..., "parameters": {...}}`, bare or after `<|python_tag|>`."""

    name = "llama3"
    expected_format = (
        'Reply with only the call, as {"name": <function-name>, "parameters": <args-json-object>}; '
        'separate several calls with ";".'
    )
    python_tag = "<|python_tag|>"
    code_tool = "python"

    def _parse(self, text: str) -> Action:
        tag = text.find(self.python_tag)
        if tag >= 0:
            start = tag
            at = tag + len(self.python_tag)
        else:
            stripped = text.lstrip()
            if not (
                stripped.startswith("{")
                or (stripped.startswith("[") and stripped[1:].lstrip().startswith("{"))
            ):
                return Action(text.strip())
            start = at = len(text) - len(stripped)
        while at < len(text) and text[at].isspace():
            at += 1
        if tag >= 0 and not text.startswith(("{", "["), at):
            code = text[at:].strip()
            if not code:
                failed = self._collect(text, [(tag, len(text), self._error(0, f"nothing follows {self.python_tag}",
                                                                           "missing_name"))])
                return dataclasses.replace(failed, text=text[:tag].strip())
            call = ToolCall(self.code_tool, {"code": code}, call_id(0, text[tag:]), text[tag:])
            return self._collect(text, [(tag, len(text), call)])
        return self._collect(text, self._read_calls(text, start, at))

    def _read_calls(self, text: str, start: int, at: int) -> _Items:
        items: _Items = []
        while at < len(text) and len(items) <= self.max_calls:
            index = len(items)
            try:
                value, end = _decode_json(text, at, at_end=True)
            except _CallError as exc:
                items.append((at, len(text), self._fail(index, exc)))
                break
            entries = value if isinstance(value, list) else [value]
            for k, obj in enumerate(entries):
                try:
                    call = _make_call(obj, len(items), text[at:end], ("parameters", "arguments"))
                    items.append((start if k == 0 else end, end, call))
                except _CallError as exc:
                    items.append((at, end, self._fail(len(items), exc)))
            start = at = end
            while at < len(text) and (text[at].isspace() or text[at] in ";,"):
                at += 1
            if at < len(text) and text[at] not in "{[":
                break  # prose after the calls stays in the text
        return items


# ── ReTool ──────────────────────────────────────────────────────────────────────────────────────
class RetoolParser(ToolCallParser):
    """ReTool-style code blocks, ```` ```python ... ``` ```` or `<code>...</code>`, as `python` tool calls."""

    name = "retool"
    expected_format = "Put the code to run in a <code>```python\n...\n```</code> block."
    tool_name = "python"
    _FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n", re.IGNORECASE)

    def _parse(self, text: str) -> Action:
        items: _Items = []
        pos = 0
        while pos < len(text) and len(items) <= self.max_calls:
            block = self._next_block(text, pos)
            if block is None:
                break
            start, end, code = block
            index = len(items)
            raw = text[start:end]
            if code.strip():
                items.append((start, end, ToolCall(self.tool_name, {"code": code}, call_id(index, raw), raw)))
            else:
                items.append((start, end, self._error(index, "the code block is empty", "bad_arguments")))
            pos = max(end, start + 1)
        return self._collect(text, items, keep_text=True)

    def _next_block(self, text: str, pos: int) -> tuple[int, int, str] | None:
        """The next `<code>` block or python fence at or after `pos`: (start, end, code)."""
        tag = text.find("<code>", pos)
        fence = self._FENCE.search(text, pos)
        if tag < 0 and fence is None:
            return None
        if fence is None or (0 <= tag < fence.start()):
            body_start = tag + len("<code>")
            close = text.find("</code>", body_start)
            end = len(text) if close < 0 else close + len("</code>")
            body = text[body_start : len(text) if close < 0 else close]
            return tag, end, _strip_fence(body)
        close = text.find("```", fence.end())
        end = len(text) if close < 0 else close + 3
        return fence.start(), end, text[fence.end() : len(text) if close < 0 else close].strip("\n")


def _strip_fence(body: str) -> str:
    """The code inside a `<code>` block, without a ```python fence around it if there is one."""
    inner = body.strip()
    match = RetoolParser._FENCE.match(inner)
    if match:
        inner = inner[match.end() :]
        if inner.rstrip().endswith("```"):
            inner = inner.rstrip()[:-3]
    return inner.strip("\n")
