"""`render_difference`: the template check behind `agentrl check onpolicy` (a) and the gate's template figure.

Guards: a ledger whose sampled ids re-tokenise differently but decode to the same text agrees with
the re-render (the ledger keeps what was sampled); a parser that stripped whitespace the model
sampled is not a template mismatch, nor is a sampled newline that re-tokenises into the generation
prompt's last id; a template that renders the assistant turn with an extra space
is one, and the reason says where.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate, render_difference
from agentrl.models import TOOL_CHATML_TEMPLATE
from agentrl.types import TokenOrigin, Trajectory

TINY = Path("/work/shared/assets/tiny-random-qwen2")
pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason="needs the tiny model's tokenizer in /work/shared/assets")
RIGHT = "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}{% for call"


def episode(template: ChatTemplate, sampled: list[list[int]], content: str) -> Trajectory:
    t = Trajectory()
    messages = [{"role": "user", "content": "Say hello."}]
    t.extend(template.first_prompt_ids(messages), TokenOrigin.PROMPT, 0, ints=True)
    ids = [i for piece in sampled for i in piece]
    t.extend(ids, TokenOrigin.SAMPLED, 1, logprobs=[-1.0] * len(ids), version=0)
    t.messages.extend([*messages, {"role": "assistant", "content": content}])
    return t


def test_non_canonical_sampled_ids_and_stripped_whitespace_agree() -> None:
    template = ChatTemplate.from_pretrained(TINY, TOOL_CHATML_TEMPLATE)
    enc = template.encode
    split = [enc(" hel"), enc("lo"), enc(" world")]  # " hello" would be one id
    t = episode(template, split, "hello world")  # the parser stripped the leading space
    assert [i for p in split for i in p] != enc(" hello world")
    assert render_difference(template, t, prefix=True) == ""
    assert render_difference(template, t) != ""  # without prefix the re-render's closing is missing


def test_a_turn_that_starts_with_a_sampled_newline_agrees() -> None:
    """Re-tokenised, the generation prompt's closing newline and the sampled one are one id."""
    template = ChatTemplate.from_pretrained(TINY, TOOL_CHATML_TEMPLATE)
    enc = template.encode
    for text in ("\nhello", "\n\nhello"):
        t = episode(template, [enc(text[:1]), enc(text[1:])], text.strip())
        assert t.token_ids != template.encode_prompt(t.messages, None, add_generation_prompt=False)[: len(t.token_ids)]
        assert render_difference(template, t, prefix=True) == ""


def test_a_template_that_adds_a_space_to_the_assistant_turn_differs() -> None:
    assert TOOL_CHATML_TEMPLATE.count(RIGHT) == 1
    planted = TOOL_CHATML_TEMPLATE.replace(RIGHT, RIGHT.replace("}}{{ message", "}} {{ message"))
    template = ChatTemplate.from_pretrained(TINY, planted)
    t = episode(template, [template.encode("hello world")], "hello world")
    reason = render_difference(template, t, prefix=True)
    assert "first difference at id" in reason and "' hello world" in reason
