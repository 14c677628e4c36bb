"""`recall`: facts scattered over long tool results, recalled at the end; it needs context compaction.

Each task hides `pages` facts ("the code of vault 3 is 4821") in a log of `pages` pages, one fact at
the end of each page, after `page_chars` characters of routine log lines. The agent reads the pages
with the `read_log` tool, one per call, and must end with every code in page order, comma-separated,
in `\\boxed{...}` (reward 1.0 when exactly right, else 0.0). The pages together are several times
longer than one context (`rollout.max_total_tokens`), so an agent that keeps every page in its
context runs out of room (`max_length`) before it can answer: it has to compact, taking notes of the
facts in its own turns (kept when old tool outputs are dropped, `drop_tool_outputs`) or in a
summary (`summary`). docs/long-horizon.md shows both.

With `turn_rewards=True` each step also gives a per-turn reward (`info["turn_reward"]`,
`agentrl.rollout.agent_loop`): 1.0 for a turn that read a page not read before, 0.0 for one that
did not (a repeat, a page out of range, no call), none for the final answer, which the episode's
reward scores. It needs no sandbox and no network; a row is made from a seed.

`scripted_recall_turn` is the turn a perfect note-taking agent writes next, given the text of its
context: tests and `bench/agent_loop.py` play episodes with it (no model needed).
"""

from __future__ import annotations

import random
import re
from typing import Any

from agentrl.envs.tool_env import ToolEnv
from agentrl.tools.core import ToolContext, tool
from agentrl.types import Action, Message

__all__ = ["RecallEnv", "make_recall_row", "read_log", "scripted_recall_turn"]

DATA_SOURCE = "agentrl/recall"
SYSTEM_PROMPT = (
    "You are a careful assistant with a small memory. Read every page of the log with the read_log tool, "
    "one page per call. Each page ends with one fact. Before each call, write down the fact of the page "
    "you just read. Finish with every code in page order, comma-separated, as \\boxed{CODE,CODE,...}."
)
_SERVICES = ("api", "auth", "billing", "cache", "db", "queue", "search", "worker")
_EVENTS = ("heartbeat ok", "request served", "cache miss", "retry scheduled", "connection reused",
           "checkpoint written", "lease renewed", "batch flushed")


def make_recall_row(seed: int, *, pages: int = 12, page_chars: int = 600) -> dict[str, Any]:
    """A verl-format row: the task, and in `extra_info` the log's pages; fully determined by its arguments."""
    rng = random.Random(seed)
    codes = [rng.randint(1000, 9999) for _ in range(pages)]
    log_pages = []
    for k, code in enumerate(codes, start=1):
        lines: list[str] = []
        while sum(len(line) + 1 for line in lines) < page_chars:
            lines.append(f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} "
                         f"{rng.choice(_SERVICES)}-{rng.randint(1, 9)} {rng.choice(_EVENTS)} "
                         f"latency={rng.randint(1, 900)}ms")
        lines.append(f"FACT: the code of vault {k} is {code}.")
        log_pages.append("\n".join(lines))
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"The log has {pages} pages (1 to {pages}). Read them all, then give "
                                        "every vault code in page order."},
        ],
        "data_source": DATA_SOURCE,
        "reward_model": {"style": "rule", "ground_truth": ",".join(map(str, codes))},
        "extra_info": {"seed": seed, "pages": log_pages},
    }


@tool
async def read_log(page: int, ctx: ToolContext) -> str:
    """Read one page of the log.

    Args:
        page: The page number, from 1 to the number of pages.
    """
    pages: list[str] = ctx.state["pages"]
    if not 1 <= page <= len(pages):
        return f"Error: there is no page {page}; pages go from 1 to {len(pages)}."
    ctx.state["read"].append(page)
    return pages[page - 1]


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_FACT = re.compile(r"the code of vault (\d+) is (\d+)")


def scripted_recall_turn(context: str, *, pages: int, summary_prompt: str | None = None) -> str:
    """The next assistant turn of a scripted agent that reads the pages in order and notes each fact.

    `context` is the text of everything the agent sees (its prompt, decoded). Asked for a summary (the
    context ends with `summary_prompt`), it lists every fact it sees; with all `pages` facts in view it
    answers; else it notes the newest fact and reads the next page (hermes `<tool_call>` format).
    """
    facts = {int(k): v for k, v in _FACT.findall(context)}
    if summary_prompt is not None and summary_prompt in context[-len(summary_prompt) - 200:]:
        return "Summary: " + " ".join(f"the code of vault {k} is {facts[k]}." for k in sorted(facts))
    if len(facts) >= pages:
        return f"\\boxed{{{','.join(facts[k] for k in range(1, pages + 1))}}}"
    newest = max(facts, default=0)
    note = f"Noted: the code of vault {newest} is {facts[newest]}.\n" if newest else ""
    call = f'{{"name": "read_log", "arguments": {{"page": {newest + 1}}}}}'
    return f"{note}<tool_call>\n{call}\n</tool_call>"


class RecallEnv(ToolEnv):
    """Facts to recall from a log longer than one context (see the module docstring)."""

    def __init__(self, *, max_turns: int = 40, pages: int = 12, page_chars: int = 600, turn_rewards: bool = False,
                 tool_timeout_s: float = 10.0) -> None:
        super().__init__([read_log], max_turns=max_turns, tool_timeout_s=tool_timeout_s)
        self.pages = pages
        self.page_chars = page_chars
        self.turn_rewards = turn_rewards

    @classmethod
    def dataset_rows(cls, split: str, n: int = 50) -> list[dict[str, Any]]:
        """`n` generated rows; train and test use disjoint seed ranges."""
        offset = {"train": 0, "test": 1_000_000}[split]
        return [make_recall_row(offset + i) for i in range(n)]

    def generate_row(self, seed: int | None) -> dict[str, Any]:
        return make_recall_row(seed or 0, pages=self.pages, page_chars=self.page_chars)

    async def create_context(self, episode_id: str, row: dict[str, Any]) -> ToolContext:
        ctx = await super().create_context(episode_id, row)
        ctx.state["pages"] = list(row["extra_info"]["pages"])
        ctx.state["read"] = []
        return ctx

    def score(self, final_text: str, row: dict[str, Any], ctx: ToolContext) -> float:
        found = _BOXED.findall(final_text)
        answer = found[-1].replace(" ", "") if found else ""
        return 1.0 if answer == row["reward_model"]["ground_truth"] else 0.0

    async def astep(self, action: Action) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        ctx = self._ctx
        before = list(ctx.state["read"]) if ctx is not None else []
        messages, reward, terminated, truncated, info = await super().astep(action)
        if self.turn_rewards and not terminated and ctx is not None:
            new = [p for p in ctx.state["read"][len(before):] if p not in before]
            info["turn_reward"] = 1.0 if new else 0.0
        return messages, reward, terminated, truncated, info
