"""Context compaction: what the AgentLoop does when one context of a long episode is full.

A policy is chosen in the config (`rollout.compaction`, `CompactionConfig`) and read once, here, into
a `Compaction`. When a tool result would take a context past the high watermark, the AgentLoop closes
that context as a trajectory segment and opens the next one with the messages this module builds:

- `drop_tool_outputs` (a rule): the messages so far, with the oldest tool outputs truncated (all but
  the latest turn's) until the rendered context is under the low watermark. The gap between the two
  watermarks means a new context opens every few turns, not at every turn.
- `summary`: the policy is first asked, in its full context, to summarise its history; that turn is
  sampled and trained like any other. The new context holds the task (the episode's first messages:
  system prompt and task), the summary as the assistant's own message, and a user message to go on.

The earlier messages reach a new context as text, rendered whole: they are prompt tokens there
(never trained twice), and each segment's ledger is exact on its own, as the gateway's segments are
(`agentrl.types.label_segments` numbers both). This module renders and counts; it never samples,
steps an env or touches a ledger: the AgentLoop does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from agentrl.config import RolloutConfig
from agentrl.types import Message

__all__ = ["Compaction", "dropped_tool_outputs", "summary_context", "task_messages"]

CONTINUE_AFTER_SUMMARY = "Your earlier context was replaced by the summary above. Continue the task."
"""The user message that follows the summary in a new context (templates want a user turn there)."""


@dataclass(frozen=True, slots=True)
class Compaction:
    """A compaction policy in tokens, read from `rollout.compaction` (see the module docstring)."""

    kind: Literal["drop_tool_outputs", "summary"]
    high_tokens: int
    """A context whose ledger would reach this many tokens with the next tool result is compacted."""
    low_tokens: int
    """What `drop_tool_outputs` compacts down to."""
    tool_output_chars: int
    summary_prompt: str
    summary_max_tokens: int
    max_sampled_tokens: int | None

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> Compaction | None:
        """The policy `rollout.compaction` describes, or None when it is off (every field is read, so each
        has its reader whether or not the run compacts)."""
        c = rollout.compaction
        policy, high, low = c.policy, c.high_watermark, c.low_watermark
        chars, prompt, summary_max, max_sampled = c.tool_output_chars, c.summary_prompt, c.summary_max_tokens, \
            c.max_sampled_tokens
        if policy == "off":
            return None
        total = rollout.max_total_tokens
        return cls(policy, int(high * total), int(low * total), chars, prompt, summary_max, max_sampled)

    def summary_request(self) -> Message:
        return {"role": "user", "content": self.summary_prompt}


def task_messages(messages: Sequence[Message]) -> list[Message]:
    """The episode's task: its messages before the first assistant turn (system prompt, task)."""
    out: list[Message] = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append(m)
    return out


def summary_context(task: Sequence[Message], summary: str) -> list[Message]:
    """The messages of the context that follows a summary turn."""
    return [*task, {"role": "assistant", "content": summary}, {"role": "user", "content": CONTINUE_AFTER_SUMMARY}]


def _truncated(content: str, keep: int) -> str:
    dropped = len(content) - keep
    if keep <= 0:
        return f"[tool output of {len(content)} characters dropped to save context]"
    return f"{content[:keep]}\n[... {dropped} more characters dropped to save context]"


def dropped_tool_outputs(
    messages: Sequence[Message], *, count: Callable[[Sequence[Message]], int], count_text: Callable[[str], int],
    low_tokens: int, keep_chars: int,
) -> tuple[list[Message], int]:
    """(`messages` with old tool outputs cut until `count(messages)` is at most `low_tokens`, how many were cut).

    Oldest first, each old tool output is truncated to `keep_chars`; if that is not enough, they are then
    dropped whole (a one-line note stays), oldest first. The latest turn's tool outputs (those after the
    last assistant message) stay whole, as does every other message. `count` renders a context and counts
    its tokens; `count_text` counts one text's, to choose how many outputs to cut before rendering again
    (a render per guess, not per output).
    """
    out = [copy.copy(m) for m in messages]  # shallow copies, typed as the messages are
    last_assistant = max((i for i, m in enumerate(out) if m.get("role") == "assistant"), default=-1)
    old = [i for i, m in enumerate(out[:last_assistant]) if m.get("role") == "tool" and isinstance(m.get("content"), str)]
    original = {i: str(out[i]["content"]) for i in old}
    steps = [(i, _truncated(original[i], keep_chars)) for i in old if len(original[i]) > keep_chars]
    if keep_chars > 0:
        steps += [(i, _truncated(original[i], 0)) for i in old]
    cut: set[int] = set()
    total = count(out)
    done = 0
    while total > low_tokens and done < len(steps):
        excess = total - low_tokens
        while excess > 0 and done < len(steps):
            i, short = steps[done]
            excess -= count_text(str(out[i]["content"])) - count_text(short)
            out[i]["content"] = short
            cut.add(i)
            done += 1
        total = count(out)
    return out, len(cut)
