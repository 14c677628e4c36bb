"""`model.tool_parser=auto`: which tool-call family a chat template belongs to, read off its markers.

A chat template that can render tool calls writes them in its family's markup, and that markup is in
the template's source as literal text: Qwen's `<tool_call>`, GLM-4.5's `<arg_key>`, Qwen3-Coder's
`<function=` and `<parameter=`, DeepSeek's `<｜tool▁calls▁begin｜>`, Kimi-K2's
`<|tool_calls_section_begin|>`, harmony's `<|channel|>` and `<|call|>`, Mistral's `[TOOL_CALLS]`,
Llama 3.1's `ipython` role. `pick_tool_parser` looks for each family's markers (`FAMILY_MARKERS`, Jinja
comments left out) and returns the one family whose markers are all there, with the reason. It never
guesses: a template that shows no family's markers, or the markers of two families, is refused with a
`ConfigError` that lists the families and says how to name one. `retool` is never picked: it is a way
of prompting (code blocks), not a template's markup.

This module reads template text only; it loads no tokenizer and renders nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentrl.errors import ConfigError

__all__ = ["AUTO_TOOL_PARSER", "FAMILY_MARKERS", "FamilyMarkers", "ParserChoice", "pick_tool_parser",
           "template_source"]

AUTO_TOOL_PARSER = "auto"
"""The `model.tool_parser` value that picks the parser from the chat template."""


@dataclass(frozen=True)
class FamilyMarkers:
    """The markers by which a template is recognised as `family`'s: all of `needs`, none of `unless`."""

    family: str
    needs: tuple[str, ...]
    why: str
    """What the markers mean, for the reason `validate` prints."""
    unless: tuple[str, ...] = ()


FAMILY_MARKERS: tuple[FamilyMarkers, ...] = (
    FamilyMarkers("gpt_oss", ("<|channel|>", "<|call|>"), "harmony messages: <|channel|> headers, calls ended by <|call|>"),
    FamilyMarkers("kimi_k2", ("<|tool_calls_section_begin|>",), "Kimi-K2's <|tool_calls_section_begin|> section"),
    FamilyMarkers("deepseek_v3", ("<｜tool▁calls▁begin｜>",), "DeepSeek's <｜tool▁calls▁begin｜> section"),
    FamilyMarkers("glm45", ("<tool_call>", "<arg_key>", "<arg_value>"),
                  "GLM-4.5 calls: <arg_key>/<arg_value> pairs inside <tool_call>"),
    FamilyMarkers("qwen3_coder", ("<tool_call>", "<function=", "<parameter="),
                  "Qwen3-Coder XML calls: <function=...> and <parameter=...> inside <tool_call>"),
    FamilyMarkers("hermes", ("<tool_call>",), "Hermes/Qwen JSON calls in <tool_call> blocks",
                  unless=("<arg_key>", "<function=")),
    FamilyMarkers("mistral", ("[TOOL_CALLS]",), "Mistral's [TOOL_CALLS] marker"),
    FamilyMarkers("llama3", ("<|start_header_id|>", "ipython"),
                  "Llama 3 headers with the ipython role (JSON calls with \"parameters\")"),
)
"""Each family `auto` can pick, with its markers; `retool` is absent on purpose (see the module docstring)."""

_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)


@dataclass(frozen=True)
class ParserChoice:
    """The parser `auto` picked and why (what `agentrl validate` prints)."""

    family: str
    reason: str


def template_source(template: Any) -> str:
    """A tokenizer's `chat_template` as one text: a named set of templates (`{"default": ..., "tool_use": ...}`
    or Hugging Face's list of `{"name", "template"}`) is read as all of them together."""
    if isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        return "\n".join(str(v) for v in template.values())
    if isinstance(template, list):
        return "\n".join(str(t.get("template", "")) if isinstance(t, Mapping) else str(t) for t in template)
    return ""


def pick_tool_parser(source: str, *, where: str = "the chat template") -> ParserChoice:
    """The tool-call family whose markers `source` (a chat template's Jinja text) writes.

    Raises `ConfigError` when no family's markers are there, or several families' are: `where` names the
    template in the message (its path or the model's)."""
    text = _JINJA_COMMENT.sub("", source)
    found = [m for m in FAMILY_MARKERS
             if all(s in text for s in m.needs) and not any(s in text for s in m.unless)]
    if len(found) == 1:
        marks = ", ".join(found[0].needs)
        return ParserChoice(found[0].family, f"{where} writes {marks} ({found[0].why})")
    families = ", ".join(sorted([m.family for m in FAMILY_MARKERS] + ["retool"]))
    how = (f"Name the parser instead: model.tool_parser=<name>, one of {families} "
           "('agentrl tools parsers' describes each), or a 'package.module:Class' of your own.")
    if not found:
        message = (f"{where} writes none of the tool-call markers auto knows (Qwen's <tool_call>, "
                      "[TOOL_CALLS], <|python_tag|>/ipython, DeepSeek's and Kimi-K2's call sections, harmony's "
                      f"<|channel|>), so its tool-call family cannot be told. {how}")
        raise ConfigError(message)
    both = " and ".join(f"{m.family} ({', '.join(m.needs)})" for m in found)
    raise ConfigError(f"{where} writes the markers of more than one family: {both}. {how}")
