"""ParityEnv that answers a turn without a tool call and lets the episode go on, for the viewer's run.

Each episode then has up to two assistant turns with the environment's message between them, so
the ledger holds every origin (prompt, sampled, template, tool) for the browser test to check.
The reward is ParityEnv's (even-length final answer), given at the end of the second turn too.
"""

from __future__ import annotations

from typing import ClassVar

from parity_env import ParityEnv

__all__ = ["ChattyParityEnv"]


class ChattyParityEnv(ParityEnv):
    """ParityEnv over two turns: the first answer gets a reply, the second is scored."""

    end_without_tool_call: ClassVar[bool] = False
    no_tool_call_message: ClassVar[str] = "Say it once more, in other words."
    score_truncated: ClassVar[bool] = True
