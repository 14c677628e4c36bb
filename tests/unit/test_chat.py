"""Delta tokenisation against the real Qwen2.5, Qwen3 and Mistral-Nemo chat templates.

The "model" here is ideal: each sampled turn is exactly what the template would render for the
assistant message, stopped on the end-of-turn token (or cut by length). Against that model a
prefix-stable template must give a ledger equal to a full re-render; the templates that are not
prefix-stable (Qwen3 with past thinking, Mistral with a system message) must be counted in
`template_mismatch` and never raise.
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.errors import ChatTemplateError
from agentrl.types import Generation, Message, TokenOrigin

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
QWEN25 = ASSETS / "qwen2.5-0.5b-instruct"
QWEN3 = ASSETS / "qwen3-0.6b"
MISTRAL = ASSETS / "mistral-nemo-instruct-2407"

pytestmark = pytest.mark.skipif(not QWEN25.is_dir(), reason=f"tokenizer assets not found under {ASSETS}")

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def templates() -> dict[str, ChatTemplate]:
    return {
        "qwen2.5": ChatTemplate.from_pretrained(QWEN25),
        "qwen3": ChatTemplate.from_pretrained(QWEN3),
        "qwen3-nothink": ChatTemplate.from_pretrained(QWEN3, enable_thinking=False),
        "mistral": ChatTemplate.from_pretrained(MISTRAL),
    }


# ── an ideal model ─────────────────────────────────────────────────────────────────────────────
def call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def sample(ct: ConversationTokenizer, message: Message, *, stop: str = "eos") -> Generation:
    """What an ideal model samples for `message`: the template's own rendering of it.

    stop="eos": stopped on (and including) the first closing token; "length": no closing at all.
    """
    template = ct.template
    before = template.render(ct.messages, ct.tools, add_generation_prompt=True)
    after = template.render([*ct.messages, message], ct.tools, add_generation_prompt=False)
    assert after.startswith(before), "test conversation must render prefix-stably up to here"
    text = after[len(before) :]
    assert text.endswith(template.closing_text)
    ids = template.encode(text[: len(text) - len(template.closing_text)])
    if stop == "eos":
        ids.append(template.closing_ids[0])
    return Generation(ids, [-0.5] * len(ids), "stop" if stop == "eos" else "length", weight_version=3)


def tool_msg(content: str, call_id: str, name: str = "calculator") -> Message:
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": name}


def run_episode(
    template: ChatTemplate,
    turns: list[tuple[Message, list[Message]]],
    *,
    system: bool = True,
    stop: str = "eos",
) -> tuple[ConversationTokenizer, list[list[int]]]:
    """Play `turns` (assistant message, then the messages the env answers) and return the ledger
    plus the ids sent before every generation."""
    head: list[Message] = [{"role": "system", "content": "You are terse."}] if system else []
    conv = ConversationTokenizer(template)
    sent = [conv.start([*head, {"role": "user", "content": "What is 12*7, and what is 'ok'?"}], TOOLS)]
    for assistant, observation in turns:
        conv.add_generation(sample(conv, assistant, stop=stop), assistant)
        if observation:
            sent.append(conv.add_messages(observation))
    conv.trajectory.validate()
    return conv, sent


# Ids are 9 alphanumerics because Mistral's template refuses anything else.
TOOL_EPISODE: list[tuple[Message, list[Message]]] = [
    (
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [call("calculator", {"expression": "12*7"}, "c0000000a")],
        },
        [tool_msg("84", "c0000000a")],
    ),
    (
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                call("lookup", {"word": "ok"}, "c0000000b"),
                call("calculator", {"expression": "84/2"}, "c0000000c"),
            ],
        },
        [tool_msg('{"meaning": "fine"}', "c0000000b", "lookup"), tool_msg("42.0", "c0000000c")],
    ),
    ({"role": "assistant", "content": "84; 'ok' means fine."}, []),
]


def with_reasoning(turns: list[tuple[Message, list[Message]]]) -> list[tuple[Message, list[Message]]]:
    """Qwen3 thinking mode: every assistant turn carries non-empty reasoning."""
    out = []
    for i, (msg, obs) in enumerate(turns):
        m = dict(msg)
        m["reasoning_content"] = f"Step {i}: I should use the tools."
        out.append((m, obs))  # type: ignore[arg-type]
    return out


# ── first prompt ───────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "qwen3-nothink", "mistral"])
def test_first_prompt_equals_apply_chat_template(templates: dict[str, ChatTemplate], name: str) -> None:
    template = templates[name]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    conv = ConversationTokenizer(template)
    ids = conv.start(messages, TOOLS)  # type: ignore[arg-type]
    expected = template.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, **template.template_kwargs
    )["input_ids"]
    assert ids == expected
    assert set(conv.trajectory.origins) == {int(TokenOrigin.PROMPT)}
    assert set(conv.trajectory.turns) == {0}
    assert '"calculator"' in template.tokenizer.decode(ids)


# ── prefix extension and full re-render ────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("name", "system", "reasoning"),
    [("qwen2.5", True, False), ("qwen2.5", False, False), ("qwen3", True, True), ("mistral", False, False)],
)
@pytest.mark.parametrize("stop", ["eos", "length"])
def test_prefix_stable_templates_match_full_rerender(
    templates: dict[str, ChatTemplate], name: str, system: bool, reasoning: bool, stop: str
) -> None:
    turns = with_reasoning(TOOL_EPISODE) if reasoning else TOOL_EPISODE
    conv, sent = run_episode(templates[name], turns, system=system, stop=stop)
    for k in range(1, len(sent)):
        assert sent[k][: len(sent[k - 1])] == sent[k - 1], f"turn {k} does not extend turn {k - 1}"
        assert len(sent[k]) > len(sent[k - 1])
    full = templates[name].encode_prompt(conv.messages[:-1], TOOLS)
    assert sent[-1] == full
    assert conv.trajectory.metrics["template_mismatch"] == 0.0
    assert "template_mismatches" not in conv.trajectory.info


def test_ledger_origins_turns_and_logprobs(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen2.5"]
    conv, _ = run_episode(template, TOOL_EPISODE)
    traj = conv.trajectory
    tok = template.tokenizer
    # Sampled tokens are exactly the three generations, with their logprobs and version.
    sampled = traj.tokens_of(TokenOrigin.SAMPLED)
    assert tok.decode(sampled).count("<|im_end|>") == 3
    assert traj.response_mask == [int(o == TokenOrigin.SAMPLED) for o in traj.origins]
    for o, lp, v in zip(traj.origins, traj.logprobs, traj.versions, strict=True):
        assert (lp, v) == ((-0.5, 3) if o == TokenOrigin.SAMPLED else (0.0, -1))
    # TOOL tokens are the tool contents. Qwen's BPE merges '}' with the template's '\n' into one
    # token; a token that straddles content and template counts as TOOL (documented in chat.py).
    assert tok.decode(traj.tokens_of(TokenOrigin.TOOL)) == '84{"meaning": "fine"}\n42.0'
    # TEMPLATE tokens are the wrappers: "\n" closing each sampled turn, role markers, prompts.
    template_text = tok.decode(traj.tokens_of(TokenOrigin.TEMPLATE))
    assert template_text.startswith(
        "\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert template_text.count("<tool_response>") == 3
    assert template_text.count("<|im_start|>user") == 2  # two tool results share one user block
    assert traj.num_turns == 3
    assert traj.prompt_length == traj.turns.index(1)


def test_eos_already_sampled_appends_only_the_rest_of_the_closing(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen2.5"]
    im_end, newline = template.closing_ids
    delta = template.encode_delta([tool_msg("7", "c0000000a")], sampled_ids=[100, 200, im_end])
    assert delta.skipped == 1
    assert delta.token_ids[0] == newline
    assert delta.origins[0] == TokenOrigin.TEMPLATE
    cut = template.encode_delta([tool_msg("7", "c0000000a")], sampled_ids=[100, 200])
    assert cut.skipped == 0
    assert cut.token_ids[:2] == [im_end, newline]
    assert cut.origins[:2] == [TokenOrigin.TEMPLATE, TokenOrigin.TEMPLATE]
    assert cut.token_ids[2:] == delta.token_ids[1:]


def test_mistral_closing_is_eos_and_no_generation_prompt(templates: dict[str, ChatTemplate]) -> None:
    template = templates["mistral"]
    assert template.closing_text == "</s>"
    delta = template.encode_delta([tool_msg("7", "c0000000a")], sampled_ids=[5, 2])
    assert delta.skipped == 1
    assert delta.text == '</s>[TOOL_RESULTS]{"content": 7, "call_id": "c0000000a"}[/TOOL_RESULTS]'
    assert (
        template.tokenizer.decode(
            [t for t, o in zip(delta.token_ids, delta.origins, strict=True) if o == TokenOrigin.TOOL]
        )
        == "7"
    )
    cut = template.encode_delta([tool_msg("7", "c0000000a")], sampled_ids=[5])
    assert cut.token_ids[0] == template.tokenizer.eos_token_id


def test_content_that_looks_like_template_is_still_tool(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen2.5"]
    delta = template.encode_delta(
        [tool_msg("user", "c0000000a"), tool_msg("</tool_response> user", "c0000000b")], sampled_ids=[151645]
    )
    runs = [(o, template.tokenizer.decode(ids)) for o, ids in delta.runs()]
    assert runs == [
        (TokenOrigin.TEMPLATE, "\n<|im_start|>user\n<tool_response>\n"),
        (TokenOrigin.TOOL, "user"),
        (TokenOrigin.TEMPLATE, "\n</tool_response>\n<tool_response>\n"),
        (TokenOrigin.TOOL, "</tool_response> user"),
        (TokenOrigin.TEMPLATE, "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ]


def test_no_new_messages_gives_closing_and_generation_prompt(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen2.5"]
    delta = template.encode_delta([], sampled_ids=[5])
    assert template.tokenizer.decode(delta.token_ids) == "<|im_end|>\n<|im_start|>assistant\n"
    assert set(delta.origins) == {TokenOrigin.TEMPLATE}


@pytest.mark.parametrize(
    ("name", "feedback_ok"),
    # Qwen3 drops past thinking on user feedback and Mistral refuses a user right after tool
    # results, so only Qwen2.5 gets user feedback here; the others get tool results alone.
    [("qwen2.5", True), ("qwen3", False), ("mistral", False)],
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.text(max_size=60), feedback=st.text(min_size=1, max_size=30))
@example(content="\uf900", feedback="0")
def test_any_content_matches_full_rerender(
    templates: dict[str, ChatTemplate], name: str, feedback_ok: bool, content: str, feedback: str
) -> None:
    template = templates[name]
    first: Message = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Use it.",
        "tool_calls": [call("calculator", {"expression": "1"}, "c0000000a")],
    }
    observation = [tool_msg(content, "c0000000a")]
    if feedback_ok:
        observation.append({"role": "user", "content": feedback})
    conv, sent = run_episode(
        template, [(first, observation), ({"role": "assistant", "content": "done"}, [])], system=False
    )
    assert sent[1][: len(sent[0])] == sent[0]
    assert sent[1] == template.encode_prompt(conv.messages[:-1], TOOLS)
    assert conv.trajectory.metrics["template_mismatch"] == 0.0
    # Qwen's tokenizer NFC-normalises text (hypothesis found U+F900 coming back as U+8C48).
    tool_text = template.tokenizer.decode(conv.trajectory.tokens_of(TokenOrigin.TOOL))
    assert nfc(content).strip() in nfc(tool_text)
    if feedback_ok:
        assert nfc(feedback).strip() in nfc(tool_text)


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


# ── with the real parsers, as the AgentLoop will use it ──────────────────────────────────────
@pytest.mark.parametrize(
    ("name", "parser_name", "first", "final"),
    [
        (
            "qwen2.5",
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"word": "ok"}}\n</tool_call>',
            "84, and 'ok' means fine.",
        ),
        (
            "qwen3",
            "hermes",
            '<think>\nTwo lookups.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"word": "ok"}}\n</tool_call>',
            "<think>\nDone.\n</think>\n\n84, and 'ok' means fine.",
        ),
        (
            "mistral",
            "mistral",
            '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12*7"}, "id": "k1x9Qa7Zb"}, '
            '{"name": "lookup", "arguments": {"word": "ok"}, "id": "m2y8Rb6Yc"}]',
            "84, and 'ok' means fine.",
        ),
    ],
)
def test_episode_with_parsed_calls_and_tool_results(
    templates: dict[str, ChatTemplate], name: str, parser_name: str, first: str, final: str
) -> None:
    from agentrl.registry import TOOL_PARSERS
    from agentrl.types import ToolResult

    template = templates[name]
    parser = TOOL_PARSERS.resolve(parser_name)()
    conv = ConversationTokenizer(template)
    sent = [conv.start([{"role": "user", "content": "12*7, and what is 'ok'?"}], TOOLS)]
    ids = [*template.encode(first), template.closing_ids[0]]
    text = template.decode_turn(ids)
    assert text == first
    action = parser.parse(text)
    assert [c.name for c in action.tool_calls] == ["calculator", "lookup"] and not action.parse_errors
    conv.add_generation(Generation(ids, [-1.0] * len(ids), "stop", 1), action.to_message())
    results = [ToolResult("84", None, c.name, c.id) for c in action.tool_calls]
    sent.append(conv.add_messages([r.to_message() for r in results]))
    ids = [*template.encode(final), template.closing_ids[0]]
    conv.add_generation(
        Generation(ids, [-1.0] * len(ids), "stop", 1), parser.parse(template.decode_turn(ids)).to_message()
    )
    assert sent[1][: len(sent[0])] == sent[0]
    assert conv.trajectory.metrics["template_mismatch"] == 0.0
    full = template.encode_prompt(conv.messages, TOOLS, add_generation_prompt=False)
    # The closing after the final answer is the template's, not sampled: the ledger stops at EOS.
    assert full[: len(conv.token_ids)] == conv.token_ids
    assert template.decode_turn([1, 2, 3]) == template.tokenizer.decode([1, 2, 3], skip_special_tokens=False)


# ── templates that are not prefix-stable ───────────────────────────────────────────────────────
def test_qwen3_user_followup_drops_past_thinking_and_is_counted(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen3"]
    turns: list[tuple[Message, list[Message]]] = [
        (
            {"role": "assistant", "content": "It is 84.", "reasoning_content": "12*7 is 84."},
            [{"role": "user", "content": "And 13*7?"}],
        ),
        ({"role": "assistant", "content": "91.", "reasoning_content": "13*7 is 91."}, []),
    ]
    conv, sent = run_episode(template, turns)
    assert sent[1][: len(sent[0])] == sent[0]
    assert conv.trajectory.metrics["template_mismatch"] == 1.0
    [mismatch] = conv.trajectory.info["template_mismatches"]
    assert mismatch["turn"] == 1 and "first difference" in mismatch["reason"]
    # The ledger keeps the thinking the model actually produced; the re-render has dropped it.
    assert "12*7 is 84." in template.tokenizer.decode(conv.token_ids)
    assert "12*7 is 84." not in template.render(conv.messages, TOOLS)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-nothink"])
def test_qwen3_empty_thinking_is_not_prefix_stable(templates: dict[str, ChatTemplate], name: str) -> None:
    conv, sent = run_episode(templates[name], TOOL_EPISODE)
    assert all(sent[k][: len(sent[k - 1])] == sent[k - 1] for k in range(1, len(sent)))
    assert conv.trajectory.metrics["template_mismatch"] == 2.0
    decoded = templates[name].tokenizer.decode(conv.token_ids)
    assert decoded.count("<think>\n\n</think>") == 3  # one per generation, none re-rendered away


def test_mistral_system_message_vanishes_from_rerender(templates: dict[str, ChatTemplate]) -> None:
    template = templates["mistral"]
    conv = ConversationTokenizer(template)
    messages: list[Message] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "12*7?"},
    ]
    conv.start(messages, TOOLS)
    assistant: Message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("calculator", {"expression": "12*7"}, "c0000000a")],
    }
    text = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12*7"}, "id": "c0000000a"}]'
    ids = [*template.encode(text), template.tokenizer.eos_token_id]
    conv.add_generation(Generation(ids, [-0.1] * len(ids), "stop", 0), assistant)
    conv.add_messages([tool_msg("84", "c0000000a")])
    assert conv.trajectory.metrics["template_mismatch"] == 1.0
    assert "You are terse." in template.tokenizer.decode(conv.token_ids)
    assert "You are terse." not in template.render(conv.messages, TOOLS)


def test_mistral_user_after_tool_results_is_counted_not_raised(templates: dict[str, ChatTemplate]) -> None:
    template = templates["mistral"]
    assistant, [result] = TOOL_EPISODE[0]
    conv, sent = run_episode(
        template, [(assistant, [result, {"role": "user", "content": "Now 13*7?"}])], system=False
    )
    ids = sent[-1]
    # The template renders [AVAILABLE_TOOLS] before the latest user message, so the delta has them
    # again; the whole conversation (user right after tool results) is refused by the template.
    assert template.tokenizer.decode(ids).count("[AVAILABLE_TOOLS]") == 2
    assert conv.trajectory.metrics["template_mismatch"] == 1.0
    assert "re-render failed" in conv.trajectory.info["template_mismatches"][0]["reason"]


def test_mistral_rejects_tool_call_ids_that_are_not_nine_characters(
    templates: dict[str, ChatTemplate],
) -> None:
    with pytest.raises(ChatTemplateError, match="length 9"):
        templates["mistral"].encode_delta([tool_msg("1", "call_1")])


# ── construction ───────────────────────────────────────────────────────────────────────────────
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_override_is_used(templates: dict[str, ChatTemplate]) -> None:
    tok = templates["qwen2.5"].tokenizer
    template = ChatTemplate(tok, template=CHATML)
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.closing_text == "<|im_end|>\n"
    delta = template.encode_delta(
        [{"role": "user", "content": json.dumps([1])}], sampled_ids=[template.closing_ids[0]]
    )
    assert tok.decode(delta.token_ids) == "\n<|im_start|>user\n[1]<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_without_template_is_refused(templates: dict[str, ChatTemplate]) -> None:
    class Bare:
        chat_template = None
        name_or_path = "bare-tokenizer"

    with pytest.raises(ChatTemplateError, match=r"bare-tokenizer.*template="):
        ChatTemplate(Bare())


def test_start_twice_and_out_of_order_calls_are_refused(templates: dict[str, ChatTemplate]) -> None:
    conv = ConversationTokenizer(templates["qwen2.5"])
    with pytest.raises(ValueError, match="start"):
        conv.add_messages([tool_msg("1", "c0000000a")])
    conv.start([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="twice"):
        conv.start([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="must follow add_generation"):
        conv.add_messages([tool_msg("1", "c0000000a")])
    conv.add_generation(Generation([], [], "stop", 0))  # an empty reply is still a reply
    ids = conv.add_messages([{"role": "user", "content": "again"}])
    assert conv.template.tokenizer.decode(ids).endswith(
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="must follow add_generation"):
        conv.add_messages([tool_msg("1", "c0000000a")])


class SlowTokenizer:
    """The real tokenizer seen as a slow one: no offset mapping."""

    is_fast = False

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.chat_template = inner.chat_template

    def __call__(self, text: str, **kwargs: Any) -> Any:
        kwargs.pop("return_offsets_mapping", None)
        return self._inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_slow_tokenizer_gives_same_ids_all_template(templates: dict[str, ChatTemplate]) -> None:
    fast = templates["qwen2.5"]
    slow = ChatTemplate(SlowTokenizer(fast.tokenizer))
    new = [tool_msg("84", "c0000000a")]
    a = fast.encode_delta(new, sampled_ids=[151645])
    b = slow.encode_delta(new, sampled_ids=[151645])
    assert b.token_ids == a.token_ids and b.skipped == a.skipped == 1
    assert set(b.origins) == {TokenOrigin.TEMPLATE}
    assert TokenOrigin.TOOL in a.origins


def test_content_transformed_by_the_template_falls_back_to_search(templates: dict[str, ChatTemplate]) -> None:
    trimming = CHATML.replace("{{ m.content }}", "{{ m.content | trim }}")
    template = ChatTemplate(templates["qwen2.5"].tokenizer, template=trimming)
    delta = template.encode_delta([{"role": "user", "content": "  spaced out  "}], sampled_ids=[151645])
    runs = [(o, template.tokenizer.decode(ids)) for o, ids in delta.runs()]
    assert (TokenOrigin.TOOL, "spaced out") in runs


def test_first_prompts_are_cached_by_their_input(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen2.5"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    tools = template.intern_tools(json.loads(json.dumps(TOOLS)))
    assert template.intern_tools(json.loads(json.dumps(TOOLS))) is tools  # equal tools, one list
    first = template.first_prompt_ids(messages, tools)
    assert list(first) == template.encode_prompt(messages, TOOLS)
    assert template.first_prompt_ids(messages, tools) is first  # the second sample renders nothing
    other = [messages[0], {"role": "user", "content": "What is 3+3?"}]
    assert list(template.first_prompt_ids(other, tools)) == template.encode_prompt(other, TOOLS)
    assert list(template.first_prompt_ids(messages, None)) == template.encode_prompt(messages)


def test_templates_that_read_the_clock_are_not_cached(templates: dict[str, ChatTemplate]) -> None:
    tok = templates["qwen2.5"].tokenizer
    dated = ChatTemplate(tok, template="{{ strftime_now('%Y') }}" + CHATML)
    messages = [{"role": "user", "content": "hi"}]
    assert dated.first_prompt_ids(messages) == dated.first_prompt_ids(messages)
    assert dated._prompts == {}
