"""Typed call outcomes: a malformed-call corpus for each of the nine parsers yields the right status and
span, never an exception, and the episode goes on; the AgentLoop places outcomes on the sampled ids.

Each corpus text is parsed, its outcomes placed on token ids with the family's tokenizer where the shared
assets hold one (Qwen2.5 for hermes, qwen3_coder and retool; Mistral-Nemo, Llama 3.1, DeepSeek-V3, gpt-oss
for theirs); glm45 and kimi_k2 have no tokenizer there, so their texts are tokenised with Qwen2.5's, where
their markers are plain text (the spans are then checked on that vocabulary only). The Action then goes to
a `ToolEnv` with one tool, `get_weather(city: str, days: int)`, which decides `unknown_tool` and
`bad_arguments` (the schema refusing the arguments).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate, token_spans
from agentrl.envs.arithmetic import ArithmeticEnv, make_arithmetic_row
from agentrl.envs.tool_env import ToolEnv
from agentrl.registry import TOOL_PARSERS
from agentrl.rollout import AgentLoop
from agentrl.tools import ToolContext, tool
from agentrl.tools.parsers import HermesParser
from agentrl.types import Action, CallOutcome, FinishReason, Generation, SamplingParams, TokenOrigin, ToolCall


@tool
def get_weather(city: str, days: int) -> str:
    """The forecast.

    Args:
        city: Where.
        days: How many days ahead.
    """
    return f"sunny in {city} for {days} days"


class WeatherEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([get_weather], max_turns=4)

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        return 1.0 if "sunny" in final_text else 0.0


GOOD = {"city": "Paris", "days": 2}
WRONG_TYPES = {"city": "Paris", "days": "many"}


def _hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def _hermes_call(name: str, args: dict[str, Any]) -> str:
    return _hermes(json.dumps({"name": name, "arguments": args}))


def _qwen3_coder(name: str, args: dict[str, Any]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm45(name: str, args: dict[str, Any]) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


_KIMI = ("<|tool_calls_section_begin|><|tool_call_begin|>", "<|tool_call_argument_begin|>",
         "<|tool_call_end|><|tool_calls_section_end|>")


def _kimi(name: str, args_text: str) -> str:
    return f"{_KIMI[0]}functions.{name}:0{_KIMI[1]}{args_text}{_KIMI[2]}"


_DS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def _deepseek(name: str, args_text: str) -> str:
    return f"{_DS[0]}{name}\n```json\n{args_text}\n```{_DS[1]}"


_HARMONY_HEAD = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"


def _gpt_oss(name: str, args_text: str, end: str = "<|call|>") -> str:
    return _HARMONY_HEAD.format(name) + args_text + end


def _mistral(body: str) -> str:
    return f"[TOOL_CALLS]{body}"


# family -> (tokenizer folder, prose before the call, {case: (call text, parser status, status after the env)})
CORPUS: dict[str, tuple[str, str, dict[str, tuple[str, str, str]]]] = {
    "hermes": ("qwen2.5-0.5b-instruct", "Let me look it up. 🎉\n", {
        "cut": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "unclosed_block", "unclosed_block"),
        "bad_json": (_hermes('{"name": "get_weather", "arguments": {"city": \'Paris\'}}'), "invalid_json",
                     "invalid_json"),
        "no_name": (_hermes('{"arguments": {"city": "Paris"}}'), "missing_name", "missing_name"),
        "unknown_tool": (_hermes_call("get_time", {}), "ok", "unknown_tool"),
        "wrong_types": (_hermes_call("get_weather", WRONG_TYPES), "ok", "bad_arguments"),
    }),
    "qwen3_coder": ("qwen2.5-0.5b-instruct", "Let me look it up.\n", {
        "cut": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "unclosed_block", "unclosed_block"),
        "bad_json": ("<tool_call>\n<function=get_weather>\ncity=Paris\n</function>\n</tool_call>", "invalid_json",
                     "invalid_json"),
        "no_name": ("<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", "missing_name",
                    "missing_name"),
        "unknown_tool": (_qwen3_coder("get_time", {}), "ok", "unknown_tool"),
        "wrong_types": (_qwen3_coder("get_weather", WRONG_TYPES), "ok", "bad_arguments"),
    }),
    "glm45": ("qwen2.5-0.5b-instruct", "Let me look it up.\n", {
        "cut": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "unclosed_block", "unclosed_block"),
        "bad_json": ("<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call>", "invalid_json",
                     "invalid_json"),
        "no_name": ("<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                    "missing_name", "missing_name"),
        "unknown_tool": (_glm45("get_time", {}), "ok", "unknown_tool"),
        "wrong_types": (_glm45("get_weather", WRONG_TYPES), "ok", "bad_arguments"),
    }),
    "kimi_k2": ("qwen2.5-0.5b-instruct", "Let me look it up.", {
        "cut": (f'{_KIMI[0]}functions.get_weather:0{_KIMI[1]}{{"city": "Par', "unclosed_block", "unclosed_block"),
        "bad_json": (_kimi("get_weather", "{city: Paris}"), "invalid_json", "invalid_json"),
        "no_name": (_kimi("", "{}"), "missing_name", "missing_name"),
        "unknown_tool": (_kimi("get_time", "{}"), "ok", "unknown_tool"),
        "wrong_types": (_kimi("get_weather", json.dumps(WRONG_TYPES)), "ok", "bad_arguments"),
    }),
    "deepseek_v3": ("deepseek-v3-tokenizer", "Let me look it up.", {
        "cut": (f'{_DS[0]}get_weather\n```json\n{{"city": "Par', "unclosed_block", "unclosed_block"),
        "bad_json": (_deepseek("get_weather", "{city: Paris}"), "invalid_json", "invalid_json"),
        "no_name": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function\n```json\n{}\n```" + _DS[1], "missing_name",
                    "missing_name"),
        "unknown_tool": (_deepseek("get_time", "{}"), "ok", "unknown_tool"),
        "wrong_types": (_deepseek("get_weather", json.dumps(WRONG_TYPES)), "ok", "bad_arguments"),
    }),
    "gpt_oss": ("gpt-oss-tokenizer", "<|channel|>analysis<|message|>The user wants weather.<|end|>", {
        "cut": (_gpt_oss("get_weather", '{"city": "Par', end=""), "unclosed_block", "unclosed_block"),
        "bad_json": (_gpt_oss("get_weather", "{city: Paris}"), "invalid_json", "invalid_json"),
        "no_name": (_gpt_oss("", "{}"), "missing_name", "missing_name"),
        "unknown_tool": (_gpt_oss("get_time", "{}"), "ok", "unknown_tool"),
        "builtin_tool": ("<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json<|message|>"
                         '{"query": "x"}<|call|>', "unknown_tool", "unknown_tool"),
        "wrong_types": (_gpt_oss("get_weather", json.dumps(WRONG_TYPES)), "ok", "bad_arguments"),
    }),
    "mistral": ("mistral-nemo-instruct-2407", "", {
        "cut": (_mistral('[{"name": "get_weather", "arguments": {"city": "Par'), "unclosed_block", "unclosed_block"),
        "bad_json": (_mistral('[{"name": "get_weather", "arguments": {city: Paris}}]'), "invalid_json",
                     "invalid_json"),
        "no_name": (_mistral('[{"arguments": {"city": "Paris"}}]'), "missing_name", "missing_name"),
        "unknown_tool": (_mistral('[{"name": "get_time", "arguments": {}}]'), "ok", "unknown_tool"),
        "wrong_types": (_mistral(json.dumps([{"name": "get_weather", "arguments": WRONG_TYPES}])), "ok",
                        "bad_arguments"),
    }),
    "llama3": ("llama3.1-tokenizer", "", {
        "cut": ('{"name": "get_weather", "parameters": {"city": "Par', "unclosed_block", "unclosed_block"),
        "bad_json": ('{"name": "get_weather", "parameters": {city: Paris}}', "invalid_json", "invalid_json"),
        "no_name": ('{"parameters": {"city": "Paris"}}', "missing_name", "missing_name"),
        "unknown_tool": ('{"name": "get_time", "parameters": {}}', "ok", "unknown_tool"),
        "wrong_types": (json.dumps({"name": "get_weather", "parameters": WRONG_TYPES}), "ok", "bad_arguments"),
    }),
    # retool's calls have no name and no JSON: the code is the argument. An empty block is the one malformed
    # call it can tell; a block cut off looks exactly like one stopped on its closing fence, so it is read.
    "retool": ("qwen2.5-0.5b-instruct", "I will compute it.\n", {
        "empty": ("<code>\n</code>", "bad_arguments", "bad_arguments"),
        "cut": ("```python\nprint(sum(range(1", "ok", "unknown_tool"),
    }),
}
CASES = [(family, case) for family, (_, _, cases) in CORPUS.items() for case in cases]


@pytest.fixture(scope="module")
def tokenizers(assets: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loaded = {folder: AutoTokenizer.from_pretrained(assets / folder) for folder in {f for f, _, _ in CORPUS.values()}}
    # transformers 5 loads DeepSeek-V3's tokenizer.json as a LlamaTokenizer with a pre-tokenizer of its own,
    # which drops spaces on decode; the file read as it is keeps them.
    loaded["deepseek-v3-tokenizer"] = PreTrainedTokenizerFast(
        tokenizer_file=str(assets / "deepseek-v3-tokenizer" / "tokenizer.json"))
    return loaded


def test_the_corpus_covers_all_nine_parsers() -> None:
    assert set(CORPUS) == set(TOOL_PARSERS.names())


@pytest.mark.parametrize(("family", "case"), CASES)
def test_a_malformed_call_gets_its_status_and_span_and_the_episode_goes_on(
        family: str, case: str, tokenizers: dict[str, Any]) -> None:
    folder, prose, cases = CORPUS[family]
    call_text, parsed_status, final_status = cases[case]
    text = prose + call_text
    action = TOOL_PARSERS.resolve(family)().parse(text)
    (outcome,) = action.outcomes
    assert outcome.status == parsed_status
    # the span is the call's text, whole: from its first marker to the end of what it wrote
    call_start = len(prose) if family != "gpt_oss" else text.index("<|start|>")
    assert outcome.chars == (call_start, len(text))
    assert (outcome.message == "") == outcome.ok
    if not outcome.ok:
        assert outcome.message in action.parse_errors and action.tool_calls == ()
        assert TOOL_PARSERS.resolve(family).expected_format in outcome.message  # names the expected form

    # the token span: the fewest sampled ids whose text holds the call
    tok = tokenizers[folder]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    (tokens,) = token_spans(tok, ids, [outcome.chars])
    assert tokens is not None
    first, end = tokens

    def length(k: int) -> int:
        return len(tok.decode(ids[:k], skip_special_tokens=False))

    assert length(first) <= outcome.chars[0] < length(first + 1)
    assert length(end - 1) < outcome.chars[1] <= length(end)

    # the env answers it and the episode goes on, whatever the status
    env = WeatherEnv()
    env.reset(options={"row": {"prompt": "Weather in Paris?"}})
    messages, reward, terminated, truncated, info = env.step(action)
    env.close()
    assert [o.status for o in info["call_outcomes"]] == [final_status]
    assert (terminated, truncated, reward) == (False, False, 0.0)
    assert info["metrics"][f"tools/parse/{final_status}"] == 1
    assert len(messages) == 1 and messages[0]["role"] == "tool"
    if final_status != "ok":
        assert messages[0]["content"].startswith("Error: ")


def test_the_token_span_of_a_hermes_call_is_its_block_of_sampled_ids(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["qwen2.5-0.5b-instruct"]
    text = "Checking 🎉 the weather.\n" + _hermes('{"name": "get_weather", "arguments": {"city": \'Paris\'}}')
    ids = tok.encode(text, add_special_tokens=False)
    (outcome,) = HermesParser().parse(text).outcomes
    (tokens,) = token_spans(tok, ids, [outcome.chars])
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert tokens == (ids.index(open_id), ids.index(close_id) + 1)


def test_a_wrong_typed_argument_is_answered_with_the_expected_arguments() -> None:
    env = WeatherEnv()
    env.reset(options={"row": {"prompt": "Weather?"}})
    messages, *_ = env.step(HermesParser().parse(_hermes_call("get_weather", WRONG_TYPES)))
    env.close()
    assert messages[0]["content"].startswith("Error: Invalid arguments for 'get_weather': 'days': ")
    assert messages[0]["content"].endswith("Expected arguments: city, days.")


# ── through the AgentLoop ───────────────────────────────────────────────────────────────────────
class ScriptedClient:
    """Answers each turn with the next scripted text, tokenised, then <|im_end|>."""

    def __init__(self, template: ChatTemplate, script: Callable[[int], str]) -> None:
        self.tok = template.tokenizer
        self.script = script
        self.turn = 0
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        ids = self.tok.encode(self.script(self.turn), add_special_tokens=False) + [self.end]
        self.turn += 1
        return Generation(ids, [-0.5] * len(ids), "stop", 1)


@pytest.fixture(scope="module")
def template(assets: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(assets / "qwen2.5-0.5b-instruct")


def test_the_loop_records_each_outcome_and_a_failed_ones_ledger_tokens_and_it_costs_no_reward(
        template: ChatTemplate) -> None:
    row = make_arithmetic_row(3)
    expr, truth = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
    turns = [
        "I'll compute.\n" + _hermes('{"name": "calculator", "arguments": {"expression": ' + expr + "}}"),
        _hermes_call("calculate", {"expression": expr}) + _hermes_call("calculator", {"expr": expr}),
        _hermes_call("calculator", {"expression": expr}) + "\n" + _hermes('{"arguments": {}}'),
        f"The answer is \\boxed{{{truth}}}.",
    ]
    traj = asyncio.run(AgentLoop(ScriptedClient(template, lambda t: turns[t]), template, HermesParser())
                       .run_episode(ArithmeticEnv(), row=row))
    assert (traj.finish_reason, traj.reward, traj.fault) == (FinishReason.DONE, 1.0, None)
    recorded = traj.info["call_outcomes"]
    assert [(o["turn"], o["status"]) for o in recorded] == [
        (1, "invalid_json"), (2, "unknown_tool"), (2, "bad_arguments"), (3, "ok"), (3, "missing_name")]
    assert [o.get("name") for o in recorded] == [None, "calculate", "calculator", "calculator", None]
    assert all(("message" in o) == (o["status"] != "ok") for o in recorded)
    # each failed call's span covers sampled tokens only, and their text is the call's block; calls the
    # parser read are left unplaced (their text is the call's `raw`)
    tok = template.tokenizer
    assert [o["tokens"] is None for o in recorded] == [False, True, True, True, False]
    for o in recorded[:1] + recorded[4:]:
        start, end = o["tokens"]
        assert all(traj.origins[i] == TokenOrigin.SAMPLED for i in range(start, end))
        block = tok.decode(traj.token_ids[start:end])
        assert block.startswith("<tool_call>") and block.endswith("</tool_call>")
    assert traj.metrics["tools/parse/ok"] == 1 and traj.metrics["tools/parse/invalid_json"] == 1
    assert traj.metrics["tools/parse/unknown_tool"] == 1 and traj.metrics["tools/parse/bad_arguments"] == 1
    assert traj.metrics["tools/parse/missing_name"] == 1 and traj.metrics["parse_errors"] == 2
    assert traj.metrics["tool_errors_model"] == 2  # unknown_tool and bad_arguments reached the tools' side
    tool_text = tok.decode(traj.tokens_of(TokenOrigin.TOOL))
    assert "Tool call 1 was not understood: it is not valid JSON" in tool_text
    assert "there is no tool named 'calculate'. Available tools: calculator." in tool_text


class PlainParser:
    """A user's parser written against the Action of before (text, calls, parse_errors): no outcomes."""

    def parse(self, text: str) -> Action:
        if "CALL" in text:
            return Action(text, (ToolCall("calculator", {"expression": "2+2"}, "abcdefghi"),))
        if "BROKEN" in text:
            return Action(text, (), ("That call was broken.",))
        return Action(text)


def test_a_parser_without_outcomes_keeps_working(template: ChatTemplate) -> None:
    row = make_arithmetic_row(3)
    truth = row["reward_model"]["ground_truth"]
    turns = ["CALL", "BROKEN", f"\\boxed{{{truth}}}"]
    traj = asyncio.run(AgentLoop(ScriptedClient(template, lambda t: turns[t]), template, PlainParser())
                       .run_episode(ArithmeticEnv(), row=row))
    assert (traj.finish_reason, traj.reward) == (FinishReason.DONE, 1.0)
    assert traj.info["call_outcomes"] == [
        {"turn": 1, "status": "ok", "tokens": None, "name": "calculator"},
        {"turn": 2, "status": "malformed", "tokens": None, "message": "That call was broken."},
    ]
    assert traj.metrics["tools/parse/ok"] == 1 and traj.metrics["tools/parse/malformed"] == 1
    assert traj.metrics["parse_errors"] == 1 and traj.metrics["tool_calls"] == 1
    assert "That call was broken." in template.tokenizer.decode(traj.tokens_of(TokenOrigin.TOOL))


def test_outcomes_do_not_change_how_actions_compare() -> None:
    call = ToolCall("f", {}, "abcdefghi")
    assert Action("t", (call,)) == Action("t", (call,), outcomes=(CallOutcome("ok", call, chars=(0, 1)),))
