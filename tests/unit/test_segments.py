"""SegmentEncoder and the chat-template caches against the real tokenizers in the shared assets.

The cached, piecewise tokenisation must give exactly the ids (and offsets) of tokenising the whole
text, for every tokenizer agentrl is tested with; the caches must never serve a stale answer when
the tools, the system message or the shape of the messages differ.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentrl.chat import ChatTemplate
from agentrl.segments import SegmentEncoder, _overlaps_another
from agentrl.types import TokenOrigin

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
NAMES = {"qwen2.5": "qwen2.5-0.5b-instruct", "qwen3": "qwen3-0.6b", "mistral": "mistral-nemo-instruct-2407"}

pytestmark = pytest.mark.skipif(not (ASSETS / NAMES["qwen2.5"]).is_dir(), reason=f"no tokenizer assets under {ASSETS}")


def schema(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }


@pytest.fixture(scope="module")
def templates() -> dict[str, ChatTemplate]:
    return {name: ChatTemplate.from_pretrained(ASSETS / path) for name, path in NAMES.items()}


def whole(template: ChatTemplate, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = template.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def test_boundaries_are_the_role_markers(templates: dict[str, ChatTemplate]) -> None:
    assert set(templates["qwen2.5"].segments.boundaries) == {"<|im_start|>", "<|im_end|>"}
    assert {"[INST]", "[/INST]", "</s>"} <= set(templates["mistral"].segments.boundaries)


@pytest.mark.parametrize("name", list(NAMES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.text(max_size=80))
@example(content="<|im_end|>\n<|im_start|>user\n[INST] x [/INST]</s>  ")
@example(content=" \n\n leading and trailing \n ")
@example(content="\uf900\u0301e\u0301")
def test_pieces_give_the_whole_text_ids_and_offsets(
    templates: dict[str, ChatTemplate], name: str, content: str
) -> None:
    template = templates[name]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": content or "hi"},
    ]
    text = template.render(messages, [schema("calculator")])
    for _ in range(2):  # once to fill the cache, once from it
        ids, offsets = template.segments.encode_with_offsets(text)
        assert (ids, offsets) == whole(template, text)
        assert template.encode(text) == ids
    # The delta path tokenises after-marker text, starting in the middle of a turn.
    tail = text[len(text) // 3 :]
    assert template.segments.encode_with_offsets(tail) == whole(template, tail)


def test_repeated_system_block_is_served_from_the_cache(templates: dict[str, ChatTemplate]) -> None:
    template = ChatTemplate(templates["qwen2.5"].tokenizer)
    tools = [schema("calculator")]
    system = {"role": "system", "content": "A long system prompt. " * 20}
    template.encode_prompt([system, {"role": "user", "content": "first"}], tools)
    misses = template.segments.misses
    hits = template.segments.hits
    template.encode_prompt([system, {"role": "user", "content": "second"}], tools)
    # Only the new user turn (and at most the generation prompt) is tokenised again.
    assert template.segments.misses - misses == 1
    assert template.segments.hits > hits


def test_cache_is_bounded_by_characters(templates: dict[str, ChatTemplate]) -> None:
    seg = SegmentEncoder(templates["qwen2.5"].tokenizer, ["a<|im_end|>b"], max_chars=800)
    texts = [f"text number {i} " * 5 + "<|im_end|>" for i in range(100)]
    for text in texts:
        assert seg.encode(text) == whole(templates["qwen2.5"], text)[0]
    assert 0 < sum(len(p) for p in seg._cache) <= 800
    assert seg.cached_pieces < 100
    seg.clear()
    assert seg.cached_pieces == 0


def test_slow_tokenizers_get_no_pieces(templates: dict[str, ChatTemplate]) -> None:
    class Slow:
        is_fast = False

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __call__(self, text: str, **kwargs: Any) -> Any:
            return self.inner(text, **kwargs)

    seg = SegmentEncoder(Slow(templates["qwen2.5"].tokenizer), ["x<|im_end|>y"])
    assert seg.boundaries == ()
    ids, offsets = seg.encode_with_offsets("x<|im_end|>y")
    assert offsets is None and ids == whole(templates["qwen2.5"], "x<|im_end|>y")[0]


def test_tokens_that_could_match_across_a_cut_are_not_boundaries() -> None:
    assert _overlaps_another("<end>", ["<end>", "<end>\n"])  # a longer token starts with it
    assert _overlaps_another("<end>", ["x<end"])  # ends with a prefix of it
    assert _overlaps_another("<end>", ["d>tail"])  # starts with a suffix of it
    assert not _overlaps_another("<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<tool_call>"])


# ── the sentinel-render cache of ChatTemplate.encode_delta ─────────────────────────────────────
def tool_msg(content: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": "calculator"}


def fresh_delta(template: ChatTemplate, new: list[dict[str, Any]], **kwargs: Any) -> Any:
    """The delta as an uncached template instance computes it."""
    return ChatTemplate(template.tokenizer, **template.template_kwargs).encode_delta(new, **kwargs)


def test_sentinel_render_is_shared_across_call_ids(templates: dict[str, ChatTemplate]) -> None:
    template = ChatTemplate(templates["qwen2.5"].tokenizer)
    first = template.encode_delta([tool_msg("84", "call_aaaa")], sampled_ids=[151645])
    second = template.encode_delta([tool_msg("1234", "call_bbbbbbbb")], sampled_ids=[151645])
    assert len(template._masked) == 1  # one shape, one render
    assert second == fresh_delta(template, [tool_msg("1234", "call_bbbbbbbb")], sampled_ids=[151645])
    tool_text = template.tokenizer.decode([t for t, o in zip(second.token_ids, second.origins, strict=True)
                                           if o == TokenOrigin.TOOL])
    assert tool_text == "1234" and first.token_ids != second.token_ids


@pytest.mark.parametrize("name", ["qwen2.5", "mistral"])
def test_sentinel_cache_is_not_reused_when_tools_or_system_differ(
    templates: dict[str, ChatTemplate], name: str
) -> None:
    template = ChatTemplate(templates[name].tokenizer)
    new = [{"role": "user", "content": "And now?"}]
    sampled = list(template.closing_ids[:1])
    variants = [
        {"tools": [schema("calculator")]},
        {"tools": [schema("lookup")]},
        {"tools": [schema("calculator")], "system": {"role": "system", "content": "Be terse."}},
        {"tools": [schema("calculator")], "system": {"role": "system", "content": "Be verbose."}},
    ]
    deltas = [template.encode_delta(new, sampled_ids=sampled, **v) for v in variants]
    deltas += [template.encode_delta(new, sampled_ids=sampled, **v) for v in variants]  # from the cache
    for delta, variant in zip(deltas, variants * 2, strict=True):
        assert delta == fresh_delta(template, new, sampled_ids=sampled, **variant)
    if name == "mistral":  # Mistral renders the tools (and system) next to the last user message
        assert len({tuple(d.token_ids) for d in deltas[:4]}) == 4
    assert len(template._masked) == 4


def test_mistral_keeps_its_nine_character_ids(templates: dict[str, ChatTemplate]) -> None:
    template = ChatTemplate(templates["mistral"].tokenizer)
    delta = template.encode_delta([tool_msg("84", "c0000000a")], sampled_ids=[2], tools=[schema("calculator")])
    assert template._mask_ids is False  # the template refuses sentinel ids, so only contents are masked
    assert delta == fresh_delta(template, [tool_msg("84", "c0000000a")], sampled_ids=[2], tools=[schema("calculator")])
    runs = [(o, template.tokenizer.decode(ids)) for o, ids in delta.runs()]
    assert (TokenOrigin.TOOL, "84") in runs
