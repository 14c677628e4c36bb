"""Tool-call parsers of qwen3_coder, glm45, kimi_k2, deepseek_v3 and gpt_oss: calls written by each
family's real chat template parse back to the same calls, malformed calls become parse errors, and the
parsers read texts the way vLLM's parsers do.

Round trips: deepseek_v3 and gpt_oss render through their real tokenizers' `apply_chat_template`, glm45
through the GLM-4.5 template in the shared assets. qwen3_coder and kimi_k2 have no template in the assets,
so their text is written by the small renderers below (`_qwen3_coder_text`, `_kimi_text`), which follow
the families' documented formats byte for byte. The comparisons with vLLM's parsers (and with
`openai_harmony` for gpt-oss, whose vLLM parser is a stub) are `slow`: importing vLLM takes seconds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from agentrl.registry import TOOL_PARSERS
from agentrl.tools.parsers_more import (
    DeepSeekV3Parser,
    Glm45Parser,
    GptOssParser,
    KimiK2Parser,
    Qwen3CoderParser,
)
from agentrl.types import Action

PARSERS = [Qwen3CoderParser(), Glm45Parser(), KimiK2Parser(), DeepSeekV3Parser(), GptOssParser()]
CONVERSATIONS = 50


def calls(action: Action) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in action.tool_calls]


# ── generated calls ─────────────────────────────────────────────────────────────────────────────
_WORDS = ["héllo wörld", "naïve café", "日本語のテキスト", "emoji 🎉 ok", "path C:\\tmp\\x", "plain words"]
_CODE = [
    'print("a \\"quoted\\" word")',
    "s = 'it\\'s'\nprint(s.replace('\\\\', '/'))",
    'for i in range(3):\n    print(f"{i}\\t{i**2}")',
    'x = {"k": [1, 2]}  # dict\nprint(x["k"])',
]


def _string(rng: random.Random) -> str:
    """Text a model might pass; never a whole JSON non-string value, which the XML formats would type."""
    return rng.choice(_WORDS + _CODE)


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return _string(rng)
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randint(-1000, 10**6)
    if kind == 3:
        return rng.choice([0.5, -2.25, 1e-3])
    if kind == 4:
        return None if rng.random() < 0.3 else _string(rng)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _generated_calls(seed: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    names = ["python", "search_web", "get.weather", "edit_file", "run-tests"]
    return [
        (rng.choice(names), {f"arg_{j}": _value(rng) for j in range(rng.randint(0, 4))})
        for _ in range(rng.randint(1, 3))
    ]


def _messages(seed: int, arguments_as_text: bool = False) -> list[dict[str, Any]]:
    content = random.Random(seed).choice(["", "Let me check that.", 'Ich prüfe das: "x" \\ y'])
    tool_calls = [
        {
            "type": "function",
            "function": {
                "name": name,
                "arguments": json.dumps(args, ensure_ascii=False) if arguments_as_text else args,
            },
        }
        for name, args in _generated_calls(seed)
    ]
    return [
        {"role": "user", "content": "Do it."},
        {"role": "assistant", "content": content or None, "tool_calls": tool_calls},
    ]


# ── round trips through the real templates ──────────────────────────────────────────────────────
def test_the_five_families_are_registered() -> None:
    for parser in PARSERS:
        assert TOOL_PARSERS.resolve(parser.name) is type(parser)
    assert [p.name for p in PARSERS] == ["qwen3_coder", "glm45", "kimi_k2", "deepseek_v3", "gpt_oss"]


def test_glm45_template_calls_parse_back(assets: Path) -> None:
    from transformers import AutoTokenizer

    template = (assets / "chat-templates" / "glm-4.5.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(assets / "qwen3-0.6b")
    parser = Glm45Parser()
    for seed in range(CONVERSATIONS):
        messages = _messages(seed)
        messages[1]["content"] = messages[1]["content"] or ""  # the template writes None as "None"
        prompt = tok.apply_chat_template(
            messages[:1], chat_template=template, tokenize=False, add_generation_prompt=True
        )
        full = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
        assert full.startswith(prompt)
        action = parser.parse(full[len(prompt) :])
        assert calls(action) == _generated_calls(seed), full
        assert action.parse_errors == ()
        assert action.text == f"<think></think>\n{messages[1]['content']}".strip()


def test_deepseek_v3_template_calls_parse_back(assets: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "deepseek-v3-tokenizer")
    parser = DeepSeekV3Parser()
    for seed in range(CONVERSATIONS):
        messages = _messages(seed, arguments_as_text=True)
        prompt = tok.apply_chat_template(messages[:1], tokenize=False)
        full = tok.apply_chat_template(messages, tokenize=False)
        turn = full[len(prompt) :]
        assert turn.startswith("<｜Assistant｜>") and turn.endswith("<｜end▁of▁sentence｜>")
        action = parser.parse(turn[len("<｜Assistant｜>") : -len("<｜end▁of▁sentence｜>")])
        assert calls(action) == _generated_calls(seed), turn
        assert action.parse_errors == ()
        assert action.text == (messages[1]["content"] or "")


def test_gpt_oss_template_calls_parse_back(assets: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "gpt-oss-tokenizer")
    parser = GptOssParser()
    for seed in range(CONVERSATIONS):
        user, assistant = _messages(seed)
        # The template takes one call per assistant message: several calls are consecutive messages.
        split = [
            {
                "role": "assistant",
                "content": (assistant["content"] or "") if k == 0 else "",
                "tool_calls": [call],
            }
            for k, call in enumerate(assistant["tool_calls"])
        ]
        prompt = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template([user, *split], tokenize=False)
        assert full.startswith(prompt)
        action = parser.parse(full[len(prompt) :])
        assert calls(action) == _generated_calls(seed), full
        assert action.parse_errors == ()
        assert action.text == ""  # the content went to the analysis channel: reasoning, not text


def test_gpt_oss_final_channel_is_the_text() -> None:
    text = (
        "<|channel|>analysis<|message|>2+2 is 4<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    )
    assert GptOssParser().parse(text) == Action("It is 4.")
    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2}<|call|>'
    assert calls(GptOssParser().parse(call)) == [("add", {"a": 2})]


def _qwen3_coder_text(tool_calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Qwen3-Coder's format: strings as they are, other values as JSON (the GLM-4.5 template's rule)."""
    out = []
    for name, args in tool_calls:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in args.items()
        )
        out.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


def _kimi_text(tool_calls: list[tuple[str, dict[str, Any]]]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
        f"{json.dumps(args, ensure_ascii=False)}<|tool_call_end|>"
        for i, (name, args) in enumerate(tool_calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


@pytest.mark.parametrize(
    ("parser", "render"),
    [(Qwen3CoderParser(), _qwen3_coder_text), (KimiK2Parser(), _kimi_text)],
    ids=["qwen3_coder", "kimi_k2"],
)
def test_written_format_calls_parse_back(parser: Any, render: Any) -> None:
    for seed in range(CONVERSATIONS):
        expected = _generated_calls(seed)
        action = parser.parse("I will call the tools.\n" + render(expected))
        assert calls(action) == expected
        assert action.parse_errors == ()
        assert action.text == "I will call the tools."


def test_kimi_ids_are_the_call_names() -> None:
    action = KimiK2Parser().parse(_kimi_text([("f", {}), ("g", {"a": 1})]))
    assert [c.id for c in action.tool_calls] == ["functions.f:0", "functions.g:1"]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_a_last_block_left_open_by_the_stop_string_is_read(parser: Any) -> None:
    text = {
        "qwen3_coder": _qwen3_coder_text([("f", {"a": "x"})]).removesuffix("</tool_call>"),
        "glm45": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>x</arg_value>\n",
        "kimi_k2": _kimi_text([("f", {"a": "x"})]).removesuffix("<|tool_calls_section_end|>"),
        "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": "x"}\n```<｜tool▁call▁end｜>',
        "gpt_oss": '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": "x"}',
    }[parser.name]
    assert calls(parser.parse(text)) == [("f", {"a": "x"})]


def test_deepseek_v31_form_is_read() -> None:
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": [1, "ü"]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert DeepSeekV3Parser().parse(text) == Action("", DeepSeekV3Parser().parse(text).tool_calls)
    assert calls(DeepSeekV3Parser().parse(text)) == [("f", {"a": [1, "ü"]})]


# ── malformed calls ─────────────────────────────────────────────────────────────────────────────
MALFORMED = {
    "qwen3_coder": [
        "<tool_call>\n<function=f>\n<parameter=a>\nhalf a val",  # cut mid-argument
        "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  # no function
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
        "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",  # text outside parameters
        "<tool_call>\n<function=f>\n</function>\n<tool_call>\n<function=g>\n</function>\n</tool_call>",  # nesting
    ],
    "glm45": [
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>half",  # cut mid-argument
        "<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",  # no name
        "<tool_call>f\n<arg_value>1</arg_value>\n</tool_call>",  # value without key
        "<tool_call>f g h\n</tool_call>",  # not a name
        "<tool_call>f\n<tool_call>g\n</tool_call>",  # wrong nesting
    ],
    "kimi_k2": [
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": "cut',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad json}<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_begin|>functions.g:1"
        "<|tool_call_argument_begin|>{}<|tool_call_end|>",
    ],
    "deepseek_v3": [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": "cut',
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{bad}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\n```json\n{}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function f\n```json\n{}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
    ],
    "gpt_oss": [
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": "cut',
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad}<|call|>",
        "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>",
        "<|channel|>commentary to=functions.f <|constrain|>json",
        "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
        "<|channel|>commentary to=functions.f<|message|><|start|>assistant<|channel|>final<|message|>x",
    ],
}


# A call opened inside one left unclosed: the unclosed one is the error, the inner one is read.
NESTED = {
    "<tool_call>\n<function=f>\n</function>\n<tool_call>\n<function=g>\n</function>\n</tool_call>",
    "<tool_call>f\n<tool_call>g\n</tool_call>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_begin|>functions.g:1"
    "<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
}


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_malformed_calls_are_parse_errors_not_calls(parser: Any) -> None:
    for text in MALFORMED[parser.name]:
        action = parser.parse(text)
        # A block opened inside an unclosed one is read on its own; the unclosed one is the error.
        assert calls(action) == ([("g", {})] if text in NESTED else []), text
        assert len(action.parse_errors) >= 1, text
        assert all(parser.expected_format in e for e in action.parse_errors), text


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_every_prefix_of_a_valid_turn_parses_without_raising(parser: Any) -> None:
    text = {
        "qwen3_coder": _qwen3_coder_text(_generated_calls(3)),
        "glm45": '<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{"b": [1]}</arg_value>\n</tool_call>',
        "kimi_k2": _kimi_text(_generated_calls(3)),
        "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "gpt_oss": '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>',
    }[parser.name]
    for cut in range(len(text) + 1):
        action = parser.parse(text[:cut])
        assert isinstance(action, Action)
        assert all(isinstance(c.arguments, dict) for c in action.tool_calls)


# ── the same calls as vLLM's parsers and openai_harmony ─────────────────────────────────────────
# vLLM's XML-format parsers (qwen3_coder, glm45) type values by the request's tool schema, so each text is
# compared with a request whose tools declare every argument's JSON type; agentrl's parsers, which see no
# schema, must reach the same values from the text alone. Importing vLLM takes seconds: `slow`.
def _calls_without_nulls(seed: int) -> list[tuple[str, dict[str, Any]]]:
    # A top-level null has no schema type that vLLM types from text; nested nulls stay.
    # Each call gets its own function, so that one schema per function fits all its calls.
    return [
        (f"{name}_{i}", {k: v for k, v in args.items() if v is not None})
        for i, (name, args) in enumerate(_generated_calls(seed))
    ]


def _schema_type(value: Any) -> str:
    for kind, name in [
        (bool, "boolean"),
        (int, "integer"),
        (float, "number"),
        (str, "string"),
        (dict, "object"),
    ]:
        if isinstance(value, kind):
            return name
    return "array"


def _request(tool_calls: list[tuple[str, dict[str, Any]]]) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    schemas: dict[str, dict[str, Any]] = {}
    for name, args in tool_calls:
        props = schemas.setdefault(name, {})
        props.update({k: {"type": _schema_type(v)} for k, v in args.items()})
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}}
        for n, p in schemas.items()
    ]
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], model="m", tools=tools)


def _vllm_calls(parser: Any, text: str, request: Any) -> list[tuple[str, dict[str, Any]]]:
    info = parser.extract_tool_calls(text, request)
    return [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


def _texts(family: str, seed: int, tool_calls: list[tuple[str, dict[str, Any]]]) -> str:
    if family == "qwen3_coder":
        return "Calling.\n" + _qwen3_coder_text(tool_calls)
    if family == "kimi_k2":
        return "Calling." + _kimi_text(tool_calls)
    if family == "glm45":
        return "Calling." + "".join(
            f"\n<tool_call>{name}\n"
            + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                "</arg_value>\n"
                for k, v in args.items()
            )
            + "</tool_call>"
            for name, args in tool_calls
        )
    return (
        "Calling.<｜tool▁calls▁begin｜>"
        + "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```"
            "<｜tool▁call▁end｜>"
            for name, args in tool_calls
        )
        + "<｜tool▁calls▁end｜>"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "ours", "theirs", "tokenizer"),
    [
        (
            "qwen3_coder",
            Qwen3CoderParser(),
            "vllm.tool_parsers.qwen3_engine_tool_parser:Qwen3EngineToolParser",
            "qwen3-0.6b",
        ),
        (
            "glm45",
            Glm45Parser(),
            "vllm.tool_parsers.glm47_moe_tool_parser:Glm47MoeModelToolParser",
            "qwen3-0.6b",
        ),
        ("kimi_k2", KimiK2Parser(), "vllm.tool_parsers.kimi_k2_tool_parser:KimiK2ToolParser", "qwen3-0.6b"),
        # vLLM's own table names a class that its deepseekv3 module lacks, so the class is imported directly.
        (
            "deepseek_v3",
            DeepSeekV3Parser(),
            "vllm.tool_parsers.deepseekv3_tool_parser:DeepSeekV3ToolParser",
            "deepseek-v3-tokenizer",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and "." not in v and "-" not in v else "",
)
def test_same_calls_as_vllm(family: str, ours: Any, theirs: str, tokenizer: str, assets: Path) -> None:
    pytest.importorskip("vllm")
    import importlib

    from transformers import AutoTokenizer

    module, _, cls = theirs.partition(":")
    parser = getattr(importlib.import_module(module), cls)(AutoTokenizer.from_pretrained(assets / tokenizer))
    for seed in range(CONVERSATIONS):
        tool_calls = _calls_without_nulls(seed)
        text = _texts(family, seed, tool_calls)
        mine = [(c.name, c.arguments) for c in ours.parse(text).tool_calls]
        assert mine == tool_calls, text
        assert _vllm_calls(parser, text, _request(tool_calls)) == mine, text


@pytest.mark.slow
def test_same_calls_as_openai_harmony(assets: Path) -> None:
    harmony = pytest.importorskip("openai_harmony")
    from transformers import AutoTokenizer

    encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    tok = AutoTokenizer.from_pretrained(assets / "gpt-oss-tokenizer")
    for seed in range(CONVERSATIONS):
        text = "<|channel|>analysis<|message|>Thinking about it.<|end|>" + "".join(
            f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(args, ensure_ascii=False)}<|call|>"
            for name, args in _generated_calls(seed)
        )
        tokens = tok.encode(text, add_special_tokens=False)
        messages = encoding.parse_messages_from_completion_tokens(tokens, role=harmony.Role.ASSISTANT)
        theirs = [
            (m.recipient.removeprefix("functions."), json.loads(m.content[0].text))
            for m in messages
            if m.recipient
        ]
        mine = [(c.name, c.arguments) for c in GptOssParser().parse(text).tool_calls]
        assert mine == theirs == _generated_calls(seed), text
