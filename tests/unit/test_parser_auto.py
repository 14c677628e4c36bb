"""`model.tool_parser=auto`: every real chat template in the shared assets picks its family; a template
with no tool-call markers, or with two families' markers, is refused with the list of families.

Qwen3-Coder and Kimi-K2 have no template in the assets: their cases below are excerpts written here from
the markup their published templates render (the call parts only), and say so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.cli import EXIT_ERROR, main
from agentrl.errors import ConfigError
from agentrl.registry import TOOL_PARSERS
from agentrl.tools.parser_auto import FAMILY_MARKERS, pick_tool_parser, template_source

REAL_TEMPLATES = {
    "qwen2.5-0.5b-instruct": "hermes",
    "qwen3-0.6b": "hermes",
    "tiny-random-qwen2": "hermes",
    "mistral-nemo-instruct-2407": "mistral",
    "llama3.1-tokenizer": "llama3",
    "deepseek-v3-tokenizer": "deepseek_v3",
    "gpt-oss-tokenizer": "gpt_oss",
    "chat-templates/glm-4.5.jinja": "glm45",
}

WRITTEN_EXCERPTS = {
    "qwen3_coder": (
        "{%- for tool_call in message.tool_calls %}{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
        "{%- for args_name, args_value in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}"
        "{{- args_value }}{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    ),
    "kimi_k2": (
        "{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}"
        "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>{{ tool_call['function']['arguments'] }}"
        "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    ),
}

PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _real_template(assets: Path, name: str) -> str:
    path = assets / name
    if path.is_file():
        return path.read_text()
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    return template_source(json.loads((path / "tokenizer_config.json").read_text())["chat_template"])


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_each_real_template_picks_its_family(assets: Path, name: str) -> None:
    choice = pick_tool_parser(_real_template(assets, name))
    assert choice.family == REAL_TEMPLATES[name]
    assert choice.reason.startswith("the chat template writes ")


@pytest.mark.parametrize("family", sorted(WRITTEN_EXCERPTS))
def test_written_excerpts_of_templates_not_in_the_assets_pick_their_family(family: str) -> None:
    assert pick_tool_parser(WRITTEN_EXCERPTS[family]).family == family


def test_every_family_auto_can_pick_is_a_registered_parser_and_retool_is_never_picked() -> None:
    families = {m.family for m in FAMILY_MARKERS}
    assert families == set(TOOL_PARSERS.names()) - {"retool"}


def test_a_template_without_tool_markers_is_refused_with_the_families_and_how_to_name_one() -> None:
    with pytest.raises(ConfigError) as caught:
        pick_tool_parser(PLAIN_CHATML, where="the chat template of 'm'")
    message = str(caught.value)
    assert message.startswith("the chat template of 'm' writes none of the tool-call markers auto knows")
    assert ("model.tool_parser=<name>, one of deepseek_v3, glm45, gpt_oss, hermes, kimi_k2, llama3, mistral, "
            "qwen3_coder, retool") in message


def test_markers_in_a_jinja_comment_do_not_count() -> None:
    with pytest.raises(ConfigError, match="writes none of the tool-call markers"):
        pick_tool_parser("{# calls look like <tool_call>...</tool_call> #}" + PLAIN_CHATML)


def test_a_template_with_two_families_markers_is_refused_not_guessed() -> None:
    with pytest.raises(ConfigError) as caught:
        pick_tool_parser(PLAIN_CHATML + "{{ '<tool_call>' }}{{ '[TOOL_CALLS]' }}")
    assert "writes the markers of more than one family: hermes (<tool_call>) and mistral ([TOOL_CALLS])" in str(
        caught.value)


def test_named_templates_are_read_together() -> None:
    assert template_source({"default": PLAIN_CHATML, "tool_use": "{{ '<tool_call>' }}"}).endswith("<tool_call>' }}")
    assert "[TOOL_CALLS]" in template_source([{"name": "tool_use", "template": "[TOOL_CALLS]"}])


def test_validate_prints_the_family_auto_picked_and_refuses_an_unknown_template(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "env=arithmetic", "model.tool_parser=auto"]) == 0
    out = capsys.readouterr().out
    # the default model's template is agentrl's tool ChatML, whose calls are hermes blocks
    assert "\ntool parser: hermes (auto: the chat template of '" in out
    assert "writes <tool_call> (Hermes/Qwen JSON calls in <tool_call> blocks))\n" in out
    plain = tmp_path / "plain.jinja"
    plain.write_text(PLAIN_CHATML)
    assert main(["validate", "env=arithmetic", "model.tool_parser=auto", f"model.chat_template={plain}"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"agentrl validate: model.tool_parser: model.chat_template '{plain}' writes none of the tool-call" in err
    assert "Name the parser instead: model.tool_parser=<name>, one of deepseek_v3," in err


def test_validate_says_a_named_parser_was_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "env=arithmetic"]) == 0
    assert "\ntool parser: hermes (named by model.tool_parser)\n" in capsys.readouterr().out
