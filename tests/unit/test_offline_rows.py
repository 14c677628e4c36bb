"""Demonstration and preference rows become ledgers masked as an episode's: only the assistant's tokens
are SAMPLED, tool results TOOL, the rest PROMPT or TEMPLATE; bad rows are named by file, row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.errors import DatasetError
from agentrl.offline_rows import load_demonstrations, load_preferences, render_conversation
from agentrl.types import Generation, TokenOrigin

TINY = Path("/work/shared/assets/tiny-random-qwen2")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"
pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason="tiny Qwen2 not found in shared assets")

TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run code.", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
CALL = {"type": "function", "function": {"name": "python", "arguments": '{"code": "print(6 * 7)"}'}}
ROW = [{"role": "user", "content": "What is 6 * 7?"},
       {"role": "assistant", "content": None, "tool_calls": [CALL]},
       {"role": "tool", "content": "42"},
       {"role": "assistant", "content": "The answer is 42."}]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.from_pretrained(TINY)


def runs(template: ChatTemplate, trajectory) -> list[tuple[str, str]]:
    out: list[tuple[str, list[int]]] = []
    for tok, origin in zip(trajectory.token_ids, trajectory.origins, strict=True):
        name = TokenOrigin(origin).name
        if out and out[-1][0] == name:
            out[-1][1].append(tok)
        else:
            out.append((name, [tok]))
    return [(name, template.tokenizer.decode(ids)) for name, ids in out]


def write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_multi_turn_demonstration_is_masked_like_the_agent_loop_ledger(template):
    from agentrl.offline_rows import _messages

    trajectory = render_conversation(template, _messages(ROW, "messages"), TOOLS)
    pieces = runs(template, trajectory)
    assert [name for name, _ in pieces] == ["PROMPT", "SAMPLED", "TEMPLATE", "TOOL", "TEMPLATE", "SAMPLED"]
    assert pieces[1][1] == '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call><|im_end|>'
    assert pieces[3][1] == "42"
    assert pieces[5][1] == "The answer is 42.<|im_end|>"
    assert pieces[0][1].endswith("<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n")
    assert trajectory.turns[-1] == 2 and trajectory.metrics["template_mismatch"] == 0.0
    # the same ledger the AgentLoop's tokenizer builds from the same sampled ids
    conv = ConversationTokenizer(template)
    conv.start(ROW[:1], TOOLS)
    sampled = [i for i, o in zip(trajectory.token_ids, trajectory.origins, strict=True) if o == TokenOrigin.SAMPLED]
    first = len(template.encode(pieces[1][1]))
    conv.add_generation(Generation(sampled[:first], [0.0] * first, "stop"))
    conv.add_messages([{"role": "tool", "content": "42"}])
    conv.add_generation(Generation(sampled[first:], [0.0] * (len(sampled) - first), "stop"))
    assert conv.token_ids == trajectory.token_ids
    assert conv.trajectory.origins == trajectory.origins


def test_the_example_files_render_every_row(template):
    demos = load_demonstrations([EXAMPLES / "demonstrations.jsonl"], template)
    assert len(demos) == 16 and demos.template_mismatches == 0
    assert demos.examples[0].info["source"].endswith("demonstrations.jsonl row 0")
    prefs = load_preferences([EXAMPLES / "preferences.jsonl"], template)
    assert len(prefs) == 16
    for pair in prefs.examples:  # the prompt is rendered once, alike, in both ledgers
        n = pair.chosen.prompt_length
        assert pair.chosen.token_ids[:n] == pair.rejected.token_ids[:n]
        assert pair.chosen.group_id == pair.rejected.group_id


def test_the_three_preference_formats_give_the_same_ledgers(template, tmp_path):
    prompt = [{"role": "user", "content": "What is 6 * 7?"}]
    good, bad = "The answer is 42.", "The answer is 41."
    rows = [
        {"prompt": "What is 6 * 7?", "chosen": good, "rejected": bad},
        {"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
         "rejected": [{"role": "assistant", "content": bad}]},
        {"chosen": [*prompt, {"role": "assistant", "content": good}],
         "rejected": [*prompt, {"role": "assistant", "content": bad}]},
    ]
    pairs = load_preferences([write(tmp_path / "p.jsonl", rows)], template).examples
    assert len({tuple(p.chosen.token_ids) for p in pairs}) == 1
    assert len({tuple(p.rejected.token_ids) for p in pairs}) == 1
    assert runs(template, pairs[0].rejected)[-1] == ("SAMPLED", "The answer is 41.<|im_end|>")


def test_bad_rows_are_named_by_file_row_and_field_all_at_once(template, tmp_path):
    bad_args = {**ROW[1], "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": "{oops"}}]}
    rows = [
        {"messages": ROW},
        {"messages": [ROW[0], bad_args, *ROW[2:]]},
        {"messages": ROW[:3]},
        {"messages": [ROW[0], {"role": "robot", "content": "hi"}]},
        "not json",
        {"conversation": ROW},
        {"messages": [ROW[0], ROW[3], ROW[3]]},
    ]
    path = write(tmp_path / "demos.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        load_demonstrations([path], template)
    text = str(err.value)
    assert "6 malformed demonstration row(s) of 7" in text
    assert f"{path} row 1: messages[1].tool_calls[0].function.arguments: is not valid JSON" in text
    assert f"{path} row 2: messages[2]: the conversation ends with a tool message" in text
    assert f"{path} row 3: messages[1].role: must be one of system, user, assistant, tool, got 'robot'" in text
    assert f"{path} row 4: line 5 is not valid JSON" in text
    assert f"{path} row 5: messages: is missing" in text
    assert f"{path} row 6: messages[2]: two assistant messages in a row" in text
    kept = load_demonstrations([path], template, skip_bad_rows=True)
    assert len(kept) == 1 and [s.row for s in kept.skipped] == [1, 2, 3, 4, 5, 6]


def test_rows_longer_than_the_limit_and_bad_pairs_are_refused(template, tmp_path):
    path = write(tmp_path / "demos.jsonl", [{"messages": ROW}])
    with pytest.raises(DatasetError, match=r"row 0: renders to \d+ tokens, more than rollout.max_total_tokens=20"):
        load_demonstrations([path], template, max_tokens=20, limit_name="rollout.max_total_tokens")
    rows = [
        {"prompt": "hi", "chosen": "a"},
        {"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
         "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]},
        {"prompt": "hi", "chosen": "", "rejected": "b"},
    ]
    with pytest.raises(DatasetError) as err:
        load_preferences([write(tmp_path / "p.jsonl", rows)], template)
    text = str(err.value)
    assert "row 0: rejected: is missing" in text
    assert "row 1: chosen: shares no opening message with 'rejected'" in text
    assert "row 2: chosen: is an empty string" in text
