"""How long a dataset row's first prompt is, measured before the row is rolled out.

A prompt of `rollout.max_total_tokens` tokens or more leaves no room to sample a token: rolled
out, its episodes would end with nothing sampled. `PromptMeter` renders a row's first prompt the
way the AgentLoop does at reset (the env's `first_prompt(row)`, then `ConversationTokenizer.start`)
so the scheduler can filter such a row before it is rolled out, and pre-flight can count them.
It is not a limit of its own: an env that cannot say its first prompt without a reset is not
measured here, and the AgentLoop masks its over-long episodes instead (fault `request`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agentrl.chat import ChatTemplate, ConversationTokenizer
from agentrl.envs import Env
from agentrl.rollout.agent_loop import prompt_too_long

__all__ = ["PromptMeter"]

log = logging.getLogger(__name__)


class PromptMeter:
    """Measures rows' first prompts with the run's chat template and env (see the module docstring)."""

    def __init__(self, template: ChatTemplate, make_env: Callable[[], Env], max_total_tokens: int) -> None:
        self.template = template
        self.make_env = make_env
        self.max_total_tokens = max_total_tokens
        self._lengths: dict[int, int | None] = {}
        self._env: Env | None = None  # made at the first measurement, never reset

    def lengths(self, rows: list[dict[str, Any]]) -> list[int | None]:
        """The first prompt's token count of each row; None where the env cannot say without a reset."""
        if self._env is None:
            self._env = self.make_env()
        return [self._measure(self._env, row) for row in rows]

    def length(self, index: int, row: dict[str, Any]) -> int | None:
        """`lengths([row])[0]`, remembered by the row's dataset index (a row is measured once)."""
        if index not in self._lengths:
            self._lengths[index] = self.lengths([row])[0]
        return self._lengths[index]

    def too_long(self, index: int, row: dict[str, Any]) -> str | None:
        """Why the row must not be rolled out (its prompt leaves no room to sample), or None."""
        n = self.length(index, row)
        if n is None or n < self.max_total_tokens:
            return None
        return prompt_too_long(n, self.max_total_tokens)

    def close(self) -> None:
        """Close the env it measures with (outside an event loop). Closing twice is harmless."""
        env, self._env = self._env, None
        if env is not None:
            env.close()

    async def aclose(self) -> None:
        """`close` from inside an event loop."""
        env, self._env = self._env, None
        if env is not None:
            await env.aclose()

    def _measure(self, env: Env, row: dict[str, Any]) -> int | None:
        try:
            first = env.first_prompt(row)
            if first is None:
                return None
            messages, tools = first
            return len(ConversationTokenizer(self.template, verify=False).start(messages, tools or None))
        except Exception as exc:  # a row the env cannot render fails at its reset, where it is recorded
            log.debug("could not measure the first prompt of a row: %s", exc)
            return None
