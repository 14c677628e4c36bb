"""AgentLoop overhead per turn along a 100-turn episode: the cost of turn 100 against turn 2.

    python bench/agent_loop_turns.py [--repeats 20] [--turns 100] [--page-chars 300]

A scripted agent plays the `recall` env (`agentrl.envs.recall.scripted_recall_turn`): it reads
`turns - 1` pages one per turn, noting each fact, then answers; every episode is the same, so each
turn index is measured `--repeats` times and its median reported. The overhead of turn k is the time
the AgentLoop spends between the end of generation k-1 and the start of generation k, less the env's
step in between: parsing the turn, appending its tokens, delta-tokenising the tool result, the state
machine and the await machinery, everything but generation and tools. (The scripted client's own work,
decoding what it was sent, counts as generation.) It is measured in CPU time of the loop's thread
(`time.thread_time`: everything runs on it, nothing waits), so other processes on a shared machine
do not count.

Three policies side by side, in one run and on one machine: `off` (one context of up to 64k tokens:
the ledger grows to ~20k tokens, so a per-turn cost that grew with the history would show at turn
100), `drop_tool_outputs` and `summary` (contexts of 16k and 8k tokens; a turn at which a context
was compacted is reported apart: it renders the new context whole, once per compaction, by design).
Target: the median overhead of turn 100 within 1.5x that of turn 2.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any

from agentrl.chat import ChatTemplate
from agentrl.config import RolloutConfig
from agentrl.envs.recall import RecallEnv, make_recall_row, scripted_recall_turn
from agentrl.rollout import AgentLoop
from agentrl.tools.parsers import HermesParser
from agentrl.types import Action, Generation, SamplingParams

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"))


class ScriptedAgent:
    """The recall script as a generate client; records when each generation starts and ends."""

    def __init__(self, template: ChatTemplate, pages: int, summary_prompt: str | None) -> None:
        self.tok = template.tokenizer
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.pages, self.summary_prompt = pages, summary_prompt
        self.seen: list[int] = []
        self.text = ""
        self.spans: list[tuple[float, float]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        start = time.thread_time()
        if prompt_ids[: len(self.seen)] == self.seen:  # the same context, extended: decode the new part
            self.text += self.tok.decode(prompt_ids[len(self.seen):])
        else:  # a new context
            self.text = self.tok.decode(prompt_ids)
        self.seen = list(prompt_ids)
        turn = scripted_recall_turn(self.text, pages=self.pages, summary_prompt=self.summary_prompt)
        ids = (self.tok.encode(turn, add_special_tokens=False) + [self.end])[: sampling.max_tokens]
        self.spans.append((start, time.thread_time()))
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


class TimedRecallEnv(RecallEnv):
    """The recall env, recording when each step starts and ends."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps: list[tuple[float, float]] = []

    async def astep(self, action: Action) -> Any:
        start = time.thread_time()
        try:
            return await super().astep(action)
        finally:
            self.steps.append((start, time.thread_time()))


def _overheads(gens: list[tuple[float, float]], steps: list[tuple[float, float]]) -> list[float]:
    """Seconds of loop overhead before each generation k >= 2 (index k - 2): gap less env steps in it."""
    out = []
    for (_, end), (start, _) in itertools.pairwise(gens):
        env = sum(b - a for a, b in steps if a >= end and b <= start)
        out.append(start - end - env)
    return out


async def _episode(template: ChatTemplate, config: RolloutConfig, turns: int, page_chars: int,
                   seed: int) -> tuple[list[float], list[int], Any]:
    pages = turns - 1
    summary = config.compaction.summary_prompt if config.compaction.policy == "summary" else None
    client = ScriptedAgent(template, pages, summary)
    env = TimedRecallEnv(max_turns=10 * turns, pages=pages, page_chars=page_chars)
    loop = AgentLoop(client, template, HermesParser(), config)
    segments = await loop.run_episode_segments(env, row=make_recall_row(seed, pages=pages, page_chars=page_chars))
    last = segments[-1]
    if last.reward != 1.0:
        raise SystemExit(f"the scripted episode did not finish and score ({last.finish_reason}, {last.error}): "
                         "the benchmark is broken")
    # the generation index at which each new context (after the first) got its first request
    starts, length = [], 0
    for seg in segments[:-1]:
        length += int(seg.metrics["turns"])
        starts.append(length + 1)
    return _overheads(client.spans, env.steps), starts, last


def _nearest_uncompacted(per_turn: list[float], compacted: set[int], k: int) -> float:
    """The median overhead at generation k, or at the nearest earlier one that opened no context."""
    while k in compacted and k > 2:
        k -= 1
    return per_turn[k - 2]


def _config(policy: str, turns: int) -> RolloutConfig:
    # off: one context holds the whole episode. The rule keeps every assistant turn (its notes), ~65 tokens a
    # turn once its tool output is cut, so 100 turns need more room than a summary does.
    total = {"off": 65536, "drop_tool_outputs": 16384}.get(policy, 8192)
    # The final answer lists every code (~5 tokens each): 1,024 tokens a turn; a summary lists every fact.
    return RolloutConfig(max_turns=10 * turns, max_total_tokens=total, max_tokens_per_turn=1024,
                         episode_timeout_s=3600, compaction={"policy": policy, "summary_max_tokens": 2048})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--page-chars", type=int, default=300)
    parser.add_argument("--policies", default="off,drop_tool_outputs,summary")
    args = parser.parse_args()
    template = ChatTemplate.from_pretrained(ASSETS / "qwen2.5-0.5b-instruct")
    print(f"{args.turns}-turn scripted recall episodes, {args.repeats} repeats; {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    at = [2, min(25, args.turns), args.turns]
    print(f"{'policy':>18} {'tokens':>7} {'segs':>4} " + " ".join(f"{'turn ' + str(k):>9}" for k in at)
          + f" {f'{at[-1]}/{at[0]}':>7} {'compacting':>10}")
    for policy in args.policies.split(","):
        config = _config(policy, args.turns)
        asyncio.run(_episode(template, config, args.turns, args.page_chars, 0))  # warm the caches
        gc.collect()
        gc.freeze()
        runs = [asyncio.run(_episode(template, config, args.turns, args.page_chars, 0)) for _ in range(args.repeats)]
        compacted = set(runs[0][1])
        per_turn = [statistics.median(run[0][k - 2] for run in runs) for k in range(2, len(runs[0][0]) + 2)]
        n = len(per_turn) + 1  # generations in the episode (summary turns included)

        figures = [_nearest_uncompacted(per_turn, compacted, min(k, n)) for k in at]
        if os.environ.get("AGENTRL_BENCH_PROFILE"):
            print(" ".join(f"{k}:{1e6 * per_turn[k - 2]:.0f}" for k in range(2, n + 1)))
        compacting = statistics.fmean(per_turn[k - 2] for k in compacted) if compacted else 0.0
        last = runs[0][2]
        tokens = len(last.token_ids)
        print(f"{policy:>18} {tokens:>7} {len(compacted) + 1:>4} " + " ".join(f"{1e6 * f:>7.0f}us" for f in figures)
              + f" {figures[-1] / figures[0]:>6.2f}x {1e3 * compacting:>8.2f}ms", flush=True)
    print("turn k: median CPU seconds of AgentLoop work between generation k-1 and k, less the env step (a turn "
          "that opened a new context: the nearest earlier one); tokens: the last context's ledger; compacting: "
          "mean overhead of the turns that opened a new context. Target: turn 100 within 1.5x of turn 2.")


if __name__ == "__main__":
    main()
