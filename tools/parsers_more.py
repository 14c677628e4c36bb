"""Tool-call parsers for five more model families, on the shared rules of `agentrl.tools.parsers`.

- `Qwen3CoderParser` (`qwen3_coder`): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
  ...</function>\\n</tool_call>`.
- `Glm45Parser` (`glm45`): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`.
- `KimiK2Parser` (`kimi_k2`): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`; the id is kept.
- `DeepSeekV3Parser` (`deepseek_v3`): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3 and R1), and the V3.1 form
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
- `GptOssParser` (`gpt_oss`): harmony messages. `to=functions.NAME` on a `commentary` message makes it a
  call with a JSON body; `analysis` is reasoning and is left out of `Action.text`; `final` (and a
  commentary message without a recipient, a preamble) is the text.

Value typing of the two XML-like formats (qwen3_coder, glm45), whose values are text: the parser sees no
tool schema, so a value that is a whole JSON object, list, number, `true`, `false` or `null` becomes that
value and anything else stays the exact text. This is what the GLM-4.5 template's rendering implies
(strings raw, everything else `tojson`); vLLM's qwen3_coder parser instead types values by the request's
tool schema and keeps them as text when there is none, so a string argument that looks like a number
(`"42"`) comes back as the number 42 here. Ids are deterministic hashes (`call_id`) except for Kimi-K2,
whose `functions.NAME:IDX` is the id. This module parses text only, like `agentrl.tools.parsers`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from agentrl.tools.parsers import (
    ToolCallParser,
    _CallError,
    _decode_json,
    _end_of_thinking,
    _Items,
    call_id,
)
from agentrl.types import Action, ToolCall

__all__ = ["DeepSeekV3Parser", "Glm45Parser", "GptOssParser", "KimiK2Parser", "Qwen3CoderParser"]
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


def _typed(value: str) -> Any:
    """A text value as JSON when it is a whole non-string JSON value, else the text itself."""
    stripped = value.strip()
    if not stripped or stripped[0] not in "{[-0123456789tfn":
        return value
    try:
        decoded = json.loads(stripped)
    except (json.JSONDecodeError, RecursionError):
        return value
    return value if isinstance(decoded, str) else decoded


def _json_args(fragment: str, name: str, *, at_end: bool = False) -> dict[str, Any]:
    """The JSON object that is the whole of `fragment` (`at_end`: which runs to the end of the turn).
    Raises _CallError."""
    stripped = fragment.strip()
    if not stripped:
        raise _CallError(f"the arguments of {name!r} are missing (write {{}} for none)",
                         "unclosed_block" if at_end else "invalid_json")
    value, end = _decode_json(stripped, at_end=at_end)
    if stripped[end:].strip():
        raise _CallError(f"there is text after the JSON arguments of {name!r}")
    if not isinstance(value, dict):
        raise _CallError(f"the arguments of {name!r} must be a JSON object", "bad_arguments")
    return value


def _check_name(name: str) -> str:
    name = name.strip()
    if not _NAME.fullmatch(name):
        raise _CallError("it has no function name" if not name else f"{name[:40]!r} is not a function name",
                         "missing_name")
    return name


def _blocks(text: str, open_tag: str, close_tag: str, pos: int) -> list[tuple[int, int, str, str]]:
    """Each `open_tag ... close_tag` block from `pos`: (start, end, body, problem or "").

    The last block may be left open (generation stopped on its closing tag): it ends at the end of the
    text without `close_tag` (`_cut_off` tells); an open block that another block follows is a problem.
    """
    found: list[tuple[int, int, str, str]] = []
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return found
        body_start = start + len(open_tag)
        close = text.find(close_tag, body_start)
        reopen = text.find(open_tag, body_start)
        if close < 0 or 0 <= reopen < close:
            end = len(text) if reopen < 0 else reopen
            problem = "" if reopen < 0 else f"its {open_tag} is never closed with {close_tag}"
            found.append((start, end, text[body_start:end], problem))
        else:
            end = close + len(close_tag)
            found.append((start, end, text[body_start:close], ""))
        pos = end


class _BlockParser(ToolCallParser):
    """A family whose calls are `open_tag BODY close_tag` blocks after any leading thinking."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def _parse(self, text: str) -> Action:
        items: _Items = []
        pos = _end_of_thinking(text, self.open_tag)
        for start, end, body, problem in _blocks(text, self.open_tag, self.close_tag, pos):
            index = len(items)
            try:
                if problem:
                    raise _CallError(problem, "unclosed_block")
                name, args = self._read_body(body)
                raw = text[start:end]
                items.append((start, end, ToolCall(name, args, call_id(index, raw), raw)))
            except _CallError as exc:
                if _cut_off(text, end, self.close_tag):
                    exc = exc.cut(self.close_tag)
                items.append((start, end, self._fail(index, exc)))
            if len(items) > self.max_calls:
                break
        return self._collect(text, items)

    def _read_body(self, body: str) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError


# ── Qwen3-Coder ─────────────────────────────────────────────────────────────────────────────────
class Qwen3CoderParser(_BlockParser):
    """Qwen3-Coder XML calls: `<function=NAME>` with one `<parameter=KEY>` element per argument."""

    name = "qwen3_coder"
    expected_format = (
        "Write each call as <tool_call>\n<function=<function-name>>\n<parameter=<name>>\n<value>\n</parameter>\n"
        "</function>\n</tool_call>."
    )
    _FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
    _PARAMETER = re.compile(r"<parameter=([^>\n]*)>")

    def _read_body(self, body: str) -> tuple[str, dict[str, Any]]:
        head = self._FUNCTION.match(body)
        if head is None:
            raise _CallError("it does not start with <function=NAME>", "missing_name")
        name = _check_name(head.group(1))
        close = body.find("</function>", head.end())
        if close >= 0 and body[close + len("</function>") :].strip():
            raise _CallError("there is text after </function> inside the block")
        inner = body[head.end() : len(body) if close < 0 else close]
        args: dict[str, Any] = {}
        pos = 0
        while True:
            param = self._PARAMETER.search(inner, pos)
            gap = inner[pos : len(inner) if param is None else param.start()]
            if gap.strip():
                raise _CallError(f"{gap.strip()[:40]!r} is outside any <parameter=...> of {name!r}")
            if param is None:
                break
            key = param.group(1).strip()
            end = inner.find("</parameter>", param.end())
            if not key:
                raise _CallError(f"a parameter of {name!r} has no name")
            if end < 0:
                raise _CallError(f"parameter {key!r} of {name!r} is never closed with </parameter>", "unclosed_block")
            value = inner[param.end() : end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value)
            pos = end + len("</parameter>")
        return name, args


# ── GLM-4.5 ─────────────────────────────────────────────────────────────────────────────────────
class Glm45Parser(_BlockParser):
    """GLM-4.5 calls: the name, then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs."""

    name = "glm45"
    expected_format = (
        "Write each call as <tool_call><function-name>\n<arg_key><name></arg_key>\n<arg_value><value></arg_value>\n"
        "...</tool_call>."
    )
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _read_body(self, body: str) -> tuple[str, dict[str, Any]]:
        first = body.find("<arg_key>")
        name = _check_name(body if first < 0 else body[:first])
        args: dict[str, Any] = {}
        pos = len(body) if first < 0 else first
        while pos < len(body):
            pair = self._PAIR.match(body, pos)
            if pair is None:
                if body[pos:].strip():
                    raise _CallError(
                        f"{body[pos:].strip()[:40]!r} in {name!r} is not an <arg_key>...</arg_key>"
                        "<arg_value>...</arg_value> pair"
                    )
                break
            args[pair.group(1).strip()] = _typed(pair.group(2))
            pos = pair.end()
        return name, args


# ── Special-token sections: Kimi-K2 and DeepSeek ────────────────────────────────────────────────
class _SectionParser(ToolCallParser):
    """Calls inside a `section_begin ... section_end` span, each `call_begin BODY call_end`."""

    section_begin = ""
    section_end = ""
    call_begin = ""
    call_end = ""

    def _parse(self, text: str) -> Action:
        items: _Items = []
        pos = _end_of_thinking(text, self.section_begin)
        for sec_start, sec_end, body, _ in _blocks(text, self.section_begin, self.section_end, pos):
            offset = sec_start + len(self.section_begin)
            section: _Items = []
            calls = _blocks(body, self.call_begin, self.call_end, 0)
            loose = "".join(body[a:b] for a, b in _gaps(calls, len(body)))
            if not calls:
                section.append(
                    (sec_start, sec_end, self._error(len(items), "the tool-call section has no call",
                                                     "unclosed_block" if sec_end == len(text) else "missing_name"))
                )
            for start, end, call_body, problem in calls:
                index = len(items) + len(section)
                raw = body[start:end]
                try:
                    if problem:
                        raise _CallError(problem, "unclosed_block")
                    call = self._read_call(call_body, index, raw)
                    section.append((offset + start, offset + end, call))
                except _CallError as exc:
                    if _cut_off(body, end, self.call_end):
                        exc = exc.cut(self.call_end)
                    section.append((offset + start, offset + end, self._fail(index, exc)))
            if all(isinstance(item, ToolCall) for _, _, item in section) and not loose.strip():
                # Every call parsed: the section markers leave the text with them.
                section[0] = (sec_start, section[0][1], section[0][2])
                section[-1] = (section[-1][0], sec_end, section[-1][2])
            else:  # a failed call's span (which leaves nothing out of the text) takes in the markers next to it
                if not isinstance(section[0][2], ToolCall):
                    section[0] = (sec_start, section[0][1], section[0][2])
                if not isinstance(section[-1][2], ToolCall):
                    section[-1] = (section[-1][0], sec_end, section[-1][2])
            items.extend(section)
            if len(items) > self.max_calls:
                break
        return self._collect(text, items)

    def _read_call(self, body: str, index: int, raw: str) -> ToolCall:
        raise NotImplementedError


def _cut_off(text: str, end: int, close_tag: str) -> bool:
    """Whether the block that ends at `end` in `text` was cut off: it runs to the end without `close_tag`."""
    return end == len(text) and not text.endswith(close_tag)


def _gaps(blocks: list[tuple[int, int, str, str]], length: int) -> list[tuple[int, int]]:
    """The spans of `[0, length)` between `blocks`."""
    spans, pos = [], 0
    for start, end, _, _ in blocks:
        spans.append((pos, start))
        pos = end
    spans.append((pos, length))
    return spans


class KimiK2Parser(_SectionParser):
    """Kimi-K2 calls; each is named by `functions.NAME:IDX`, which is also its id."""

    name = "kimi_k2"
    expected_format = (
        "Write calls as <|tool_calls_section_begin|><|tool_call_begin|>functions.<function-name>:<index>"
        "<|tool_call_argument_begin|><args-json-object><|tool_call_end|><|tool_calls_section_end|>."
    )
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    call_end = "<|tool_call_end|>"
    _ID = re.compile(r"\s*(?:functions\.)?([^:\s]*)(?::\d+)?\s*")

    def _read_call(self, body: str, index: int, raw: str) -> ToolCall:
        ident, sep, args_text = body.partition("<|tool_call_argument_begin|>")
        if not sep:
            raise _CallError("no <|tool_call_argument_begin|> follows the call id", "missing_name"
                             if not ident.strip() else "invalid_json")
        match = self._ID.fullmatch(ident)
        if match is None:
            raise _CallError(f"{ident.strip()[:40]!r} is not a call id of the form functions.NAME:INDEX", "missing_name")
        name = _check_name(match.group(1))
        return ToolCall(name, _json_args(args_text, name), ident.strip(), raw)


class DeepSeekV3Parser(_SectionParser):
    """DeepSeek-V3 / R1 calls (`function<｜tool▁sep｜>NAME` and a ```json fence), and the V3.1 form."""

    name = "deepseek_v3"
    expected_format = (
        "Write calls as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n```json\n"
        "<args-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>."
    )
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    _FENCED = re.compile(r"([^\n]*)\n```(?:json)?[ \t]*\n(.*?)\n?```\s*", re.DOTALL)

    def _read_call(self, body: str, index: int, raw: str) -> ToolCall:
        head, sep, rest = body.partition("<｜tool▁sep｜>")
        if not sep:
            raise _CallError("no <｜tool▁sep｜> separates the type from the function name", "missing_name")
        fenced = self._FENCED.fullmatch(rest)
        if fenced is not None:
            name, args_text = fenced.group(1), fenced.group(2)
        elif head.strip() == "function" and "```" in rest:
            raise _CallError("its ```json fence is not closed", "unclosed_block")
        else:  # V3.1: NAME<｜tool▁sep｜>{json}
            name, args_text = head, rest
        name = _check_name(name)
        return ToolCall(name, _json_args(args_text, name), call_id(index, raw), raw)


# ── gpt-oss (harmony) ───────────────────────────────────────────────────────────────────────────
class GptOssParser(ToolCallParser):
    """gpt-oss harmony messages: commentary to `functions.NAME` is a call; final is the text."""

    name = "gpt_oss"
    expected_format = (
        "Write each call as <|start|>assistant<|channel|>commentary to=functions.<function-name> "
        "<|constrain|>json<|message|><args-json-object><|call|>."
    )
    _ENDS = ("<|end|>", "<|call|>", "<|return|>")
    _RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")

    def _parse(self, text: str) -> Action:
        items: _Items = []
        shown: list[str] = []
        for start, end, header, body in self._messages(text):
            recipient = self._RECIPIENT.search(header)
            channel = self._CHANNEL.search(header)
            if recipient is None:
                if body is None:
                    shown.append(header.strip())
                elif channel is None or channel.group(1) != "analysis":
                    shown.append(body.strip())
                continue
            index = len(items)
            raw = text[start:end]
            try:
                if body is None:
                    raise _CallError("the message to it stops before <|message|>", "unclosed_block")
                target = recipient.group(1)
                if not target.startswith("functions."):
                    raise _CallError(f"{target[:40]!r} is not a function; call functions.<function-name>",
                                     "unknown_tool")
                name = _check_name(target[len("functions.") :])
                # A message that runs to the end of the turn without an end token may have been cut off.
                at_end = end == len(text) and not text.endswith(self._ENDS)
                items.append((start, end, ToolCall(name, _json_args(body, name, at_end=at_end), call_id(index, raw),
                                                   raw)))
            except _CallError as exc:
                items.append((start, end, self._fail(index, exc)))
            if len(items) > self.max_calls:
                break
        action = self._collect(text, items)
        return dataclasses.replace(action, text="\n".join(part for part in shown if part))

    def _messages(self, text: str) -> list[tuple[int, int, str, str | None]]:
        """Each message as (start, end, header, body or None when cut before `<|message|>`)."""
        found: list[tuple[int, int, str, str | None]] = []
        pos = 0
        while pos < len(text):
            start = pos
            marker = text.find("<|message|>", pos)
            nxt = text.find("<|start|>", pos + 1)
            if marker < 0 or (0 <= nxt < marker):
                if text[pos : nxt if nxt >= 0 else len(text)].strip():
                    end = len(text) if nxt < 0 else nxt
                    found.append((start, end, text[pos:end], None))  # a header cut short, or loose text
                if nxt < 0:
                    break
                pos = nxt
                continue
            header = text[pos:marker]
            body_start = marker + len("<|message|>")
            ends = [i for i in (text.find(e, body_start) for e in self._ENDS) if i >= 0]
            if nxt >= 0 and nxt > body_start:
                ends.append(nxt)
            body_end = min(ends) if ends else len(text)
            end = body_end
            for tag in self._ENDS:
                if text.startswith(tag, body_end):
                    end = body_end + len(tag)
            found.append((start, end, header, text[body_start:body_end]))
            pos = end
        return found
