"""Tool-call parsers: exact results for valid, multiple and malformed calls per family, and fuzzing
that proves no input can make a parser raise or return something ill-typed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.registry import TOOL_PARSERS
from agentrl.tools.parsers import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    RetoolParser,
    ToolCallParser,
    call_id,
)
from agentrl.types import Action, ToolCall

HERMES_HINT = 'Write each call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>.'
PARSERS: list[ToolCallParser] = [HermesParser(), MistralParser(), Llama3Parser(), RetoolParser()]


def calls(action: Action) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in action.tool_calls]


def tc(name: str, args: dict[str, Any], raw: str, index: int = 0, ident: str = "") -> ToolCall:
    return ToolCall(name, args, ident or call_id(index, raw), raw)


# ── common interface ───────────────────────────────────────────────────────────────────────────
def test_registry_names_resolve_to_the_parsers() -> None:
    for name, cls in [
        ("hermes", HermesParser),
        ("mistral", MistralParser),
        ("llama3", Llama3Parser),
        ("retool", RetoolParser),
    ]:
        assert TOOL_PARSERS.resolve(name) is cls
        assert cls.name == name


def test_call_ids_are_deterministic_nine_alphanumerics() -> None:
    assert call_id(0, "x") == call_id(0, "x")
    assert call_id(0, "x") != call_id(1, "x")
    assert re.fullmatch(r"[a-z0-9]{9}", call_id(3, "\ud800 surrogate"))


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_non_text_input_is_an_error_not_an_exception(parser: ToolCallParser) -> None:
    action = parser.parse(None)  # type: ignore[arg-type]
    assert action == Action("", (), ("Expected the assistant turn as text, got NoneType.",))


def test_a_parser_bug_becomes_a_parse_error(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(HermesParser):
        def _parse(self, text: str) -> Action:
            raise KeyError("bug")

    action = Broken().parse("<tool_call>{}</tool_call>")
    assert action == Action(
        "<tool_call>{}</tool_call>", (), (f"Your tool calls could not be read (KeyError). {HERMES_HINT}",)
    )
    assert "hermes parser failed" in caplog.text


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_plain_prose_has_no_calls(parser: ToolCallParser) -> None:
    text = "  The answer is 42 (see [1]).\n"
    action = parser.parse(text)
    assert action.tool_calls == () and action.parse_errors == ()
    assert action.text == (text if parser.name == "retool" else text.strip())


def test_max_calls_caps_the_number_read() -> None:
    text = "".join(f'<tool_call>{{"name": "f{i}"}}</tool_call>' for i in range(10))
    action = HermesParser(max_calls=3).parse(text)
    assert [c.name for c in action.tool_calls] == ["f0", "f1", "f2"]
    assert action.parse_errors == ("Only 3 tool calls are read per turn; the rest were ignored.",)
    with pytest.raises(ValueError, match="max_calls"):
        HermesParser(max_calls=0)


# ── hermes ─────────────────────────────────────────────────────────────────────────────────────
def test_hermes_single_and_multiple_calls() -> None:
    one = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    two = '<tool_call>\n{"name": "lookup", "arguments": {"word": "ok", "n": [1, 2]}}\n</tool_call>'
    action = HermesParser().parse(f"Let me compute.\n{one}\n{two}")
    assert action == Action(
        "Let me compute.",
        (tc("calculator", {"expression": "12*7"}, one, 0), tc("lookup", {"word": "ok", "n": [1, 2]}, two, 1)),
    )


def test_hermes_keeps_thinking_and_accepts_string_arguments_and_missing_arguments() -> None:
    text = '<think>\nuse it\n</think>\n\n<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "now"}</tool_call>'
    action = HermesParser().parse(text)
    assert action.text == "<think>\nuse it\n</think>"
    assert calls(action) == [("f", {"a": 1}), ("now", {})]
    assert action.parse_errors == ()


def test_hermes_ignores_drafts_inside_thinking() -> None:
    draft = '<tool_call>{"name": "draft"}</tool_call>'
    real = '<tool_call>{"name": "real"}</tool_call>'
    assert calls(HermesParser().parse(f"<think>\nmaybe {draft}\n</think>\n\n{real}")) == [("real", {})]
    cut = HermesParser().parse(f"<think>\nmaybe {draft} and")
    assert cut == Action(f"<think>\nmaybe {draft} and")
    # Thinking opened by the prompt shows only its closing tag.
    assert calls(HermesParser().parse(f"maybe\n</think>\n\n{real}")) == [("real", {})]
    # A closing tag inside a call's arguments is just text.
    inside = '<tool_call>{"name": "f", "arguments": {"s": "</think>"}}</tool_call>'
    assert calls(HermesParser().parse(inside)) == [("f", {"s": "</think>"})]


def test_hermes_final_block_cut_by_stop_string_is_read() -> None:
    action = HermesParser().parse('Ok.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert calls(action) == [("f", {"x": 1})]
    assert action.text == "Ok."


@pytest.mark.parametrize(
    ("block", "what"),
    [
        (
            '{"name": "f", "arguments": {"x": 1}',
            "it is not valid JSON (Expecting ',' delimiter at character 35)",
        ),
        ('{"arguments": {"x": 1}}', 'it has no "name" string'),
        ('{"name": "", "arguments": {}}', 'it has no "name" string'),
        ('{"name": "f", "arguments": [1, 2]}', "\"arguments\" of 'f' must be a JSON object, got a list"),
        ('{"name": "f", "arguments": "x=1"}', "\"arguments\" of 'f' is a string that is not a JSON object"),
        ('{"name": "f", "arguments": null}', "\"arguments\" of 'f' must be a JSON object, got null"),
        ('["f", {}]', "expected a JSON object, got a list"),
        ('{"name": "f"} and more', "there is text after the JSON object inside the block"),
        ("  \n", "the <tool_call> block is empty"),
    ],
)
def test_hermes_malformed_calls_are_explained(block: str, what: str) -> None:
    good = '<tool_call>{"name": "ok"}</tool_call>'
    text = f"Hi <tool_call>{block}</tool_call>{good}"
    action = HermesParser().parse(text)
    assert action.parse_errors == (f"Tool call 1 was not understood: {what}. {HERMES_HINT}",)
    # The good call still counts, and the malformed markup stays in the text for the record.
    assert action.tool_calls == (tc("ok", {}, good, 1),)
    assert action.text == f"Hi <tool_call>{block}</tool_call>"


def test_hermes_tag_reopened_before_closing() -> None:
    action = HermesParser().parse('<tool_call>{"name": "a"\n<tool_call>{"name": "b"}</tool_call>')
    assert calls(action) == [("b", {})]
    assert action.parse_errors == (
        f"Tool call 1 was not understood: its <tool_call> tag is never closed with </tool_call>. {HERMES_HINT}",
    )


# ── mistral ────────────────────────────────────────────────────────────────────────────────────
def test_mistral_list_form_keeps_valid_ids_and_replaces_bad_ones() -> None:
    text = (
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1+1"}, "id": "abc123DEF"}, '
        '{"name": "lookup", "arguments": "{\\"word\\": \\"ok\\"}", "id": "call_1"}]'
    )
    action = MistralParser().parse(text)
    assert action == Action(
        "",
        (
            tc("calculator", {"expression": "1+1"}, text, 0, "abc123DEF"),
            tc("lookup", {"word": "ok"}, text, 1),
        ),
    )
    assert len(action.tool_calls[1].id) == 9


def test_mistral_named_form_with_and_without_call_id() -> None:
    first = '[TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}'
    second = '[TOOL_CALLS]lookup[CALL_ID]a1b2c3d4e[ARGS]{"word": "hi"}'
    action = MistralParser().parse(f"Sure. {first}{second}")
    assert action == Action(
        "Sure.",
        (
            tc("calculator", {"expression": "2*3"}, first, 0),
            tc("lookup", {"word": "hi"}, second, 1, "a1b2c3d4e"),
        ),
    )


@pytest.mark.parametrize(
    ("text", "what"),
    [
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {}',
            "it is not valid JSON (Expecting ',' delimiter at character 30): the turn ends before its JSON does",
        ),
        ("[TOOL_CALLS][]", "the list of calls is empty"),
        ('[TOOL_CALLS]["f"]', "expected a JSON object, got a string"),
        (
            '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
            "\"arguments\" of 'f' must be a JSON object, got a number",
        ),
        ("[TOOL_CALLS]f{}", "no [ARGS] follows the function name"),
        ("[TOOL_CALLS]not a name[ARGS]{}", "'not a name' is not a function name"),
        ('[TOOL_CALLS]f[ARGS]{"x": }', "it is not valid JSON (Expecting value at character 6)"),
        ("[TOOL_CALLS]f[ARGS][1]", "\"arguments\" of 'f' must be a JSON object, got a list"),
    ],
)
def test_mistral_malformed_calls_are_explained(text: str, what: str) -> None:
    action = MistralParser().parse(text)
    assert action.tool_calls == ()
    assert action.parse_errors == (
        f"Tool call 1 was not understood: {what}. {MistralParser.expected_format}",
    )


# ── llama3 ─────────────────────────────────────────────────────────────────────────────────────
def test_llama3_bare_json_and_several_calls() -> None:
    a = '{"name": "calculator", "parameters": {"expression": "1+1"}}'
    b = '{"name": "lookup", "arguments": {"word": "ok"}}'
    assert Llama3Parser().parse(a) == Action("", (tc("calculator", {"expression": "1+1"}, a),))
    action = Llama3Parser().parse(f"{a}; {b}")
    assert action == Action(
        "", (tc("calculator", {"expression": "1+1"}, a, 0), tc("lookup", {"word": "ok"}, b, 1))
    )
    listed = f"[{a}, {b}]"
    assert calls(Llama3Parser().parse(listed)) == calls(action)


def test_llama3_python_tag_with_json_and_with_code() -> None:
    call = '{"name": "calculator", "parameters": {"expression": "2"}}'
    action = Llama3Parser().parse(f"Checking.<|python_tag|>{call}")
    assert action == Action("Checking.", (tc("calculator", {"expression": "2"}, call),))
    code = Llama3Parser().parse("<|python_tag|>import math\nprint(math.pi)")
    raw = "<|python_tag|>import math\nprint(math.pi)"
    assert code == Action("", (tc("python", {"code": "import math\nprint(math.pi)"}, raw),))


def test_llama3_prose_after_calls_stays_text() -> None:
    action = Llama3Parser().parse('{"name": "f", "parameters": {}} then I wait.')
    assert calls(action) == [("f", {})]
    assert action.text == "then I wait."


@pytest.mark.parametrize(
    ("text", "what"),
    [
        (
            '{"name": "f", "parameters": {"x": 1}',
            "it is not valid JSON (Expecting ',' delimiter at character 36): the turn ends before its JSON does",
        ),
        ('{"parameters": {}}', 'it has no "name" string'),
        (
            '{"name": "f", "parameters": "oops"}',
            "\"parameters\" of 'f' is a string that is not a JSON object",
        ),
        ('<|python_tag|>{"name": 3}', 'it has no "name" string'),
        ("<|python_tag|>   ", "nothing follows <|python_tag|>"),
    ],
)
def test_llama3_malformed_calls_are_explained(text: str, what: str) -> None:
    action = Llama3Parser().parse(text)
    assert action.tool_calls == ()
    assert action.parse_errors == (f"Tool call 1 was not understood: {what}. {Llama3Parser.expected_format}",)


# ── retool ─────────────────────────────────────────────────────────────────────────────────────
def test_retool_fences_and_code_blocks() -> None:
    block = "<code>\n```python\nprint(1)\n```\n</code>"
    fence = "```py\nx = 2\nprint(x)\n```"
    text = f"Let me run:\n{block}\nand\n{fence}\nand ```bash\nls\n```"
    action = RetoolParser().parse(text)
    assert action == Action(
        text,
        (tc("python", {"code": "print(1)"}, block, 0), tc("python", {"code": "x = 2\nprint(x)"}, fence, 1)),
    )


def test_retool_unclosed_final_block_and_empty_block() -> None:
    assert calls(RetoolParser().parse("Run it: <code>print(3)")) == [("python", {"code": "print(3)"})]
    assert calls(RetoolParser().parse("```python\nprint(4)\n")) == [("python", {"code": "print(4)"})]
    empty = RetoolParser().parse("<code>\n</code>")
    assert empty.tool_calls == ()
    assert empty.parse_errors == (
        f"Tool call 1 was not understood: the code block is empty. {RetoolParser.expected_format}",
    )


# ── parsed turns re-render to what was sampled ─────────────────────────────────────────────────
ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))


@pytest.mark.skipif(not (ASSETS / "qwen2.5-0.5b-instruct").is_dir(), reason="tokenizer assets not found")
@pytest.mark.parametrize(
    ("model", "parser", "sampled"),
    [
        (
            "qwen2.5-0.5b-instruct",
            HermesParser(),
            'Let me see.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"word": "é"}}\n</tool_call>',
        ),
        (
            "qwen3-0.6b",
            HermesParser(),
            '<think>\nI need it.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"word": "x"}}\n</tool_call>',
        ),
        (
            "mistral-nemo-instruct-2407",
            MistralParser(),
            '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1+1"}, "id": "abcdefghi"}]',
        ),
    ],
)
def test_parsed_message_rerenders_to_the_sampled_text(
    model: str, parser: ToolCallParser, sampled: str
) -> None:
    from agentrl.chat import ChatTemplate

    template = ChatTemplate.from_pretrained(ASSETS / model)
    history = [{"role": "user", "content": "Go."}]
    prompt = template.render(history)
    message = parser.parse(sampled).to_message()
    full = template.render([*history, message], add_generation_prompt=False)
    assert full == prompt + sampled + template.closing_text


# ── fuzzing ────────────────────────────────────────────────────────────────────────────────────
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "<code>",
    "</code>",
    "```python\n",
    "```",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    '"id"',
    ":",
    ",",
    ";",
    '"f"',
    '"abc123def"',
    "null",
    "1e999",
    "NaN",
    "-0",
    '"\\u0000"',
    "\\",
    '"',
    "\n",
    " ",
    "é",
    "\ud7ff",
    "x",
]
adversarial = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=60).map("".join)


def check_well_typed(action: Action, text: str) -> None:
    assert isinstance(action, Action)
    assert isinstance(action.text, str)
    assert isinstance(action.tool_calls, tuple) and isinstance(action.parse_errors, tuple)
    for call in action.tool_calls:
        assert isinstance(call, ToolCall)
        assert isinstance(call.name, str) and call.name
        assert isinstance(call.arguments, dict)
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
        assert isinstance(call.raw, str) and call.raw in text
        json.dumps(call.arguments)  # arguments are JSON data, ready to send to a tool
    for error in action.parse_errors:
        assert isinstance(error, str) and error


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=200) | adversarial)
def test_fuzz_never_raises_and_is_well_typed(parser: ToolCallParser, text: str) -> None:
    # `_parse` bypasses the catch-all in `parse`: the parsing itself must not raise, not merely be
    # rescued by the safety net.
    action = parser._parse(text)
    check_well_typed(action, text)
    assert parser.parse(text) == action


HUGE = [
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    "<tool_call>" * 30_000,
    "[TOOL_CALLS]" + "{" * 100_000,
    "[TOOL_CALLS]" * 30_000,
    "<|python_tag|>" + "[" * 100_000,
    '{"name": "f", "parameters": {}};' * 5_000,
    "<code>" * 30_000 + "```python\n" * 30_000,
    "x" * 1_000_000,
]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("text", HUGE, ids=lambda t: f"{t[:14]!r}x{len(t)}")
def test_huge_inputs_are_handled(parser: ToolCallParser, text: str) -> None:
    action = parser._parse(text)
    check_well_typed(action, text)
    assert len(action.tool_calls) + len(action.parse_errors) <= parser.max_calls + 1


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
call_lists = st.lists(
    st.tuples(names, st.dictionaries(st.text(max_size=8), json_values, max_size=4)), min_size=1, max_size=5
)


@settings(max_examples=100, deadline=None)
@given(specs=call_lists)
def test_roundtrip_every_family(specs: list[tuple[str, dict[str, Any]]]) -> None:
    def dump(x: Any) -> str:
        return json.dumps(x, ensure_ascii=False)

    hermes = "\n".join(
        f'<tool_call>\n{{"name": {dump(n)}, "arguments": {dump(a)}}}\n</tool_call>' for n, a in specs
    )
    mistral_list = "[TOOL_CALLS]" + dump([{"name": n, "arguments": a} for n, a in specs])
    mistral_named = "".join(f"[TOOL_CALLS]{n}[ARGS]{dump(a)}" for n, a in specs)
    llama = "; ".join(dump({"name": n, "parameters": a}) for n, a in specs)
    for parser, text in [
        (HermesParser(), hermes),
        (MistralParser(), mistral_list),
        (MistralParser(), mistral_named),
        (Llama3Parser(), llama),
        (Llama3Parser(), "<|python_tag|>" + llama),
    ]:
        action = parser.parse(text)
        assert action.parse_errors == (), (parser.name, text)
        assert calls(action) == specs
        assert action.text == ""
